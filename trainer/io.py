"""Files a crash never leaves half-written (the new content goes to a temporary file beside the target, is
flushed to disk, and replaces the target in one rename), and whether a process that left a file behind still
runs."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: str | os.PathLike, data: bytes | Callable[[BinaryIO], object]) -> Path:
    """Write ``data`` to ``path`` atomically (a reader sees the old file or the new one, never a part); the
    parent directory is made if missing. Returns the path.

    Args:
        data: the bytes, or a function that writes them to the open file (``torch.save``'s, which streams a large
            object rather than holding all its bytes at once).

    Raises:
        OSError: naming ``path`` (a full disk, say); the temporary file is removed and ``path`` is unchanged.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data) if isinstance(data, bytes) else data(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno is not None:
            raise OSError(e.errno, e.strerror, str(path)) from None  # the file the caller asked for
        raise
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
