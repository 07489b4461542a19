"""train.precision=fp8: torchao's float8 training on the linears our rule picks.

On CPU the float8 matmuls are emulated (``TRAINER_FP8_EMULATE=1``: torchao's ``emulate=True`` computes them in
higher precision from the float8-rounded operands), so the conversion, the casts and their scales, the training
loop, the report and checkpoints are tested; the float8 tensor-core matmul and its speed are not (the GPU runs
of scripts/bench_fsdp.py and the ``gpu`` test below are).
"""

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from tests.conftest import GPU_CACHE, ROOT, losses, metric

torchao = pytest.importorskip("torchao")

from trainer.precision import fp8  # noqa: E402

EMULATE = {fp8.EMULATE_ENV: "1"}
MODEL = ["model.preset=null", "model.target=tests.fp8_model:make", "data.seq_len=32", "train.micro_batch_size=4",
         "train.eval_batches=1", "log.every=1", "log.progress=false", "optim.lr=1e-3"]  # fmt: skip


def test_the_torchao_api_we_use():
    """The names and arguments trainer.precision.fp8 relies on, in the torchao the fp8 extra installs (>= 0.18)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.float8_linear import Float8Linear

    assert tuple(int(x) for x in torchao.__version__.split(".")[:2]) >= (0, 18), torchao.__version__
    assert {"module_filter_fn", "config"} <= set(inspect.signature(convert_to_float8_training).parameters)
    for recipe in fp8.RECIPES:
        config = Float8LinearConfig.from_recipe_name(recipe)
        assert hasattr(config, "enable_fsdp_float8_all_gather") and hasattr(config, "emulate")
    assert callable(precompute_float8_dynamic_scale_for_fsdp) and issubclass(Float8Linear, nn.Linear)


def test_the_rule_converts_wide_linears_and_leaves_the_head_and_small_ones():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50304, 2048)
            self.q = nn.Linear(2048, 2048)  # 2048*2048/4096 = 1024: converts
            self.kv = nn.Linear(2048, 512)  # 410: too small
            self.mlp = nn.Linear(2048, 8192)  # 1638: converts
            self.odd = nn.Linear(2048, 2056)  # 2056 is no multiple of 16
            self.gpt2 = nn.Linear(768, 3072)  # 614: too small
            self.head = nn.Linear(2048, 50304, bias=False)  # as wide as the token table: the head

    with torch.device("meta"):
        model = Model()
    conversion = fp8.convert(model, "tensorwise")
    assert conversion.converted == ["q", "mlp"]
    assert dict(conversion.left_out) == {"kv": "too small to gain: 2048 -> 512",
                                         "odd": "not a multiple of 16: 2048 -> 2056",
                                         "gpt2": "too small to gain: 768 -> 3072", "head": "the LM head"}  # fmt: skip
    from torchao.float8.float8_linear import Float8Linear

    assert isinstance(model.q, Float8Linear) and type(model.kv) is nn.Linear and type(model.head) is nn.Linear
    assert fp8.conversion_of(model, "tensorwise").as_dict() == conversion.as_dict()  # the report reads the model


def test_a_hugging_face_llama_keeps_its_head_and_key_value_projections():
    transformers = pytest.importorskip("transformers")
    from trainer.models.hf import HFCausalLM

    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=2048, intermediate_size=8192,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=256)  # fmt: skip
    with torch.device("meta"):  # the Llama-3.2-1B widths, no memory
        model = HFCausalLM(transformers.LlamaForCausalLM(config))
    conversion = fp8.convert(model, "rowwise")
    layer = "hf.model.layers.0."
    assert sorted(conversion.converted) == sorted(
        layer + n for n in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    )
    assert dict(conversion.left_out)["hf.lm_head"] == "the LM head"  # 256 rows: found as the output embeddings
    assert dict(conversion.left_out)[layer + "self_attn.k_proj"] == "too small to gain: 2048 -> 512"


def test_fp8_where_float8_cannot_run_exits_2_naming_the_key(tmp_path, capsys, monkeypatch):
    from trainer.cli import main

    monkeypatch.delenv(fp8.EMULATE_ENV, raising=False)
    rc = main(["fit", "configs/tiny.yaml", "train.precision=fp8", f"run.dir={tmp_path / 'a'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "train.precision: fp8 needs a CUDA GPU with float8 tensor cores" in err, err
    assert "Traceback" not in err and not (tmp_path / "a").exists()
    monkeypatch.setenv(fp8.EMULATE_ENV, "1")
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # as without torchao
    rc = main(["fit", "configs/tiny.yaml", "train.precision=fp8", f"run.dir={tmp_path / 'b'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "fp8 needs torchao; install it with: pip install -e '.[fp8]'" in err, err
    rc = main(["fit", "configs/tiny.yaml", "train.fp8_recipe=delayed", f"run.dir={tmp_path / 'c'}"])
    assert rc == 2 and "train.fp8_recipe" in capsys.readouterr().err


def test_fp8_trains_like_bf16_and_the_report_lists_the_conversion(tmp_path, monkeypatch, capsys):
    """Compiled (aot_eager) fp8 against eager bf16, 6 steps of the same batches: the loss curves agree to 1%
    (observed 0.1%: e4m3 keeps 3 mantissa bits, bf16 7, on one of four linears), and compile_report.json and
    explain's text list the linear in float8 and why the others are not."""
    from trainer.cli import main

    monkeypatch.setenv(fp8.EMULATE_ENV, "1")
    common = [*MODEL, "train.steps=6", "checkpoint.enabled=false"]
    assert main(["fit", "configs/tiny.yaml", *common, "train.precision=bf16", f"run.dir={tmp_path / 'bf16'}"]) == 0
    assert main(["fit", "configs/tiny.yaml", *common, "train.precision=fp8", "compile.enabled=true",
                 "compile.backend=aot_eager", f"run.dir={tmp_path / 'fp8'}"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "fp8 (tensorwise): 1 of 4 linears in float8; bf16 too small to gain: 2; the LM head: 1" in out, out
    a, b = losses(tmp_path / "bf16"), losses(tmp_path / "fp8")
    assert a.keys() == b.keys() and all(abs(a[s] - b[s]) <= 0.01 * abs(a[s]) for s in a), (a, b)
    report = json.loads((tmp_path / "fp8" / "compile_report.json").read_text())
    assert report["fp8"]["converted"] == ["blocks.0.wide"]
    assert {x["name"]: x["why"] for x in report["fp8"]["left_out"]} == {
        "blocks.0.up": "too small to gain: 64 -> 2048", "blocks.0.down": "too small to gain: 2048 -> 64",
        "head": "the LM head"}  # fmt: skip
    from trainer.compile.report import format_text

    text = format_text(report)
    assert "fp8 (tensorwise): 1 linears in float8, 3 in bf16" in text and "bf16, the LM head: 1 (head)" in text


def _torchrun(nproc: int, *args: str, emulate: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "trainer",
           "fit", "configs/tiny.yaml", *MODEL, *GPU_CACHE, *args]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(EMULATE if emulate else {})}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def test_a_bf16_run_resumes_in_fp8_on_two_ranks_and_back(tmp_path):
    """Checkpoints hold the same parameters in bf16 and fp8 (fp32, the same names): a bf16 fsdp run on 2 gloo ranks
    (DCP checkpoints) resumes in fp8 (emulated, the weights all-gathered in float8) at its step, and that run
    resumes in bf16 again. Each continues where the other stopped: the steps are 1..6 once each, and the loss keeps
    falling from where it was. (The float8 weights' wrapper class must not reach the checkpoint: torch.load would
    refuse it.)"""
    out = _bf16_fp8_bf16(tmp_path / "run", emulate=True)
    assert "weights all-gathered in float8" in out


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_fsdp_fp8_on_two_gpus_resumes_from_bf16_and_back(tmp_path):
    """The same on 2 GPUs under NCCL, compiled, with the float8 tensor-core matmul and the weights all-gathered in
    float8 (their scales precomputed after each step): DCP saves and loads those weights like bf16's."""
    out = _bf16_fp8_bf16(tmp_path / "run", emulate=False)
    assert "weights all-gathered in float8" in out


def test_fsdp_fp8_with_the_triton_optimizer_matches_torchs_on_two_ranks(tmp_path):
    """Under fsdp the float8 weights are DTensors over torchao's wrapper subclass, which has no storage of its own
    (``data_ptr()`` 0): the Triton AdamW must update the fp32 values it wraps, not write through address 0. Two gloo
    ranks, fp8 emulated, 3 clipped steps: its losses and gradient norms equal torch's foreach AdamW's."""
    common = ["distributed.strategy=fsdp", "train.steps=3", "train.precision=fp8", "optim.grad_clip=0.5",
              "checkpoint.enabled=false"]  # fmt: skip
    for impl in ("triton", "foreach"):
        r = _torchrun(2, *common, f"optim.impl={impl}", f"run.dir={tmp_path / impl}")
        assert r.returncode == 0, r.stderr[-3000:]
    a, b = losses(tmp_path / "triton"), losses(tmp_path / "foreach")
    assert sorted(a) == [1, 2, 3] and a[3] != a[1], a
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5 * abs(b[step]), (step, a[step], b[step])
    na, nb = metric(tmp_path / "triton", "grad_norm"), metric(tmp_path / "foreach", "grad_norm")
    assert min(na.values()) > 0.5, na  # every step clipped
    for step in nb:
        assert abs(na[step] - nb[step]) <= 1e-5 * nb[step], (step, na[step], nb[step])


def _bf16_fp8_bf16(run, emulate: bool) -> str:
    """bf16 for 2 steps, fp8 to step 4, bf16 to step 6, each resuming the last: the fp8 run's stdout."""
    strategy = "fsdp"
    r = _torchrun(2, f"distributed.strategy={strategy}", "train.steps=6", "train.stop_at=2",
                  "train.precision=bf16", f"run.dir={run}", emulate=emulate)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    r = _torchrun(2, f"distributed.strategy={strategy}", "train.steps=6", "train.stop_at=4",
                  "train.precision=fp8", f"run.dir={run}", "resume=last", emulate=emulate)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    fp8_out = r.stdout
    assert "resumed from" in fp8_out and "train.precision: 'bf16' -> 'fp8'" in fp8_out, fp8_out
    assert "fp8 (tensorwise): 1 of 4 linears in float8" in fp8_out
    r = _torchrun(2, f"distributed.strategy={strategy}", "train.steps=6", "train.precision=bf16",
                  f"run.dir={run}", "resume=last", emulate=emulate)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    loss = losses(run)
    assert sorted(loss) == [1, 2, 3, 4, 5, 6]
    assert loss[6] < loss[1], loss
    return fp8_out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_on_the_gpu_matches_bf16(tmp_path):
    """The float8 tensor-core matmul, compiled and graphed: 20 steps of the fp8 test model within 2% of bf16."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs float8 tensor cores")
    from trainer.cli import main

    common = [
        *MODEL,
        *GPU_CACHE,
        "train.steps=20",
        "checkpoint.enabled=false",
        "train.micro_batch_size=8",
        "data.seq_len=256",
    ]
    assert main(["fit", "configs/tiny.yaml", *common, "train.precision=bf16", f"run.dir={tmp_path / 'bf16'}"]) == 0
    assert main(["fit", "configs/tiny.yaml", *common, "train.precision=fp8", f"run.dir={tmp_path / 'fp8'}"]) == 0
    a, b = losses(tmp_path / "bf16"), losses(tmp_path / "fp8")
    assert all(abs(a[s] - b[s]) <= 0.02 * abs(a[s]) for s in a), (a, b)
