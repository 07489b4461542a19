"""Whether a checkpoint is whole, and the newest intact checkpoint of a run, which resume falls back to.

Each checkpoint holds ``manifest.json``: every file in it (``dcp/`` shards included, paths relative to the
checkpoint) with its size in bytes, and a CRC-32 of each file of at most :data:`CHECKSUM_MAX_BYTES`. The main rank
writes it after every rank has written its files (the ranks agree on that, a collective: under DCP each rank
writes its own shards) and before the checkpoint is renamed into place, so a published checkpoint has one.

:func:`damage` checks a checkpoint against its manifest: a ``stat`` per file, a read of each file small enough to
carry a checksum, and of each ``torch.save`` file's zip directory (at its end). That is milliseconds even for a
100 GB DCP checkpoint, so every resume runs it. Sizes catch what damages a checkpoint in practice (a write or a
copy cut short, a file lost); the checksums add bit rot in the small files (``meta.json``, the RNG files, DCP's
``.metadata``, a small model's ``model.pt`` and ``optim.pt``). Large files are not hashed: reading a 100 GB
checkpoint back takes minutes, at each save and at each resume. A large file that is damaged inside and still
the right size passes; if it then fails to load, the resume stops there with exit 2 naming the file.

A checkpoint without a manifest (``tests/data/tiny_checkpoint`` is one) passes when it holds ``meta.json``,
readable, ``optim.pt`` and ``model.pt`` (or DCP's ``dcp/.metadata``), and each ``torch.save`` file has its zip
directory (a truncated one has none); each file is checked again as it loads.

On ``resume=last`` or ``resume=auto``, :func:`find` walks back from the checkpoint ``last`` names to the newest
one that passes; :func:`set_aside` (the run that resumes, holding the run directory) renames the damaged ones it
passed to ``<name>.damaged-N`` (nothing is deleted) and points ``last`` at the intact one. Where every checkpoint
is damaged, nothing is resumed: :class:`CheckpointError` lists each and why.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from trainer import console
from trainer.io import atomic_write_text

MANIFEST = "manifest.json"
META = "meta.json"
LAST = "last"
CHECKSUM_MAX_BYTES = 16 << 20
"""Files up to this size carry a CRC-32 in the manifest (read back at save and at each resume); larger ones only
their size."""
_STEP = re.compile(r"step_(\d+)")
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format is a zip archive


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, truncated, corrupt, unsafe or incompatible (exit 2).

    ``all_ranks``: every rank raised it (rank 0 decided; rank 0 alone reports it).
    """

    def __init__(self, message: str, *, all_ranks: bool = False):
        super().__init__(message)
        self.all_ranks = all_ranks


