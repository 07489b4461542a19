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

import functools
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from trainer import console, startup
from trainer.checkpoint import rundir
from trainer.checkpoint.background import BackgroundSave, ShardWriter, Stager
from trainer.checkpoint.integrity import META, CheckpointError, resolve
from trainer.checkpoint.write import (
    DCP_DIR,
    DCP_KEYS,
    _save_file,
    save,
)
from trainer.distributed.env import DistEnv
from trainer.faults import fault_point
from trainer.io import atomic_write_text

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

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


def _load_file(path: Path, device: torch.device) -> Any:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path}")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # no read into fresh memory first
    except Exception as e:  # noqa: BLE001 - every failure to read is the same user error: a bad file
        raise CheckpointError(f"cannot load checkpoint file {path}: {_load_failure(e)}") from None
    return loaded if device.type == "cpu" else _onto(loaded, device, {})


def _onto(obj: Any, device: torch.device, moved: dict[tuple[int, int], torch.UntypedStorage]) -> Any:
    """``obj`` (containers of CPU tensors, changed in place) with its tensors on ``device``, as
    ``torch.load(map_location=device)`` gives them: each storage copied once, whole, and its tensors rebuilt on the
    copy with their offsets and strides (tied weights still share one). The copy is ``Tensor.to``'s, which lets the
    GIL go while it reads the file's pages and copies them (a storage's own ``copy_``, torch.load's, holds it): a
    thread reading ahead (:class:`ReadAhead`) leaves the main thread to build."""
    if isinstance(obj, torch.Tensor):
        src = obj.untyped_storage()
        if (key := (src.data_ptr(), src.nbytes())) not in moved:
            whole = torch.empty(0, dtype=torch.uint8, device="cpu").set_(src)  # the storage's bytes
            moved[key] = whole.to(device).untyped_storage()
        out = torch.empty(0, dtype=obj.dtype, device=device)
        return out.set_(moved[key], obj.storage_offset(), obj.size(), obj.stride())
    if isinstance(obj, dict):  # in place: a state dict's _metadata (its modules' versions) stays
        for key, value in obj.items():
            obj[key] = _onto(value, device, moved)
    elif isinstance(obj, list):
        obj[:] = [_onto(v, device, moved) for v in obj]
    elif isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return type(obj)(_onto(v, device, moved) for v in obj)
    return obj


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


class ReadAhead:
    """The files of the checkpoint ``resume=spec`` names (:func:`read`), read by a thread from the moment the
    checkpoint is chosen, while the run builds its model and optimizer; :meth:`Checkpointer.restore` takes them
    (:meth:`result`), or raises in the main thread what the thread raised.

    On CUDA the thread also copies them to the device, the restore's longest part (11.7 GB of a 1B model's state);
    the build it overlaps is mostly Python (imports, the model's construction), which holds the GIL that the copies
    let go. On the CPU the tensors stay mapped from the files, as the restore reads them; the thread asks the kernel
    to read the files into its page cache meanwhile (a first read from disk). A DCP checkpoint's shards are read
    into the states once they exist, by the restore. Nothing is written: a crash loses nothing.

    Args:
        spec: ``start.resume`` (:func:`trainer.checkpoint.rundir.claim`'s choice: a checkpoint's path).
        run_dir: the run directory (where ``last`` is looked up).
        env: this rank's rank and device.
    """

    def __init__(self, spec: str, run_dir: Path, env: DistEnv):
        self.spec = spec
        self._out: tuple[Path, dict[str, Any]] | BaseException | None = None
        if env.device.type == "cuda" and env.device.index is None:  # "cuda": this thread's device, for the other
            env = replace(env, device=torch.device("cuda", torch.cuda.current_device()))
        self._thread = threading.Thread(
            target=self._read, args=(run_dir, env), name="checkpoint-read-ahead", daemon=True
        )
        self._thread.start()

    def _read(self, run_dir: Path, env: DistEnv) -> None:
        try:
            if env.device.type == "cuda":
                torch.cuda.set_device(env.device)  # a thread starts on device 0
            path = resolve(self.spec, run_dir)
            for name in ("model.pt", "optim.pt"):
                _will_need(path / name)
            self._out = path, read(path, rank=env.rank, device=env.device)
        except BaseException as e:  # noqa: BLE001 - the main thread raises it, in result()
            self._out = e

    def result(self) -> tuple[Path, dict[str, Any]]:
        """``(the checkpoint's path, its state dicts)`` once the thread is done: :func:`read`'s answer. Once only:
        the state dicts are the caller's, freed with its use of them.

        Raises:
            CheckpointError: as :func:`read` and :func:`~trainer.checkpoint.integrity.resolve` do, and whatever else
                the thread raised.
        """
        self._thread.join()
        out, self._out = self._out, None
        assert out is not None, "ReadAhead.result() is called once"
        if isinstance(out, BaseException):
            raise out
        return out


