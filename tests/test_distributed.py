"""Under torchrun (2 gloo processes on CPU): DDP reproduces a single process with the same global batch."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    FAST,
    GPU_CACHE,
    ROOT,
    cli,
    losses,
    metric,
    rank_process,
    shared_run,
    start_torchrun,
    torchrun,
)

SHAPE = [f for f in FAST if not f.startswith("train.micro_batch_size")]


def _fit_cmd(nproc: int, *args) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "trainer", "fit", "configs/tiny.yaml", *args]  # fmt: skip


def _env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _torchrun(nproc: int, *args, timeout=300):
    return torchrun(_fit_cmd(nproc, *args), timeout=timeout, env=_env())


def _params(run_dir, step):
    """The model's parameters at ``step``: model.pt, or a DCP checkpoint (fsdp) converted to whole tensors (in a
    directory of its own: the run's may be another test's too)."""
    ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
    if (ckpt / "dcp").is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(ckpt / "dcp", Path(tmp) / "whole.pt")
            return torch.load(Path(tmp) / "whole.pt", weights_only=False)["model"]
    return torch.load(ckpt / "model.pt", weights_only=True)


COMMON = [*SHAPE, "train.steps=8", "log.every=1", "optim.lr=3e-3"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process (a test process), the whole global batch of 8 sequences."""

    def make(one):
        r = cli(None, "fit", "configs/tiny.yaml", *COMMON, "train.micro_batch_size=8", f"run.dir={one}")
        assert r.returncode == 0

    return shared_run(tmp_path_factory, "distributed-one", make)


# Each variant: 2 ranks x 4 sequences (or 2 micro-batches of 2) = the reference's global batch.
VARIANTS = {
    # Eager, with gradient accumulation (2 micro-batches of 2 per rank; reduction only on the last).
    "ddp-accum": ["distributed.strategy=ddp", "train.micro_batch_size=2", "train.grad_accum=2"],
    # 10 KiB buckets: one block per bucket, so the compiled forward is split into 4 pieces.
    "ddp-compiled": ["distributed.strategy=ddp", "compile.enabled=true", "compile.backend=aot_eager",
                     "distributed.bucket_mb=0.01"],
    # Our kernels substituted into each graph piece (the interpreter on CPU; the default on CUDA): the residual
    # add + LayerNorm takes the projection's bias into its kernel; the pieces still follow the plan (checked below).
    "ddp-compiled-kernels": ["distributed.strategy=ddp", "compile.enabled=true", "compile.backend=aot_eager",
                             "distributed.bucket_mb=0.01", "compile.kernels=all"],
    "ddp-compiled-autograd": ["distributed.strategy=ddp", "compile.enabled=true", "compile.backend=aot_eager",
                              "compile.autograd=true", "distributed.bucket_mb=0.01", "train.grad_accum=2",
                              "train.micro_batch_size=2"],
    # A fully_shard unit per block; by default both (tiny) blocks are one unit.
    "fsdp-accum": ["distributed.strategy=fsdp", "train.micro_batch_size=2", "train.grad_accum=2",
                   "distributed.fsdp_unit_mb=0"],
    "fsdp-compiled": ["distributed.strategy=fsdp", "compile.enabled=true", "compile.backend=aot_eager"],
}  # fmt: skip


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_ranks_reproduce_one_process(variant, one_process, tmp_path):
    r = _torchrun(2, *COMMON, "train.micro_batch_size=4", *VARIANTS[variant], f"run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert "do not follow the bucket plan" not in r.stdout + r.stderr
    a, b = losses(one_process), losses(tmp_path)
    assert sorted(a) == sorted(b) == list(range(1, 9))  # rank 0 alone writes: each step once
    # The logged loss is the mean over ranks; the ranks' gradients are summed in another order than one
    # process's batched matmuls: observed max |diff| 1e-6 over 8 steps.
    for step in a:
        assert abs(a[step] - b[step]) < 1e-5, (step, a[step], b[step])
    # The logged (pre-clip) gradient norm: ddp computes it bucket by bucket while reducing, fsdp over shards.
    na, nb = metric(one_process, "grad_norm"), metric(tmp_path, "grad_norm")
    assert sorted(na) == sorted(nb) == list(range(1, 9))
    for step in na:
        assert abs(na[step] - nb[step]) <= 1e-5 * na[step], (step, na[step], nb[step])
    pa, pb = _params(one_process, 8), _params(tmp_path, 8)
    assert set(pa) == set(pb)
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], rtol=0, atol=1e-5)  # observed 2e-7 (Adam's update, fp32)


