"""What a checkpoint saves: the run's parts as Stateful objects.

Each value of the states dict a :class:`trainer.checkpoint.Checkpointer` is given has ``state_dict()`` and
``load_state_dict()`` (the ``torch.distributed.checkpoint.stateful.Stateful`` protocol). Where an object is
Stateful already but FSDP, the graphed step or the config change what its state dict must be, an adapter here
says how (the model, the optimizer, the LR schedule); small classes give the RNG, the data position and the step
counters a state of their own. :func:`run_states` builds a run's dict, in the order a resume loads it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from trainer.compile import cache
from trainer.compile.graphed import plain_lrs
from trainer.distributed.fsdp import is_sharded


@dataclass
class TrainState:
    """The run's position: optimizer steps taken and tokens trained on (a skipped step trains on none)."""

    step: int = 0
    tokens_seen: int = 0

    def advance(self, tokens: int) -> int:
        """One more step, on ``tokens`` tokens; returns the step count."""
        self.step += 1
        self.tokens_seen += tokens
        return self.step

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict.get("tokens_seen", 0))


class ModelState:
    """The model's weights.

    Args:
        model: the unwrapped model (FSDP-sharded or not).
        by_name: use DCP's state-dict API (``get_model_state_dict``/``set_model_state_dict``): under FSDP, this
            rank's shards as DTensors. Default: when the model is sharded. Otherwise ``model.state_dict()``,
            whole tensors. For a model that is not sharded the two give the same dict.
    """

    def __init__(self, model: nn.Module, *, by_name: bool | None = None):
        self.model = model
        self.by_name = is_sharded(model) if by_name is None else by_name

    def named(self) -> ModelState:
        """This state in the form a DCP checkpoint holds it (see ``by_name``)."""
        return self if self.by_name else ModelState(self.model, by_name=True)

    def state_dict(self) -> dict[str, Any]:
        if not self.by_name:
            return self.model.state_dict()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {k: _plain(v) for k, v in get_model_state_dict(self.model).items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self.by_name:
            self.model.load_state_dict(state_dict)
            return
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state_dict)


def _plain(t):
    """``t`` with a wrapper subclass around its (local) tensor replaced by the tensor it wraps.

    Float8 all-gather (``train.precision=fp8`` under fsdp) wraps each float8 layer's fp32 weight in torchao's
    ``WeightWithDynamicFloat8CastTensor``. DCP would pickle that class into the checkpoint, which ``torch.load``
    refuses to read back (``weights_only``) and a bf16 run or an export could not use: the checkpoint keeps the
    fp32 tensor inside it, as a bf16 run saves it. A wrapper whose one inner tensor has another shape or dtype is
    kept as it is. The inner tensor shares the wrapper's storage, so a load into it loads the parameter.
    """
    from torch.distributed.tensor import DTensor

    local = t._local_tensor if isinstance(t, DTensor) else t
    if not isinstance(local, torch.Tensor) or type(local) in (torch.Tensor, nn.Parameter):
        return t
    names = local.__tensor_flatten__()[0] if hasattr(local, "__tensor_flatten__") else []
    inner = getattr(local, names[0]) if len(names) == 1 else None
    if inner is None or inner.shape != local.shape or inner.dtype != local.dtype:
        return t
    if not isinstance(t, DTensor):
        return inner
    return DTensor.from_local(inner, t.device_mesh, t.placements, shape=t.shape, stride=t.stride(), run_check=False)


class OptimizerState:
    """The optimizer's state and hyperparameters.

    Args:
        model: the model whose parameters ``opt`` updates (names the parameters in the ``by_name`` form).
        opt: any of the run's optimizers; the sharded optimizer's ``state_dict()`` is a collective (every rank
            calls it) that returns the unsharded optimizer's.
        by_name: DCP's state-dict API (``get_optimizer_state_dict``/``set_optimizer_state_dict``): parameters by
            name, under FSDP this rank's shards as DTensors. Default: when the model is sharded. Otherwise
            ``opt.state_dict()`` (parameters by index), with its learning rates as floats: a graphed step keeps
            them in a device tensor, and a checkpoint must load into any run.
    """

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, *, by_name: bool | None = None):
        self.model, self.opt = model, opt
        self.by_name = is_sharded(model) if by_name is None else by_name

    def named(self) -> OptimizerState:
        """This state in the form a DCP checkpoint holds it (see ``by_name``)."""
        return self if self.by_name else OptimizerState(self.model, self.opt, by_name=True)

    def state_dict(self) -> dict[str, Any]:
        if not self.by_name:
            return plain_lrs(self.opt.state_dict())
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.opt)  # initialises an empty state: the target of a load

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self.by_name:
            self.opt.load_state_dict(state_dict)
            return
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.opt, state_dict)


