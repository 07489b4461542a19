"""Adam/AdamW over flat buffers: the ``trainer::adamw_step`` op (``optimizers.TritonAdamW`` uses it).

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

Precision: all math is fp32 (bf16 parameters, gradients and states are widened after loading). States are
fp32, and bf16 parameters are stored with round-to-nearest-even and no fp32 master copy: an update smaller than
half a bf16 ulp of the parameter is lost, as in torch's AdamW on bf16 parameters. With ``stochastic`` (bf16
master weights, ``optim.master_weights=bf16``) the parameters and both states are bf16 and each is stored with
stochastic rounding: the fp32 result rounds up to the next bf16 with probability equal to the fraction of a bf16
ulp it lies above the one below, so every store is unbiased and small updates accumulate in expectation. The
random bits come from Philox seeded by the device step counter and indexed by the element's position: the same
step rounds the same way again (a resume is bitwise), and no state is kept. The arithmetic follows
``torch.optim.adam._single_tensor_adam`` (non-capturable) operation by operation, with IEEE division and square
root, so fp32 results agree with torch to about one ulp per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trainer.ops.utils import check_flat_args

BLOCK_SIZE = 2048
NUM_WARPS = 8
N_HPARAMS = 6  # float64: lr, beta1, beta2, eps, weight_decay, max_grad_norm
N_COEFS = 10  # fp32: step_size, sqrt(bias_correction2), 1-beta1, beta2, 1-beta2, eps, decay, weight_decay, clip, step


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
    tl.store(Coefs_ptr + 9, step.to(tl.float32))  # the stochastic rounding's seed
    if HAS_CLIP:
        # torch.nn.utils.clip_grad_norm_: clamp(max_norm / (norm + 1e-6), max=1). A NaN norm gives
        # a NaN coefficient (the comparison is false), which poisons the update as torch's does.
        max_norm = tl.load(Hparams_ptr + 5).to(tl.float32)
        clip = max_norm / (tl.load(GradNorm_ptr) + 1e-6)
        tl.store(Coefs_ptr + 8, tl.where(clip > 1.0, 1.0, clip))


@triton.jit
def round_bf16_stochastic(x, bits):
    """fp32 ``x`` to bf16, up with probability (x - the bf16 below) / ulp: ``bits``' low 16 random bits added to
    the 16 that bf16 drops, which are then cut (the sign is apart, so negatives round in magnitude the same way)."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + (bits & 0xFFFF)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True).to(tl.bfloat16)  # exact: the low 16 bits are zero


@triton.jit
def adamw_update_block(
    Param_ptr,
    ExpAvg_ptr,
    ExpAvgSq_ptr,
    offsets,
    mask,
    g,
    Coefs_ptr,
    DECOUPLED: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    positions,
):
    """One Adam(W) update of a block of the flat param and state buffers, in place, with its gradient ``g``
    (fp32) and this step's coefficients (``_adamw_coefs_kernel``). Shared by the flat kernel and the
    address-table kernel (:mod:`trainer.optim.grad_table`). ``STOCHASTIC``: the parameters and states are bf16,
    stored with stochastic rounding; ``positions``: the elements' distinct indices, for their random bits."""
    # Widen right after loading: bf16 arithmetic is wrong under TRITON_INTERPRET, and fp32 math
    # is what we want on the GPU anyway.
    p = tl.load(Param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(ExpAvg_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(ExpAvgSq_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
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
    if STOCHASTIC:
        seed = tl.load(Coefs_ptr + 9).to(tl.int32)
        r_p, r_m, r_v, _ = tl.randint4x(seed, positions)
        tl.store(Param_ptr + offsets, round_bf16_stochastic(p, r_p), mask=mask)
        tl.store(ExpAvg_ptr + offsets, round_bf16_stochastic(m, r_m), mask=mask)
        tl.store(ExpAvgSq_ptr + offsets, round_bf16_stochastic(v, r_v), mask=mask)
    else:
        tl.store(Param_ptr + offsets, p.to(Param_ptr.dtype.element_ty), mask=mask)
        tl.store(ExpAvg_ptr + offsets, m.to(ExpAvg_ptr.dtype.element_ty), mask=mask)
        tl.store(ExpAvgSq_ptr + offsets, v.to(ExpAvgSq_ptr.dtype.element_ty), mask=mask)


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
    STOCHASTIC: tl.constexpr = False,
):
    pid = tl.program_id(0)
    offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    g = tl.load(Grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    adamw_update_block(
        Param_ptr, ExpAvg_ptr, ExpAvgSq_ptr, offsets, mask, g, Coefs_ptr, DECOUPLED, HAS_CLIP, STOCHASTIC, offsets
    )


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
    stochastic: bool = False,
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
        STOCHASTIC=stochastic,
        num_warps=num_warps,
    )


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
    stochastic: bool = False,
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
        stochastic: bf16 parameters and states, stored with stochastic rounding (see the module docstring).
    """
    check_flat_args(param, grad, [exp_avg, exp_avg_sq], step, hparams, N_HPARAMS, states_like_param=stochastic)
    launch_adamw(param, grad, exp_avg, exp_avg_sq, step, hparams, grad_norm, decoupled, stochastic)


@adamw_step.register_fake
def _(param, grad, exp_avg, exp_avg_sq, step, hparams, grad_norm, decoupled, stochastic=False) -> None:
    return None
