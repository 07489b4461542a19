"""The process environment: torchrun variables, the process group, this rank's device, rank-0 output, and what
a rank does when another one is lost (timeouts, naming the lost rank)."""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trainer import console, startup
from trainer.errors import TrainingError
from trainer.io import pid_alive


@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None  # None when no process group was created
    peers: list[tuple[str, int]] = field(default_factory=list)
    """Every rank's ``(host, pid)``, in rank order (empty for one process): which rank was lost, when one is."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def resolve_device(spec: str, local_rank: int, key: str = "train.device") -> torch.device:
    """``auto`` -> ``cuda:<local_rank>`` if CUDA is available, else ``cpu`` (the one rule for a device's ``auto``).

    Raises:
        ValueError: CUDA asked for but unavailable, or an unknown device string (the message names ``key``).
    """
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"{key}: unknown device '{spec}'; expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{key}: '{spec}' asked for, but CUDA is not available here; use auto or cpu")
        if device.index is None:
            device = torch.device("cuda", local_rank)
    return device


_GLOO_USED = False  # a gloo process group was created in this process (see exit_code)


def exit_code(code: int) -> int:
    """``code``, for ``sys.exit``; but a process that ran a gloo process group exits here, with ``code`` and
    without finalizing the interpreter. A gloo worker thread can still hold a finished collective's work then, and
    its destructor releases Python objects, for which it takes the GIL while the interpreter finalizes: the process
    aborts ("terminate called without an active exception", exit -6; about 1 in 700 two-rank CPU test runs, after
    the run had written and said everything; more often after a failure). https://github.com/pytorch/pytorch/pull/179291
    describes it. Everything the run writes is closed by then; stdout and stderr are flushed here."""
    if _GLOO_USED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def coordination_group() -> None:
    """A gloo process group over torchrun's ranks, for processes that coordinate rather than train (``trainer
    tune``: the candidates run in processes of their own); such a process exits through :func:`exit_code`'s path."""
    global _GLOO_USED
    dist.init_process_group("gloo")
    _GLOO_USED = True


def print_error(e: BaseException, prefix: str = "trainer: error") -> None:
    """Print ``e`` on stderr, naming the rank under torchrun (but rank 0); one that every rank raised together
    (``e.all_ranks``) is printed by rank 0 alone."""
    rank = os.environ.get("RANK", "0")
    if getattr(e, "all_ranks", False) and rank != "0":
        return
    console.error(f"{prefix}: {e}" if rank == "0" else f"{prefix} (rank {rank}): {e}")


def await_launcher(wait_s: float = 5.0, terminated: bool = False) -> None:
    """After this rank stopped because a rank on this host exited: under torchrun, wait up to ``wait_s`` for
    torchrun to end this process (SIGTERM, with its default action again) instead of exiting first. torchrun names
    the first failure it observes as the run's root cause, and one poll that finds both processes gone names the
    lower rank: the rank that was lost must be seen first. ``terminated``: torchrun's SIGTERM already came (it saw
    the lost rank first); no wait."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or terminated:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(wait_s)


def setup(device: str = "auto", backend: str = "auto", timeout_s: float | None = None) -> DistEnv:
    """Read torchrun's environment and create the process group when ``WORLD_SIZE > 1``.

    ``accelerate launch`` sets the same variables, so it works unchanged. ``timeout_s``: how long a collective
    waits for the other ranks before it fails (``distributed.timeout_s``; None: torch's default, 10 minutes).
    """
    startup.mark(startup.FIRST)  # the process's start so far: the interpreter, the imports, the config
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world == 1:
        startup.mark("device_and_group")
        return DistEnv(rank=0, local_rank=0, world_size=1, device=dev, backend=None)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": dev} if dev.type == "cuda" else {}
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        if (store := _restart_store(rank, world, kwargs.get("timeout"))) is not None:
            kwargs.update(store=store, rank=rank, world_size=world)
        dist.init_process_group(backend=backend, **kwargs)
    global _GLOO_USED
    _GLOO_USED = _GLOO_USED or backend == "gloo"
    env = DistEnv(rank=rank, local_rank=local_rank, world_size=world, device=dev, backend=backend)
    env.peers = [tuple(p) for p in every_rank((socket.gethostname(), os.getpid()), env)]
    startup.mark("device_and_group")
    return env


def _restart_store(rank: int, world: int, timeout: datetime.timedelta | None):
    """For a torchrun restart of a one-node job, the store torchrun's agent keeps for its workers, with this start's
    keys apart from the previous start's; None otherwise (``init_process_group`` then finds the store itself).

    torchrun keeps one store for every start of a job (``TORCHELASTIC_USE_AGENT_STORE=True``, its default), and the
    process group of a restarted worker reads what the previous start wrote there under the same keys: the old
    peers' addresses (gloo: "connectFullMesh failed ... Connection refused"), NCCL's old unique id
    (https://github.com/pytorch/pytorch/issues/135712; torch 2.11 and 2.13 still reuse the store). Prefixed by the
    restart count, the keys are this start's. On one node every worker has the same count; the agents of several
    nodes can count differently, so there the launch needs ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a new store per
    start, docs/operations.md). Remove once torchrun gives each restart a store of its own (the restart test of
    tests/test_restarts.py then passes without this).
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if not agent_store or restart == "0" or os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        return None
    from torch.distributed.constants import default_pg_timeout

    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout or default_pg_timeout))
    return dist.PrefixStore(f"trainer/restart_{restart}", store)


