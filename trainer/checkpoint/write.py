"""Writing one checkpoint atomically: a temporary directory, every rank's files, the ranks agreeing that all were
written, then the manifest, the rename and ``last`` on the main rank, and pruning. Used by the synchronous save
(:func:`save`) and the background one (:mod:`trainer.checkpoint.background`) alike."""

from __future__ import annotations

import errno
import functools
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import integrity
from trainer.checkpoint.integrity import LAST
from trainer.distributed.env import DistEnv, every_rank
from trainer.errors import TrainingError
from trainer.faults import fault_point
from trainer.io import atomic_write, atomic_write_text

DCP_DIR = "dcp"
# The states DCP storage keeps in dcp/, and their keys there.
DCP_KEYS = {"model": "model", "optimizer": "optim"}


class CheckpointWriteError(TrainingError):
    """A checkpoint could not be written (a full disk, a lost permission): the run stops, ``last`` unchanged."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_file(obj: Any, path: Path, disk_full: bool = False) -> None:
    if disk_full:  # fault injection (tests): the disk fills up during this file
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    atomic_write(path, functools.partial(torch.save, obj))


def _barrier(env: DistEnv) -> None:
    if env.distributed:
        torch.distributed.barrier()


def save(root: Path, step: int, write: Callable[[Path], None], env: DistEnv, keep: int) -> Path:
    """Write the checkpoint of ``step`` atomically, move ``last`` to it, and keep the newest ``keep``.

    Every rank calls this. The main rank makes the temporary directory; then every rank calls ``write(directory)``
    to write its files there; the ranks agree on whether every write succeeded (a collective), so that a write
    failing on one rank stops all; the main rank writes the manifest of every rank's files, renames the directory
    into place, moves ``last`` and prunes.

    Raises:
        CheckpointWriteError: on every rank, when a rank could not write (a full disk): it names the file, the
            partial checkpoint is removed, ``last`` still names the previous checkpoint.
    """
    name = checkpoint_name(step)
    final, tmp = root / name, root / f".tmp-{name}"
    failed = _attempt(_make_empty, tmp, rank=env.rank) if env.is_main else None
    _barrier(env)
    failed = failed or _attempt(write, tmp, rank=env.rank)
    _stop_if_failed(every_rank(failed, env), step, root, tmp if env.is_main else None)
    published = _attempt(_publish, tmp, final, rank=env.rank) if env.is_main else None
    _stop_if_failed(every_rank(published, env), step, root, None)
    if env.is_main:
        _after_publish(final, step, keep, env.rank)
    _barrier(env)
    fault_point("after_checkpoint", step)
    return final


def _make_empty(directory: Path) -> None:
    if directory.exists():  # a save that a crash interrupted
        shutil.rmtree(directory)
    directory.mkdir(parents=True)


def _publish(tmp: Path, final: Path) -> None:
    """Write the manifest of the complete checkpoint ``tmp`` (every rank's files), rename it to ``final`` and point
    ``last`` at it, each step durable."""
    root = final.parent
    integrity.write_manifest(tmp)
    _fsync_dir(tmp)
    if final.exists():  # a re-save of the same step (e.g. a signal right after a periodic save)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    atomic_write_text(root / LAST, final.name + "\n")
    _fsync_dir(root)


def _after_publish(final: Path, step: int, keep: int, rank: int) -> None:
    """The main rank, once checkpoint ``final`` is ``last``: prune the old ones (and the fault that damages it)."""
    _prune(final.parent, keep)
    if fault_point("damage_checkpoint", step, rank):
        _cut_largest_file(final)


def _attempt(fn: Callable, *args, rank: int) -> tuple[str, int | None, int] | None:
    """Run ``fn(*args)`` (``args[0]``: the directory written); a failure to write (OSError, DCP's
    CheckpointException, torch.save's writer coming up short) as ``(message, errno, rank)``, else None."""
    try:
        fn(*args)
    except OSError as e:
        return str(e), e.errno, rank
    except RuntimeError as e:
        if "inline_container" not in str(e):  # not torch.save's zip writer
            raise
        # Its write came up short (a full disk, a quota) and it says only "unexpected pos ..." or "file write
        # failed": how full the disk is tells which.
        free = _free_bytes(Path(args[0]))
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        full = free is not None and free < SHORT_WRITE_FREE
        room = "" if free is None else f"; the disk holding {args[0]} has {free / 1e9:.2f} GB free"
        why = f"torch.save's write came up short, as on a full disk, a quota or a file size limit ({first}){room}"
        return why, errno.ENOSPC if full else None, rank
    except BaseException as e:
        if type(e).__name__ != "CheckpointException":  # DCP's: every rank's failures, gathered
            raise
        return str(e), None, rank
    return None


SHORT_WRITE_FREE = 2**30
"""A write that came up short with less than this free on its disk is taken as a full disk."""


def _free_bytes(path: Path) -> int | None:
    """Free bytes on the disk holding ``path`` (or its nearest existing parent); None if unknown."""
    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return None


def _stop_if_failed(failures: list, step: int, root: Path, partial: Path | None) -> None:
    """Raise :class:`CheckpointWriteError` on every rank if any rank failed (``failures``: every rank's)."""
    failed = [f for f in failures if f]
    if not failed:
        return
    if partial is not None:
        shutil.rmtree(partial, ignore_errors=True)  # frees the space it took; ``last`` never named it
    message, code, rank = failed[0]
    message += f" (rank {rank})" if len(failures) > 1 else ""
    pointer = root / LAST
    kept = (
        f"the last checkpoint is still {root / pointer.read_text().strip()} (resume=last continues from it)"
        if pointer.is_file()
        else "no checkpoint was saved before this one"
    )
    fix = "Free disk space (or set run.dir on another disk)" if code == errno.ENOSPC else "Fix the cause"
    raise CheckpointWriteError(
        f"cannot save the checkpoint of step {step}: {message}. Stopped; {kept}. {fix}, then resume.",
        all_ranks=len(failures) > 1,
    )


def _cut_largest_file(checkpoint: Path) -> None:
    """Fault injection (tests): cut the largest file of ``checkpoint`` to half its size."""
    largest = max((p for p in checkpoint.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    os.truncate(largest, largest.stat().st_size // 2)


def _prune(root: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` intact checkpoints (and the one ``last`` names). A damaged one is neither
    counted nor deleted (a resume moves it aside); one set aside (``<name>.damaged-N``) is not looked at."""
    intact = [p for p in integrity.checkpoint_dirs(root) if integrity.damage(p, checksums=False) is None]
    current = (root / LAST).read_text().strip()
    for old in intact[:-keep]:
        if old.name != current:
            shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-step_*"):  # a save that a crash interrupted
        shutil.rmtree(stale, ignore_errors=True)
