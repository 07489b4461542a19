"""distributed.shard_optimizer: 2 gloo ranks under torchrun, each keeping half of the optimizer state, reproduce one
process; checkpoints hold the whole state and resume across world sizes, with or without sharding."""

import pytest
import torch

from tests.conftest import FAST, GPU_CACHE, cli, losses, metric, shared_run, start_torchrun, torchrun
from tests.test_distributed import _env, _fit_cmd
from trainer.config import ConfigError, load_config
from trainer.optim import zero

# n_embd=33 (3 heads of 11): odd-sized weights and biases, so the buckets need padding and parameters straddle the
# boundary between the two ranks' halves. grad_clip=0.5 under the observed norms (1.7-2.6): every step is clipped.
# 10 KiB buckets: one per block, the head and the embeddings each (several flat buffers).
SHAPE = [f for f in FAST if not f.startswith(("train.micro_batch_size", "model.n_head", "model.n_embd"))]
COMMON = [*SHAPE, "model.n_head=3", "model.n_embd=33", "train.steps=8", "log.every=1", "optim.grad_clip=0.5",
          "optim.weight_decay=0.1", "checkpoint.every=4", "distributed.bucket_mb=0.01"]  # fmt: skip
OPTIMS = {"adamw": ["optim.lr=3e-3"], "sgd": ["optim.name=sgd", "optim.lr=0.3", "optim.momentum=0.9"]}
SHARDED = ["distributed.strategy=ddp", "distributed.shard_optimizer=true"]
ONE = ["train.micro_batch_size=8"]  # the global batch: 8 sequences in one process, 4 on each of 2 ranks
TWO = ["train.micro_batch_size=4"]


def _fit_here(capsys, *args):
    """``trainer fit`` in one process (this one)."""
    r = cli(capsys, "fit", "configs/tiny.yaml", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _torchrun(nproc: int, *args, timeout=300):
    r = torchrun(_fit_cmd(nproc, *args), timeout=timeout, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _ckpt(run_dir, step: int):
    return run_dir / "checkpoints" / f"step_{step:06d}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Lazily made runs, each once per session: ``runs(name)`` -> its run directory (one process: a test process)."""
    recipes = {
        "one-adamw": (1, *OPTIMS["adamw"], *ONE),
        "one-sgd": (1, *OPTIMS["sgd"], *ONE),
        "two-adamw": (2, *OPTIMS["adamw"], *TWO, *SHARDED),
        "two-sgd": (2, *OPTIMS["sgd"], *TWO, *SHARDED),
    }

    def make(name: str, run_dir):
        nproc, *args = recipes[name]
        if nproc == 1:
            _fit_here(None, *COMMON, *args, f"run.dir={run_dir}")
        else:
            r = _torchrun(nproc, *COMMON, *args, f"run.dir={run_dir}")
            assert "optimizer state sharded over 2 ranks" in r.stdout + r.stderr

    def get(name: str):
        return shared_run(tmp_path_factory, f"shard_optimizer-{name}", lambda d: make(name, d))

    return get


def _same_losses(a, b, steps, tol=1e-5):
    # The ranks' gradients are summed in another order than one process's batched matmuls (as in
    # tests/test_distributed.py); observed max |diff| 4.8e-7 (AdamW), 7.2e-7 (SGD) over 8 steps.
    for step in steps:
        assert abs(a[step] - b[step]) < tol, (step, a[step], b[step])


def _load(path):
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("optim", list(OPTIMS))
def test_two_sharded_ranks_reproduce_one_process(optim, runs):
    one, two = runs(f"one-{optim}"), runs(f"two-{optim}")
    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    assert a[8] < a[1] - 0.1  # the updates move the loss: a skipped or wrong shard update would show
    _same_losses(a, b, a)
    # The pre-clip norm, from the two ranks' gradient shards (observed relative diff 2.1e-7 AdamW, 5.6e-7 SGD).
    na, nb = metric(one, "grad_norm"), metric(two, "grad_norm")
    assert all(n > 0.5 for n in na.values())  # above optim.grad_clip: clipping was active
    for step in na:
        assert abs(na[step] - nb[step]) <= 1e-5 * na[step], (step, na[step], nb[step])
    pa, pb = _load(_ckpt(one, 8) / "model.pt"), _load(_ckpt(two, 8) / "model.pt")
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], rtol=0, atol=1e-5)  # observed 4.7e-7 (AdamW), 6e-8 (SGD)
    # optim.pt: the unsharded optimizer's state dict, gathered from the shards: same groups, same keys and shapes.
    sa, sb = _load(_ckpt(one, 8) / "optim.pt")["optimizer"], _load(_ckpt(two, 8) / "optim.pt")["optimizer"]
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys() == set(range(len(pa) - 1))  # the tied head: one parameter
    for i, state in sa["state"].items():
        assert list(state) == list(sb["state"][i])
        for key, value in state.items():
            assert value.shape == sb["state"][i][key].shape and value.dtype == sb["state"][i][key].dtype
            # The moments of clipped gradients (|exp_avg| <= 0.08, |momentum_buffer| <= 0.21): observed max |diff|
            # 1.5e-8 (exp_avg), 9e-10 (exp_avg_sq), 9e-8 (momentum_buffer).
            torch.testing.assert_close(value, sb["state"][i][key], rtol=1e-4, atol=1e-6)


