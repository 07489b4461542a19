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


def use_cache_dir(path: Path) -> None:
    """Point Inductor's and Triton's caches at ``path`` (call before the first compile)."""
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path.resolve())
    os.environ["TRITON_CACHE_DIR"] = str((path / "triton").resolve())


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
