"""Files a crash never leaves half-written: the new content goes to a temporary file beside the target, is
flushed to disk, and replaces the target in one rename."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (a reader sees the old file or the new one, never a part); the
    parent directory is made if missing. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
