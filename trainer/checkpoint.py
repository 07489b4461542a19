"""Checkpoints: atomic, keep-N, a ``last`` pointer, and loading that never runs code.

Layout of ``<run.dir>/checkpoints/``::

    step_000040/            one complete checkpoint
      model.pt              the model's state dict (tensors only)
      optim.pt              optimizer + LR scheduler (+ grad scaler) state (tensors and plain containers)
      rng_rank<R>.pt        each rank's RNG states (Python, NumPy, torch CPU, CUDA)
      meta.json             step, tokens seen, sampler position, the resolved config
    last                    a text file naming the newest complete checkpoint

A checkpoint is written into a temporary directory, each file fsynced, then renamed into
place; ``last`` moves (write + fsync + rename) only after that, and old checkpoints are
pruned only after ``last`` moved. A crash at any moment leaves ``last`` naming a complete
checkpoint; a write that fails (a full disk) on any rank stops every rank with one error naming
the file, the partial checkpoint removed and ``last`` unchanged. Files load with
``torch.load(weights_only=True)``: a pickled object that would run code is refused.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import random
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer import console
from trainer.distributed.env import every_rank
from trainer.io import atomic_write_text
from trainer.step import TrainingError

META = "meta.json"
LAST = "last"
DCP_DIR = "dcp"
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


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, truncated, corrupt, unsafe or incompatible (exit 2)."""


class CheckpointWriteError(TrainingError):
    """A checkpoint could not be written (a full disk, a lost permission): the run stops, ``last`` unchanged."""


_KILL_POINTS = ("checkpoint_write", "after_checkpoint", "kill")


