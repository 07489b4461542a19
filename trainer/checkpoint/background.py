"""Checkpoints written in the background (``checkpoint.async_save``): the states copied to host memory while the
step waits (:class:`Stager`; DCP's stager for the shards, :class:`ShardWriter`), then written by a thread on each
rank (:class:`BackgroundSave`) and published by the main rank's as :func:`trainer.checkpoint.write.save`
publishes, with no collective of their own beside the training's."""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer import console
from trainer.checkpoint.write import (
    DCP_DIR,
    DCP_KEYS,
    _after_publish,
    _attempt,
    _make_empty,
    _publish,
    _stop_if_failed,
    checkpoint_name,
)
from trainer.distributed.env import DistEnv, every_rank
from trainer.io import atomic_write_text

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful


# How long the main rank's background writer waits for another rank's files (torch's default collective timeout).
MARKER_WAIT_S = 600.0


class Stager:
    """Copies a snapshot's tensors to host memory, so that training may change the originals while a thread
    writes the copies. Each storage is copied whole, once, and the tensors are rebuilt on the copies with their
    offsets and strides: tensors that shared a storage still do (tied weights, views of one buffer), and the files
    written are those the originals would give. On CUDA the copies go to pinned buffers kept from one save to the
    next (the states keep their storages), with one synchronize for all of them; on the CPU they are clones.
    Containers are rebuilt, other values kept (training does not change them in place)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._pinned: dict[tuple[int, int], torch.UntypedStorage] = {}  # (device address, bytes) -> host buffer

    def stage(self, obj: Any) -> Any:
        copies: dict = {}  # this snapshot's storages (by device and address) and objects (by id), each copied once
        out = self._copy(obj, copies)
        if self.cuda:
            torch.cuda.synchronize()  # the non-blocking copies into the pinned buffers are complete
            # The buffers of storages this snapshot no longer has are freed.
            used = {id(s) for key, s in copies.items() if isinstance(key, tuple)}
            self._pinned = {k: v for k, v in self._pinned.items() if id(v) in used}
        return out

    def _storage(self, t: torch.Tensor, copies: dict) -> torch.UntypedStorage:
        src = t.untyped_storage()
        key = (src.device.type, src.data_ptr())
        if key in copies:
            return copies[key]
        if src.device.type == "cpu" or not self.cuda:
            copy = src.clone()
        else:
            buf_key = (src.data_ptr(), src.nbytes())
            copy = self._pinned.get(buf_key)
            if copy is None:
                copy = self._pinned[buf_key] = torch.empty(
                    src.nbytes(), dtype=torch.uint8, pin_memory=True
                ).untyped_storage()
            copy.copy_(src, non_blocking=True)
        copies[key] = copy
        return copy

    def _copy(self, obj: Any, copies: dict) -> Any:
        """``obj`` with its tensors on the copies; an object met twice is copied once (as pickle writes it once:
        the param groups' shared betas, a tensor under two names)."""
        if id(obj) in copies:
            return copies[id(obj)][1]
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            out = torch.empty((), dtype=t.dtype).set_(
                self._storage(t, copies), t.storage_offset(), t.size(), t.stride()
            )
        elif isinstance(obj, dict):
            out = type(obj)((k, self._copy(v, copies)) for k, v in obj.items())
            if attrs := getattr(obj, "__dict__", None):  # a state dict's _metadata (its modules' versions)
                out.__dict__.update(self._copy(attrs, copies))
        elif isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            out = type(obj)(self._copy(v, copies) for v in obj)
        else:
            return obj
        copies[id(obj)] = (obj, out)  # the original kept alive, so that its id is not reused during the copy
        return out


class BackgroundSave:
    """One checkpoint written by a thread on every rank (:class:`Checkpointer` with ``background``).

    The temporary directory is made at once (every rank waits for it); then each rank's thread writes its files
    and a marker saying whether they were written. The main rank's thread waits for every rank's marker, then
    publishes the checkpoint as :func:`save` does (manifest, rename, ``last``, prune), with no collective, so the
    step's collectives are never interleaved with a checkpoint's. :meth:`join` gathers every rank's result."""

    def __init__(self, owner: Any, step: int, snapshot: dict[str, Any], shards: ShardWriter | None):
        """``owner``: the :class:`trainer.checkpoint.checkpointer.Checkpointer` whose states and files these are."""
        self.owner, self.step, env = owner, step, owner.env
        name = checkpoint_name(step)
        self.final, self.tmp = owner.root / name, owner.root / f".tmp-{name}"
        failed = _attempt(_make_empty, self.tmp, rank=env.rank) if env.is_main else None
        _stop_if_failed(every_rank(failed, env), step, owner.root, self.tmp if env.is_main else None)
        # DCP's shards: staged now (the copies to host memory), written by the thread.
        self.shards = shards.stage(owner.states, self.tmp / DCP_DIR) if shards is not None else None
        self.failed: tuple[str, int | None, int] | None = None
        self.published: Path | None = None
        self.thread = threading.Thread(target=self._run, args=(snapshot,), name=f"checkpoint-{name}", daemon=True)
        self.thread.start()

    def _marker(self, rank: int) -> Path:
        return self.tmp / f".written-rank{rank}"

    def _run(self, snapshot: dict[str, Any]) -> None:
        env = self.owner.env
        try:
            write = functools.partial(self.owner._write, snapshot, self.step, shards=self.shards)
            self.failed = _attempt(write, self.tmp, rank=env.rank)
            if not env.is_main:
                atomic_write_text(self._marker(env.rank), json.dumps(self.failed))
                return
            if self.failed is None:
                self.failed = self._others_failed()
            if self.failed is None:
                for r in range(env.world_size):
                    self._marker(r).unlink(missing_ok=True)
                self.failed = _attempt(_publish, self.tmp, self.final, rank=env.rank)
            if self.failed is None:
                self.published = self.final
                _after_publish(self.final, self.step, self.owner.keep, env.rank)
        except BaseException as e:  # noqa: BLE001 - said on every rank by join(), not lost in the thread
            self.failed = (f"{type(e).__name__}: {e}", None, env.rank)

    def _others_failed(self) -> tuple[str, int | None, int] | None:
        """The first other rank's failure, once every rank's marker is there (polled: no collective)."""
        env = self.owner.env
        deadline = time.monotonic() + MARKER_WAIT_S
        for r in range(1, env.world_size):
            while not self._marker(r).exists():
                if time.monotonic() > deadline:
                    return f"rank {r} did not finish writing its files", None, r
                time.sleep(0.02)
            if (failed := json.loads(self._marker(r).read_text())) is not None:
                return tuple(failed)
        return None

    def join(self) -> Path | None:
        started = time.monotonic()
        self.thread.join(5.0)
        if self.thread.is_alive():
            console.info(f"waiting for the checkpoint of step {self.step} to be written in the background")
            self.thread.join()
        waited, env = time.monotonic() - started, self.owner.env
        _stop_if_failed(every_rank(self.failed, env), self.step, self.owner.root, self.tmp if env.is_main else None)
        if waited > 5.0 and env.is_main:
            console.info(f"  written after {waited:.0f} s more")
        return self.published


class ShardWriter:
    """DCP's shards of a background write: the model's and optimizer's state dicts (DTensors) copied to host memory
    by DCP's stager (pinned on CUDA, its buffers reused), then written by ``dcp.save`` in the writing thread over a
    gloo group of its own (:func:`trainer.distributed.env.background_group`)."""

    def __init__(self, env: DistEnv):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        from trainer.distributed.env import background_group

        self.cuda = cuda = env.device.type == "cuda"
        self.group = background_group(env)
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=cuda))  # fmt: skip

    def stage(self, states: dict[str, Stateful], directory: Path) -> Callable[[], None]:
        """Copy the shards now; returns the write, for the thread."""
        import torch.distributed.checkpoint as dcp

        staged = self.stager.stage({key: states[name].named().state_dict() for name, key in DCP_KEYS.items()})
        if self.cuda:
            torch.cuda.synchronize()  # the stager's non-blocking copies are complete before training goes on
        return functools.partial(dcp.save, staged, checkpoint_id=str(directory), process_group=self.group)

    def close(self) -> None:
        self.stager.close()


