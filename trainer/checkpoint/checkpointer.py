"""Checkpoints of a run's Stateful parts: atomic, keep-N, a ``last`` pointer, and loading that never runs code.

A :class:`Checkpointer` is given the run's states (``{name: Stateful}``, built by :func:`.states.run_states`) and
a :class:`Storage` for the model's and the optimizer's: :data:`TORCH_SAVE` (whole tensors in ``torch.save``
files that the main rank writes) or :data:`DCP` (``torch.distributed.checkpoint``: every rank writes its shards,
and a load reshards them to the current world size). A run whose model is FSDP-sharded uses DCP. The other states
are small and go to the same files either way. Layout of ``<run.dir>/checkpoints/``::

    step_000040/            one complete checkpoint
      model.pt              "model": the model's state dict, whole tensors (TORCH_SAVE)
      dcp/                  "model" and "optimizer" (as "optim"), every rank's shards (DCP)
      optim.pt              {"optimizer" (TORCH_SAVE), "scheduler", "scaler" (fp16)}: tensors and plain containers
      rng_rank<R>.pt        "rng": each rank's RNG states (Python, NumPy, torch CPU, CUDA)
      meta.json             "train" (step, tokens seen) at its top level, "sampler", the world size, the config
      manifest.json         every file above with its size (and a checksum of the small ones): integrity.py
    step_000030.damaged-1/  a damaged checkpoint a resume moved aside (integrity.py), kept, never pruned
    last                    a text file naming the newest complete checkpoint
    compile_cache.bin       beside the checkpoints (one for all of them), when compiling

A checkpoint is written into a temporary directory, each file fsynced, its manifest written, then renamed into
place; ``last`` moves (write + fsync + rename) only after that, and old checkpoints are pruned only after ``last``
moved (the newest ``checkpoint.keep`` intact ones are kept; a damaged one is neither counted nor deleted). A crash
at any moment leaves ``last`` naming a complete checkpoint; a write that fails (a full disk) on any rank stops every
rank with one error naming the file, the partial checkpoint removed and ``last`` unchanged. Files load with
``torch.load(weights_only=True)``: a pickled object that would run code is refused.

A checkpoint damaged on disk after it was published (a truncated file, a lost one) is found by its manifest when a
run resumes: ``resume=last`` and ``resume=auto`` fall back to the newest intact one (rank 0 decides, in
:func:`.rundir.claim`), a checkpoint named explicitly is refused (:mod:`.integrity`).
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from trainer import console
from trainer.checkpoint import integrity, rundir
from trainer.checkpoint.integrity import LAST, META, CheckpointError, resolve
from trainer.distributed.env import DistEnv, every_rank
from trainer.errors import TrainingError
from trainer.faults import fault_point
from trainer.io import atomic_write, atomic_write_text

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

DCP_DIR = "dcp"
# The states DCP storage keeps in dcp/, and their keys there.
DCP_KEYS = {"model": "model", "optimizer": "optim"}
# The states of optim.pt, under their own names.
OPTIM_KEYS = ("optimizer", "scheduler", "scaler")
# States a checkpoint may lack: a run with a grad scaler resumes one saved without (fp32 -> fp16), and a rank that
# the saving run did not have finds no RNG file of its own.
OPTIONAL = ("scaler", "rng")
# Keys of the config that fix the model's shape: a resume must not change them.
SHAPE_KEYS = [
    "model.preset",
    "model.n_layer",
    "model.n_head",
    "model.n_embd",
    "model.bias",
    "model.target",
    "model.kwargs",
    "model.hf",
    "model.hf_overrides",
    "data.vocab_size",
    "data.seq_len",
    "optim.name",
]


# How long the main rank's background writer waits for another rank's files (torch's default collective timeout).
MARKER_WAIT_S = 600.0


class CheckpointWriteError(TrainingError):
    """A checkpoint could not be written (a full disk, a lost permission): the run stops, ``last`` unchanged."""


@dataclass(frozen=True)
class Storage:
    """How a checkpoint keeps the model's and the optimizer's states (the choice: :data:`TORCH_SAVE` or :data:`DCP`).

    Attributes:
        sharded: every rank writes its shards of them through DCP under ``dcp/`` (the states in their ``by_name``
            form, :mod:`trainer.checkpoint.states`); otherwise the main rank writes whole tensors to ``model.pt`` and
            ``optim.pt``. A checkpoint is read as it was written, whatever this run's storage: a run without FSDP
            resumes an FSDP run's checkpoint, resharded by DCP to whole tensors.
    """

    sharded: bool


TORCH_SAVE = Storage(sharded=False)
DCP = Storage(sharded=True)


class SideFiles(Protocol):
    """Files kept beside the checkpoints rather than in one (:class:`trainer.checkpoint.states.CompileCache`)."""

    def save(self, root: Path) -> None:
        """Write them into ``root`` (the main rank, with each checkpoint's files)."""

    def load(self, root: Path) -> str | None:
        """Read them from ``root`` on resume; a line for rank 0 to print, or None."""


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
        _prune(root, keep)
        if fault_point("damage_checkpoint", step, env.rank):
            _cut_largest_file(final)
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


def _attempt(fn: Callable, *args, rank: int) -> tuple[str, int | None, int] | None:
    """Run ``fn(*args)``; a failure to write (OSError, DCP's CheckpointException) as ``(message, errno, rank)``,
    else None."""
    try:
        fn(*args)
    except OSError as e:
        return str(e), e.errno, rank
    except BaseException as e:
        if type(e).__name__ != "CheckpointException":  # DCP's: every rank's failures, gathered
            raise
        return str(e), None, rank
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


def _load_file(path: Path, device: torch.device) -> Any:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path}")
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # noqa: BLE001 - every failure to read is the same user error: a bad file
        raise CheckpointError(f"cannot load checkpoint file {path}: {_load_failure(e)}") from None


