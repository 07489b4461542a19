"""Triton's compile workers started with the run (trainer/compile/cache.py, trainer/build.py): where Inductor compiles
for CUDA they start while the model is built, in the run's cache directories; torch's pool behind it is pinned."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import ROOT
from trainer import build
from trainer.compile import cache
from trainer.config import load_config


@pytest.fixture
def started(monkeypatch):
    """The calls to start_workers, none of them starting a pool; the cache variables restored after the test."""
    calls = []
    monkeypatch.setattr(cache, "start_workers", lambda: calls.append(dict(os.environ)) or True)
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.setenv(name, "before")
    return calls


def _plan(device: str, compiled: bool, *overrides: str):
    cfg = load_config(ROOT / "configs/tiny.yaml", list(overrides))
    return SimpleNamespace(cfg=cfg, compiled=compiled, device=torch.device(device))


def test_workers_start_for_inductor_on_cuda_after_the_cache_is_set(started, tmp_path):
    assert build.compile_caches(_plan("cuda", True), tmp_path) is True
    assert len(started) == 1  # they inherit the run's cache directories, set before they start
    assert started[0]["TRITON_CACHE_DIR"] == str((tmp_path / "compile_cache" / "triton").resolve())
    assert started[0]["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "compile_cache").resolve())


@pytest.mark.parametrize(
    ("device", "compiled", "overrides"),
    [("cpu", True, ()), ("cuda", True, ("compile.backend=aot_eager",)), ("cuda", False, ("compile.autograd=true",))],
)
def test_no_workers_where_inductor_does_not_compile_for_cuda(started, tmp_path, device, compiled, overrides):
    assert build.compile_caches(_plan(device, compiled, *overrides), tmp_path) is True
    assert started == [] and os.environ["TRITON_CACHE_DIR"].startswith(str(tmp_path.resolve()))


def test_nothing_compiled_leaves_the_caches_alone(started, tmp_path):
    assert build.compile_caches(_plan("cuda", False), tmp_path) is False
    assert started == [] and os.environ["TRITON_CACHE_DIR"] == "before"


def test_torchs_pool_is_ready_after_start_workers(tmp_path):
    """Pins the torch internals start_workers relies on: none of Inductor's pool before it; after it, the pool and its
    first job (the one that says the workers are up) exist, and once done Inductor compiles in the workers
    (use_process_pool: what it asks before each kernel)."""
    code = (
        "import time\n"
        "from trainer.compile.cache import start_workers\n"
        "from torch._inductor import async_compile\n"
        "assert async_compile.get_compile_threads() > 1\n"
        "assert not async_compile._pool_set and async_compile.AsyncCompile._ready_future is None\n"
        "assert start_workers()\n"
        "assert async_compile._pool_set, 'no pool started'\n"
        "ready = async_compile.AsyncCompile._ready_future  # the job that says the workers are up\n"
        "assert ready is not None, 'the workers were not woken'\n"
        "ready.result(timeout=90)\n"
        "assert async_compile.AsyncCompile.use_process_pool()\n"
        "print('ready')\n"
    )
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "2", **cache.cache_env(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=150)
    assert r.returncode == 0 and r.stdout.strip() == "ready", r.stderr[-2000:]