def background_checkpoints(
    device: str, state_bytes: int, local_ranks: int, available: int | None, sharded: bool = False
) -> tuple[bool, str]:
    """``checkpoint.async_save=auto``: whether to write checkpoints in the background, and why. On CUDA the save
    then holds the step only for the copy to pinned host memory (0.25 s against 28.8 s for the Llama-3.2-1B shape on
    an H200: docs/performance.md); the copy stays in host memory, so it is on when the host's available memory
    (``available`` bytes, None: unknown) holds every local rank's copy (``state_bytes`` each) twice over. Off on a
    CPU, where the copy and the write share the cores that train, and under fsdp (``sharded``: DCP's stager and
    background ``dcp.save``), which ``true`` turns on."""
    if device != "cuda":
        return False, "off (on a CPU the copy and the write share the cores that train)"
    if sharded:
        return False, "off under fsdp (true writes DCP's shards in the background)"
    need = state_bytes * local_ranks
    ranks = f" x {local_ranks} local ranks" if local_ranks > 1 else ""
    if available is None:
        return False, f"off (the host's available memory is unknown; the copy needs {need / 1e9:.1f} GB)"
    room = f"{state_bytes / 1e9:.1f} GB{ranks} in host memory; {available / 1e9:.0f} GB available"
    if 2 * need > available:
        return False, f"off (the copy would take {room}: less than twice over; true insists)"
    return True, f"on (the save holds the step for a copy of the state: {room})"


def local_ranks() -> int:
    """The ranks torchrun runs on this host (1 outside it)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def available_host_memory() -> int | None:
    """The host's available memory in bytes (Linux's MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