def _worker_env(**extra: str) -> dict:
    """tests/ddp_worker.py's environment: the repository first on the path, the caller's path kept (where the
    dependencies may live, e.g. a --target install on the GPU machine)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


def test_plan_split_and_reduction_inside_the_backward_graph(tmp_path):
    """tests/ddp_worker.py on 2 ranks: buckets, graph pieces, all-reduces in the compiled-autograd graph."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "tests" / "ddp_worker.py"), str(tmp_path)]  # fmt: skip
    r = torchrun(cmd, timeout=300, env=_worker_env())
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for variant in ("eager", "split", "ca"):
            v = res[variant]
            # Gradients equal the mean over the global batch computed in one process (fp32; observed 3e-8).
            assert v["max_grad_err"] < 1e-6, (variant, v["max_grad_err"])
            # The plan: head first (ready first), then the blocks from the last, then the embeddings (tied wte).
            assert [u for units in v["units"] for u in units] == [
                "head",
                "transformer.h.3",
                "transformer.h.2",
                "transformer.h.1",
                "transformer.h.0",
                "embeddings",
            ]
            assert v["buckets"][-1] == ["transformer.wpe.weight", "transformer.wte.weight"]
        # Eagerly the gradients are reduced where autograd left them (no flat copy); a bf16 reduction needs a
        # buffer, so its gradients are views of one.
        assert res["eager"]["in_place"] and res["split"]["in_place"] and not res["bf16"]["in_place"]
        # finish_grad_sync(norm=True): the global norm of the reduced gradients, bucket by bucket (observed 1e-7).
        for variant in ("eager", "split", "ca"):
            assert res[variant]["norm_rel_err"] < 1e-6, (variant, res[variant]["norm_rel_err"])
        split = res["split"]
        # One graph, six pieces; piece k (forward order) first uses exactly the parameters of bucket 5-k.
        assert split["pieces"] == [[[5], [4], [3], [2], [1], [0]]]
        assert split["n_compiled_pieces"] == 6 and not split["misaligned"]
        # Compiled autograd: one all-reduce per bucket, inside the captured backward graph.
        assert res["ca"]["ca_all_reduces"] == 6
        # distributed.reduce_dtype=bf16: each rank's gradient rounded to bf16 (8 bits of mantissa) before the
        # sum, the result cast back to the parameters' fp32. Not exact (so bf16 was on the wire), and within a
        # few bf16 roundings (2^-8 = 3.9e-3) of each tensor's largest gradient: the ranks' gradients, which are
        # rounded, can be larger than their mean (observed 5.6e-3).
        bf16 = res["bf16"]
        assert bf16["grad_dtypes"] == ["torch.float32"]
        assert 1e-4 < bf16["max_rel_grad_err"] < 2e-2, bf16["max_rel_grad_err"]


def test_save_on_two_ranks_resume_on_one(one_process, tmp_path, capsys):
    """fsdp: stop at step 5 of 8 on 2 ranks (a DCP checkpoint), finish in 1 process (this one): equal to one process.

    (A ddp checkpoint holds whole tensors in model.pt, the same files a single process writes; resume
    across runs is covered by tests/test_fit.py.)
    """
    r = _torchrun(2, *COMMON, "train.micro_batch_size=4", "distributed.strategy=fsdp", "train.stop_at=5",
                  f"run.dir={tmp_path}")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "checkpoints" / "step_000005" / "dcp").is_dir()
    assert not (tmp_path / "checkpoints" / "step_000005" / "model.pt").exists()
    # The manifest, written by rank 0 once both ranks wrote: every rank's files, its DCP shards too.
    manifest = json.loads((tmp_path / "checkpoints" / "step_000005" / "manifest.json").read_text())["files"]
    shards = {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "rng_rank0.pt", "rng_rank1.pt"}
    assert shards <= set(manifest), sorted(manifest)
    r = cli(capsys, "fit", "configs/tiny.yaml", *COMMON, "train.micro_batch_size=8", f"run.dir={tmp_path}",
            "resume=last")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout
    a, b = losses(one_process), losses(tmp_path)
    for step in (6, 7, 8):
        assert abs(a[step] - b[step]) < 1e-5, (step, a[step], b[step])


