import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU, our Triton kernels run on CPU tensors through Triton's interpreter. It must be
# chosen before triton is first imported (which the first compiled test may do), so set it here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]

# A model and batch small enough that a step takes milliseconds on 2 CPU cores.
FAST = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
    "data.seq_len=32",
    "train.micro_batch_size=4",
    "train.eval_batches=2",
    "schedule.warmup_steps=2",
    "log.every=5",
    "log.progress=false",
]


@pytest.fixture
def fresh_dynamo():
    """Each test from an empty Dynamo cache and zeroed counters (recompile counts are per test)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def rank_process(launcher, rank: int):
    """The psutil process of ``rank`` among the trainer workers a torchrun ``launcher`` (a Popen) started."""
    import psutil

    workers = [p for p in psutil.Process(launcher.pid).children(recursive=True) if "trainer" in " ".join(p.cmdline())]
    return next(p for p in workers if p.environ().get("RANK") == str(rank))


def forbid_fallbacks(monkeypatch, module, *names: str) -> None:
    """Replace ``module``'s PyTorch fallbacks ``names`` with a failure: where Triton can run, a test of a kernel
    must test the kernel, not the fallback it would silently take."""

    def fail(*args, **kwargs):
        raise AssertionError("the PyTorch fallback ran where the Triton kernel should have")

    for name in names:
        monkeypatch.setattr(module, name, fail)


def run_cli(*args, env=None, timeout=300, cwd=ROOT):
    """Run `python -m trainer ARGS` in a subprocess; returns CompletedProcess with text output."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd
    )


def metric(run_dir: Path, key: str) -> dict[int, float]:
    """``{step: value}`` of one metric (``loss``, ``grad_norm``, ...) from a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


def losses(run_dir: Path) -> dict[int, float]:
    """``{step: loss}`` from a run's metrics.jsonl."""
    return metric(run_dir, "loss")


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    n_gpu = torch.cuda.device_count() if has_cuda else 0
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multi_gpu" in item.keywords and n_gpu < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2 CUDA GPUs"))