def test_grad_accum_two_sharded_ranks_reproduce_one_process(runs, tmp_path):
    """2 micro-batches of 2 per rank: the reduce-scatter only after the last micro-batch's backward."""
    _torchrun(2, *COMMON, *OPTIMS["adamw"], *SHARDED, "train.micro_batch_size=2", "train.grad_accum=2",
              f"run.dir={tmp_path}")  # fmt: skip
    a, b = losses(runs("one-adamw")), losses(tmp_path)
    assert sorted(b) == list(range(1, 9))
    _same_losses(a, b, a)  # observed 4.8e-7


def test_sharded_checkpoint_resumes_in_one_process(runs, tmp_path, capsys):
    """Saved at step 4 by 2 sharded ranks, resumed by one process (this one; no sharding): steps 5-8 as the
    uninterrupted one-process run's. Wrongly gathered moments would change the next updates."""
    saved = _ckpt(runs("two-adamw"), 4)
    r = _fit_here(capsys, *COMMON, *OPTIMS["adamw"], *ONE, f"run.dir={tmp_path}", f"resume={saved}")
    assert "resumed from" in r.stdout + r.stderr
    a, b = losses(runs("one-adamw")), losses(tmp_path)
    assert sorted(b) == [5, 6, 7, 8]
    _same_losses(a, b, b)  # observed 0 (to the logged float32 loss)


def test_unsharded_checkpoint_resumes_on_two_sharded_ranks(runs, tmp_path):
    """The reverse: one process's step-4 checkpoint, each rank loading its slices of the whole state."""
    _torchrun(2, *COMMON, *OPTIMS["adamw"], *TWO, *SHARDED, f"run.dir={tmp_path}",
              f"resume={_ckpt(runs('one-adamw'), 4)}")  # fmt: skip
    a, b = losses(runs("one-adamw")), losses(tmp_path)
    assert sorted(b) == [5, 6, 7, 8]
    _same_losses(a, b, b)  # observed 4.8e-7


@pytest.mark.multi_gpu
@pytest.mark.parametrize("optim", list(OPTIMS))
def test_two_gpus_sharded_reproduce_one_gpu(optim, tmp_path):
    """NCCL (the reduce-scatter averages, the all-gather writes in place), torch's fused optimizer over the segments
    (what optim.impl=auto picks there), Inductor's graph pieces; fp32. Then a resume of the sharded step-4 checkpoint
    on one GPU."""
    common = [*COMMON, *GPU_CACHE, *OPTIMS[optim], "train.device=cuda", "train.precision=fp32", "compile.enabled=true"]
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    wait_one = start_torchrun(_fit_cmd(1, *common, *ONE, f"run.dir={one}"), env=_env())
    r = _torchrun(2, *common, *TWO, *SHARDED, f"run.dir={two}")
    r1 = wait_one()
    assert r1.returncode == 0, r1.stderr[-3000:]
    out = r.stdout + r.stderr
    assert f"fused {optim}, optimizer state sharded over 2 ranks" in out
    blocker = "optim.name=sgd" if optim == "sgd" else "distributed.shard_optimizer=true"  # the first unmet need
    assert f"compile.cudagraphs=auto: off, {blocker}" in out
    _torchrun(1, *common, *ONE, f"run.dir={resumed}", f"resume={_ckpt(two, 4)}")
    a, b, c = losses(one), losses(two), losses(resumed)
    print(optim, "max |loss diff| 2 sharded GPUs vs 1:", max(abs(a[s] - b[s]) for s in a),
          "resumed on 1:", max(abs(a[s] - c[s]) for s in c))  # fmt: skip
    # TF32 matmuls and another summation order: 1e-3 (relative to losses ~5), as tests/test_distributed.py.
    _same_losses(a, b, a, tol=1e-3)
    _same_losses(a, c, c, tol=1e-3)
    na, nb = metric(one, "grad_norm"), metric(two, "grad_norm")
    for step in na:
        assert abs(na[step] - nb[step]) <= 1e-3 * na[step], (step, na[step], nb[step])