def restart_warning() -> str | None:
    """A warning for a torchrun job of several nodes whose restarts would reuse torchrun's store (see
    :func:`_restart_store`); None when restarts need nothing more."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.get("GROUP_WORLD_SIZE", "1") == "1":
        return None
    if env.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0":
        return None
    return (
        f"torchrun --max-restarts {env['TORCHELASTIC_MAX_RESTARTS']} on {env['GROUP_WORLD_SIZE']} nodes: a restart "
        "would find the previous start's process-group keys in torchrun's shared store and fail to connect "
        "(https://github.com/pytorch/pytorch/issues/135712); launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
        "(docs/operations.md)"
    )


def teardown(env: DistEnv, failed: bool = False) -> None:
    """End the process group. After a failure (``failed``) an NCCL group is aborted instead: destroying it waits for
    its unfinished collectives, which a peer that stopped answering never completes, so a rank that raised would
    hang in its way out (and keep the others waiting) instead of exiting for torchrun to end the job."""
    if not (env.distributed and dist.is_initialized()):
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if failed and env.backend == "nccl" and abort is not None:
        abort()
    else:
        dist.destroy_process_group()


def all_reduce_mean(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Mean over ranks (a no-op for one process)."""
    if env.distributed:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= env.world_size
    return t


_ROWS: dict = {}  # per_rank's buffer per (world size, device)