def checkpoint_dirs(root: Path) -> list[Path]:
    """The checkpoint directories in ``root`` (``step_<N>``; not the ones set aside, nor a save's temporary one),
    oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def write_manifest(directory: Path) -> None:
    """Write ``directory``'s ``manifest.json``: each file's size, and a CRC-32 of the small ones.

    Raises:
        OSError: it could not be written (the save fails as for any of its files).
    """
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        name = path.relative_to(directory).as_posix()
        if name == MANIFEST:
            continue
        size = path.stat().st_size
        files[name] = {"size": size, **({"crc32": _crc32(path)} if size <= CHECKSUM_MAX_BYTES else {})}
    atomic_write_text(directory / MANIFEST, json.dumps({"files": files}, indent=1))


def damage(path: Path, *, checksums: bool = True) -> str | None:
    """Why checkpoint ``path`` is damaged (a few words naming the file), or None when it is intact.

    Args:
        checksums: also compare the small files' CRC-32 (a read of each); without, sizes alone.
    """
    if not path.is_dir():
        return "no such directory"
    manifest = path / MANIFEST
    if manifest.is_file():
        try:
            files = json.loads(manifest.read_text())["files"]
            entries = [(name, int(entry["size"]), entry.get("crc32")) for name, entry in files.items()]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return f"its {MANIFEST} cannot be read"
        for name, size, crc in entries:
            try:
                actual = (path / name).stat().st_size
            except FileNotFoundError:
                return f"{name} is missing"
            if actual != size:
                return f"{name} is {actual:,} bytes, its manifest says {size:,}"
            if checksums and crc is not None and _crc32(path / name) != crc:
                return f"{name} does not match its manifest's checksum"
    else:
        whole = "dcp/.metadata" if (path / "dcp").is_dir() else "model.pt"
        for name in (META, "optim.pt", whole):
            if not (path / name).is_file():
                return f"{name} is missing"
    try:
        json.loads((path / META).read_text())
    except FileNotFoundError:
        return f"{META} is missing"
    except (OSError, ValueError):
        return f"{META} cannot be read"
    return next((reason for f in sorted(path.glob("*.pt")) if (reason := _zip_damage(f))), None)


def _zip_damage(path: Path) -> str | None:
    """Why ``torch.save`` file ``path`` is damaged, from its start and its zip directory; None if they read."""
    try:
        with open(path, "rb") as f:
            magic = f.read(len(_ZIP_MAGIC))
        if not magic:
            return f"{path.name} is empty"
        if magic != _ZIP_MAGIC:  # an old torch.save format, without a zip directory: its load checks it
            return None
        with zipfile.ZipFile(path):  # reads the end-of-directory record and the directory, at the file's end
            return None
    except (OSError, zipfile.BadZipFile, ValueError):
        return f"{path.name} is cut short (its zip directory is missing)"


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


@dataclass(frozen=True)
class Found:
    """What :func:`find` found: the newest intact checkpoint, and the damaged ones newer than it, each with why."""

    intact: Path
    damaged: list[tuple[Path, str]] = field(default_factory=list)


def find(root: Path, asked: str) -> Found | None:
    """The checkpoint ``<root>/last`` names if it is intact, else the newest older one that is; None without a
    ``last`` file. Reads only.

    Args:
        asked: what asked for it, for the error (``resume=auto``, ``sample``).

    Raises:
        CheckpointError: no checkpoint is intact; it lists each and why.
    """
    pointer = root / LAST
    if not pointer.is_file():
        return None
    named = _STEP.fullmatch(pointer.read_text().strip())
    newest = int(named.group(1)) if named else None
    candidates = [root / named.group(0)] if named else []
    candidates += [p for p in reversed(checkpoint_dirs(root)) if newest is None or int(p.name[5:]) < newest]
    damaged = []
    for path in candidates:
        if (reason := damage(path)) is None:
            return Found(path, damaged)
        damaged.append((path, reason))
    listed = "; ".join(f"{path.name} ({reason})" for path, reason in damaged) or f"{LAST} names no checkpoint"
    raise CheckpointError(
        f"{asked}: no intact checkpoint in {root}: {listed}. Nothing was moved or deleted. Copy the damaged files "
        "back from a backup, or start afresh elsewhere with run.dir=<another directory> (or run.overwrite=true, "
        "which moves this run aside)."
    )


def set_aside(found: Found, say: Callable[[str], None] = console.warn) -> None:
    """Rename each damaged checkpoint of ``found`` to ``<name>.damaged-N``, point ``last`` at the intact one, and
    say so, one line each. Only the run that holds the run directory calls this (rank 0, after taking the lock)."""
    if not found.damaged:
        return
    root = found.intact.parent
    for path, reason in found.damaged:
        aside = _aside(path)
        if path.is_dir():
            os.rename(path, aside)
            moved = f"the damaged one moved aside to {aside}"
        else:
            moved = f"{LAST} named it"
        say(f"checkpoint {path} is damaged ({reason}): resuming from {found.intact}, the newest intact one; {moved}")
    atomic_write_text(root / LAST, found.intact.name + "\n")


def say_fallback(found: Found, say: Callable[[str], None] = console.warn) -> None:
    """Say, one line each, which damaged checkpoints ``found`` passed over to the intact one, leaving them in place
    (a reader of a run, which does not hold its directory)."""
    for path, reason in found.damaged:
        say(
            f"checkpoint {path} is damaged ({reason}): using {found.intact}, the newest intact one (left in place; "
            "resume=last or resume=auto in its run.dir moves it aside)"
        )


def resolve(spec: str, run_dir: Path, asked: str | None = None) -> Path:
    """The checkpoint directory ``spec`` names, checked; reads only.

    ``last``: the one ``<run_dir>/checkpoints/last`` names, or the newest intact one before it (a warning names
    each damaged one passed over, left in place). A run directory or its ``checkpoints/`` directory: the same for
    its ``last``. A checkpoint directory: itself, refused if damaged (it was asked for by name).

    Args:
        asked: what asked, for the messages (default ``resume=<spec>``).

    Raises:
        CheckpointError: no such checkpoint, none intact, or a damaged one named explicitly.
    """
    asked = asked or f"resume={spec}"
    if spec == "last":
        root = run_dir / "checkpoints"
    else:
        path = Path(spec)
        root = next((p.parent for p in (path / "checkpoints" / LAST, path / LAST) if p.is_file()), None)
        if root is None:
            if not path.exists():
                raise CheckpointError(f"{asked}: no such checkpoint directory")
            verify(path, asked)
            return path
    found = find(root, asked)
    if found is None:
        raise CheckpointError(f"{asked}: no complete checkpoint in {root} (no '{LAST}' file)")
    say_fallback(found)
    return found.intact


def verify(path: Path, asked: str) -> None:
    """Check the checkpoint a command named explicitly; no fallback: it is the one asked for.

    Raises:
        CheckpointError: it is damaged: why, and the newest intact checkpoint beside it, if any.
    """
    if (reason := damage(path)) is None:
        return
    beside = next((p for p in reversed(checkpoint_dirs(path.parent)) if p != path and damage(p) is None), None)
    other = f"; the newest intact one beside it is {beside}" if beside else ""
    raise CheckpointError(f"{asked}: checkpoint {path} is damaged ({reason}){other}")


def _aside(path: Path) -> Path:
    """``<path>.damaged-N`` with the first free N."""
    n = 1
    while (aside := path.with_name(f"{path.name}.damaged-{n}")).exists():
        n += 1
    return aside
