"""trainer's Triton optimizers: ``TritonAdamW``, ``TritonAdam`` and ``TritonSGD``, drop-ins for torch's on CUDA.

Each is a :class:`~trainer.optim.flat.FlatOptimizer` (parameters and states in flat buffers, checkpoints
that interchange with torch's optimizers) whose update is one launch per flat group of the ``trainer::adamw_step``
or ``trainer::sgd_step`` op, or of the address-table kernel (:mod:`~trainer.optim.grad_table`)::

    from trainer.optim.optimizers import TritonAdamW
    opt = TritonAdamW(model.parameters(), lr=3e-4, weight_decay=0.1, max_grad_norm=1.0, flat_grads=False)

On FSDP2's ``DTensor`` parameters (``fully_shard``) each rank updates its local shards in place, where FSDP keeps
them, with its states sized to them; the clipping norm is all-reduced over the shards (see
:mod:`~trainer.optim.flat`).
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.optim.adamw import _adamw_kernel, adamw_step
from trainer.optim.flat import FlatOptimizer
from trainer.optim.flat_group import FlatGroup
from trainer.optim.sgd import _sgd_kernel, sgd_step

__all__ = ["TritonAdam", "TritonAdamW", "TritonSGD"]


class TritonAdamW(FlatOptimizer):
    """AdamW over flat buffers with trainer's Triton kernels: one launch per flat group and step.

    A drop-in for ``torch.optim.AdamW`` on CUDA (state layout and checkpoints interchange with it),
    with optional global-norm gradient clipping fused into the step. See
    :mod:`trainer.optim.flat` for the flat-buffer semantics (a ``None`` gradient counts
    as zero) and this module's docstring for precision.

    Args:
        params: Parameters or param-group dicts, all on one CUDA device (CPU only under
            ``TRITON_INTERPRET=1``, for tests).
        lr: Learning rate.
        betas: Coefficients of the running averages of the gradient and its square.
        eps: Added to the denominator.
        weight_decay: Weight decay (decoupled for AdamW).
        max_grad_norm: Clip gradients to this global L2 norm inside the step; 0 disables. The
            pre-clip norm is left in ``last_grad_norm`` (a device tensor) for logging.
        flat_grads: Gradients in a flat buffer too (the default for plain tensors), or left where autograd puts
            them and read through a table of addresses (:mod:`trainer.optim.grad_table`): no
            ``grad += new`` in the backward and no zeroing, for a single GPU without gradient accumulation.
            FSDP2's ``DTensor`` parameters always take the table, parameters included (leave it unset).
        decoupled_weight_decay: AdamW (true) or Adam with an L2 penalty (false).
        stochastic_rounding: bf16 master weights (``optim.master_weights=bf16``): bf16 parameters keep bf16
            states, and the parameters and states are stored with stochastic rounding (see
            :mod:`trainer.optim.adamw`); parameters of other dtypes are updated as without it.

    Raises:
        ValueError: On invalid hyperparameters, or parameters on a device Triton cannot run on.
    """

    state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        max_grad_norm: float = 0.0,
        decoupled_weight_decay: bool = True,
        flat_grads: bool | None = None,
        stochastic_rounding: bool = False,
    ):
        self.stochastic_rounding = stochastic_rounding
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"Invalid betas: {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        # The same keys as torch.optim.AdamW's groups, so checkpoints load either way.
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=False,
            maximize=False,
            foreach=None,
            capturable=False,
            differentiable=False,
            fused=None,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults, max_grad_norm, flat_grads=flat_grads)

    def _kernel(self):
        return _adamw_kernel

    def _hparams(self, group: dict[str, Any]) -> tuple[float, ...]:
        beta1, beta2 = group["betas"]
        return (
            float(group["lr"]),
            float(beta1),
            float(beta2),
            float(group["eps"]),
            float(group["weight_decay"]),
            self.max_grad_norm,
        )

    def _state_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.bfloat16 if self.stochastic_rounding and dtype == torch.bfloat16 else torch.float32

    def _update(self, group, flat: FlatGroup, bufs, step, hparams, grad_norm) -> None:
        decoupled = bool(group.get("decoupled_weight_decay", self.defaults["decoupled_weight_decay"]))
        stochastic = self.stochastic_rounding and flat.dtype == torch.bfloat16
        m, v = bufs["exp_avg"], bufs["exp_avg_sq"]
        if not self.flat_grads:
            flat.table.launch_adamw(flat.param, m, v, step, hparams, grad_norm, decoupled, stochastic)
            return
        adamw_step(flat.param, flat.grad, m, v, step, hparams, grad_norm, decoupled, stochastic)

    def _check_group(self, group: dict[str, Any]) -> None:
        for key in ("amsgrad", "maximize"):
            if group.get(key):
                raise ValueError(f"{type(self).__name__} does not implement {key}=True (the checkpoint has it)")


class TritonAdam(TritonAdamW):
    """Adam (L2 weight decay added to the gradient) over flat buffers; see :class:`TritonAdamW`."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        max_grad_norm: float = 0.0,
        flat_grads: bool | None = None,
    ):
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            max_grad_norm=max_grad_norm,
            decoupled_weight_decay=False,
            flat_grads=flat_grads,
        )


