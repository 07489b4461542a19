"""Under torchrun (2 gloo processes on CPU): DDP reproduces a single process with the same global batch."""

import json
import os
import subprocess
import sys

import torch

from tests.conftest import FAST, ROOT

SHAPE = [f for f in FAST if not f.startswith("train.micro_batch_size")]


def _torchrun(nproc: int, *args, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "trainer", "fit", "configs/tiny.yaml", *args]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def _losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_ddp_two_ranks_reproduce_one_process(tmp_path):
    common = [*SHAPE, "train.steps=8", "log.every=1", "optim.lr=3e-3"]
    one, two = tmp_path / "one", tmp_path / "two"
    r = _torchrun(1, *common, "train.micro_batch_size=8", f"run.dir={one}")
    assert r.returncode == 0, r.stderr
    r = _torchrun(2, *common, "train.micro_batch_size=4", "distributed.strategy=ddp", f"run.dir={two}")
    assert r.returncode == 0, r.stderr
    a, b = _losses(one), _losses(two)
    assert sorted(a) == sorted(b) == list(range(1, 9))  # rank 0 alone writes: each step once
    # The logged loss is the mean over ranks; gloo sums gradients in another order than one process's
    # batched matmuls: observed max |diff| 1e-6 over 8 steps.
    for step in a:
        assert abs(a[step] - b[step]) < 1e-5, (step, a[step], b[step])
    pa = torch.load(one / "checkpoints/step_000008/model.pt", weights_only=True)
    pb = torch.load(two / "checkpoints/step_000008/model.pt", weights_only=True)
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], rtol=0, atol=1e-5)  # observed 2e-7 (Adam's update, fp32)
    # Gradient accumulation (2 micro-batches of 2 per rank, reduction only on the last) is the same step.
    accum = tmp_path / "accum"
    r = _torchrun(2, *common, "train.micro_batch_size=2", "train.grad_accum=2", "distributed.strategy=ddp",
                  f"run.dir={accum}")  # fmt: skip
    assert r.returncode == 0, r.stderr
    c = _losses(accum)
    for step in a:
        assert abs(a[step] - c[step]) < 1e-5, (step, a[step], c[step])


def test_strategy_none_under_torchrun_is_refused(tmp_path):
    r = _torchrun(2, *SHAPE, "train.steps=2", f"run.dir={tmp_path}")
    assert r.returncode != 0
    assert "would train 2 independent models" in r.stderr


def test_sigterm_to_one_rank_stops_all_with_one_checkpoint(tmp_path):
    import signal
    import time

    import psutil

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "trainer",
           "fit", "configs/tiny.yaml", *SHAPE, "train.steps=100000", "log.every=2", "distributed.strategy=ddp",
           f"run.dir={tmp_path}"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        time.sleep(0.2)
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if "trainer" in " ".join(p.cmdline())]
    rank1 = next(p for p in workers if p.environ().get("RANK") == "1")
    rank1.send_signal(signal.SIGTERM)  # as a scheduler would, to one process
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert len(saved) == 1, saved
    last = json.loads((tmp_path / "checkpoints" / saved[0] / "meta.json").read_text())
    assert last["world_size"] == 2 and last["step"] % 2 == 0  # ranks agree at a log step
    assert "stopped by signal" in err
