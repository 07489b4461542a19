"""Residual add + LayerNorm in one Triton kernel each way (substituted into captured graphs: compile.kernels).

A pre-LN transformer computes, twice per block, ``s = x + f(h)`` (the residual stream, fp32 under
autocast, plus a bf16 branch output) and ``h = LayerNorm(s)`` (cast to bf16 by the next matmul).
Inductor fuses that forward into one kernel, but its partitioner saves the normalised
``(s - mean) * rstd`` (fp32) for the backward and never writes ``s``: every LayerNorm kernel
re-adds the chain of bf16 branch outputs since the last saved sum, so each kernel of a block reads
more than the one before it. Its backward is two passes: a reduction kernel for the per-row sums and a
second kernel reading everything again (docs/performance.md, "Residual add + LayerNorm").

This op writes ``s`` once and saves it (plus the per-row mean and 1/std) in place of the
normalised tensor, the same bytes:

- forward, one pass per row: read ``x`` and ``inc``, write ``s`` (x's dtype), ``y = LN(s)`` in the
  output dtype (the autocast dtype under autocast: the cast the next matmul would do) and the
  row statistics;
- backward, one pass: read ``dy``, ``s`` and the gradient already flowing into ``s`` from later
  layers, write ``ds + LN'(dy)`` in x's dtype and again in inc's (what the residual and the branch
  each receive), and per program column partial sums for the weight and bias gradients, which a
  second small kernel finishes (one launch for all of them, where two torch ``sum(0)`` kernels a
  norm cost a launch each).

``inc_bias`` (optional) is the bias of the matmul that produced ``inc``, moved into this op: the
forward adds it in fp32 and the backward's partial sums include ``dx``'s column sums, which is its
gradient, so the separate reduction over the (tokens x width) gradient that the matmul's bias
would cost in the backward goes away (the GPT does it for the attention projection: 12 of the 24
such reductions).

``layer_norm`` is the same op without ``inc`` (the first block's norm). Both are ``torch.library``
custom ops with fake implementations, so they compose with ``torch.compile(fullgraph=True)``.
Numerics: the sum ``x + inc`` is rounded to x's dtype before the norm (as ``nn.LayerNorm`` reads it);
mean and variance are two-pass fp32 sums over the row, as torch's; outputs round to nearest.

Triton runs on CUDA tensors, and on CPU tensors when ``TRITON_INTERPRET=1`` was set before
``triton`` was first imported; otherwise CPU tensors take the same math in PyTorch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from trainer.ops import warm
from trainer.ops.utils import autocast_dtype, interpreted, plan_programs, sum_parts, triton_can_run

__all__ = ["add_layer_norm", "add_layer_norm_op", "layer_norm"]

_MAX_COLS = 16384  # one row per program tile; wider rows would spill registers


@triton.jit
def _add_ln_fwd_kernel(
    X,
    INC,
    IB,
    W,
    B,
    S,
    Y,
    MEAN,
    RSTD,
    n_rows,
    n_cols,
    eps,
    HAS_INC: tl.constexpr,
    HAS_INC_BIAS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """Rows ``[pid * BLOCK_ROWS, +BLOCK_ROWS)``: s = x + (inc + ib) (stored in S's dtype when HAS_INC),
    y = (s - mean) * rstd * w + b, mean and rstd per row."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    s = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_INC:
        inc = tl.load(INC + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_INC_BIAS:
            inc += tl.load(IB + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        s += inc
        s_store = s.to(S.dtype.element_ty)
        tl.store(S + offs, s_store, mask=mask)
        s = s_store.to(tl.float32)  # the norm reads the rounded sum, as nn.LayerNorm reads s
    mean = tl.sum(s, axis=1) / n_cols
    centered = tl.where(mask, s - mean[:, None], 0.0)
    var = tl.sum(centered * centered, axis=1) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = centered * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _add_ln_bwd_kernel(
    DY,
    DS,
    S,
    W,
    MEAN,
    RSTD,
    DX,
    DINC,
    PARTS,
    n_rows,
    n_cols,
    rows_per_program,
    HAS_DS: tl.constexpr,
    HAS_DINC: tl.constexpr,
    HAS_DIB: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """Program ``pid`` takes rows ``[pid * rows_per_program, +rows_per_program)``, BLOCK_ROWS at a time:
    dx = ds + rstd * (w*dy - mean(w*dy) - xhat * mean(w*dy*xhat)) into DX (and DINC), and its column
    sums of dy * xhat, dy (and dx, the inc bias's gradient, when HAS_DIB) into row ``pid`` of
    PARTS[0], PARTS[1] (and PARTS[2]), each a (programs, n_cols) fp32 array."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_COLS)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_COLS], tl.float32)
    db = tl.zeros([BLOCK_COLS], tl.float32)
    dib = tl.zeros([BLOCK_COLS], tl.float32)
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, n_rows)
    for first in range(start, end, BLOCK_ROWS):
        rows = first + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < end
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        s = tl.load(S + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        xhat = tl.where(mask, (s - mean[:, None]) * rstd[:, None], 0.0)
        wdy = w[None, :] * dy
        c1 = tl.sum(xhat * wdy, axis=1) / n_cols
        c2 = tl.sum(wdy, axis=1) / n_cols
        dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        if HAS_DS:
            dx += tl.load(DS + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_DINC:
            tl.store(DINC + offs, dx.to(DINC.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
        db += tl.sum(dy, axis=0)
        if HAS_DIB:
            dib += tl.sum(tl.where(mask, dx, 0.0), axis=0)
    part = PARTS + pid * n_cols + cols
    part_stride = tl.num_programs(0).to(tl.int64) * n_cols
    tl.store(part, dw, mask=col_ok)
    tl.store(part + part_stride, db, mask=col_ok)
    if HAS_DIB:
        tl.store(part + 2 * part_stride, dib, mask=col_ok)


_INTERPRETED = interpreted(_add_ln_fwd_kernel)


def _use_triton(device: torch.device) -> bool:
    """Whether the Triton kernel can run on tensors of ``device`` in this process."""
    return triton_can_run(device, _add_ln_fwd_kernel)


# Elements per tile (rows x padded columns) of each kernel on the GPU, and elements per warp; the interpreter
# takes 64K-element tiles (it pays per program, not per element). scripts/bench_layer_norm.py sweeps these: at
# gpt2-small's shape the forward is at its floor at every setting and the backward fastest at these; fewer
# elements a warp slows it (docs/performance.md).
TILE = {"fwd": 4096, "bwd": 4096}
ELEMENTS_PER_WARP = {"fwd": 1024, "bwd": 1024}
PROGRAMS_PER_SM = 2  # backward programs, each summing its rows' weight gradients


def _block_rows(n_cols: int, kernel: str) -> int:
    tile = 65536 if _INTERPRETED else TILE[kernel]
    return max(1, tile // triton.next_power_of_2(n_cols))


def _num_warps(block_rows: int, block_cols: int, kernel: str) -> int:
    return min(16, max(1, block_rows * block_cols // ELEMENTS_PER_WARP[kernel]))


# ---- forward ------------------------------------------------------------------------------------


def _forward_torch(x, inc, inc_bias, weight, bias, eps, out_dtype):
    if inc is not None:
        inc = inc.float() if inc_bias is None else inc.float() + inc_bias.float()
        s = (x.float() + inc).to(x.dtype)
    else:
        s = x
    sf = s.float()
    var, mean = torch.var_mean(sf, dim=-1, correction=0)
    rstd = torch.rsqrt(var + eps)
    y = (sf - mean[:, None]) * rstd[:, None] * weight.float()
    if bias is not None:
        y = y + bias.float()
    return (s if inc is not None else x.new_empty(0)), y.to(out_dtype), mean, rstd


@torch.library.custom_op("trainer::add_layer_norm", mutates_args=())
def _fwd_op(
    x: Tensor,
    inc: Tensor | None,
    inc_bias: Tensor | None,
    weight: Tensor,
    bias: Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(s, y, mean, rstd)`` over the rows of 2-D ``x``: ``s = x + (inc + inc_bias)`` (empty without
    ``inc``), ``y = LayerNorm(s)`` in ``out_dtype``, fp32 row statistics."""
    warm.finish()
    if inc_bias is not None and inc is None:
        raise ValueError("add_layer_norm: inc_bias without inc")
    n_rows, n_cols = x.shape
    if not _use_triton(x.device):
        return _forward_torch(x, inc, inc_bias, weight, bias, eps, out_dtype)
    s = torch.empty_like(x) if inc is not None else x.new_empty(0)
    y = x.new_empty((n_rows, n_cols), dtype=out_dtype)
    mean = x.new_empty(n_rows, dtype=torch.float32)
    rstd = x.new_empty(n_rows, dtype=torch.float32)
    if n_rows:
        block_cols = triton.next_power_of_2(n_cols)
        block_rows = _block_rows(n_cols, "fwd")
        _add_ln_fwd_kernel[(triton.cdiv(n_rows, block_rows),)](
            x,
            inc if inc is not None else x,
            inc_bias if inc_bias is not None else weight,
            weight,
            bias if bias is not None else weight,
            s,
            y,
            mean,
            rstd,
            n_rows,
            n_cols,
            eps,
            HAS_INC=inc is not None,
            HAS_INC_BIAS=inc_bias is not None,
            HAS_BIAS=bias is not None,
            BLOCK_ROWS=block_rows,
            BLOCK_COLS=block_cols,
            num_warps=_num_warps(block_rows, block_cols, "fwd"),
        )
    return s, y, mean, rstd


@_fwd_op.register_fake
def _(x, inc, inc_bias, weight, bias, eps, out_dtype):
    warm.record(__name__, "add_layer_norm", (x, inc, inc_bias, weight, bias, eps, out_dtype))
    n_rows = x.shape[0]
    s = torch.empty_like(x) if inc is not None else x.new_empty(0)
    return (
        s,
        x.new_empty(x.shape, dtype=out_dtype),
        x.new_empty(n_rows, dtype=torch.float32),
        x.new_empty(n_rows, dtype=torch.float32),
    )


# ---- backward -----------------------------------------------------------------------------------


def _backward_torch(dy, ds, s, weight, mean, rstd, has_bias, inc_dtype, inc_bias_dtype):
    sf = s.float()
    xhat = (sf - mean[:, None]) * rstd[:, None]
    dyf = dy.float()
    wdy = dyf * weight.float()
    c1 = (xhat * wdy).mean(dim=1, keepdim=True)
    c2 = wdy.mean(dim=1, keepdim=True)
    dx = (wdy - (xhat * c1 + c2)) * rstd[:, None]
    if ds is not None:
        dx = dx + ds.float()
    dinc = dx.to(inc_dtype, copy=True) if inc_dtype is not None else s.new_empty(0)  # outputs may not alias
    dw = (dyf * xhat).sum(0).to(weight.dtype)
    db = dyf.sum(0).to(weight.dtype) if has_bias else weight.new_empty(0)
    dib = dx.sum(0).to(inc_bias_dtype) if inc_bias_dtype is not None else weight.new_empty(0)
    return dx.to(s.dtype), dinc, dw, db, dib


@torch.library.custom_op("trainer::add_layer_norm_backward", mutates_args=())
def _bwd_op(
    dy: Tensor,
    ds: Tensor | None,
    s: Tensor,
    weight: Tensor,
    mean: Tensor,
    rstd: Tensor,
    has_bias: bool,
    inc_dtype: torch.dtype | None,
    inc_bias_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dinc, dweight, dbias, dinc_bias)``: ``dx = ds + d(y . dy)/ds`` in s's dtype, the same in
    ``inc_dtype`` (empty when None), the weight and bias gradients (bias empty when ``has_bias`` is
    False) and the column sums of ``dx`` in ``inc_bias_dtype`` (empty when None)."""
    warm.finish()
    if not _use_triton(s.device):
        return _backward_torch(dy, ds, s, weight, mean, rstd, has_bias, inc_dtype, inc_bias_dtype)
    n_rows, n_cols = s.shape
    dx = torch.empty_like(s)
    dinc = s.new_empty(s.shape, dtype=inc_dtype) if inc_dtype is not None else s.new_empty(0)
    block_cols = triton.next_power_of_2(n_cols)
    block_rows = _block_rows(n_cols, "bwd")
    programs, rows_per_program = plan_programs(n_rows, block_rows, PROGRAMS_PER_SM, s.device, _INTERPRETED)
    n_sums = 3 if inc_bias_dtype is not None else 2
    parts = (s.new_empty if n_rows else s.new_zeros)((n_sums, programs, n_cols), dtype=torch.float32)
    if n_rows:
        _add_ln_bwd_kernel[(programs,)](
            dy,
            ds if ds is not None else dy,
            s,
            weight,
            mean,
            rstd,
            dx,
            dinc,
            parts,
            n_rows,
            n_cols,
            rows_per_program,
            HAS_DS=ds is not None,
            HAS_DINC=inc_dtype is not None,
            HAS_DIB=inc_bias_dtype is not None,
            BLOCK_ROWS=block_rows,
            BLOCK_COLS=block_cols,
            num_warps=_num_warps(block_rows, block_cols, "bwd"),
        )
    dw = weight.new_empty(n_cols)
    db = weight.new_empty(n_cols if has_bias else 0)
    dib = weight.new_empty(n_cols, dtype=inc_bias_dtype) if inc_bias_dtype is not None else weight.new_empty(0)
    # Arrays without an output (no bias) are summed into a scratch vector: one launch either way.
    outs = [dw, db if has_bias else weight.new_empty(n_cols, dtype=torch.float32), dib]
    sum_parts(parts, outs[:n_sums])
    return dx, dinc, dw, db, dib


@_bwd_op.register_fake
def _(dy, ds, s, weight, mean, rstd, has_bias, inc_dtype, inc_bias_dtype):
    args = (dy, ds, s, weight, mean, rstd, has_bias, inc_dtype, inc_bias_dtype)
    warm.record(__name__, "add_layer_norm_backward", args)
    dinc = s.new_empty(s.shape, dtype=inc_dtype) if inc_dtype is not None else s.new_empty(0)
    db = weight.new_empty(weight.shape) if has_bias else weight.new_empty(0)
    dib = weight.new_empty(weight.shape, dtype=inc_bias_dtype) if inc_bias_dtype is not None else weight.new_empty(0)
    return torch.empty_like(s), dinc, weight.new_empty(weight.shape), db, dib


def _setup_context(ctx, inputs, output):
    x, inc, inc_bias, weight, bias, _eps, _out_dtype = inputs
    s, _y, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(s if inc is not None else x, weight, mean, rstd)
    ctx.inc_dtype = inc.dtype if inc is not None else None  # None: no inc
    ctx.inc_bias_dtype = inc_bias.dtype if inc_bias is not None else None
    ctx.has_bias = bias is not None


def _backward(ctx, ds, dy, _dmean, _drstd):
    s, weight, mean, rstd = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(s)
    has_inc = ctx.inc_dtype is not None
    if not has_inc:
        ds = None  # s is an empty placeholder without inc: nothing flows into it
    # The kernel reads rows at a stride of the width; an incoming gradient can be any view (e.g. an expanded
    # scalar from a .sum() loss).
    dy = dy.contiguous()
    ds = ds.contiguous() if ds is not None else None
    dx, dinc, dw, db, dib = _bwd_op(dy, ds, s, weight, mean, rstd, ctx.has_bias, ctx.inc_dtype, ctx.inc_bias_dtype)
    return (
        dx,
        (dinc if has_inc else None),
        (dib if ctx.inc_bias_dtype is not None else None),
        dw,
        (db if ctx.has_bias else None),
        None,
        None,
    )


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ---- public functions ---------------------------------------------------------------------------


def _dense(t: Tensor | None) -> Tensor | None:
    """The kernels read vectors at stride 1 (a parameter already is: no copy)."""
    return t.contiguous() if t is not None else None


def _check(x: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    if x.shape[-1] != weight.shape[0] or weight.dim() != 1 or (bias is not None and bias.shape != weight.shape):
        raise ValueError(f"expected weight and bias of shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if x.shape[-1] > _MAX_COLS:
        raise ValueError(f"rows of more than {_MAX_COLS} elements are not supported, got {x.shape[-1]}")


def add_layer_norm(
    x: Tensor,
    inc: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    eps: float = 1e-5,
    inc_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(s, y)`` with ``s = x + (inc + inc_bias)`` (x's dtype) and ``y = F.layer_norm(s, ...)`` over the
    last dim, in the autocast dtype under autocast (the input dtype of the matmul that reads it), else
    s's dtype.

    ``x`` is the residual stream (fp32 under autocast), ``inc`` a branch output of any float dtype
    and the same shape, ``inc_bias`` an optional vector added to each row of ``inc`` in fp32 (the
    bias of the matmul that made ``inc``, moved here so that its gradient, the column sums of the
    gradient into ``s``, comes out of this op's backward pass instead of a reduction of its own);
    gradients come back in each input's dtype.
    """
    return add_layer_norm_op(x, inc, weight, bias, eps, autocast_dtype(x), inc_bias=inc_bias)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float = 1e-5) -> Tensor:
    """``F.layer_norm(x, ...)`` over the last dim, in the autocast dtype under autocast (see ``add_layer_norm``)."""
    return add_layer_norm_op(x, None, weight, bias, eps, autocast_dtype(x))[1]


def add_layer_norm_op(
    x: Tensor,
    inc: Tensor | None,
    weight: Tensor,
    bias: Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
    inc_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`add_layer_norm` with the output dtype given (what a graph rewrite knows the readers want); without
    ``inc`` the plain LayerNorm of ``x``, and ``s`` is ``x`` itself."""
    _check(x, weight, bias)
    if inc is not None and inc.shape != x.shape:
        raise ValueError(f"x and inc must have one shape, got {tuple(x.shape)} and {tuple(inc.shape)}")
    if inc_bias is not None and inc is None:
        raise ValueError("add_layer_norm: inc_bias without inc")
    if inc_bias is not None and inc_bias.shape != weight.shape:
        raise ValueError(f"expected inc_bias of shape ({x.shape[-1]},), got {tuple(inc_bias.shape)}")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()  # (rows, C)
    inc2 = inc.reshape(-1, shape[-1]).contiguous() if inc is not None else None
    s, y, _, _ = _fwd_op(x2, inc2, _dense(inc_bias), _dense(weight), _dense(bias), eps, out_dtype)
    return (s.view(shape) if inc is not None else x), y.view(shape)