class TritonSGD(FlatOptimizer):
    """SGD (momentum, Nesterov, L2 weight decay) over flat buffers with trainer's Triton kernels.

    A drop-in for ``torch.optim.SGD`` on CUDA whose state (``momentum_buffer``) and checkpoints
    interchange with it, plus optional fused global-norm clipping. The momentum buffer is fp32 for
    any parameter dtype. See :mod:`trainer.optim.flat` for the flat-buffer semantics.

    Args:
        params: Parameters or param-group dicts, all on one CUDA device (CPU only under
            ``TRITON_INTERPRET=1``).
        lr: Learning rate.
        momentum: Momentum factor (0 disables the buffer).
        dampening: Dampening for momentum.
        weight_decay: L2 penalty added to the gradient.
        nesterov: Nesterov momentum (needs momentum > 0 and dampening == 0).
        max_grad_norm: Clip gradients to this global L2 norm inside the step; 0 disables.
        flat_grads: As for :class:`TritonAdamW`.

    Raises:
        ValueError: On invalid hyperparameters, or parameters on a device Triton cannot run on.
    """

    state_keys = ("momentum_buffer",)
    state_has_step = False

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        max_grad_norm: float = 0.0,
        flat_grads: bool | None = None,
    ):
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not momentum >= 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        # The same keys as torch.optim.SGD's groups, so checkpoints load either way.
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=False,
            foreach=None,
            differentiable=False,
            fused=None,
        )
        super().__init__(params, defaults, max_grad_norm, flat_grads=flat_grads)

    def _kernel(self):
        return _sgd_kernel

    def _hparams(self, group: dict[str, Any]) -> tuple[float, ...]:
        return (
            float(group["lr"]),
            float(group["momentum"]),
            float(group["dampening"]),
            float(group["weight_decay"]),
            self.max_grad_norm,
        )

    def _update(self, group, flat: FlatGroup, bufs, step, hparams, grad_norm) -> None:
        momentum_buffer = bufs["momentum_buffer"] if group["momentum"] != 0 else None
        if not self.flat_grads:
            flat.table.launch_sgd(flat.param, momentum_buffer, step, hparams, grad_norm, bool(group["nesterov"]))
            return
        sgd_step(flat.param, flat.grad, momentum_buffer, step, hparams, grad_norm, bool(group["nesterov"]))

    def _has_state(self, group: dict[str, Any], host_step: int) -> bool:
        return host_step > 0 and group["momentum"] != 0

    def _loaded_step(self, state: dict[str, Any]) -> float:
        # torch's SGD keeps no step; a saved momentum buffer means the seeding step is past.
        return 1.0 if state.get("momentum_buffer") is not None else 0.0

    def _check_group(self, group: dict[str, Any]) -> None:
        if group.get("maximize"):
            raise ValueError("TritonSGD does not implement maximize=True (the checkpoint has it)")
        if group.get("nesterov") and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
