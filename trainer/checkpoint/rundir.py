"""The run directory: a fresh run never writes over an old one, and one live run at a time holds it.

:func:`claim` runs at the start of ``fit`` (on rank 0 under torchrun; the other ranks learn its answer):

- A directory that holds a run (rows in ``metrics.jsonl``, or checkpoints) refuses a fresh run with a
  :class:`RunDirError` (exit 2) naming the old run and the ways on: ``resume=last`` continues it, another
  ``run.dir`` starts elsewhere, ``run.overwrite=true`` moves it aside to ``<run.dir>.old-N`` (nothing is deleted).
  A directory whose earlier run stopped before its first logged step (a config error) holds no run. A run refused
  before it wrote anything (the data or the model did not fit) leaves no directory behind.
- ``<run.dir>/.lock`` names the live run (pid, host, start time). A second run exits 2 naming them. A lock whose
  process is gone (same host: the pid has exited, was reused, or the host rebooted) is taken over with a note; a
  lock from another host cannot be checked from here and is respected (the message says how to remove it).
- The lock is removed when the run ends, also on an error; a SIGKILLed run leaves it stale for the next to take.

``resume=auto`` (the same command for the first start, torchrun's restarts and a requeued job), ``resume=last`` and
``resume=PATH`` are decided here too, by rank 0, before any rank reads a checkpoint; every rank gets its answer as a
:class:`Start`, the checkpoint's path fixed, so every rank loads the same one:

- ``checkpoints/last`` names a checkpoint: the run resumes from it if it is intact, else from the newest intact one
  before it; each damaged one passed over is moved aside to ``<name>.damaged-N`` with a warning, and ``last`` is
  pointed at the intact one (:mod:`.integrity`). None intact: exit 2 listing each and why. ``resume=last``
  does the same; ``resume=PATH`` naming a damaged checkpoint exits 2 (it was asked for by name).
- No checkpoint, and no run (an empty or new directory): the run starts fresh.
- No checkpoint, and a run that keeps checkpoints (its ``config.yaml`` has ``checkpoint.enabled: true``): that run
  stopped before its first save (a run saves at its end and on a stop signal), so nothing of it can be continued;
  it is this run's earlier start, killed, and the run starts again from step 0 in place. Its ``metrics.jsonl`` rows
  are dropped with a note, as a resume drops the rows past its checkpoint; its compile cache is reused.
- No checkpoint, and a run that keeps none (``checkpoint.enabled: false``, or no readable ``config.yaml``): its
  metrics are all it left, so it is refused as a fresh run would be (``run.overwrite=true`` moves it aside).

Each start appends one line to ``<run.dir>/starts.jsonl``: when, how (fresh, or the checkpoint and step resumed
from), torchrun's restart count, the world size.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from trainer import console, startup
from trainer.checkpoint import integrity
from trainer.distributed.env import DistEnv, every_rank, restart_warning
from trainer.io import pid_alive

LOCK = ".lock"
STARTS = "starts.jsonl"
AUTO = "auto"
_HELD: set[str] = set()  # the locks this process holds (absolute paths): a fit inside a fit in one directory


class RunDirError(ValueError):
    """The run directory cannot be used as asked (exit 2); the message says why and what to do.

    ``all_ranks``: every rank raised it (rank 0 decided; rank 0 alone reports it).
    """

    def __init__(self, message: str, *, all_ranks: bool = False):
        super().__init__(message)
        self.all_ranks = all_ranks


@dataclass(frozen=True)
class Start:
    """How a run starts in its directory, as rank 0 decided it (every rank holds the same).

    Attributes:
        resume: the checkpoint to load, checked (``resume=last``, ``auto`` or ``PATH`` decided), or None (fresh).
        asked: the command line's ``resume=`` (``auto``, ``last``, a path), or None.
        restart: torchrun's restart count of this job (``TORCHELASTIC_RESTART_COUNT``, 0 for its first start), None
            outside torchrun; ``max_restarts``: its ``--max-restarts``.
        again: ``resume=auto`` starts again from step 0 over an earlier start that saved no checkpoint.
    """

    resume: str | None
    asked: str | None = None
    restart: int | None = None
    max_restarts: int | None = None
    again: bool = False

    def _restarted(self) -> str:
        return f" (torchrun restart {self.restart} of at most {self.max_restarts})" if self.restart else ""

    def headline(self) -> str:
        """The startup line of a resume, a template of ``{path}`` and ``{step}``: ``resume=last: resumed from ...``
        or ``resume=auto: ...``; a path asked for is the path resumed from, so its line is ``resumed from ...``."""
        asked = f"resume={self.asked}: " if self.asked in (AUTO, "last") else ""
        return f"{asked}resumed from {{path}} at step {{step}}{self._restarted()}"

    def fresh_line(self, run_dir: Path) -> str | None:
        """The startup line of a fresh start under ``resume=auto`` or a torchrun restart; None for a plain one."""
        restarted = self._restarted()
        if self.asked == AUTO:
            again = " (an earlier start here stopped before its first checkpoint)" if self.again else ""
            where = run_dir / "checkpoints"
            return f"resume=auto: no complete checkpoint in {where}; starting fresh at step 0{again}{restarted}"
        return f"starting fresh at step 0{restarted}" if restarted else None


def torchrun_restart() -> tuple[int | None, int | None]:
    """torchrun's restart count of this job and its ``--max-restarts`` (None, None outside torchrun)."""
    count, most = os.environ.get("TORCHELASTIC_RESTART_COUNT"), os.environ.get("TORCHELASTIC_MAX_RESTARTS")
    return (int(count) if count and count.isdigit() else None), (int(most) if most and most.isdigit() else None)


