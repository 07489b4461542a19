"""The global batch is a number of the run: ``train.global_batch_size`` on 2 gloo ranks against one process (the
same sequences per step, grad_accum derived for each world), a 2-rank run resumed in one process keeping it, a
resume on another world size without the key warning, and a global batch the ranks cannot split exiting 2."""

import os
import shutil
import sys

import pytest

from tests.conftest import cli, metric, shared_run, torchrun

SHAPE = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "data.seq_len=32", "schedule.warmup_steps=2",
         "train.eval_every=0", "train.eval_batches=1", "log.every=1", "log.progress=false"]  # fmt: skip
# 8 sequences a step: one process accumulates 2 micro-batches of 4, each of 2 ranks takes one.
KEY = ["train.micro_batch_size=4", "train.global_batch_size=8", "train.steps=5"]
TOKENS = 8 * 32  # a step's tokens: sequences x data.seq_len


def _torchrun(*args: str):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "trainer",
           "fit", "configs/tiny.yaml", *SHAPE, "distributed.strategy=ddp", *args]  # fmt: skip
    return torchrun(cmd, timeout=180, env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})


def _tokens_per_step(run_dir) -> dict[int, int]:
    """``{step: tokens trained at that step}`` from metrics.jsonl's running ``tokens``."""
    seen = metric(run_dir, "tokens")
    return {step: seen[step] - seen.get(step - 1, 0) for step in sorted(seen)}


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """The reference: 5 steps in one process (grad_accum 2)."""

    def make(run_dir):
        assert cli(None, "fit", "configs/tiny.yaml", *SHAPE, *KEY, f"run.dir={run_dir}").returncode == 0

    return shared_run(tmp_path_factory, "global-batch-one", make)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """The same config on 2 ddp ranks (grad_accum 1), stopped at step 3 with a checkpoint; its stdout in
    ``launch.out``."""

    def make(run_dir):
        r = _torchrun(*KEY, "train.stop_at=3", f"run.dir={run_dir}")
        assert r.returncode == 0, r.stderr[-3000:]
        (run_dir / "launch.out").write_text(r.stdout)

    return shared_run(tmp_path_factory, "global-batch-two", make)


def test_one_process_and_two_ranks_train_the_same_global_batch(one, two):
    """grad_accum 2 in one process, 1 on each of 2 ranks: 8 sequences a step either way, the same ones (the data
    of a step depends on the global batch, not the world), so step 1 is the same step."""
    assert _tokens_per_step(one) == {step: TOKENS for step in range(1, 6)}
    assert _tokens_per_step(two) == {step: TOKENS for step in range(1, 4)}
    assert "5 steps x 256 tokens (global batch 8 = 4 x 1 accumulated x 2 ranks)" in (two / "launch.out").read_text()
    for run_dir, accum in ((one, 2), (two, 1)):
        doc = (run_dir / "plan.json").read_text()
        assert f'"train.grad_accum": {accum},' in doc and '"global_batch": 8,' in doc
    # Each micro-batch's forward and backward is the same computation in both runs. One process averages the two
    # micro-batch losses in fp32, the ranks' losses are averaged on the host; the norm is summed bucket by bucket
    # under ddp: observed 2.4e-7 in the loss and in the gradient norm (one fp32 ulp at 5.4 and 2.1).
    loss, norm = metric(one, "loss"), metric(one, "grad_norm")
    assert abs(loss[1] - metric(two, "loss")[1]) <= 1e-6, (loss[1], metric(two, "loss")[1])
    assert abs(norm[1] - metric(two, "grad_norm")[1]) <= 1e-6, (norm[1], metric(two, "grad_norm")[1])


def test_a_two_rank_run_resumed_in_one_process_keeps_its_global_batch(one, two, tmp_path, capsys):
    """The 2-rank run's checkpoint of step 3 resumed in one process, with the config as given to both runs minus
    train.global_batch_size (the checkpoint's config has it): 8 sequences a step still, grad_accum 2, said in one
    line; the steps after it are the uninterrupted one-process run's."""
    run_dir = tmp_path / "run"
    shutil.copytree(two, run_dir)
    r = cli(capsys, "fit", "configs/tiny.yaml", *SHAPE, "train.micro_batch_size=4", "train.steps=5", "resume=last",
            f"run.dir={run_dir}")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "resume: global batch 8 sequences kept; train.grad_accum 1 -> 2 for 1 data-parallel rank" in r.stdout
    assert "changed on resume: train.grad_accum" not in r.stdout  # the line above says it
    assert "5 steps x 256 tokens (global batch 8 = 4 x 2 accumulated x 1 rank)" in r.stdout
    assert "warning" not in r.stderr, r.stderr
    assert _tokens_per_step(run_dir) == {step: TOKENS for step in range(1, 6)}
    # Three steps taken on 2 ranks, then two in one process, against five in one process: observed 0 in the loss
    # and 1.2e-7 in the gradient norm (the ranks' fp32 rounding of steps 1-3, carried in the parameters).
    for key in ("loss", "grad_norm"):
        want, got = metric(one, key), metric(run_dir, key)
        for step in (4, 5):
            assert abs(want[step] - got[step]) <= 1e-6, (key, step, want[step], got[step])


def test_without_the_key_a_resume_on_another_world_size_warns(tmp_path, capsys):
    """A one-process checkpoint (4 sequences a step) resumed on 2 ranks without train.global_batch_size: the global
    batch doubles, and rank 0 warns once with both numbers and the key that would keep it."""
    args = [*SHAPE, "train.micro_batch_size=4", "train.steps=3", f"run.dir={tmp_path}"]
    assert cli(capsys, "fit", "configs/tiny.yaml", *args, "train.stop_at=2").returncode == 0
    r = _torchrun(*args, "resume=last")
    assert r.returncode == 0, r.stderr[-3000:]
    warning = (
        "warning: resume: the global batch changes from the checkpoint's 4 sequences per step on 1 data-parallel "
        "rank to 8 (train.micro_batch_size 4 x train.grad_accum 1 x 2 data-parallel ranks); set "
        "train.global_batch_size=4 to keep it on any number of GPUs"
    )
    assert r.stderr.count(warning) == 1, r.stderr[-3000:]
    assert _tokens_per_step(tmp_path) == {1: 4 * 32, 2: 4 * 32, 3: 8 * 32}


def test_a_global_batch_the_ranks_cannot_split_exits_2(tmp_path):
    """12 sequences over 2 ranks of 4: every rank exits 2, naming both numbers and the keys, before it writes."""
    r = _torchrun("train.micro_batch_size=4", "train.global_batch_size=12", "train.steps=2", f"run.dir={tmp_path}")
    assert r.stderr.count("exitcode  : 2 ") == 2, r.stderr[-3000:]
    assert (
        "trainer: error: train.global_batch_size: 12 is not a multiple of train.micro_batch_size (4) x 2 "
        "data-parallel ranks = 8; set train.global_batch_size to a multiple of 8, or train.micro_batch_size to a "
        "divisor of 6"
    ) in r.stderr
    assert "Traceback" not in r.stderr.split("torch.distributed.run")[0]
    assert not any(tmp_path.iterdir())  # refused before anything was written
