"""The process environment: torchrun variables, the process group, this rank's device, rank-0 output."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None  # None when no process group was created

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def resolve_device(spec: str, local_rank: int) -> torch.device:
    """``auto`` -> ``cuda:<local_rank>`` if CUDA is available, else ``cpu``.

    Raises:
        ValueError: CUDA asked for but unavailable, or an unknown device string.
    """
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"train.device: unknown device '{spec}'; expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"train.device: '{spec}' asked for, but CUDA is not available here; use auto or cpu")
        if device.index is None:
            device = torch.device("cuda", local_rank)
    return device


def setup(device: str = "auto", backend: str = "auto") -> DistEnv:
    """Read torchrun's environment and create the process group when ``WORLD_SIZE > 1``.

    ``accelerate launch`` sets the same variables, so it works unchanged.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world == 1:
        return DistEnv(rank=0, local_rank=0, world_size=1, device=dev, backend=None)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend=backend, **kwargs)
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world, device=dev, backend=backend)


def teardown(env: DistEnv) -> None:
    if env.distributed and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_mean(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Mean over ranks (a no-op for one process)."""
    if env.distributed:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= env.world_size
    return t


def any_rank(flag: bool, env: DistEnv) -> bool:
    """True on every rank if ``flag`` is true on any rank (e.g. a stop signal seen by one)."""
    if not env.distributed:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class StopSignals:
    """SIGINT and SIGTERM ask the run to stop: it finishes the step, saves a checkpoint and exits cleanly (a second
    SIGINT aborts at once). A context manager around the run; :meth:`on_any_rank` tells whether any rank got one."""

    def __init__(self):
        self.requested = False
        self._old: dict = {}

    def _handler(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        again = " (Ctrl-C again to abort)" if signum == signal.SIGINT else ""
        print(f"\n{signal.Signals(signum).name}: finishing this step and saving a checkpoint{again}", flush=True)

    def __enter__(self) -> StopSignals:
        try:
            self._old = {s: signal.signal(s, self._handler) for s in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:  # not the main thread: leave signals alone
            self._old = {}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def on_any_rank(self, env: DistEnv) -> bool:
        """Whether a stop was asked for on any rank (a collective under torchrun: every rank must call it)."""
        return any_rank(self.requested, env)