RANK0_BUILDS = r"""
import json, os, sys
import torch
from trainer import build, plan
from trainer.config import load_config
from trainer.distributed import env as dist_env

env = dist_env.setup("cpu", "gloo")
out = {}
for case, overrides in json.loads(sys.argv[2]).items():
    cfg = load_config("configs/tiny.yaml", ["distributed.strategy=fsdp", "distributed.fsdp_unit_mb=0",
                                             "model.dropout=0.0", *overrides])
    build.seed_everything(cfg.seed)
    model = build.make_model(plan.resolve(cfg, env), 256, env)
    on_meta = sorted({p.device.type for p in model.parameters()})
    build.shard(model, plan.resolve(cfg, env), env)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    build.seed_everything(cfg.seed)  # the same model built whole in this process, as one process would
    whole = build.make_model(plan.one_process(cfg, env.device), 256)
    diff = max((full[k] - v).abs().max().item() for k, v in whole.state_dict().items())
    out[case] = {"devices": on_meta, "keys": sorted(full) == sorted(whole.state_dict()), "diff": diff,
                 "buffers": max([(a - b).abs().max().item() for a, b in zip(model.buffers(), whole.buffers())]
                                or [0.0])}
with open(os.path.join(sys.argv[1], f"rank{env.rank}.json"), "w") as f:
    json.dump(out, f)
dist_env.teardown(env)
dist_env.exit_code(0)
"""


@pytest.fixture(scope="module")
def rank0_builds(tmp_path_factory) -> dict[str, list[dict]]:
    """RANK0_BUILDS on 2 ranks, one launch for the two tests below: ``{case: [rank 0's result, rank 1's]}`` for the
    built-in GPT (``gpt``) and, with transformers installed, a pretrained Llama (``llama``)."""

    def make(tmp_path):
        cases = {"gpt": []}
        try:
            import transformers
        except ImportError:
            transformers = None
        if transformers is not None:
            config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=64)  # fmt: skip
            torch.manual_seed(123)  # weights no seed of the run would draw
            transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
            cases["llama"] = [f"model.hf={tmp_path / 'llama'}", "model.pretrained=true", "data.seq_len=32"]
        script = tmp_path / "rank0_builds.py"
        script.write_text(RANK0_BUILDS)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
               str(tmp_path), json.dumps(cases)]  # fmt: skip
        r = torchrun(cmd, timeout=300, env=_worker_env())
        assert r.returncode == 0, r.stderr[-3000:]

    tmp_path = shared_run(tmp_path_factory, "distributed-rank0_builds", make)
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1)]
    return {case: [rank[case] for rank in ranks] for case in ranks[0]}


def test_fsdp_rank0_builds_the_model_the_others_get_their_shards(rank0_builds):
    """Under fsdp rank 0 builds the model on the host and rank 1 with its parameters on the meta device (no
    memory); after sharding, every rank's shards put together equal the model one process builds with the seed."""
    ranks = rank0_builds["gpt"]
    assert [x["devices"] for x in ranks] == [["cpu"], ["meta"]]
    for x in ranks:
        assert x["keys"] and x["diff"] == 0.0 and x["buffers"] == 0.0, x


def test_fsdp_pretrained_weights_are_read_by_rank0_and_reach_every_rank(rank0_builds):
    """model.pretrained under fsdp: rank 0 reads the weights, rank 1 builds the structure on meta (it reads no
    weights) and gets its shards from rank 0; the rotary table (a non-persistent buffer) is the same on both."""
    pytest.importorskip("transformers")
    ranks = rank0_builds["llama"]
    assert [x["devices"] for x in ranks] == [["cpu"], ["meta"]]
    for x in ranks:
        assert x["keys"] and x["diff"] == 0.0 and x["buffers"] == 0.0, x


