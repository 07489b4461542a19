"""Residual add + RMSNorm in one Triton kernel each way: the Llama/Mistral/Qwen sibling of ``add_layer_norm``.

A pre-norm decoder block computes, twice per block, ``s = x + f(h)`` (the residual stream, fp32 under autocast,
plus a bf16 branch output) and ``h = RMSNorm(s)``. As for LayerNorm (see ``add_layer_norm``'s docstring for the
measured cost of what Inductor generates there), this op writes ``s`` once, saves it with the per-row 1/rms for
the backward, and does each direction in one pass over the rows:

- forward: read ``x`` and ``inc``, write ``s`` (x's dtype), ``y = s * rsqrt(mean(s^2) + eps) * w`` in the output
  dtype (chosen by the caller, so that a graph rewriter can keep the dtype of the code it replaces) and the fp32
  per-row ``1/rms``;
- backward: read ``dy``, ``s`` and the gradient already flowing into ``s`` from later layers, write
  ``ds + RMSNorm'(dy)`` in x's dtype and again in inc's (what the residual and the branch each receive), and per
  program column partial sums of ``dy * s / rms`` for the weight gradient, which a second small kernel finishes.

``rms_norm`` is the same op without ``inc`` (the first block's norm). Both are ``torch.library`` custom ops with
fake implementations, so they compose with ``torch.compile(fullgraph=True)``.

Numerics, in fp32 whatever the storage dtypes: ``s = (x.float() + inc.float()).to(x.dtype)``, and the norm reads
that rounded ``s``; ``y = (s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + eps) * w.float())``
rounded to the output dtype. That is ``F.rms_norm(s, (C,), w, eps)`` in fp32, and the Hugging Face Llama form
``w * (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)`` when ``h`` is fp32
(with bf16 ``h`` that form rounds to bf16 before the weight multiply: not this op).

Triton runs on CUDA tensors, and on CPU tensors when ``TRITON_INTERPRET=1`` was set before ``triton`` was first
imported; otherwise CPU tensors take the same math in PyTorch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from trainer.ops import warm
from trainer.ops.utils import autocast_dtype, interpreted, plan_programs, sum_parts, triton_can_run

__all__ = ["add_rms_norm", "rms_norm"]

_MAX_COLS = 16384  # one row per program tile; wider rows would spill registers


@triton.jit
def _add_rms_fwd_kernel(
    X,
    INC,
    W,
    S,
    Y,
    RSTD,
    n_rows,
    n_cols,
    eps,
    HAS_INC: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """Rows ``[pid * BLOCK_ROWS, +BLOCK_ROWS)``: s = x + inc (stored in S's dtype when HAS_INC),
    y = s * rstd * w, rstd = 1 / sqrt(mean(s^2) + eps) per row."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    s = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_INC:
        s += tl.load(INC + offs, mask=mask, other=0.0).to(tl.float32)
        s_store = s.to(S.dtype.element_ty)
        tl.store(S + offs, s_store, mask=mask)
        s = s_store.to(tl.float32)  # the norm reads the rounded sum, as the module after the add reads s
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / n_cols + eps)  # masked columns are 0: they add nothing
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = s * rstd[:, None] * w[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _add_rms_bwd_kernel(
    DY,
    DS,
    S,
    W,
    RSTD,
    DX,
    DINC,
    PARTS,
    n_rows,
    n_cols,
    rows_per_program,
    HAS_DS: tl.constexpr,
    HAS_DINC: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """Program ``pid`` takes rows ``[pid * rows_per_program, +rows_per_program)``, BLOCK_ROWS at a time:
    dx = ds + rstd * (w*dy - xhat * mean(w*dy*xhat)) with xhat = s * rstd, into DX (and DINC), and the
    column sums of dy * xhat into row ``pid`` of PARTS, a (programs, n_cols) fp32 array."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_COLS)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_COLS], tl.float32)
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, n_rows)
    for first in range(start, end, BLOCK_ROWS):
        rows = first + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < end
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        s = tl.load(S + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        xhat = s * rstd[:, None]  # 0 where masked: s loads as 0
        wdy = w[None, :] * dy
        c = tl.sum(xhat * wdy, axis=1) / n_cols
        dx = (wdy - xhat * c[:, None]) * rstd[:, None]
        if HAS_DS:
            dx += tl.load(DS + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_DINC:
            tl.store(DINC + offs, dx.to(DINC.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
    tl.store(PARTS + pid * n_cols + cols, dw, mask=col_ok)


_INTERPRETED = interpreted(_add_rms_fwd_kernel)


def _use_triton(device: torch.device) -> bool:
    """Whether the Triton kernels can run on tensors of ``device`` in this process."""
    return triton_can_run(device, _add_rms_fwd_kernel)


# Elements per tile (rows x padded columns) of each kernel on the GPU, and elements per warp: add_layer_norm's
# settings, which read the same bytes per element and one reduction less; not swept for this op yet. The
# interpreter takes 64K-element tiles (it pays per program, not per element).
TILE = {"fwd": 4096, "bwd": 4096}
INTERPRETER_TILE = 65536
ELEMENTS_PER_WARP = {"fwd": 1024, "bwd": 1024}
PROGRAMS_PER_SM = 2  # backward programs, each summing its rows' weight gradients


def _block_rows(n_cols: int, kernel: str) -> int:
    tile = INTERPRETER_TILE if _INTERPRETED else TILE[kernel]
    return max(1, tile // triton.next_power_of_2(n_cols))


def _num_warps(block_rows: int, block_cols: int, kernel: str) -> int:
    return min(16, max(1, block_rows * block_cols // ELEMENTS_PER_WARP[kernel]))


# ---- forward ------------------------------------------------------------------------------------


def _forward_torch(x, inc, weight, eps, out_dtype):
    s = (x.float() + inc.float()).to(x.dtype) if inc is not None else x
    sf = s.float()
    rstd = torch.rsqrt(sf.pow(2).mean(-1) + eps)
    y = sf * rstd[:, None] * weight.float()
    return (s if inc is not None else x.new_empty(0)), y.to(out_dtype), rstd


@torch.library.custom_op("trainer::add_rms_norm", mutates_args=())
def _fwd_op(
    x: Tensor, inc: Tensor | None, weight: Tensor, eps: float, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """``(s, y, rstd)`` over the rows of 2-D ``x``: ``s = x + inc`` in x's dtype (empty without ``inc``),
    ``y = RMSNorm(s) * weight`` in ``out_dtype``, the fp32 per-row ``1/rms``."""
    warm.finish()
    n_rows, n_cols = x.shape
    if not _use_triton(x.device):
        return _forward_torch(x, inc, weight, eps, out_dtype)
    s = torch.empty_like(x) if inc is not None else x.new_empty(0)
    y = x.new_empty((n_rows, n_cols), dtype=out_dtype)
    rstd = x.new_empty(n_rows, dtype=torch.float32)
    if n_rows:
        block_cols = triton.next_power_of_2(n_cols)
        block_rows = _block_rows(n_cols, "fwd")
        _add_rms_fwd_kernel[(triton.cdiv(n_rows, block_rows),)](
            x,
            inc if inc is not None else x,
            weight,
            s,
            y,
            rstd,
            n_rows,
            n_cols,
            eps,
            HAS_INC=inc is not None,
            BLOCK_ROWS=block_rows,
            BLOCK_COLS=block_cols,
            num_warps=_num_warps(block_rows, block_cols, "fwd"),
        )
    return s, y, rstd


@_fwd_op.register_fake
def _(x, inc, weight, eps, out_dtype):
    warm.record(__name__, "add_rms_norm", (x, inc, weight, eps, out_dtype))
    s = torch.empty_like(x) if inc is not None else x.new_empty(0)
    return s, x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape[0], dtype=torch.float32)


# ---- backward -----------------------------------------------------------------------------------


def _backward_torch(dy, ds, s, weight, rstd, inc_dtype):
    xhat = s.float() * rstd[:, None]
    dyf = dy.float()
    wdy = dyf * weight.float()
    dx = (wdy - xhat * (xhat * wdy).mean(dim=1, keepdim=True)) * rstd[:, None]
    if ds is not None:
        dx = dx + ds.float()
    dinc = dx.to(inc_dtype, copy=True) if inc_dtype is not None else s.new_empty(0)  # outputs may not alias
    return dx.to(s.dtype), dinc, (dyf * xhat).sum(0).to(weight.dtype)


@torch.library.custom_op("trainer::add_rms_norm_backward", mutates_args=())
def _bwd_op(
    dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor, rstd: Tensor, inc_dtype: torch.dtype | None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dinc, dweight)``: ``dx = ds + d(y . dy)/ds`` in s's dtype, the same in ``inc_dtype`` (empty when
    None) and the weight gradient in the weight's dtype."""
    warm.finish()
    if not _use_triton(s.device):
        return _backward_torch(dy, ds, s, weight, rstd, inc_dtype)
    n_rows, n_cols = s.shape
    dx = torch.empty_like(s)
    dinc = s.new_empty(s.shape, dtype=inc_dtype) if inc_dtype is not None else s.new_empty(0)
    block_cols = triton.next_power_of_2(n_cols)
    block_rows = _block_rows(n_cols, "bwd")
    programs, rows_per_program = plan_programs(n_rows, block_rows, PROGRAMS_PER_SM, s.device, _INTERPRETED)
    parts = (s.new_empty if n_rows else s.new_zeros)((programs, n_cols), dtype=torch.float32)
    if n_rows:
        _add_rms_bwd_kernel[(programs,)](
            dy,
            ds if ds is not None else dy,
            s,
            weight,
            rstd,
            dx,
            dinc,
            parts,
            n_rows,
            n_cols,
            rows_per_program,
            HAS_DS=ds is not None,
            HAS_DINC=inc_dtype is not None,
            BLOCK_ROWS=block_rows,
            BLOCK_COLS=block_cols,
            num_warps=_num_warps(block_rows, block_cols, "bwd"),
        )
    dw = weight.new_empty(n_cols)
    sum_parts(parts[None], [dw])
    return dx, dinc, dw


@_bwd_op.register_fake
def _(dy, ds, s, weight, rstd, inc_dtype):
    warm.record(__name__, "add_rms_norm_backward", (dy, ds, s, weight, rstd, inc_dtype))
    dinc = s.new_empty(s.shape, dtype=inc_dtype) if inc_dtype is not None else s.new_empty(0)
    return torch.empty_like(s), dinc, weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, inc, weight, _eps, _out_dtype = inputs
    s, _y, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(s if inc is not None else x, weight, rstd)
    ctx.inc_dtype = inc.dtype if inc is not None else None  # None: no inc


def _backward(ctx, ds, dy, _drstd):
    s, weight, rstd = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(s)
    has_inc = ctx.inc_dtype is not None
    if not has_inc:
        ds = None  # s is an empty placeholder without inc: nothing flows into it
    # The kernel reads rows at a stride of the width; an incoming gradient can be any view (e.g. an expanded
    # scalar from a .sum() loss).
    dy = dy.contiguous()
    ds = ds.contiguous() if ds is not None else None
    dx, dinc, dw = _bwd_op(dy, ds, s, weight, rstd, ctx.inc_dtype)
    return dx, (dinc if has_inc else None), dw, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ---- public functions ---------------------------------------------------------------------------


def _check(x: Tensor, weight: Tensor) -> None:
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"expected a weight of shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if not 0 < x.shape[-1] <= _MAX_COLS:
        raise ValueError(f"rows of 1 to {_MAX_COLS} elements are supported, got {x.shape[-1]}")


def add_rms_norm(
    x: Tensor, inc: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """Residual add and RMSNorm of the sum, over the last dim.

    Args:
        x: the residual stream (fp32 under autocast), any leading shape.
        inc: a branch output of x's shape and any float dtype (bf16 under autocast).
        weight: the norm's scale, shape ``(C,)`` for ``C = x.shape[-1] <= 16384``.
        eps: added to the mean square before the reciprocal square root.
        out_dtype: the dtype of ``y``; None: the autocast dtype under autocast (the input dtype of the matmul that
            reads it), else x's dtype.

    Returns:
        ``(s, y)``: ``s = (x.float() + inc.float()).to(x.dtype)`` and
        ``y = (s.float() * rsqrt(mean(s.float()^2) + eps) * weight.float()).to(out_dtype)``. Gradients come back
        in each input's dtype.

    Raises:
        ValueError: shapes that do not fit together, or rows wider than 16384.
    """
    if inc.shape != x.shape:
        raise ValueError(f"x and inc must have one shape, got {tuple(x.shape)} and {tuple(inc.shape)}")
    _check(x, weight)
    shape, out_dtype = x.shape, out_dtype if out_dtype is not None else autocast_dtype(x)
    x2, inc2 = x.reshape(-1, shape[-1]).contiguous(), inc.reshape(-1, shape[-1]).contiguous()  # (rows, C)
    s, y, _ = _fwd_op(x2, inc2, weight.contiguous(), eps, out_dtype)
    return s.view(shape), y.view(shape)  # (..., C)


def rms_norm(x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype | None = None) -> Tensor:
    """``(x.float() * rsqrt(mean(x.float()^2) + eps) * weight.float()).to(out_dtype)`` over the last dim: the
    ``add_rms_norm`` op without the add (arguments and errors as there)."""
    _check(x, weight)
    shape, out_dtype = x.shape, out_dtype if out_dtype is not None else autocast_dtype(x)
    _, y, _ = _fwd_op(x.reshape(-1, shape[-1]).contiguous(), None, weight.contiguous(), eps, out_dtype)
    return y.view(shape)  # (..., C)