def _load_failure(e: Exception, most: int = 400) -> str:
    """Why ``torch.load`` failed, in one line of whole words: torch's first line (cut at a word, with an ellipsis,
    past ``most`` characters); for ``weights_only``'s refusals, whether the file would run code or is corrupt."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
    if "weights only load failed" in lines[0].lower() or "weights_only" in lines[0]:
        if any("global" in line.lower() for line in lines[1:]):  # "unsupported GLOBAL posix.system", by version
            return "it holds a pickled object that would run code on load; refusing to load it"
        said = next((i for i, line in enumerate(lines) if "WeightsUnpickler error" in line), None)
        detail = lines[said + 1] if said is not None and said + 1 < len(lines) else lines[-1]
        return f"its pickled data is corrupt ({detail})"
    line = lines[0]
    if len(line) <= most:
        return line
    cut = line.rfind(" ", 0, most)
    return line[: cut if cut > 0 else most].rstrip(" ,;:") + " ..."


def _read_meta(path: Path) -> dict:
    if not path.is_dir():
        raise CheckpointError(f"not a checkpoint directory: {path}")
    try:
        return json.loads((path / META).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"incomplete checkpoint {path}: {META} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"corrupt checkpoint file {path / META}: {e}") from None


def checkpoint_meta(path: Path) -> dict:
    """The ``meta.json`` of checkpoint ``path``: what a run reads of it before it builds anything (the global batch
    it keeps).

    Raises:
        CheckpointError: not a checkpoint directory, or no readable meta.json in it.
    """
    return _read_meta(Path(path))


def read(path: Path, *, rank: int, device: torch.device) -> dict[str, Any]:
    """The state dicts checkpoint ``path`` holds in files, by state name, and its ``config``: every file this rank
    reads is read (and checked) here, before anything is loaded. A DCP checkpoint's ``model`` and ``optimizer``
    are not among them: :func:`_load_shards` reads those into the states.

    Raises:
        CheckpointError: naming the file and the problem.
    """
    meta = _read_meta(path)
    train = {k: v for k, v in meta.items() if k not in ("sampler", "world_size", "config")}
    saved = {"train": train, "config": meta.get("config", {})}
    if "sampler" in meta:
        saved["sampler"] = meta["sampler"]
    if not (path / DCP_DIR).is_dir():
        saved["model"] = _load_file(path / "model.pt", device)
    saved.update(_load_file(path / "optim.pt", device))
    rng_path = path / f"rng_rank{rank}.pt"
    if rng_path.exists():
        saved["rng"] = _load_file(rng_path, torch.device("cpu"))
    return saved


def _save_shards(states: dict[str, Stateful], directory: Path) -> None:
    """Every rank writes its shards of the DCP-kept states under ``directory``."""
    import torch.distributed.checkpoint as dcp

    dcp.save({key: states[name].named().state_dict() for name, key in DCP_KEYS.items()}, checkpoint_id=str(directory))


def _load_shards(states: dict[str, Stateful], directory: Path) -> None:
    """Load a DCP checkpoint's states, resharded to this run's layout (any world size; whole tensors without FSDP).
    Their state dicts, taken first, are the layout DCP reads into (an empty optimizer state is initialised)."""
    import torch.distributed.checkpoint as dcp

    named = {key: states[name].named() for name, key in DCP_KEYS.items()}
    target = {key: state.state_dict() for key, state in named.items()}
    dcp.load(target, checkpoint_id=str(directory))
    for key in reversed(list(named)):  # the optimizer first, as DCP's set_state_dict does
        named[key].load_state_dict(target[key])


def load_model_weights(path: Path, model: torch.nn.Module) -> dict:
    """Load checkpoint ``path``'s model weights into ``model`` (whole, unsharded, on the CPU) in this one process,
    without the optimizer state: ``model.pt``, or an fsdp run's DCP shards read whole (no process group needed).
    Returns the checkpoint's meta (``trainer export``).

    Raises:
        CheckpointError: a missing or incomplete checkpoint, or weights that do not fit ``model``.
    """
    meta = _read_meta(path)
    try:
        if (path / DCP_DIR).is_dir():
            import warnings

            import torch.distributed.checkpoint as dcp

            state = {"model": model.state_dict()}  # views of the parameters: DCP reads into them in place
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(state, checkpoint_id=str(path / DCP_DIR), no_dist=True)
            model.load_state_dict(state["model"])
        else:
            model.load_state_dict(_load_file(path / "model.pt", torch.device("cpu")))
    except (RuntimeError, KeyError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        reason = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise CheckpointError(f"checkpoint {path} does not fit the model its run's config builds: {reason}") from None
    return meta


def _get(d: dict, key: str):
    for part in key.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def compare_configs(saved: dict, current: dict, path: Path) -> list[str]:
    """Changes between a checkpoint's config and the current one.

    Returns:
        ``"key: old -> new"`` lines for allowed changes.

    Raises:
        CheckpointError: a change that cannot work (model shape, vocabulary, optimizer type).
    """
    for key in SHAPE_KEYS:
        if _get(saved, key) != _get(current, key):
            raise CheckpointError(
                f"checkpoint {path} is incompatible with this config: {key} was {_get(saved, key)!r}, "
                f"now {_get(current, key)!r}; the model or optimizer would not match. Use the original value or "
                "start a fresh run (another run.dir)."
            )
    a, b = _flatten(saved), _flatten(current)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


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


class _BackgroundSave:
    """One checkpoint written by a thread on every rank (:class:`Checkpointer` with ``background``).

    The temporary directory is made at once (every rank waits for it); then each rank's thread writes its files
    and a marker saying whether they were written. The main rank's thread waits for every rank's marker, then
    publishes the checkpoint as :func:`save` does (manifest, rename, ``last``, prune), with no collective, so the
    step's collectives are never interleaved with a checkpoint's. :meth:`join` gathers every rank's result."""

    def __init__(self, owner: Checkpointer, step: int, snapshot: dict[str, Any], shards: _ShardWriter | None):
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
                _prune(self.owner.root, self.owner.keep)
                if fault_point("damage_checkpoint", self.step, env.rank):
                    _cut_largest_file(self.final)
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