def _will_need(path: Path) -> None:
    """Ask the kernel to read ``path`` into its page cache in the background (``POSIX_FADV_WILLNEED``), where it can."""
    if not hasattr(os, "posix_fadvise") or not path.is_file():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


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
        background: write the files in a thread (``checkpoint.async_save``, :mod:`trainer.checkpoint.background`):
            :meth:`save` returns once the states are copied to host memory; ``last`` moves when every rank's files
            are written, and :meth:`wait` (the next save, the run's end) raises a failure on every rank.
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
        from trainer.checkpoint.background import ShardWriter

        self._stager = Stager(env.device)
        self._pending: BackgroundSave | None = None
        self._shards: ShardWriter | None = ShardWriter(env) if background and storage.sharded else None
        self.last: Path | None = None  # the newest checkpoint this process wrote
        self.resumed: Path | None = None  # the checkpoint this run resumed from

    def save(self, step: int, wait: bool = False) -> tuple[float, float]:
        """Write the checkpoint of ``step`` (every rank calls this) and move ``last`` to it; in the background
        (``background``), the previous background write first waited for, and this one too with ``wait``.
        Returns the seconds the caller waited, and how many of them for the previous background write."""
        start = time.perf_counter()
        self.wait()
        previous = time.perf_counter() - start
        # Every rank takes every state dict: one may be a collective (the sharded optimizer gathers its state).
        sharded = DCP_KEYS if self.storage.sharded else {}
        snapshot = {name: state.state_dict() for name, state in self.states.items() if name not in sharded}
        if self.env.is_main:
            for files in self.beside:  # beside the checkpoints, not in one: written now, in either mode
                files.save(self.root)
        if self.background:
            self._pending = BackgroundSave(self, step, self._stager.stage(snapshot), self._shards)
            if wait:
                self.wait()
        else:
            self.last = save(self.root, step, functools.partial(self._write, snapshot, step), self.env, self.keep)
        return time.perf_counter() - start, previous

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

    def begin(self, start: rundir.Start, ahead: ReadAhead | None = None) -> Stateful:
        """Start the run as ``start`` says: restore its checkpoint (the files ``ahead`` read, if given), or none; say
        how it started in one line (a resume, or a fresh start under ``resume=auto`` or a torchrun restart) and
        record it in ``starts.jsonl`` (rank 0). Returns the ``train`` state
        (:class:`trainer.checkpoint.states.TrainState`): the run's position."""
        startup.mark("build")
        step = self.restore(start.resume, start.headline(), ahead) if start.resume else 0
        if start.resume and self.env.device.type == "cuda":
            torch.cuda.empty_cache()  # the loaded copies' blocks: the training's reserved memory as a fresh start's
        startup.mark("checkpoint_read")
        if self.env.is_main:
            if start.resume is None and (line := start.fresh_line(self.root.parent)):
                console.info(line)
            rundir.record_start(self.root.parent, start, step, self.resumed, self.env.world_size)
        return self.states["train"]

    def restore(
        self, spec: str, headline: str = "resumed from {path} at step {step}", ahead: ReadAhead | None = None
    ) -> int:
        """Load ``resume=spec`` (``last`` or a path) into the states; returns its step. ``headline``: the line rank 0
        says first, a template of ``{path}`` and ``{step}``. ``ahead``: its files, read ahead of this call.

        Raises:
            CheckpointError: a checkpoint that is missing, unreadable, or does not fit this run's config or states.
        """
        assert ahead is None or ahead.spec == spec, (ahead.spec, spec)
        if ahead is not None:
            path, saved = ahead.result()
        else:
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