def roll_back(cfg, env: DistEnv, spike, rollbacks: int) -> Start:
    """The start that follows a loss spike under ``train.on_spike=rollback`` (``spike``: its
    :class:`trainer.errors.Rollback`, every rank's the same; ``rollbacks``: those this run made before): the last
    checkpoint resumed (or a fresh start before the first), and the batches of the steps since it added to
    ``cfg.train.skip_batches`` (which the checkpoint's sampler keeps from then on). Past ``train.max_rollbacks``
    the run stops (:class:`trainer.errors.TrainingError`, every rank)."""
    import gc
    import traceback

    import torch._dynamo

    from trainer.data import data_step, merge_ranges
    from trainer.errors import TrainingError

    traceback.clear_frames(spike.__traceback__)  # the given-up run's locals (its model, optimizer, ...) let go
    torch._dynamo.reset()  # with the compiled graphs of its model, then its memory
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    every_rank(None, env)  # a barrier: a background write that every rank finished is published before it is read
    root = Path(cfg.run.dir) / "checkpoints"
    last = root / (root / integrity.LAST).read_text().strip() if (root / integrity.LAST).is_file() else None
    meta = json.loads((last / integrity.META).read_text()) if last else {}
    back_to = int(meta.get("step", 0))
    skip = merge_ranges([*cfg.train.skip_batches, *meta.get("sampler", {}).get("skip", [])])
    if rollbacks >= cfg.train.max_rollbacks:
        raise TrainingError(
            f"{spike}; stopping: train.max_rollbacks={cfg.train.max_rollbacks} rollbacks made already "
            f"(train.skip_batches is now {skip}). Lower optim.lr or look at the data of these steps.",
            all_ranks=True,
        )
    passed = [data_step(back_to + 1, skip), data_step(spike.step, skip)]
    cfg.train.skip_batches = merge_ranges([*skip, passed])
    if env.is_main:
        console.warn(
            f"{spike}: rolling back to {last or 'the start'} (step {back_to}) and passing over the batches of steps "
            f"{passed[0]}-{passed[1]} (rollback {rollbacks + 1} of at most {cfg.train.max_rollbacks})"
        )
    return Start(resume=str(last) if last else None, asked="rollback")


@contextlib.contextmanager
def claim(
    run_dir: Path, *, resume: str | None, overwrite: bool, env: DistEnv, say: Callable[[str], None] = console.warn
) -> Iterator[Start]:
    """Hold ``run_dir`` for the run inside the ``with``: refuse it if it holds another run (unless ``resume``, or
    ``overwrite``: then move that run aside), lock it against a second live run, unlock on the way out. Yields how
    the run starts (``resume=auto`` decided: see the module's docstring).

    Every rank calls this (rank 0 decides, the others wait for its answer: a collective under torchrun).

    Raises:
        RunDirError: on every rank: a live run holds the directory, or it holds a run that a fresh run would
            overwrite (``run.overwrite=false``).
        CheckpointError: on every rank: the checkpoint to resume is missing or damaged, or none is intact.
    """
    lock, refused, start = None, None, None
    if env.is_main:
        if warning := restart_warning():
            say(warning)
        try:
            lock, start = _claim(Path(run_dir), resume, overwrite, say)
        except (RunDirError, integrity.CheckpointError, OSError) as e:  # OSError: run.dir cannot be created or read
            error = e if isinstance(e, ValueError) else RunDirError(f"run.dir {run_dir}: {e}")
            if not env.distributed:
                raise error from None
            refused = (type(error) is integrity.CheckpointError, str(error))
    if env.distributed:
        refused, start = every_rank((refused, start), env)[0]
        if refused:
            checkpoint, message = refused
            raise (integrity.CheckpointError if checkpoint else RunDirError)(message, all_ranks=True)
    startup.mark("run_dir")
    try:
        yield start
    finally:
        if lock is not None:
            lock.release()


