"""Adam/AdamW over flat buffers: ``trainer::adamw_step`` and the ``TritonAdamW`` / ``TritonAdam`` optimizers.

One step of one flat group is two launches:

1. ``_adamw_coefs_kernel`` (one program) increments the device step counter and turns the
   float64 hyperparameters into the fp32 scalars of this step: bias corrections from the device
   step (``beta ** step`` by repeated squaring in float64, so ``1 - beta2 ** step`` keeps its
   digits at small steps), the decoupled decay factor and the clip coefficient from the
   on-device gradient norm. Nothing is read back to the host and nothing is specialised on a
   value, so a scheduler changing ``lr`` every step neither syncs nor recompiles.
2. ``_adamw_kernel`` streams the flat buffers once: reads param, grad, exp_avg, exp_avg_sq and
   writes param, exp_avg, exp_avg_sq (28 bytes per fp32 parameter, 22 per bf16 parameter with
   bf16 gradients), the memory-bandwidth floor of AdamW.

Precision: states are fp32 and all math is fp32 (bf16 parameters and gradients are widened after
loading). bf16 parameters are stored with round-to-nearest-even and there is no fp32 master copy:
an update smaller than half a bf16 ulp of the parameter is lost, as in torch's AdamW on bf16
parameters. The arithmetic follows ``torch.optim.adam._single_tensor_adam`` (non-capturable)
operation by operation, with IEEE division and square root, so fp32 results agree with torch to
about one ulp per step.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from trainer.compile.kernels.flat import FlatGroup, FlatOptimizer

BLOCK_SIZE = 2048
NUM_WARPS = 8
N_HPARAMS = 6  # float64: lr, beta1, beta2, eps, weight_decay, max_grad_norm
N_COEFS = 9  # fp32: step_size, sqrt(bias_correction2), 1-beta1, beta2, 1-beta2, eps, decay, weight_decay, clip


@triton.jit
def _adamw_coefs_kernel(Step_ptr, Hparams_ptr, GradNorm_ptr, Coefs_ptr, HAS_CLIP: tl.constexpr):
    step = tl.load(Step_ptr) + 1.0
    tl.store(Step_ptr, step)
    lr = tl.load(Hparams_ptr + 0)
    beta1 = tl.load(Hparams_ptr + 1)
    beta2 = tl.load(Hparams_ptr + 2)
    eps = tl.load(Hparams_ptr + 3)
    weight_decay = tl.load(Hparams_ptr + 4)
    # beta ** step in float64 by repeated squaring: exact to a few ulp with only multiplies, and
    # no dependence on float64 exp/log support in the backend.
    n = step.to(tl.int32)
    pow1 = beta1 * 0.0 + 1.0
    pow2 = beta2 * 0.0 + 1.0
    b1 = beta1
    b2 = beta2
    while n > 0:
        if n % 2 == 1:
            pow1 = pow1 * b1
            pow2 = pow2 * b2
        b1 = b1 * b1
        b2 = b2 * b2
        n = n // 2
    tl.store(Coefs_ptr + 0, (lr / (1.0 - pow1)).to(tl.float32))
    tl.store(Coefs_ptr + 1, tl.sqrt(1.0 - pow2).to(tl.float32))
    tl.store(Coefs_ptr + 2, (1.0 - beta1).to(tl.float32))
    tl.store(Coefs_ptr + 3, beta2.to(tl.float32))
    tl.store(Coefs_ptr + 4, (1.0 - beta2).to(tl.float32))
    tl.store(Coefs_ptr + 5, eps.to(tl.float32))
    tl.store(Coefs_ptr + 6, (1.0 - lr * weight_decay).to(tl.float32))
    tl.store(Coefs_ptr + 7, weight_decay.to(tl.float32))
    if HAS_CLIP:
        # torch.nn.utils.clip_grad_norm_: clamp(max_norm / (norm + 1e-6), max=1). A NaN norm gives
        # a NaN coefficient (the comparison is false), which poisons the update as torch's does.
        max_norm = tl.load(Hparams_ptr + 5).to(tl.float32)
        clip = max_norm / (tl.load(GradNorm_ptr) + 1e-6)
        tl.store(Coefs_ptr + 8, tl.where(clip > 1.0, 1.0, clip))


@triton.jit
def adamw_update_block(Param_ptr, ExpAvg_ptr, ExpAvgSq_ptr, offsets, mask, g, Coefs_ptr, DECOUPLED: tl.constexpr,
                       HAS_CLIP: tl.constexpr):  # fmt: skip
    """One Adam(W) update of a block of the flat param and state buffers, in place, with its gradient ``g``
    (fp32) and this step's coefficients (``_adamw_coefs_kernel``). Shared by the flat kernel and the
    address-table kernel (:mod:`trainer.compile.kernels.grad_table`)."""
    # Widen right after loading: bf16 arithmetic is wrong under TRITON_INTERPRET, and fp32 math
    # is what we want on the GPU anyway.
    p = tl.load(Param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(ExpAvg_ptr + offsets, mask=mask, other=0.0)
    v = tl.load(ExpAvgSq_ptr + offsets, mask=mask, other=0.0)
    step_size = tl.load(Coefs_ptr + 0)
    bias_correction2_sqrt = tl.load(Coefs_ptr + 1)
    one_minus_beta1 = tl.load(Coefs_ptr + 2)
    beta2 = tl.load(Coefs_ptr + 3)
    one_minus_beta2 = tl.load(Coefs_ptr + 4)
    eps = tl.load(Coefs_ptr + 5)
    if HAS_CLIP:
        g = g * tl.load(Coefs_ptr + 8)
    if DECOUPLED:
        p = p * tl.load(Coefs_ptr + 6)
    else:
        g = g + tl.load(Coefs_ptr + 7) * p
    # exp_avg.lerp_(grad, 1 - beta1), with torch's two formulas on either side of weight 0.5.
    m = tl.where(one_minus_beta1 < 0.5, m + one_minus_beta1 * (g - m), g - (g - m) * (1.0 - one_minus_beta1))
    # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    v = v * beta2 + one_minus_beta2 * g * g
    # denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps; param.addcdiv_(exp_avg, denom, value=-step_size)
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)
    tl.store(Param_ptr + offsets, p.to(Param_ptr.dtype.element_ty), mask=mask)
    tl.store(ExpAvg_ptr + offsets, m, mask=mask)
    tl.store(ExpAvgSq_ptr + offsets, v, mask=mask)


@triton.jit
def _adamw_kernel(
    Param_ptr,
    Grad_ptr,
    ExpAvg_ptr,
    ExpAvgSq_ptr,
    Coefs_ptr,
    n_elements,
    DECOUPLED: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    g = tl.load(Grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    adamw_update_block(Param_ptr, ExpAvg_ptr, ExpAvgSq_ptr, offsets, mask, g, Coefs_ptr, DECOUPLED, HAS_CLIP)


def adamw_coefs(step: torch.Tensor, hparams: torch.Tensor, grad_norm: torch.Tensor | None) -> torch.Tensor:
    """The update's per-step coefficients on the device (``_adamw_coefs_kernel``: step counted, lr, bias
    corrections, clip factor when ``grad_norm`` is given), for ``adamw_update_block``."""
    coefs = torch.empty(N_COEFS, dtype=torch.float32, device=step.device)
    has_clip = grad_norm is not None
    _adamw_coefs_kernel[(1,)](step, hparams, grad_norm if has_clip else step, coefs, HAS_CLIP=has_clip, num_warps=1)
    return coefs


def launch_adamw(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hparams: torch.Tensor,
    grad_norm: torch.Tensor | None,
    decoupled: bool,
    *,
    block_size: int = BLOCK_SIZE,
    num_warps: int = NUM_WARPS,
) -> None:
    """Launch the two kernels of one AdamW step (see the module docstring); arguments as ``adamw_step``."""
    coefs = adamw_coefs(step, hparams, grad_norm)
    n = param.numel()
    _adamw_kernel[(triton.cdiv(n, block_size),)](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        coefs,
        n,
        DECOUPLED=decoupled,
        HAS_CLIP=grad_norm is not None,
        BLOCK_SIZE=block_size,
        num_warps=num_warps,
    )


def _check_flat_args(param: torch.Tensor, grad: torch.Tensor, states: list[torch.Tensor], step, hparams, n_hparams):
    for name, t in [("param", param), ("grad", grad)] + [(f"state {i}", s) for i, s in enumerate(states)]:
        if t.device != param.device or not t.is_contiguous() or t.numel() != param.numel():
            raise ValueError(
                f"{name}: expected a contiguous tensor of {param.numel()} elements on {param.device}, "
                f"got {tuple(t.shape)} on {t.device} (contiguous={t.is_contiguous()})"
            )
    if grad.dtype != param.dtype or any(s.dtype != torch.float32 for s in states):
        raise ValueError(f"grad must have the param dtype ({param.dtype}) and states must be float32")
    if step.dtype != torch.float32 or step.numel() != 1 or step.device != param.device:
        raise ValueError("step must be a one-element float32 tensor on the param device")
    if hparams.dtype != torch.float64 or hparams.numel() != n_hparams or hparams.device != param.device:
        raise ValueError(f"hparams must be a float64 tensor of {n_hparams} elements on the param device")


@torch.library.custom_op("trainer::adamw_step", mutates_args=("param", "exp_avg", "exp_avg_sq", "step"))
def adamw_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hparams: torch.Tensor,
    grad_norm: torch.Tensor | None,
    decoupled: bool,
) -> None:
    """One Adam(W) step over flat buffers, in place.

    Args:
        param: Parameters (fp32 or bf16), contiguous; updated in place.
        grad: Gradients, same dtype and numel as ``param``. Not modified (clipping is applied on the fly).
        exp_avg: First moment, fp32, updated in place.
        exp_avg_sq: Second moment, fp32, updated in place.
        step: One-element fp32 step counter on the device; incremented in place before use.
        hparams: float64 ``[lr, beta1, beta2, eps, weight_decay, max_grad_norm]`` on the device.
        grad_norm: Global gradient norm (fp32 scalar on the device) to clip with, or ``None``.
        decoupled: AdamW's decoupled weight decay if true, Adam's L2 penalty if false.
    """
    _check_flat_args(param, grad, [exp_avg, exp_avg_sq], step, hparams, N_HPARAMS)
    launch_adamw(param, grad, exp_avg, exp_avg_sq, step, hparams, grad_norm, decoupled)


@adamw_step.register_fake
def _(param, grad, exp_avg, exp_avg_sq, step, hparams, grad_norm, decoupled) -> None:
    return None


class TritonAdamW(FlatOptimizer):
    """AdamW over flat buffers with our Triton kernels: one launch per flat group and step.

    A drop-in for ``torch.optim.AdamW`` on CUDA (state layout and checkpoints interchange with it),
    with optional global-norm gradient clipping fused into the step. See
    :mod:`trainer.compile.kernels.flat` for the flat-buffer semantics (a ``None`` gradient counts
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
        flat_grads: Gradients in a flat buffer too (default), or left where autograd puts them and read
            through a table of addresses (:mod:`trainer.compile.kernels.grad_table`): no ``grad += new``
            in the backward and no zeroing, for a single GPU without gradient accumulation.
        decoupled_weight_decay: AdamW (true) or Adam with an L2 penalty (false).

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
        flat_grads: bool = True,
    ):
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

    def _update(self, group, flat: FlatGroup, bufs, step, hparams, grad_norm) -> None:
        decoupled = bool(group.get("decoupled_weight_decay", self.defaults["decoupled_weight_decay"]))
        if not self.flat_grads:
            m, v = bufs["exp_avg"], bufs["exp_avg_sq"]
            flat.table.launch_adamw(flat.param, m, v, step, hparams, grad_norm, decoupled)
            return
        adamw_step(flat.param, flat.grad, bufs["exp_avg"], bufs["exp_avg_sq"], step, hparams, grad_norm, decoupled)

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
        flat_grads: bool = True,
    ):
        super().__init__(
            params, lr, betas, eps, weight_decay, max_grad_norm=max_grad_norm, decoupled_weight_decay=False,
            flat_grads=flat_grads,
        )  # fmt: skip
