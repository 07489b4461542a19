"""Fault injection for tests: ``TRAINER_FAULT`` names the points where a run is made to fail, as a disk, a rank or
a scheduler would make it fail, so that the tests see what the user would (the checkpoints kept, the message, the
exit)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

_KILL_POINTS = ("checkpoint_write", "after_checkpoint", "kill")
_FIRED: set[str] = set()


def fault_point(point: str, step: int, rank: int = 0) -> bool:
    """Fault injection for tests: ``TRAINER_FAULT=<point>:<step>[@<rank>][#<restart>]`` fires at ``point`` of step
    ``step`` (on every rank without ``@<rank>``; with ``#<restart>``, only in that start of a torchrun job,
    ``TORCHELASTIC_RESTART_COUNT``, 0 for the first: a fault that torchrun's restart does not meet again). Several
    faults are separated by commas: ``damage_checkpoint:20#0,kill:25@0#0``.

    Points: ``checkpoint_write`` (between two files of a checkpoint), ``after_checkpoint`` and ``kill`` (a step
    launched) SIGKILL this process; ``hang`` (a step launched) waits for good in the main thread, its signal handlers
    still running; ``sigterm`` (a step launched) sends SIGTERM to torchrun's launcher, which passes
    it to every rank, as a scheduler stopping the job does (outside torchrun, to this process); ``raise`` (a step
    launched) raises a RuntimeError; ``nan_loss`` (the step's loss, as read for the checks), ``wrong_sum`` (every
    rank's losses, as this rank received them), ``replica_drift`` (this rank's parameters, before the ddp replicas
    are compared), ``spike`` (this rank's loss as its step returns it, ten times larger; the gradients are
    unchanged), ``disk_full`` (this rank's last checkpoint file fails with ENOSPC) and ``damage_checkpoint`` (the
    main rank, once the checkpoint is published: its largest file is cut to half its size, as a disk or a copy
    damages one) return True for the caller to act on. Returns False everywhere else.
    """
    spec = next((s for s in os.environ.get("TRAINER_FAULT", "").split(",") if _fires(s, point, step, rank)), None)
    if spec is None or spec in _FIRED:
        return False
    _FIRED.add(spec)  # once in a process: a step met again after a rollback does not fire it again
    if point in _KILL_POINTS:
        os.kill(os.getpid(), signal.SIGKILL)
    if point == "sigterm":
        os.kill(os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid(), signal.SIGTERM)
        return False
    if point == "hang":  # the main thread waits for good, as one waiting on the device for a lost rank does
        print(f"injected hang on rank {rank} at step {step} at {time.time():.3f}", file=sys.stderr, flush=True)
        threading.Event().wait()
    if point == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step} (TRAINER_FAULT={spec})")
    return True


def _fires(spec: str, point: str, step: int, rank: int) -> bool:
    """Whether the fault ``spec`` (one of ``TRAINER_FAULT``'s) is ``point`` of ``step`` on ``rank``, in this start."""
    name, _, where = spec.strip().partition(":")
    where, _, at_restart = where.partition("#")
    at_step, _, at_rank = where.partition("@")
    if name != point or at_step != str(step) or (at_rank and at_rank != str(rank)):
        return False
    return not at_restart or at_restart == os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
