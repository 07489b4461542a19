"""SGD with momentum over flat buffers: the ``trainer::sgd_step`` op (``optimizers.TritonSGD`` uses it).

Follows ``torch.optim.SGD`` exactly: weight decay is the L2 penalty added to the gradient (as
torch's SGD does), the momentum buffer starts as a copy of the first gradient (no dampening on the
first step), and Nesterov adds ``momentum * buf`` to the gradient. As for AdamW, one step is a
one-program coefficient kernel (step counter, clip coefficient, "is this the first step") and one
streaming kernel: 16 bytes per fp32 parameter with momentum (read p, g, buf; write p, buf).
The first-step test reads the device step counter, so it needs no host sync either.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trainer.ops.utils import check_flat_args

BLOCK_SIZE = 2048
NUM_WARPS = 8
N_HPARAMS = 5  # float64: lr, momentum, dampening, weight_decay, max_grad_norm
N_COEFS = 6  # fp32: lr, momentum, 1-dampening, weight_decay, clip, first step (1.0 or 0.0)


@triton.jit
def _sgd_coefs_kernel(Step_ptr, Hparams_ptr, GradNorm_ptr, Coefs_ptr, HAS_CLIP: tl.constexpr):
    step = tl.load(Step_ptr) + 1.0
    tl.store(Step_ptr, step)
    tl.store(Coefs_ptr + 0, tl.load(Hparams_ptr + 0).to(tl.float32))
    tl.store(Coefs_ptr + 1, tl.load(Hparams_ptr + 1).to(tl.float32))
    tl.store(Coefs_ptr + 2, (1.0 - tl.load(Hparams_ptr + 2)).to(tl.float32))
    tl.store(Coefs_ptr + 3, tl.load(Hparams_ptr + 3).to(tl.float32))
    tl.store(Coefs_ptr + 5, tl.where(step == 1.0, 1.0, 0.0))
    if HAS_CLIP:
        max_norm = tl.load(Hparams_ptr + 4).to(tl.float32)
        clip = max_norm / (tl.load(GradNorm_ptr) + 1e-6)
        tl.store(Coefs_ptr + 4, tl.where(clip > 1.0, 1.0, clip))


@triton.jit
def sgd_update_block(
    params,
    g,
    momentum_buffer,
    mask,
    Coefs_ptr,
    HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    HAS_CLIP: tl.constexpr,
):
    """One SGD update of a block in place (``params``, ``momentum_buffer``: blocks of pointers; ``g``: the fp32
    gradient), with this step's coefficients from :func:`_sgd_coefs_kernel`. The flat kernel and the address-table
    kernel (grad_table.py) both call it."""
    lr = tl.load(Coefs_ptr + 0)
    weight_decay = tl.load(Coefs_ptr + 3)
    p = tl.load(params, mask=mask, other=0.0).to(tl.float32)
    if HAS_CLIP:
        g = g * tl.load(Coefs_ptr + 4)
    # torch skips the add when weight_decay == 0, which keeps g exact where p is inf.
    g = tl.where(weight_decay != 0.0, g + weight_decay * p, g)
    if HAS_MOMENTUM:
        momentum = tl.load(Coefs_ptr + 1)
        one_minus_dampening = tl.load(Coefs_ptr + 2)
        first = tl.load(Coefs_ptr + 5)
        buf = tl.load(momentum_buffer, mask=mask, other=0.0)
        # First step: buf = grad.clone(); then buf.mul_(momentum).add_(grad, alpha=1 - dampening).
        buf = tl.where(first != 0.0, g, buf * momentum + one_minus_dampening * g)
        tl.store(momentum_buffer, buf, mask=mask)
        if NESTEROV:
            g = g + momentum * buf
        else:
            g = buf
    p = p - lr * g
    tl.store(params, p.to(params.dtype.element_ty), mask=mask)


@triton.jit
def _sgd_kernel(
    Param_ptr,
    Grad_ptr,
    MomentumBuffer_ptr,
    Coefs_ptr,
    n_elements,
    HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    g = tl.load(Grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    sgd_update_block(
        Param_ptr + offsets, g, MomentumBuffer_ptr + offsets, mask, Coefs_ptr, HAS_MOMENTUM, NESTEROV, HAS_CLIP
    )


def launch_sgd(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    step: torch.Tensor,
    hparams: torch.Tensor,
    grad_norm: torch.Tensor | None,
    nesterov: bool,
    *,
    block_size: int = BLOCK_SIZE,
    num_warps: int = NUM_WARPS,
) -> None:
    """Launch the two kernels of one SGD step; arguments as ``sgd_step``."""
    coefs = torch.empty(N_COEFS, dtype=torch.float32, device=param.device)
    has_clip = grad_norm is not None
    has_momentum = momentum_buffer is not None
    _sgd_coefs_kernel[(1,)](step, hparams, grad_norm if has_clip else step, coefs, HAS_CLIP=has_clip, num_warps=1)
    n = param.numel()
    _sgd_kernel[(triton.cdiv(n, block_size),)](
        param,
        grad,
        momentum_buffer if has_momentum else param,
        coefs,
        n,
        HAS_MOMENTUM=has_momentum,
        NESTEROV=nesterov,
        HAS_CLIP=has_clip,
        BLOCK_SIZE=block_size,
        num_warps=num_warps,
    )


@torch.library.custom_op("trainer::sgd_step", mutates_args=("param", "momentum_buffer", "step"))
def sgd_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    step: torch.Tensor,
    hparams: torch.Tensor,
    grad_norm: torch.Tensor | None,
    nesterov: bool,
) -> None:
    """One SGD step over flat buffers, in place.

    Args:
        param: Parameters (fp32 or bf16), contiguous; updated in place.
        grad: Gradients, same dtype and numel as ``param``; not modified.
        momentum_buffer: fp32 momentum buffer updated in place, or ``None`` for plain SGD.
        step: One-element fp32 step counter on the device, incremented in place (step 1 seeds the buffer).
        hparams: float64 ``[lr, momentum, dampening, weight_decay, max_grad_norm]`` on the device.
        grad_norm: Global gradient norm (fp32 scalar on the device) to clip with, or ``None``.
        nesterov: Nesterov momentum.
    """
    states = [momentum_buffer] if momentum_buffer is not None else []
    check_flat_args(param, grad, states, step, hparams, N_HPARAMS)
    launch_sgd(param, grad, momentum_buffer, step, hparams, grad_norm, nesterov)


@sgd_step.register_fake
def _(param, grad, momentum_buffer, step, hparams, grad_norm, nesterov) -> None:
    return None