def _claim(run_dir: Path, resume: str | None, overwrite: bool, say: Callable[[str], None]) -> tuple[RunLock, Start]:
    run_dir = Path(os.path.abspath(run_dir))
    lock = RunLock(run_dir / LOCK)
    lock.check()  # before anything is written: a live run holds the directory
    old = describe(run_dir)
    start, found = Start(resume, resume, *torchrun_restart()), None
    if resume == AUTO:
        start, found = _decide_auto(run_dir, old, start)
        old = None if start.again else old  # an earlier start that saved no checkpoint: started again in place
    elif resume == "last":
        found = integrity.find(run_dir / "checkpoints", "resume=last")
        if found is None:
            where = run_dir / "checkpoints"
            raise integrity.CheckpointError(f"resume=last: no complete checkpoint in {where} (no 'last' file)")
    elif resume is not None:  # a path, checked; a run directory's last (another run's: nothing is moved there)
        start = replace(start, resume=str(integrity.resolve(resume, run_dir)))
    if found is not None:
        start = replace(start, resume=str(found.intact))
    resume = start.resume
    if old and not resume and not overwrite:
        if start.asked == AUTO:
            raise RunDirError(
                f"run.dir {run_dir} holds a run ({old}) that keeps no checkpoints (checkpoint.enabled=false in its "
                "config.yaml, or no config.yaml), so resume=auto cannot continue it, and a fresh run would write "
                f"over its history. Start elsewhere with run.dir=<another directory>, or set run.overwrite=true to "
                f"move it aside to {_aside(run_dir)} and start afresh here."
            )
        raise RunDirError(
            f"run.dir {run_dir} holds a run ({old}); a fresh run would write over its history. Continue it with "
            f"resume=last (or resume=auto), start elsewhere with run.dir=<another directory>, or set "
            f"run.overwrite=true to move it aside to {_aside(run_dir)} and start afresh here."
        )
    lock.made_dir = not run_dir.exists()  # removed again if the run leaves it empty (refused by a later check)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock.acquire(say)
    if old and not resume:  # run.overwrite=true: moved aside while this process holds the lock
        try:
            aside = _aside(run_dir)
            os.rename(run_dir, aside)  # the lock moves with it: this process holds it in the new place below
            run_dir.mkdir()
            lock.acquire(say)
            (aside / LOCK).unlink(missing_ok=True)
        except BaseException:
            lock.release()
            raise
        say(f"run.overwrite=true: moved the old run in {run_dir} ({old}) aside to {aside}; nothing was deleted")
    if found is not None:  # the damaged checkpoints passed over, moved aside while this process holds the lock
        try:
            integrity.set_aside(found, say)
        except BaseException:
            lock.release()
            raise
    return lock, start


def _decide_auto(run_dir: Path, old: str | None, start: Start) -> tuple[Start, integrity.Found | None]:
    """``resume=auto``: the newest intact checkpoint from the one ``checkpoints/last`` names back, else a fresh
    start (``again`` over an earlier start of a run that keeps checkpoints but saved none)."""
    if found := integrity.find(run_dir / "checkpoints", "resume=auto"):
        return start, found
    return replace(start, resume=None, again=old is not None and _keeps_checkpoints(run_dir / "config.yaml")), None