class _ShardWriter:
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


class Checkpointer:
    """A run's checkpoints: its states saved by every rank together, atomically, and loaded on resume.

    Args:
        states: the run's Stateful parts by name (:func:`.states.run_states`); a resume loads them in this
            order. The names place them in the layout (the module docstring): ``model``, ``optimizer``,
            ``scheduler``, ``scaler``, ``train``, ``sampler``, ``rng``.
        storage: :data:`TORCH_SAVE` or :data:`DCP`, for the model's and the optimizer's states.
        run_dir: the run directory; checkpoints go to ``run_dir/checkpoints``.
        env: this process's rank and device; every rank calls :meth:`save` and :meth:`restore`.
        config: the run's resolved config as plain containers: saved with each checkpoint; a resume compares it
            with the checkpoint's.
        keep: how many complete checkpoints to keep (the newest).
        beside: files kept beside the checkpoints (:class:`SideFiles`), saved with each and loaded on resume.
        background: write the files in a thread (``checkpoint.async_save``, the one-file format): :meth:`save`
            returns once the states are copied to host memory (:class:`Stager`); ``last`` moves when every rank's
            files are written, and :meth:`wait` (the next save, the run's end) raises a failure on every rank.
    """

    def __init__(
        self,
        states: dict[str, Stateful],
        storage: Storage,
        run_dir: Path,
        env: DistEnv,
        *,
        config: dict,
        keep: int,
        beside: Sequence[SideFiles] = (),
        background: bool = False,
    ):
        assert set(states) <= {*DCP_KEYS, *OPTIM_KEYS, "train", "sampler", "rng"}, f"no place for {sorted(states)}"
        self.states, self.storage, self.root, self.env = states, storage, run_dir / "checkpoints", env
        self.config, self.keep, self.beside, self.background = config, keep, beside, background
        self._stager = Stager(env.device)
        self._pending: _BackgroundSave | None = None
        self._shards: _ShardWriter | None = _ShardWriter(env) if background and storage.sharded else None
        self.last: Path | None = None  # the newest checkpoint this process wrote
        self.resumed: Path | None = None  # the checkpoint this run resumed from

    def save(self, step: int, wait: bool = False) -> float:
        """Write the checkpoint of ``step`` (every rank calls this) and move ``last`` to it; in the background
        (``background``), the previous background write first waited for, and this one too with ``wait``.
        Returns the seconds the caller waited."""
        start = time.perf_counter()
        self.wait()
        # Every rank takes every state dict: one may be a collective (the sharded optimizer gathers its state).
        sharded = DCP_KEYS if self.storage.sharded else {}
        snapshot = {name: state.state_dict() for name, state in self.states.items() if name not in sharded}
        if self.env.is_main:
            for files in self.beside:  # beside the checkpoints, not in one: written now, in either mode
                files.save(self.root)
        if self.background:
            self._pending = _BackgroundSave(self, step, self._stager.stage(snapshot), self._shards)
            if wait:
                self.wait()
        else:
            self.last = save(self.root, step, functools.partial(self._write, snapshot, step), self.env, self.keep)
        return time.perf_counter() - start

    def wait(self) -> Path | None:
        """Wait for the background write in flight, if any (every rank calls this at the same point: the next
        save, the run's end, a stop): ``last`` names it once this returns. Returns the checkpoint it published,
        or None with none in flight.

        Raises:
            CheckpointWriteError: on every rank, when a rank could not write it (``last`` unchanged).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        published = pending.join()
        if published is not None:
            self.last = published
        return published

    def close(self, timeout_s: float = 60.0) -> None:
        """The run's end: free what the background writes kept (DCP's staging buffers). A background write still in
        flight (a failure stopped the run before :meth:`wait`) is given up to ``timeout_s`` to end, with no
        collective: a checkpoint every rank finished is published, one that did not stays a temporary directory
        that the next start removes."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.thread.join(timeout_s)
        if self._shards is not None:
            self._shards.close()

    def _write(self, snapshot: dict[str, Any], step: int, directory: Path, shards: Callable | None = None) -> None:
        """This rank's files of the checkpoint of ``step`` in ``directory``: its RNG state, its DCP shards (written
        by ``shards`` in a background write); on the main rank ``model.pt``, ``optim.pt`` and ``meta.json``."""
        rank, main = self.env.rank, self.env.is_main
        disk_full = fault_point("disk_full", step, rank)
        _save_file(snapshot["rng"], directory / f"rng_rank{rank}.pt", disk_full and not main)
        if shards is not None:
            shards()
        elif self.storage.sharded:
            _save_shards(self.states, directory / DCP_DIR)
        if not main:
            return
        if "model" in snapshot:
            _save_file(snapshot["model"], directory / "model.pt")
        fault_point("checkpoint_write", step)  # between two files: the checkpoint is incomplete
        _save_file({k: snapshot[k] for k in OPTIM_KEYS if k in snapshot}, directory / "optim.pt", disk_full)
        meta = {
            **snapshot["train"],
            "sampler": snapshot["sampler"],
            "world_size": self.env.world_size,
            "config": self.config,
        }
        atomic_write_text(directory / META, json.dumps(meta, indent=1))

    def begin(self, start: rundir.Start) -> Stateful:
        """Start the run as ``start`` says: restore its checkpoint, or none; say how it started in one line (a
        resume, or a fresh start under ``resume=auto`` or a torchrun restart) and record it in ``starts.jsonl``
        (rank 0). Returns the ``train`` state (:class:`trainer.checkpoint.states.TrainState`): the run's position."""
        step = self.restore(start.resume, start.headline()) if start.resume else 0
        if self.env.is_main:
            if start.resume is None and (line := start.fresh_line(self.root.parent)):
                console.info(line)
            rundir.record_start(self.root.parent, start, step, self.resumed, self.env.world_size)
        return self.states["train"]

    def restore(self, spec: str, headline: str = "resumed from {path} at step {step}") -> int:
        """Load ``resume=spec`` (``last`` or a path) into the states; returns its step. ``headline``: the line rank 0
        says first, a template of ``{path}`` and ``{step}``.

        Raises:
            CheckpointError: a checkpoint that is missing, unreadable, or does not fit this run's config or states.
        """
        path = resolve(spec, self.root.parent)
        saved = read(path, rank=self.env.rank, device=self.env.device)
        changes = compare_configs(saved.pop("config"), self.config, path)
        in_shards = (path / DCP_DIR).is_dir()
        if self.storage.sharded and not in_shards:
            raise CheckpointError(
                f"checkpoint {path} was written without fsdp (whole tensors in model.pt); resume "
                "it with distributed.strategy=ddp or none"
            )
        try:
            if in_shards:  # written under FSDP: resharded to this run's world size by DCP
                _load_shards(self.states, path / DCP_DIR)
            for name, state in self.states.items():
                if name in saved:
                    state.load_state_dict(saved[name])
                elif name not in OPTIONAL and not (in_shards and name in DCP_KEYS):
                    raise KeyError(name)
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointError(f"checkpoint {path} does not fit this model/optimizer: {e}") from None
        said = [line for files in self.beside if (line := files.load(self.root))]
        self.resumed = path
        step = int(saved["train"]["step"])
        if self.env.is_main:
            console.info(headline.format(path=path, step=step))
            for line in said:
                console.info(line)
            # With train.global_batch_size, grad_accum is derived: the plan's line says how and why it changed.
            derived = ("train.grad_accum:",) if _get(self.config, "train.global_batch_size") is not None else ()
            for line in changes:
                if not line.startswith(("run.", "model.kwargs", *derived)):
                    console.info(f"  changed on resume: {line}")
        return step