class SchedulerState:
    """The LR schedule's position (a ``LambdaLR``).

    Its lambdas are not in a checkpoint: a load sets the learning rates from this run's config (``lr`` and the
    lambdas built from it), so a changed ``optim.lr`` or ``train.steps`` takes effect; unchanged, the learning
    rate continues exactly. Load it after the optimizer, whose learning rates it sets.
    """

    def __init__(self, sched: torch.optim.lr_scheduler.LambdaLR, lr: float):
        self.sched, self.lr = sched, lr

    def state_dict(self) -> dict[str, Any]:
        return self.sched.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sched = self.sched
        sched.load_state_dict(state_dict)
        sched.base_lrs = [self.lr for _ in sched.base_lrs]
        for group, lam in zip(sched.optimizer.param_groups, sched.lr_lambdas):
            group["lr"] = self.lr * lam(sched.last_epoch)


class SamplerState:
    """The data position. Batches are a pure function of ``(seed, step)`` (:class:`trainer.data.Batches`), so the
    position is the train state's step; the ranges of steps whose batches are passed over (``skip``: the config's
    ``train.skip_batches`` and the rollbacks') are restored, joined with this run's."""

    def __init__(self, batches, train: TrainState):
        self.batches, self.train = batches, train

    def state_dict(self) -> dict[str, Any]:
        return self.batches.state_dict(next_step=self.train.step)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from trainer.data import merge_ranges

        self.batches.skip = merge_ranges([*self.batches.skip, *state_dict.get("skip", [])])


class RNGState:
    """This process's random generators: Python's, NumPy's, torch's CPU generator and, on CUDA, ``device``'s."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        state = {
            "python": random.getstate(),
            "numpy": [x.tolist() if isinstance(x, np.ndarray) else x for x in np.random.get_state()],
            "torch": torch.get_rng_state(),
        }
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        random.setstate(_tuples(state_dict["python"]))
        np_state = state_dict["numpy"]
        np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
        torch.set_rng_state(state_dict["torch"])
        if self.device.type == "cuda" and "cuda" in state_dict:
            torch.cuda.set_rng_state(state_dict["cuda"], self.device)


def _tuples(x):
    """Lists back to the tuples ``random.setstate`` wants (a checkpoint keeps plain containers only)."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


class CompileCache:
    """The compile cache's bundle (:mod:`trainer.compile.cache`), kept beside the checkpoints, one for all of them:
    the main rank saves it with each checkpoint, and a resume hot-loads it before the first compile. It is
    generated code: loaded only from this run's own checkpoints directory."""

    def save(self, root: Path) -> None:
        cache.save_artifacts(root)

    def load(self, root: Path) -> str | None:
        """Load the bundle if there is one; the line to print when loaded."""
        return "loaded the compile cache saved with the checkpoints" if cache.load_artifacts(root) else None


def run_states(model: nn.Module, opt, sched, scaler, batches, *, lr: float, device: torch.device) -> dict[str, Any]:
    """A run's states by name, in the order a resume loads them (the schedule after the optimizer; the RNG last,
    after everything that might draw from it). ``states["train"]`` is a fresh :class:`TrainState`, the run's
    position, which the loop advances.

    Args:
        model: the unwrapped model; opt, sched: its optimizer and ``LambdaLR`` schedule; lr: ``optim.lr``.
        scaler: the fp16 grad scaler, or None (no ``scaler`` state).
        batches: the sampler (:class:`trainer.data.Batches`).
        device: this rank's device (its CUDA generator is saved).
    """
    train = TrainState()
    states = {
        "model": ModelState(model),
        "optimizer": OptimizerState(model, opt),
        "scheduler": SchedulerState(sched, lr),
        "scaler": scaler,  # torch.amp.GradScaler is Stateful
        "train": train,
        "sampler": SamplerState(batches, train),
        "rng": RNGState(device),
    }
    return {k: v for k, v in states.items() if v is not None}