def _keeps_checkpoints(config: Path) -> bool:
    """Whether the run whose resolved config is ``config`` saves checkpoints (False when it cannot be read)."""
    import yaml

    try:
        cfg = yaml.safe_load(config.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    section = cfg.get("checkpoint") if isinstance(cfg, dict) else None
    return isinstance(section, dict) and section.get("enabled") is True


def record_start(run_dir: Path, start: Start, step: int, checkpoint: Path | None, world_size: int) -> None:
    """Append this start to ``<run_dir>/starts.jsonl`` (rank 0): when, fresh or resumed (the checkpoint and its
    step), ``resume=`` as asked, torchrun's restart count, the world size, the host and pid."""
    row = {
        "started": _now(),
        "step": step,
        "checkpoint": str(checkpoint) if checkpoint else None,
        "resume": start.asked,
        "again": start.again,
        "restart": start.restart,
        "max_restarts": start.max_restarts,
        "world_size": world_size,
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    with open(run_dir / STARTS, "a") as f:
        f.write(json.dumps(row) + "\n")


def _aside(run_dir: Path) -> Path:
    """``<run_dir>.old-N`` with the first free N."""
    n = 1
    while (aside := run_dir.with_name(f"{run_dir.name}.old-{n}")).exists():
        n += 1
    return aside


def describe(run_dir: Path) -> str | None:
    """What run ``run_dir`` holds, in a few words (its last logged step, its last checkpoint); None for none."""
    parts = []
    step = last_logged_step(run_dir / "metrics.jsonl")
    if step is not None:
        parts.append(f"metrics.jsonl up to step {step}")
    root = run_dir / "checkpoints"
    pointer = root / "last"
    done = [p.name for p in integrity.checkpoint_dirs(root)]
    if pointer.is_file():
        parts.append(f"last checkpoint {root / pointer.read_text().strip()}")
    elif done:
        parts.append(f"checkpoints {', '.join(done)}")
    return "; ".join(parts) or None


def last_logged_step(path: Path) -> int | None:
    """The step of the last readable row of a ``metrics.jsonl``; None without one."""
    try:
        lines = path.read_text().splitlines()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


class RunLock:
    """``<run.dir>/.lock``: a JSON file naming the live run. Created whole (written aside, then linked into place),
    so a reader never sees half of one.

    Args:
        path: the lock file.
    """

    def __init__(self, path: Path):
        self.path = Path(os.path.abspath(path))
        self.token = uuid.uuid4().hex
        self.held = False
        self.made_dir = False  # the run directory was made for this run: release removes it if nothing is in it

    def check(self) -> None:
        """Raise :class:`RunDirError` if a live run (or one on another host) holds the lock; a stale lock passes."""
        info = self._read()
        if info is not None:
            self._refuse_if_live(info)

    def acquire(self, say: Callable[[str], None]) -> None:
        """Take the lock (again, if it moved away); a stale one is taken over with a note.

        Raises:
            RunDirError: a live run, or a run on another host, holds it.
        """
        for _ in range(3):
            if self._create():
                self.held = True
                _HELD.add(str(self.path))
                return
            info = self._read()
            if info is None:  # removed meanwhile: try again
                continue
            self._refuse_if_live(info)
            say(f"{self.path} was left by a run that is no longer running ({_who(info)}): taking it over")
            self.path.unlink(missing_ok=True)
        raise RunDirError(f"{self.path}: another run keeps taking this lock; use another run.dir")

    def release(self) -> None:
        """Remove the lock if this process still holds it."""
        if not self.held:
            return
        self.held = False
        _HELD.discard(str(self.path))
        info = self._read()
        if info is not None and info.get("token") == self.token:
            self.path.unlink(missing_ok=True)
        if self.made_dir:
            with contextlib.suppress(OSError):  # not empty: the run wrote something
                self.path.parent.rmdir()

    def _create(self) -> bool:
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": _now(),
            "token": self.token,
            "boot_id": _boot_id(),
            "proc_start": _proc_start(os.getpid()),
            "argv": sys.argv[:20],
        }
        tmp = self.path.with_name(f"{LOCK}.{self.token}")
        tmp.write_text(json.dumps(info) + "\n")
        try:
            os.link(tmp, self.path)  # atomic, and fails if the lock exists
            return True
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links: exclusive create, then the content
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(info) + "\n")
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def _read(self) -> dict | None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            info = json.loads(text)
            return info if isinstance(info, dict) else {}
        except ValueError:
            return {}  # unreadable: nothing names a live run

    def _refuse_if_live(self, info: dict) -> None:
        here = socket.gethostname()
        if info.get("host") not in (None, here):
            raise RunDirError(
                f"run.dir {self.path.parent} is locked by a run on host {info.get('host')} ({_who(info)}), which "
                f"this host ({here}) cannot check. If that run has ended, delete {self.path} and start again; "
                "otherwise use another run.dir."
            )
        if _alive(info, self.path):
            raise RunDirError(
                f"run.dir {self.path.parent} is in use by a live run ({_who(info)}; {self.path}). Wait for it to "
                "end or stop it, or use another run.dir."
            )


def _alive(info: dict, path: Path) -> bool:
    """Whether the process a lock of this host names still runs."""
    pid = info.get("pid")
    if not isinstance(pid, int):
        return False
    if pid == os.getpid():  # this process: alive only if it holds the lock now (else a previous life of this pid)
        return str(path) in _HELD
    if not pid_alive(pid):
        return False
    if info.get("boot_id") and _boot_id() and info["boot_id"] != _boot_id():
        return False  # the host rebooted since: the pid is another process
    start = _proc_start(pid)
    return not (info.get("proc_start") and start and info["proc_start"] != start)  # not a reused pid


def _who(info: dict) -> str:
    return f"pid {info.get('pid')} on {info.get('host')}, started {info.get('started')}"


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _proc_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), None without /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]  # fields from the 3rd (state) on, after the command
    except (OSError, IndexError):
        return None
