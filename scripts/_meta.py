"""What a benchmark result records about the code it measured."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git_sha() -> str:
    """The commit measured: ``GIT_SHA`` if set (a copy of the tree without its git history, on a remote GPU
    machine), else ``git rev-parse``, with ``-dirty`` for uncommitted changes; ``unknown`` without either."""
    if os.environ.get("GIT_SHA"):
        return os.environ["GIT_SHA"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
    except OSError:
        return "unknown"
    return (sha.stdout.strip() or "unknown") + ("-dirty" if dirty and sha.stdout.strip() else "")


@contextlib.contextmanager
def gpu_timeline(name: str) -> Iterator[None]:
    """With ``BENCH_TRACE=dir`` set, rank 0's GPU timeline of the code inside (kernels; host events too with
    ``BENCH_TRACE_CPU=1``) is written to ``dir/<name>.json.gz`` (``name`` made file-safe), for
    ``scripts/trace_gaps.py``. Without it, or on another rank, nothing is recorded."""
    trace_dir = os.environ.get("BENCH_TRACE")
    if not trace_dir or int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    import torch

    acts = [torch.profiler.ProfilerActivity.CUDA]
    if os.environ.get("BENCH_TRACE_CPU"):
        acts.append(torch.profiler.ProfilerActivity.CPU)
    with torch.profiler.profile(activities=acts) as prof:
        yield
    os.makedirs(trace_dir, exist_ok=True)
    prof.export_chrome_trace(trace_file(trace_dir, name))


def trace_file(trace_dir: str, name: str) -> str:
    """Where :func:`gpu_timeline` writes the timeline of ``name``: the name made file-safe."""
    safe = name.replace("@", "_at_").replace("=", "-").replace("/", "_").replace(":", "_")
    return os.path.join(trace_dir, f"{safe}.json.gz")
