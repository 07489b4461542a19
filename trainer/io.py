"""Files a crash never leaves half-written (the new content goes to a temporary file beside the target, is
flushed to disk, and replaces the target in one rename), and whether a process that left a file behind still
runs."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (a reader sees the old file or the new one, never a part); the
    parent directory is made if missing. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """:func:`atomic_write` of ``text`` in UTF-8."""
    return atomic_write(path, text.encode())


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` on this host is running (an exited process its parent has not reaped yet is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"  # the state follows the command name
    except (OSError, IndexError):
        return True  # no /proc (macOS): os.kill's answer stands
