"""Compile caches kept with the run, so a resumed or repeated run compiles much faster.

Two layers: Inductor's on-disk caches (FX graph cache, AOTAutograd cache, Triton kernels)
pointed at ``compile.cache_dir`` (default ``<run.dir>/compile_cache``), and torch's
"mega-cache" bundle (``torch.compiler.save_cache_artifacts``) written beside the checkpoints
and hot-loaded before the first compile of a resumed run. On CPU the C++ ``.so`` files are
not in the bundle; the directory cache covers them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from trainer.io import atomic_write

ARTIFACTS = "compile_cache.bin"


def cache_env(path: Path) -> dict[str, str]:
    """The environment variables that point Inductor's and Triton's caches at ``path``."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(path.resolve()), "TRITON_CACHE_DIR": str((path / "triton").resolve())}


def use_cache_dir(path: Path) -> None:
    """Point Inductor's and Triton's caches at ``path`` (call before the first compile)."""
    path.mkdir(parents=True, exist_ok=True)
    os.environ.update(cache_env(path))


def wants_workers(backend: str, device_type: str) -> bool:
    """Whether a compile with ``backend`` for ``device_type`` uses Inductor's Triton compile workers."""
    return backend == "inductor" and device_type == "cuda"


def start_workers() -> bool:
    """Start Inductor's Triton compile workers now (call after :func:`use_cache_dir`: they inherit its directories).

    Inductor starts them at its first compile and compiles every kernel in the main process, one at a time, until
    they are ready: each worker's parent imports torch first (seconds; over ten without bytecode), so a model's
    first graphs are compiled serially. Started while the run builds its model, they are ready by then. Returns
    False where this torch has no such pool (its internals moved), or it is turned off (``TORCH_WARM_POOL=0``)."""
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:
        return False
    maybe_warm_pool()
    return True


def save_artifacts(ckpt_root: Path) -> int:
    """Write the mega-cache bundle beside the checkpoints (atomically); returns its size in bytes (0 if none)."""
    saved = torch.compiler.save_cache_artifacts()
    if not saved or not saved[0]:
        return 0
    data = saved[0]
    atomic_write(ckpt_root / ARTIFACTS, data)
    return len(data)


def load_artifacts(ckpt_root: Path) -> bool:
    """Hot-load a saved bundle if there is one; True when loaded."""
    path = ckpt_root / ARTIFACTS
    if not path.is_file():
        return False
    return torch.compiler.load_cache_artifacts(path.read_bytes()) is not None