# -- the layout, in one process -------------------------------------------------------------------


def test_segments_straddle_the_rank_boundary_and_pad():
    # 3 + 5 + 1 = 9 elements, padded to 10: rank 0 owns [0, 5), rank 1 [5, 10) (9 is padding).
    assert zero.padded_numel([3, 5, 1], 2) == 10
    s0, s1 = zero.rank_segments([3, 5, 1], 2, 0), zero.rank_segments([3, 5, 1], 2, 1)
    assert s0 == [zero.Segment(0, 0, 0, 3), zero.Segment(1, 3, 3, 5)]
    assert s1 == [zero.Segment(1, 3, 5, 8), zero.Segment(2, 8, 8, 9)]
    # A bucket smaller than the world: one element each for 4 ranks; ranks 1-3 own padding only.
    assert zero.padded_numel([1], 4) == 4
    assert zero.rank_segments([1], 4, 0) == [zero.Segment(0, 0, 0, 1)]
    assert all(zero.rank_segments([1], 4, r) == [] for r in (1, 2, 3))
    # Every element of every parameter is owned by exactly one rank.
    numels = [7, 1, 12, 3]
    owned = sorted((s.start, s.stop) for r in range(3) for s in zero.rank_segments(numels, 3, r))
    assert owned[0][0] == 0 and owned[-1][1] == sum(numels)
    assert all(a[1] == b[0] for a, b in zip(owned, owned[1:]))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 1))