def fault_point(point: str, step: int, rank: int = 0) -> bool:
    """Fault injection for tests: ``TRAINER_FAULT=<point>:<step>[@<rank>][#<restart>]`` fires at ``point`` of step
    ``step`` (on every rank without ``@<rank>``; with ``#<restart>``, only in that start of a torchrun job,
    ``TORCHELASTIC_RESTART_COUNT``, 0 for the first: a fault that torchrun's restart does not meet again).

    Points: ``checkpoint_write`` (between two files of a checkpoint), ``after_checkpoint`` and ``kill`` (a step
    launched) SIGKILL this process; ``sigterm`` (a step launched) sends SIGTERM to torchrun's launcher, which passes
    it to every rank, as a scheduler stopping the job does (outside torchrun, to this process); ``raise`` (a step
    launched) raises a RuntimeError; ``nan_loss`` (the step's loss, as read for the checks) and ``disk_full`` (this
    rank's last checkpoint file fails with ENOSPC) return True for the caller to act on. Returns False everywhere
    else.
    """
    spec = os.environ.get("TRAINER_FAULT")
    if not spec:
        return False
    name, _, where = spec.partition(":")
    where, _, at_restart = where.partition("#")
    at_step, _, at_rank = where.partition("@")
    if name != point or at_step != str(step) or (at_rank and at_rank != str(rank)):
        return False
    if at_restart and at_restart != os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"):
        return False
    if point in _KILL_POINTS:
        os.kill(os.getpid(), signal.SIGKILL)
    if point == "sigterm":
        os.kill(os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid(), signal.SIGTERM)
        return False
    if point == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step} (TRAINER_FAULT={spec})")
    return True


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_file(obj: Any, path: Path, disk_full: bool = False) -> None:
    if disk_full:  # fault injection (tests): the disk fills up during this file
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def rng_state(device: torch.device) -> dict:
    state = {
        "python": random.getstate(),
        "numpy": [x.tolist() if isinstance(x, np.ndarray) else x for x in np.random.get_state()],
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(_tuples(state["python"]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def save(
    ckpt_root: Path,
    *,
    step: int,
    model_state: dict,
    optim_state: dict,
    meta: dict,
    rng: dict,
    rank: int,
    is_main: bool,
    keep: int,
    barrier=lambda: None,
    gather=lambda x: [x],
    write_shards=None,
    write_main=None,
) -> Path:
    """Write one checkpoint atomically and move ``last`` to it.

    Every rank calls this; ``rank`` writes its RNG file, the main rank writes the rest and
    renames. ``barrier`` separates the phases when several ranks write; ``gather(x)`` returns every rank's
    ``x`` (a collective), so that a write failing on one rank stops all. ``write_shards(dir)``,
    when given, is called on every rank to write sharded state (DCP) under ``dir/dcp``; then
    ``model_state`` is None and no ``model.pt`` is written. ``write_main()``, when given, runs on the main rank
    with its writes (the compile cache beside the checkpoints).

    Raises:
        CheckpointWriteError: on every rank, when a rank could not write (a full disk): it names the file, the
            partial checkpoint is removed, ``last`` still names the previous checkpoint.
    """
    name = checkpoint_name(step)
    final = ckpt_root / name
    tmp = ckpt_root / f".tmp-{name}"
    disk_full = fault_point("disk_full", step, rank)

    def make_tmp():
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)

    def write():
        _save_file(rng, tmp / f"rng_rank{rank}.pt", disk_full and not is_main)
        if write_shards is not None:
            write_shards(tmp / DCP_DIR)
        if is_main:
            if write_main is not None:
                write_main()
            if model_state is not None:
                _save_file(model_state, tmp / "model.pt")
            fault_point("checkpoint_write", step)  # between two files: the checkpoint is incomplete
            _save_file(optim_state, tmp / "optim.pt", disk_full)
            with open(tmp / META, "w") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())

    def publish():
        _fsync_dir(tmp)
        if final.exists():  # a re-save of the same step (e.g. a signal right after a periodic save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(ckpt_root)
        atomic_write_text(ckpt_root / LAST, name + "\n")
        _fsync_dir(ckpt_root)

    failed = _attempt(make_tmp, rank) if is_main else None
    barrier()
    failed = failed or _attempt(write, rank)
    _stop_if_failed(gather(failed), step, ckpt_root, tmp if is_main else None)
    _stop_if_failed(gather(_attempt(publish, rank) if is_main else None), step, ckpt_root, None)
    if is_main:
        _prune(ckpt_root, keep)
    barrier()
    fault_point("after_checkpoint", step)
    return final


def _attempt(fn, rank: int) -> tuple[str, int | None, int] | None:
    """Run ``fn``; a failure to write (OSError, DCP's CheckpointException) as ``(message, errno, rank)``, else
    None."""
    try:
        fn()
    except OSError as e:
        return str(e), e.errno, rank
    except BaseException as e:
        if type(e).__name__ != "CheckpointException":  # DCP's: every rank's failures, gathered
            raise
        return str(e), None, rank
    return None


def _stop_if_failed(failures: list, step: int, ckpt_root: Path, partial: Path | None) -> None:
    """Raise :class:`CheckpointWriteError` on every rank if any rank failed (``failures``: every rank's)."""
    failed = [f for f in failures if f]
    if not failed:
        return
    if partial is not None:
        shutil.rmtree(partial, ignore_errors=True)  # frees the space it took; ``last`` never named it
    message, code, rank = failed[0]
    message += f" (rank {rank})" if len(failures) > 1 else ""
    pointer = ckpt_root / LAST
    kept = (
        f"the last checkpoint is still {ckpt_root / pointer.read_text().strip()} (resume=last continues from it)"
        if pointer.is_file()
        else "no checkpoint was saved before this one"
    )
    fix = "Free disk space (or set run.dir on another disk)" if code == errno.ENOSPC else "Fix the cause"
    raise CheckpointWriteError(
        f"cannot save the checkpoint of step {step}: {message}. Stopped; {kept}. {fix}, then resume.",
        all_ranks=len(failures) > 1,
    )


def _prune(ckpt_root: Path, keep: int) -> None:
    done = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir() and (p / META).exists())
    current = (ckpt_root / LAST).read_text().strip()
    for old in done[:-keep]:
        if old.name != current:
            shutil.rmtree(old, ignore_errors=True)
    for stale in ckpt_root.glob(".tmp-step_*"):  # a save that a crash interrupted
        shutil.rmtree(stale, ignore_errors=True)


def resolve(spec: str, run_dir: Path) -> Path:
    """``last`` -> the checkpoint that ``<run_dir>/checkpoints/last`` names; otherwise a path.

    ``PATH`` may be a checkpoint directory, a run directory, or its ``checkpoints/`` directory.
    """
    if spec == "last":
        root = run_dir / "checkpoints"
        pointer = root / LAST
        if not pointer.exists():
            raise CheckpointError(f"resume=last: no complete checkpoint in {root} (no '{LAST}' file)")
        return root / pointer.read_text().strip()
    p = Path(spec)
    for candidate in (p / "checkpoints" / LAST, p / LAST):
        if candidate.is_file():
            return candidate.parent / candidate.read_text().strip()
    if not p.exists():
        raise CheckpointError(f"resume={spec}: no such checkpoint directory")
    return p