def per_rank(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Every rank's value of the scalar ``t``, as a ``(world_size,)`` float tensor on every rank (a collective
    without a host sync: an all-reduce of one-hot rows, so a NaN stays in its rank's slot).

    The result is one buffer, overwritten by the next call (in stream order on a GPU): copy it before then. It lives
    as long as the process (no allocation per step; a gloo collective's tensors freed late at exit: see
    :func:`exit_code`).
    """
    row = _ROWS.get((env.world_size, t.device))
    if row is None:
        row = _ROWS[(env.world_size, t.device)] = torch.zeros(env.world_size, device=t.device)
    row.zero_()
    row[env.rank] = t.detach().float()
    dist.all_reduce(row, op=dist.ReduceOp.SUM)
    return row


def background_group(env: DistEnv):
    """A gloo process group over every rank for a thread's collectives beside the training's (DCP's planning and
    gathering in a background checkpoint write): a group of its own, so that the two threads' collectives never
    interleave on one group (which would pair different collectives across ranks), and gloo, which runs on CPU
    tensors whatever the device. A collective: every rank calls it at the same point. None for one process."""
    if not env.distributed:
        return None
    return dist.new_group(backend="gloo")


def every_rank(obj, env: DistEnv) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank (a collective; ``[obj]`` for one process)."""
    if not env.distributed:
        return [obj]
    out: list = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def any_rank(flag: bool, env: DistEnv) -> bool:
    """True on every rank if ``flag`` is true on any rank (e.g. a stop signal seen by one)."""
    if not env.distributed:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class StopSignals:
    """SIGINT and SIGTERM ask the run to stop: it finishes the step, saves a checkpoint and exits cleanly (a second
    SIGINT aborts at once). A context manager around the run; :meth:`on_any_rank` tells whether any rank got one.

    Under torchrun (``env``, distributed) a SIGTERM that comes after a rank on this host exited is torchrun ending the
    job's ranks to restart it, not a request to save: no checkpoint can be written without the lost rank, and a rank
    waiting on the device for a collective with it never returns to Python to see the signal, so torchrun would kill
    it only after its 30 s shutdown timeout, all of it added to the restart. A thread woken by the signal itself
    (``signal.set_wakeup_fd``: written by the C-level handler, also while the main thread waits in CUDA or NCCL)
    then gives the main thread :data:`LOST_PEER_GRACE_S` to end on its own (a rank leaving with the same error as
    the lost one keeps its message and exit status), then says which rank was lost and ends this process
    (:data:`LOST_PEER_EXIT`)."""

    def __init__(self, env: DistEnv | None = None):
        self.requested = False
        self.env = env
        self._old: dict = {}
        self._wakeup: tuple | None = None  # (read socket, write socket, the wakeup fd before)

    def _handler(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        again = " (Ctrl-C again to abort)" if signum == signal.SIGINT else ""
        console.info(
            f"\n{signal.Signals(signum).name}: finishing this step and saving a checkpoint{again}", every_rank=True
        )

    def __enter__(self) -> StopSignals:
        try:
            self._old = {s: signal.signal(s, self._handler) for s in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:  # not the main thread: leave signals alone
            self._old = {}
        if self._old and self.env is not None and self.env.distributed:
            read, write = socket.socketpair()
            write.setblocking(False)
            self._wakeup = (read, write, signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False))
            threading.Thread(target=self._watch, args=(read,), daemon=True, name="trainer-lost-peer").start()
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        if self._wakeup is not None:
            read, write, before = self._wakeup
            signal.set_wakeup_fd(before)
            read.shutdown(socket.SHUT_RDWR)  # the thread's recv returns: it ends
            read.close()
            write.close()
            self._wakeup = None

    def _watch(self, read: socket.socket) -> None:
        """The thread's loop: on each SIGTERM, end this process if a rank on this host has exited."""
        env, host = self.env, socket.gethostname()
        while data := _recv(read):
            if signal.SIGTERM not in data:
                continue
            gone = [
                (r, pid) for r, (h, pid) in enumerate(env.peers) if h == host and r != env.rank and not pid_alive(pid)
            ]
            if gone:
                # A rank on its way out already (with the same error as the lost rank's, say) ends in this time
                # with its own message and exit status; one waiting on the device for the lost rank does not.
                time.sleep(LOST_PEER_GRACE_S)
                who = ", ".join(f"rank {r} (pid {pid} on {host})" for r, pid in gone)
                os.write(
                    2,
                    f"trainer: rank {env.rank}: lost {who}: it exited, and torchrun is ending the job's ranks; "
                    "exiting now (a checkpoint needs every rank: nothing saved)\n".encode(),
                )
                os._exit(LOST_PEER_EXIT)

    def on_any_rank(self, env: DistEnv) -> bool:
        """Whether a stop was asked for on any rank (a collective under torchrun: every rank must call it)."""
        return any_rank(self.requested, env)


LOST_PEER_GRACE_S = 2.0
"""How long :class:`StopSignals` lets a rank that got torchrun's SIGTERM after a lost rank end on its own."""
LOST_PEER_EXIT = 128 + signal.SIGTERM
"""The exit status of a rank ended by :class:`StopSignals` after a lost rank: as if SIGTERM had ended it."""


def _recv(sock: socket.socket) -> bytes:
    """The next bytes from ``sock``; b"" once it is shut down."""
    try:
        return sock.recv(64)
    except OSError:
        return b""


def lost_peer(e: BaseException, env: DistEnv, timeout_s: float | None, wait_s: float = 5.0) -> tuple[str, bool] | None:
    """The error to stop with when a collective failed because another rank is gone or hung, and whether a rank on
    this host was seen to exit; None when ``e`` is not such a failure. Names the lost rank where this host can tell:
    a rank on this host whose process exited (polled for up to ``wait_s``: a rank that raised is still exiting)."""
    text = str(e)
    # NCCL's failures are DistBackendErrors; gloo's are RuntimeErrors naming its source ("Connection closed by peer",
    # "Timed out waiting 5000ms for recv").
    if not env.distributed or not (isinstance(e, dist.DistError) or "gloo" in text):
        return None
    timed_out = "timed out" in text.lower() or "timeout" in text.lower()  # a hung rank: no use waiting for it
    host = socket.gethostname()
    local = [(r, pid) for r, (h, pid) in enumerate(env.peers) if h == host and r != env.rank]
    deadline = time.monotonic() + (0 if timed_out else wait_s)
    while not (gone := [(r, pid) for r, pid in local if not pid_alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    reason = next((line.strip() for line in text.splitlines() if line.strip()), type(e).__name__)[:300]
    if gone:
        who = ", ".join(f"rank {r} (pid {pid} on {host})" for r, pid in gone)
        lost = f"lost {who}: its process exited" if len(gone) == 1 else f"lost {who}: their processes exited"
    elif timed_out:
        limit = f"distributed.timeout_s={timeout_s:g} s" if timeout_s else "the collective timeout"
        lost = f"a collective waited longer than {limit}: another rank stopped answering (hung, or its host failed)"
    else:
        lost = "another rank is gone (none on this host exited: it ran on another host; its log names it)"
    return f"rank {env.rank}: {lost}; stopping. The collective failed with: {reason}", bool(gone)


@contextlib.contextmanager
def lost_rank_stops(env: DistEnv, timeout_s: float | None, error: type[TrainingError]):
    """A context in which a collective that fails because another rank is gone or hung raises ``error`` with a
    message naming the lost rank (:func:`lost_peer`) instead of the backend's traceback, and prints it at once
    (``reported``); its ``peer_exited`` says whether a rank on this host exited (see :func:`await_launcher`)."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, error) or not env.distributed:
            raise
        # torchrun, which saw the lost rank exit, sends SIGTERM any moment now: noted (not the run's stop-signal
        # handler, which would finish a step and save), then its default action once the message is out.
        terminated: list[int] = []
        main = threading.current_thread() is threading.main_thread()  # only it can handle signals
        held = signal.getsignal(signal.SIGTERM) if main else None
        if main:
            signal.signal(signal.SIGTERM, lambda *_: terminated.append(1))
        lost = lost_peer(e, env, timeout_s)
        if lost is None:
            if main:
                signal.signal(signal.SIGTERM, held if held is not None else signal.SIG_DFL)
            raise
        stop = error(lost[0])
        stop.peer_exited = lost[1]
        print_error(stop, prefix="trainer")  # said now, not on the way out
        stop.reported = True
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        stop.terminated = bool(terminated)
        raise stop from None
