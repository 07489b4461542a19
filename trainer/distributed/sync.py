"""How a step's gradients reach every rank: the :class:`GradSync` protocol the training step calls, one
implementation per strategy.

A step runs each micro-batch's backward inside ``sync.no_sync(skip)`` (``skip``: not the last micro-batch, whose
backward alone reduces), then ``sync.finish(norm)`` once. :func:`of` picks the implementation from the plan.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Protocol

import torch
import torch.nn as nn


class GradSync(Protocol):
    def no_sync(self, skip: bool) -> AbstractContextManager[None]:
        """The context a micro-batch's backward runs in; ``skip``: hold the reduction (a micro-batch before the
        last)."""

    def finish(self, norm: bool) -> torch.Tensor | None:
        """After the last backward: wait for the reductions. With ``norm``, the reduced gradients' global norm
        where the reduction computes it on the way (else None: the step computes it)."""

    def detach(self) -> None:
        """Unregister what the sync hooked into the parameters (before they are wrapped again)."""


class NoSync:
    """One process, or nothing to reduce."""

    def no_sync(self, skip: bool) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def finish(self, norm: bool) -> torch.Tensor | None:
        return None

    def detach(self) -> None:
        pass


class BucketSync:
    """ddp over the bucket plan (:class:`trainer.distributed.ddp.DataParallel`), its optimizer state sharded or
    not: all-reduces (or reduce-scatters) start bucket by bucket during the last micro-batch's backward."""

    def __init__(self, model: nn.Module):
        self.model = model

    def no_sync(self, skip: bool) -> AbstractContextManager[None]:
        return self.model.no_sync() if skip else contextlib.nullcontext()

    def finish(self, norm: bool) -> torch.Tensor | None:
        return self.model.finish_grad_sync(norm=norm)

    def detach(self) -> None:
        self.model.remove_hooks()


class FSDPSync:
    """FSDP2: its own hooks reduce-scatter each unit's gradients; the step only holds them back before the last
    micro-batch."""

    def __init__(self, model: nn.Module):
        self.model = model

    def no_sync(self, skip: bool) -> AbstractContextManager[None]:
        self.model.set_requires_gradient_sync(not skip)
        return contextlib.nullcontext()

    def finish(self, norm: bool) -> torch.Tensor | None:
        return None  # FSDP2 waits for its reduce-scatters itself, before the optimizer reads the gradients

    def detach(self) -> None:
        pass


def of(model: nn.Module, plan) -> GradSync:
    """The sync of ``model`` (what :func:`trainer.build.wrap` returned) under ``plan``'s strategy."""
    if plan.strategy.ddp:
        return BucketSync(model)
    if plan.strategy.fsdp:
        return FSDPSync(model)
    return NoSync()