def _load_file(path: Path, device: torch.device) -> Any:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path}")
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # noqa: BLE001 - every failure to read is the same user error: a bad file
        reason = str(e).strip().splitlines()
        reason = next((line for line in reason if line.strip()), type(e).__name__)
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            reason = "it holds a pickled object that would run code on load; refusing to load it"
        raise CheckpointError(f"cannot load checkpoint file {path}: {reason[:300]}") from None


def load(path: Path, *, rank: int, device: torch.device) -> dict:
    """Read a checkpoint directory: ``{"model", "optim", "rng", "meta", "dcp"}``.

    A checkpoint written under FSDP has its model and optimizer state in ``dcp/`` (read with
    :func:`trainer.distributed.fsdp.load_dcp`): then ``model`` is None and ``dcp`` is that path.

    Raises:
        CheckpointError: naming the file and the problem.
    """
    if not path.is_dir():
        raise CheckpointError(f"not a checkpoint directory: {path}")
    meta_path = path / META
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"incomplete checkpoint {path}: {META} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"corrupt checkpoint file {meta_path}: {e}") from None
    rng_path = path / f"rng_rank{rank}.pt"
    sharded = (path / DCP_DIR).is_dir()
    return {
        "meta": meta,
        "dcp": path / DCP_DIR if sharded else None,  # model and optimizer state, sharded (DCP)
        "model": None if sharded else _load_file(path / "model.pt", device),
        "optim": _load_file(path / "optim.pt", device),
        "rng": _load_file(rng_path, torch.device("cpu")) if rng_path.exists() else None,
    }


