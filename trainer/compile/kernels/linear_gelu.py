"""``gelu_tanh(x @ W.T + b)`` whose backward computes the bias gradient inside the GELU backward kernel.

The MLP's first half in GPT-2: ``h = gelu(c_fc(x))``, (N, C) -> (N, 4C). Compiled by Inductor,
its backward runs two memory-bound kernels over the (N, 4C) pre-activation besides the matmuls:
``dpre = gelu'(pre) * dh`` (a pointwise kernel: reads dh and pre, writes dpre) and the bias
gradient ``db = dpre.sum(0)`` (a column reduction that reads both inputs again). For gpt2-small
(N = 16384, 4C = 3072, bf16) that second kernel is 0.40 ms of a 32 ms step on an H200 (12 layers,
``scripts/results/trace_breakdown_ddp_h200x2.txt``). Here one Triton kernel reads ``dh`` and
``pre`` once, writes ``dpre`` and per-program column sums of it (a (G, 4C) fp32 array, G <= 64,
summed by one small reduction): the bias gradient costs no extra pass over the (N, 4C) tensors.

The rest is unchanged: the forward is ``torch.addmm`` (cuBLAS, bias in its epilogue) and
``F.gelu(approximate="tanh")`` (Inductor generates the same pointwise kernel as for the module
version), and the backward's two matmuls are ``torch.mm``. :func:`linear_gelu` casts its inputs
to the autocast dtype first, as autocast does for ``F.linear``, so the gradients reaching the
fp32 parameters are those autocast gives: the weight gradient is a matmul in the compute dtype,
the bias gradient sums ``dpre`` as rounded to the compute dtype, accumulating in fp32 (aten's
``sum`` of a bf16 tensor), rounded to the compute dtype.

The backward kernel is a ``torch.library`` custom op with a fake implementation, so the whole
function composes with ``torch.compile`` (Dynamo traces the autograd.Function; the op is opaque
to Inductor). It runs on CUDA, and on CPU under ``TRITON_INTERPRET=1`` (set before triton is
imported); other CPU tensors take the same math in PyTorch ops.

Not used by the built-in GPT: in a gpt2-small step on an H100 it measured no faster than Inductor's two
kernels (``scripts/results/notes_linear_gelu.md``). It stays as the experiment ``scripts/bench_linear_gelu.py``
measures; wire it into ``MLP.forward`` only once that benchmark shows it ahead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from trainer.compile.kernels.flat import triton_can_run

# Read inside the kernel: compiled Triton accepts globals only as constexpr (the interpreter takes any).
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_COEF = tl.constexpr(0.044715)
MAX_GROUPS = 64  # row groups: partial column sums per column, reduced after the kernel


@triton.jit
def _gelu_tanh_backward_bias_kernel(
    DOut,
    Pre,
    DPre,
    Partials,
    n_rows,
    n_cols,
    rows_per_group,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Program (g, j): rows [g * rows_per_group, (g + 1) * rows_per_group) of columns block j."""
    g = tl.program_id(0)
    j = tl.program_id(1)
    cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = g * rows_per_group
    row_end = tl.minimum(row_start + rows_per_group, n_rows)
    for r in range(row_start, row_end, BLOCK_M):
        rows = r + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < row_end) & col_ok[None, :]
        offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
        dout = tl.load(DOut + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(Pre + offs, mask=mask, other=0.0).to(tl.float32)
        # With t = tanh(u): (1 + t) / 2 = sigmoid(2u) = s and (1 - t^2) / 4 = s (1 - s), and with e = exp(-2u),
        # s = 1 / (1 + e) and 1 - s = e * s: one exp and one division, and neither tail cancels (1 + t near
        # t = -1 would). |u| <= 40 keeps e finite (e^80 < fp32 max) and saturates s.
        u = tl.minimum(tl.maximum(_SQRT_2_OVER_PI * (x + _COEF * x * x * x), -40.0), 40.0)
        e = tl.exp(-2.0 * u)
        s = 1.0 / (1.0 + e)
        one_minus_s = e * s
        dgelu = s + 2.0 * x * s * one_minus_s * _SQRT_2_OVER_PI * (1.0 + 3.0 * _COEF * x * x)
        dpre = (dout * dgelu).to(DPre.dtype.element_ty)
        tl.store(DPre + offs, dpre, mask=mask)
        acc += tl.sum(dpre.to(tl.float32), axis=0)  # the stored (rounded) values, summed in fp32
    tl.store(Partials + g * n_cols + cols, acc, mask=col_ok)


def _backward_torch(grad_out: Tensor, pre: Tensor) -> tuple[Tensor, Tensor]:
    dpre = torch.ops.aten.gelu_backward(grad_out, pre, approximate="tanh")
    return dpre, dpre.sum(0, dtype=torch.float32).to(pre.dtype)


@torch.library.custom_op("trainer::gelu_tanh_backward_bias", mutates_args=())
def gelu_tanh_backward_bias(grad_out: Tensor, pre: Tensor) -> tuple[Tensor, Tensor]:
    """``(dpre, dbias)`` for ``out = gelu_tanh(pre)``, ``pre = x @ W.T + b`` (2-D, row-major): ``dpre =
    grad_out * gelu_tanh'(pre)`` in ``pre``'s dtype and ``dbias = dpre.sum(0)`` (fp32 accumulation)."""
    if grad_out.dim() != 2 or grad_out.shape != pre.shape:
        raise ValueError(f"gelu_tanh_backward_bias: expected two equal 2-D shapes, got {grad_out.shape}, {pre.shape}")
    if not triton_can_run(pre.device, _gelu_tanh_backward_bias_kernel):
        return _backward_torch(grad_out, pre)
    grad_out, pre = grad_out.contiguous(), pre.contiguous()
    n_rows, n_cols = pre.shape
    block_m, block_n = 32, 128
    groups = max(1, min(MAX_GROUPS, triton.cdiv(n_rows, 4 * block_m)))
    rows_per_group = triton.cdiv(triton.cdiv(n_rows, groups), block_m) * block_m
    groups = triton.cdiv(n_rows, rows_per_group) if n_rows else 1
    dpre = torch.empty_like(pre)
    partials = torch.zeros(groups, n_cols, dtype=torch.float32, device=pre.device)
    if n_rows and n_cols:
        grid = (groups, triton.cdiv(n_cols, block_n))
        _gelu_tanh_backward_bias_kernel[grid](
            grad_out, pre, dpre, partials, n_rows, n_cols, rows_per_group, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=4,
        )  # fmt: skip
    return dpre, partials.sum(0).to(pre.dtype)


@gelu_tanh_backward_bias.register_fake
def _(grad_out: Tensor, pre: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(pre), pre.new_empty(pre.shape[-1])


class _LinearGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        pre = torch.addmm(bias, x, weight.t())
        ctx.save_for_backward(x, weight, pre)
        return F.gelu(pre, approximate="tanh")

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight, pre = ctx.saved_tensors
        dpre, dbias = gelu_tanh_backward_bias(grad_out.contiguous(), pre)
        return dpre @ weight, dpre.t() @ x, dbias


def linear_gelu(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``F.gelu(F.linear(x, weight, bias), approximate="tanh")`` with the bias gradient fused into the GELU backward.

    ``x``: (..., C); ``weight``: (H, C); ``bias``: (H,). Under autocast the three are cast to the
    autocast dtype first (as ``F.linear`` is cast); the result has that dtype.
    """
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    lead = x.shape[:-1]
    out = _LinearGelu.apply(x.reshape(-1, x.shape[-1]).to(dtype), weight.to(dtype), bias.to(dtype))
    return out.reshape(*lead, weight.shape[0])