class _ReadsItsWeights(torch.nn.Module):
    """A user's model whose __init__ computes with a parameter's value (impossible on the meta device)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = float(self.lin.weight.detach().abs().max())


def test_fsdp_a_model_that_cannot_be_built_on_meta_is_built_whole_with_a_warning(capsys):
    from trainer import build, plan
    from trainer.config import load_config
    from trainer.distributed.env import DistEnv

    cfg = load_config("configs/tiny.yaml", ["distributed.strategy=fsdp", "model.preset=null",
                                            f"model.target={__name__}:_ReadsItsWeights"])  # fmt: skip
    rank1 = DistEnv(rank=1, local_rank=1, world_size=2, device=torch.device("cpu"), backend="gloo")
    model = build.make_model(plan.resolve(cfg, rank1), 256, rank1)
    err = capsys.readouterr().err
    assert err.count("warning: fsdp: rank 1 could not build the model with its parameters on the meta device") == 1
    assert model.lin.weight.device.type == "cpu"
    assert build.make_model(plan.one_process(cfg), 256) is not None


def test_strategy_none_under_torchrun_is_refused(tmp_path):
    r = _torchrun(2, *SHAPE, "train.steps=2", f"run.dir={tmp_path}")
    assert r.returncode != 0
    assert "would train 2 independent models" in r.stderr


def test_sigterm_to_one_rank_stops_all_with_one_checkpoint(tmp_path):
    import signal
    import time

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "trainer",
           "fit", "configs/tiny.yaml", *SHAPE, "train.steps=100000", "log.every=2", "distributed.strategy=ddp",
           f"run.dir={tmp_path}"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        time.sleep(0.2)
    rank1 = rank_process(proc, 1)
    rank1.send_signal(signal.SIGTERM)  # as a scheduler would, to one process
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert len(saved) == 1, saved
    last = json.loads((tmp_path / "checkpoints" / saved[0] / "meta.json").read_text())
    assert last["world_size"] == 2 and last["step"] % 2 == 0  # ranks agree at a log step
    assert "stopped by signal" in err


# Inductor where its code is what runs under NCCL, aot_eager where the backend is not what a variant tests; 10 KiB
# buckets (one block each: several graph pieces and all-reduces) where the bucket plan is. tests/ddp_worker.py
# checks compiled autograd's all-reduces bucket by bucket on the GPUs.
GPU_VARIANTS = {
    "ddp-compiled": ["distributed.strategy=ddp", "compile.enabled=true", "distributed.bucket_mb=0.01"],
    "ddp-compiled-triton-adamw": [
        "distributed.strategy=ddp",
        "compile.enabled=true",
        "compile.backend=aot_eager",
        "optim.impl=triton",
    ],
    "ddp-compiled-autograd": ["distributed.strategy=ddp", "compile.enabled=true", "compile.autograd=true"],
    "fsdp-compiled": ["distributed.strategy=fsdp", "compile.enabled=true", "distributed.fsdp_unit_mb=0"],
    # both blocks: one unit
    "fsdp-compiled-grouped": ["distributed.strategy=fsdp", "compile.enabled=true", "compile.backend=aot_eager"],
}


@pytest.mark.multi_gpu
@pytest.mark.parametrize("variant", list(GPU_VARIANTS))
def test_two_gpus_reproduce_one_gpu(variant, tmp_path):
    """NCCL: 2 GPUs x 4 sequences against 1 GPU x 8, in fp32 (no autocast) to compare closely."""
    common = [*COMMON, *GPU_CACHE, "train.device=cuda", "train.precision=fp32", *GPU_VARIANTS[variant]]
    one, two = tmp_path / "one", tmp_path / "two"
    wait_one = start_torchrun(_fit_cmd(1, *common, "train.micro_batch_size=8", f"run.dir={one}"), env=_env())
    r = _torchrun(2, *common, "train.micro_batch_size=4", f"run.dir={two}")
    assert r.returncode == 0, r.stderr[-3000:]
    r = wait_one()
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = losses(one), losses(two)
    for step in a:
        # TF32 matmuls and another summation order: tolerance 1e-3 (relative to losses ~5).
        assert abs(a[step] - b[step]) < 1e-3, (step, a[step], b[step])
    na, nb = metric(one, "grad_norm"), metric(two, "grad_norm")  # ddp: the norm computed while reducing
    print(variant, "max relative grad-norm diff, 2 GPUs vs 1:", max(abs(na[s] - nb[s]) / na[s] for s in na))
    for step in na:
        assert abs(na[step] - nb[step]) <= 1e-3 * na[step], (step, na[step], nb[step])


@pytest.mark.multi_gpu
def test_nccl_reduces_inductor_gradients_in_place(tmp_path):
    """tests/ddp_worker.py on 2 GPUs (NCCL; the split variant's pieces compiled by Inductor): the gradients are
    reduced where autograd left them (the sole-owner guard accepts Inductor's outputs: no silent fallback to
    the flat copy), equal to one process's, and the norm returned while reducing is theirs."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "tests" / "ddp_worker.py"), str(tmp_path)]  # fmt: skip
    env = _worker_env(DDP_WORKER_DEVICE="cuda")
    r = torchrun(cmd, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["eager"]["in_place"] and res["split"]["in_place"] and not res["bf16"]["in_place"]
        for variant in ("eager", "split", "ca"):
            # fp32 (no TF32 by default); Inductor's fused kernels sum in another order than eager.
            assert res[variant]["max_rel_grad_err"] < 1e-5, (variant, res[variant]["max_rel_grad_err"])
            assert res[variant]["norm_rel_err"] < 1e-5, (variant, res[variant]["norm_rel_err"])
        assert res["split"]["pieces"] == [[[5], [4], [3], [2], [1], [0]]]


@pytest.mark.multi_gpu
@pytest.mark.parametrize("impl", ["auto", "triton"])
def test_graphed_ddp_step_equals_ungraphed_on_two_gpus(tmp_path, impl):
    """compile.cudagraphs with ddp: the bucket all-reduces captured in the step's CUDA graph (fp32, accumulation,
    clipping, 12 steps): the replays give the ungraphed run's losses, and the graph was captured; with torch's
    fused AdamW and with ours (which reads the reduced gradients through its address table)."""
    common = [*COMMON, *GPU_CACHE, "train.steps=12", "train.device=cuda", "train.precision=fp32",
              "distributed.strategy=ddp", "compile.enabled=true", "distributed.bucket_mb=0.01",
              "train.micro_batch_size=2", "train.grad_accum=2", "optim.grad_clip=1.0", "model.dropout=0.0",
              f"optim.impl={impl}"]  # fmt: skip
    runs = {}
    for graphs in ("false", "true"):
        r = _torchrun(2, *common, f"compile.cudagraphs={graphs}", f"run.dir={tmp_path / graphs}")
        assert r.returncode == 0, r.stderr[-3000:]
        runs[graphs] = losses(tmp_path / graphs)
    assert "captured as one CUDA graph" in r.stdout + r.stderr
    a, b = runs["false"], runs["true"]
    assert sorted(a) == sorted(b) == list(range(1, 13))
    print("losses ungraphed:", [round(a[s], 5) for s in sorted(a)], "graphed:", [round(b[s], 5) for s in sorted(b)])
    print("max |loss diff| graphed vs ungraphed, 2 GPUs:", max(abs(a[s] - b[s]) for s in a))
    for step in a:
        assert abs(a[step] - b[step]) < 1e-5, (step, a[step], b[step])  # the same kernels on the same inputs
    na, nb = metric(tmp_path / "false", "grad_norm"), metric(tmp_path / "true", "grad_norm")
    for step in na:
        assert abs(na[step] - nb[step]) <= 1e-5 * na[step], (step, na[step], nb[step])


def test_accelerate_launch_works_like_torchrun(one_process, tmp_path):
    """`accelerate launch --multi_gpu` sets torchrun's environment: 2 gloo ranks on the CPU, same losses."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "trainer", "fit",
           "configs/tiny.yaml", *COMMON, "train.micro_batch_size=4", "distributed.strategy=ddp",
           f"run.dir={tmp_path}"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = losses(one_process), losses(tmp_path)
    for step in a:
        assert abs(a[step] - b[step]) < 1e-5, (step, a[step], b[step])


def test_explain_under_torchrun_prints_the_plan_once(tmp_path):
    """Two ranks: the plan comes from the splitter the run used; rank 1 prints nothing and exits 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "trainer",
           "explain", "configs/tiny.yaml", *SHAPE, "compile.backend=aot_eager", "distributed.strategy=ddp",
           "distributed.bucket_mb=0.01", "--steps", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    r = torchrun(cmd, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("bucket plan: 4 buckets") == 1  # head, h.1, h.0, embeddings (2 layers)
    assert "forward graph split into 4 pieces (one per bucket)" in r.stdout


def test_parameters_on_meta_keeps_what_a_model_set_on_a_parameter():
    from trainer.models.no_init import parameters_on_meta

    class Tagged(torch.nn.Module):
        def __init__(self):
            super().__init__()
            p = torch.nn.Parameter(torch.ones(3), requires_grad=False)
            p.tag = "no decay"  # an attribute, as some models set on their parameters
            self.p = p
            self.register_buffer("table", torch.arange(3.0))

    with parameters_on_meta():
        m = Tagged()
    assert m.p.is_meta and m.p.tag == "no decay" and not m.p.requires_grad and isinstance(m.p, torch.nn.Parameter)
    assert m.table.device.type == "cpu" and m.table.tolist() == [0.0, 1.0, 2.0]  # buffers are built as usual
    assert not Tagged().p.is_meta  # outside the context, as before