def load_model_weights(path: Path, model: torch.nn.Module) -> dict:
    """Load checkpoint ``path``'s model weights into ``model`` (whole, unsharded, on the CPU) in this one process,
    without the optimizer state: ``model.pt``, or an fsdp run's DCP shards read whole (no process group needed).
    Returns the checkpoint's meta (``trainer export``).

    Raises:
        CheckpointError: a missing or incomplete checkpoint, or weights that do not fit ``model``.
    """
    if not path.is_dir():
        raise CheckpointError(f"not a checkpoint directory: {path}")
    try:
        meta = json.loads((path / META).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"incomplete checkpoint {path}: {META} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"corrupt checkpoint file {path / META}: {e}") from None
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
    """A run's checkpoints: the model, optimizer, schedule, grad scaler, sampler position and RNG, saved and restored.

    Args:
        run_dir: the run directory (checkpoints go to ``run_dir/checkpoints``).
        cfg: the run's config (saved with each checkpoint; a resume compares it with its own).
        env: the process environment (every rank writes its RNG state; under FSDP its shards).
        model: the unwrapped model; FSDP-sharded models are saved and loaded through DCP.
        opt, sched, scaler: the optimizer, the LR scheduler and the fp16 grad scaler (or None).
        batches: the sampler, whose position is the step.
    """

    def __init__(self, run_dir: Path, cfg, env, model, opt, sched, scaler, batches):
        self.root = run_dir / "checkpoints"
        self.cfg, self.env, self.model, self.opt, self.sched, self.scaler = cfg, env, model, opt, sched, scaler
        self.batches = batches
        self.last: Path | None = None  # the newest checkpoint this process wrote
        self.resumed: Path | None = None  # the checkpoint this run resumed from

    def save(self, step: int, tokens_seen: int) -> Path:
        """Write the checkpoint of ``step`` (every rank calls this) and move ``last`` to it."""
        from trainer.compile.graphed import plain_lrs
        from trainer.config import to_dict
        from trainer.distributed.fsdp import is_sharded, save_dcp

        env, sharded = self.env, is_sharded(self.model)
        optim_state = {"scheduler": self.sched.state_dict()}
        if not sharded:
            optim_state["optimizer"] = plain_lrs(self.opt.state_dict())  # a graphed step keeps lr in a tensor
        if self.scaler is not None:
            optim_state["scaler"] = self.scaler.state_dict()
        meta = {
            "step": step,
            "tokens_seen": tokens_seen,
            "sampler": self.batches.state_dict(next_step=step),
            "world_size": env.world_size,
            "config": to_dict(self.cfg),
        }
        write_main = None
        if self.cfg.compile.enabled or self.cfg.compile.autograd:
            from trainer.compile import cache

            write_main = functools.partial(cache.save_artifacts, self.root)
        self.last = save(
            self.root,
            step=step,
            model_state=None if sharded else self.model.state_dict(),
            optim_state=optim_state,
            meta=meta,
            rng=rng_state(env.device),
            rank=env.rank,
            is_main=env.is_main,
            keep=self.cfg.checkpoint.keep,
            barrier=torch.distributed.barrier if env.distributed else (lambda: None),
            gather=functools.partial(every_rank, env=env),
            write_main=write_main,
            write_shards=(lambda path: save_dcp(path, self.model, self.opt)) if sharded else None,
        )
        return self.last

    def begin(self, start) -> tuple[int, int]:
        """Start the run as ``start`` (a :class:`trainer.rundir.Start`) says: restore its checkpoint, or none; say
        how it started in one line (a resume, or a fresh start under ``resume=auto`` or a torchrun restart) and
        record it in ``starts.jsonl`` (rank 0). Returns ``(step, tokens_seen)``."""
        from trainer import rundir

        step, tokens = self.restore(start.resume, start.headline()) if start.resume else (0, 0)
        if self.env.is_main:
            if start.resume is None and (line := start.fresh_line(self.root.parent)):
                console.info(line)
            rundir.record_start(self.root.parent, start, step, self.resumed, self.env.world_size)
        return step, tokens

    def restore(self, spec: str, headline: str = "resumed from {path} at step {step}") -> tuple[int, int]:
        """Load ``resume=spec`` (``last`` or a path) into the run; returns ``(step, tokens_seen)``. ``headline``:
        the line rank 0 prints first, a template of ``{path}`` and ``{step}``.

        The schedule follows the current config (its lambdas are not in the checkpoint), so a changed ``optim.lr``
        or ``train.steps`` takes effect; unchanged, the learning rate continues exactly.
        """
        from trainer.config import to_dict
        from trainer.distributed.fsdp import is_sharded, load_dcp

        path = resolve(spec, self.root.parent)
        state = load(path, rank=self.env.rank, device=self.env.device)
        meta = state["meta"]
        changes = compare_configs(meta.get("config", {}), to_dict(self.cfg), path)
        if is_sharded(self.model) and state["dcp"] is None:
            raise CheckpointError(
                f"checkpoint {path} was written without fsdp (whole tensors in model.pt); resume "
                "it with distributed.strategy=ddp or none"
            )
        try:
            if state["dcp"] is not None:  # written under FSDP: resharded to this run's world size by DCP
                load_dcp(state["dcp"], self.model, self.opt)
            else:
                self.model.load_state_dict(state["model"])
                self.opt.load_state_dict(state["optim"]["optimizer"])
            self.sched.load_state_dict(state["optim"]["scheduler"])
            if self.scaler is not None and "scaler" in state["optim"]:
                self.scaler.load_state_dict(state["optim"]["scaler"])
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointError(f"checkpoint {path} does not fit this model/optimizer: {e}") from None
        lr = self.cfg.optim.lr
        self.sched.base_lrs = [lr for _ in self.sched.base_lrs]
        for group, lam in zip(self.opt.param_groups, self.sched.lr_lambdas):
            group["lr"] = lr * lam(self.sched.last_epoch)
        if state["rng"] is not None:
            set_rng_state(state["rng"], self.env.device)
        # The compile bundle is generated code: loaded only from this run's own directory.
        cached = (self.cfg.compile.enabled or self.cfg.compile.autograd) and self._load_compile_cache()
        self.resumed = path
        if self.env.is_main:
            console.info(headline.format(path=path, step=meta["step"]))
            if cached:
                console.info("loaded the compile cache saved with the checkpoints")
            for line in changes:
                if not line.startswith(("run.", "model.kwargs")):
                    console.info(f"  changed on resume: {line}")
        return int(meta["step"]), int(meta.get("tokens_seen", 0))

    def _load_compile_cache(self) -> bool:
        from trainer.compile import cache

        return cache.load_artifacts(self.root)
