"""Where a start of a run goes, from the process's creation to its first step: each phase's end is marked where it
happens, and the first record of the run's metrics carries the phases' seconds (``startup_s``) and when the process
was created (``process_started_at``, seconds since the epoch), so that a restart's time can be taken apart: the
launcher's part (from the kill to the new process), then ours.

Phases, in order: ``imports`` (the interpreter, torch and trainer imported, the config read), ``device_and_group``
(the device set, the process group made), ``run_dir`` (the run directory held, the checkpoint to resume chosen),
``build`` (the plan, the data, the model and its layout, the optimizer), ``checkpoint_read`` (the checkpoint loaded
into them), ``wrap`` (compiled and wrapped, the step made); the record's ``first_step_s`` is the compile and the
first step."""

from __future__ import annotations

import os
import time
from pathlib import Path

FIRST = "imports"
_MARKS: list[tuple[str, float]] = []


def started_at() -> float | None:
    """When this process was created, in seconds since the epoch (from Linux's /proc, to 10 ms), or None; for a
    spare of ``trainer tune`` (:func:`trainer.tune_runs.spare_main`), when it was given its run."""
    if given := os.environ.get("TRAINER_STARTED_AT"):
        return float(given)
    try:
        ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def mark(phase: str) -> None:
    """``phase`` ended now. :data:`FIRST` starts the count again (a run started again in the same process)."""
    if phase == FIRST:
        _MARKS.clear()
    _MARKS.append((phase, time.time()))


def phases() -> dict[str, float] | None:
    """The seconds of each phase marked since :data:`FIRST` (the first from the process's creation), once: the marks
    are then cleared. None without a :data:`FIRST` mark or where the process's creation is not known."""
    marks, began = list(_MARKS), started_at()
    _MARKS.clear()
    if not marks or marks[0][0] != FIRST or began is None:
        return None
    out, before = {}, began
    for phase, at in marks:
        out[phase] = round(at - before, 3)
        before = at
    return out


def uncached_imports(names: tuple[str, ...] = ("torch", "transformers")) -> list[str]:
    """The packages among ``names`` (those imported) whose code Python compiled from source at this start and kept
    no bytecode of: ``PYTHONDONTWRITEBYTECODE`` set, or the install (or ``PYTHONPYCACHEPREFIX``) not writable. Every
    start of a process, each restart's too, then compiles them again: seconds that bytecode written once saves."""
    import importlib.util
    import sys

    out = []
    for name in names:
        file = getattr(sys.modules.get(name), "__file__", None)
        if not file or not file.endswith(".py"):  # not imported, or imported from bytecode alone
            continue
        try:
            cached = importlib.util.cache_from_source(file)  # under sys.pycache_prefix where one is set
        except NotImplementedError:  # an interpreter that writes no bytecode at all
            continue
        if not os.path.exists(cached):
            out.append(name)
    return out


def bytecode_note(names: list[str]) -> str:
    """What to do about :func:`uncached_imports`' ``names``."""
    import sys

    them, their = ("it", "its") if len(names) == 1 else ("them", "their")
    why = "PYTHONDONTWRITEBYTECODE is set" if sys.dont_write_bytecode else "where Python writes it is not writable"
    return (
        f"Python compiled {' and '.join(names)} from source at this start and kept no bytecode ({why}): every "
        f"start, each restart's too, compiles {them} again. Write it once: `python -m compileall -q` on {their} "
        "install, or PYTHONPYCACHEPREFIX set to a writable directory"
        + (" and PYTHONDONTWRITEBYTECODE unset" if sys.dont_write_bytecode else "")
        + " (docs/troubleshooting.md)"
    )