def test_bucket_shards_repoint_parameters_into_padded_flat_buffers(monkeypatch):
    """Rank 1 of a pretend world of 2 (no process group: nothing here communicates)."""
    from trainer.distributed.buckets import plan_buckets

    monkeypatch.setattr(zero.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(zero.dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(zero.dist, "get_backend", lambda group=None: "gloo")
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = plan_buckets(model, bucket_mb=24 / 2**20)  # 24 bytes: [2.bias, 2.weight], [1.bias, 1.weight], [0.bias], ...
    assert [b.numel for b in plan.buckets] == [4, 6, 3, 9]
    shards = zero.BucketShards(plan, group=object())
    for n, p in model.named_parameters():  # the values kept, the storage now the bucket's buffer
        assert torch.equal(p, before[n])
    for b, bucket in enumerate(plan.buckets):
        flat = shards.flats[b]
        assert flat.numel() == [4, 6, 4, 10][b] and shards.grad_shards[b].numel() == flat.numel() // 2
        assert all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in bucket.params)
    # Bucket 0 = 2.bias (1) + 2.weight (3); rank 1 owns [2, 4): elements 1 and 2 of 2.weight, none of 2.bias.
    w = model[2].weight
    assert shards.range_of[id(w)] == (1, 3) and id(model[2].bias) not in shards.segment_of
    seg = shards.segment_of[id(w)]
    assert seg.data_ptr() == w.data_ptr() + w.element_size() and seg.is_leaf and not seg.requires_grad
    assert seg.grad.data_ptr() == shards.grad_shards[0].data_ptr()  # the shard's first element
    # Bucket 2 = 0.bias (3), padded to 4: rank 1 owns its last element and the padding.
    assert shards.range_of[id(model[0].bias)] == (2, 3) and shards.segment_of[id(model[0].bias)].grad.numel() == 1
    # Bucket 3 = 0.weight (9), padded to 10: rank 1 owns [5, 9) of it; the padding stays zero.
    assert shards.range_of[id(model[0].weight)] == (5, 9) and shards.flats[3][9] == 0


def test_state_dict_is_the_unsharded_optimizers(tmp_path):
    """One rank (an in-process gloo group): the same steps, and a state dict identical to the unsharded optimizer's
    (groups, keys, dtypes, values), which loads back."""
    import torch.distributed as dist

    from trainer.distributed.buckets import plan_buckets
    from trainer.optim import build_optimizer, param_groups

    make = lambda groups, clip: build_optimizer(groups, name="adamw", impl="foreach", lr=1e-2, weight_decay=0.1,
                                                max_grad_norm=clip)  # fmt: skip
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ref_model, model = _model(), _model()
        ref = make(param_groups(ref_model, 0.1), 0.0)
        opt = zero.ShardedOptimizer(param_groups(model, 0.1), plan_buckets(model, 24 / 2**20),
                                    lambda groups: make(groups, 0.0), max_grad_norm=0.1)  # fmt: skip
        x = torch.randn(4, 3)
        for _ in range(2):
            ref_model(x).square().sum().backward()
            torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.1)
            ref.step()
            ref.zero_grad()
            model(x).square().sum().backward()
            for b, bucket in enumerate(opt.shards.plan.buckets):  # what DataParallel's reduce-scatter writes
                grads = torch.cat([p.grad.reshape(-1) for p in bucket.params])
                opt.shards.grad_shards[b][: grads.numel()] = grads
            opt.step()
            opt.zero_grad()
        for p, q in zip(ref_model.parameters(), model.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-7)  # observed 0: the same foreach kernels
        want, got = ref.state_dict(), opt.state_dict()
        assert want["param_groups"] == got["param_groups"]
        assert want["state"].keys() == got["state"].keys()
        for i, state in want["state"].items():
            assert list(state) == list(got["state"][i])
            for key, value in state.items():
                assert value.dtype == got["state"][i][key].dtype and value.device == got["state"][i][key].device
                torch.testing.assert_close(value, got["state"][i][key], rtol=0, atol=1e-7)
        for state in got["state"].values():  # its own storage, as torch's: not views of one gathered buffer
            assert all(v.untyped_storage().nbytes() == v.nbytes for v in state.values())
        opt.load_state_dict(want)
        for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
            seg = opt.shards.segment_of[id(p)]
            torch.testing.assert_close(opt.inner.state[seg]["exp_avg"], want["state"][i]["exp_avg"].reshape(-1))
        with pytest.raises(ValueError, match="does not fit"):
            bad = {**want, "state": {0: {**want["state"][0], "exp_avg": torch.zeros(2)}}}
            opt.load_state_dict(bad)
    finally:
        dist.destroy_process_group()


# -- the config ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["distributed.strategy=none"], "needs distributed.strategy=ddp"),
        (["distributed.strategy=fsdp"], "fsdp shards the optimizer state"),
        (["distributed.strategy=ddp", "compile.autograd=true"], "compile.autograd=true"),
        (["distributed.strategy=ddp", "train.precision=fp16"], "train.precision=fp16"),
        (["distributed.strategy=ddp", "optim.impl=triton"], "optim.impl=triton"),
    ],
)
def test_config_refuses_what_sharding_cannot_run_with(overrides, says):
    with pytest.raises(ConfigError, match="distributed.shard_optimizer") as e:
        load_config("configs/tiny.yaml", [*overrides, "distributed.shard_optimizer=true"])
    assert says in str(e.value)


def test_cudagraphs_refused_and_auto_off_with_the_reason():
    with pytest.raises(ConfigError, match="compile.cudagraphs: needs distributed.shard_optimizer=false"):
        load_config("configs/tiny.yaml", [*SHARDED, "compile.cudagraphs=true"])
    from trainer.compile.graphed import blocker
    from trainer.schema import graphed_step_settings

    cfg = load_config("configs/tiny.yaml", [*SHARDED, "compile.enabled=true"])
    assert blocker(True, **graphed_step_settings(cfg)).startswith("distributed.shard_optimizer=true (needs false")


def test_cli_exits_2_naming_the_key(capsys):
    r = cli(capsys, "print-config", "configs/tiny.yaml", "distributed.shard_optimizer=true")
    assert r.returncode == 2 and "distributed.shard_optimizer" in r.stderr and "Traceback" not in r.stderr
