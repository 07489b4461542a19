"""Fused linear + cross-entropy: the loss of ``x @ weight.T`` without the (N, V) logits in memory.

For a language-model head (N tokens, hidden size C, vocabulary V) the logits are the largest
tensor of the step: gpt2-small at N = 16 * 1024 has N * V = 824M of them, 3.3 GB in fp32, and
``F.cross_entropy`` keeps several such tensors alive (the logits, their fp32 copy, the
log-softmax, the gradient). This op walks the tokens in chunks of ``chunk_size`` rows and per
chunk:

1. ``logits = x_chunk @ W.T`` (cuBLAS) into one reused (chunk_size, V) buffer;
2. ``_linear_cross_entropy_kernel`` computes each row's logsumexp and loss in fp32 and
   overwrites the logits in place with their gradient ``softmax - onehot`` (zero rows for
   ``ignore_index``);
3. ``grad_x_chunk = dlogits @ W`` and ``grad_W += dlogits.T @ x_chunk`` (fp32 accumulator; on CUDA cuBLAS
   adds the half-precision product into it in fp32 itself, ``addmm`` with ``out_dtype``).

The gradients are computed in the forward, as Liger-Kernel does, because they need the same
logits: three matmuls (6 * N * C * V FLOPs) instead of four. They are the gradients of the
*sum* of the per-row losses; the backward multiplies them by ``grad_output`` (and by
``1 / n_valid`` for ``reduction="mean"``) in fp32. Scaling there rather than in the kernel keeps
the stored logit gradients in [-1, 1]: ``(p - onehot) / n_valid`` is ~1e-9 for gpt2 shapes and
underflows in fp16.

Memory beyond the inputs, while the op runs (gpt2-small head, bf16 autocast, fp32 weight,
N = 16384, default chunking: 4 chunks of 4096 rows):

- the logits buffer, ``chunk_size * V`` elements of the compute dtype (412 MB);
- ``x`` chunk cast to the compute dtype (6 MB), the weight cast to it when its dtype differs
  (77 MB), and on CPU the per-chunk ``dlogits.T @ x_chunk`` product when the compute dtype is not
  fp32 (77 MB);
- the fp32 ``grad_W`` accumulator (154 MB) and ``grad_x`` in x's dtype (50 MB); these two are
  returned and kept for the backward, where the ``.grad`` would have been anyway.

Eager ``F.cross_entropy(F.linear(x, W), t)`` under autocast peaks near 10 GB by the same count
(bf16 logits, fp32 log-softmax and two fp32 gradients; ``scripts/bench_fused_loss.py`` measures
both). Chunks are not made as small as x (Liger-Kernel's rule, 256 rows here): each chunk adds a
V x C product into the fp32 ``grad_W`` (~460 MB of traffic), ~30 GB over 64 chunks against
~2 GB over 4. Double backward is not supported.

``save_logit_grads=True`` (``trainer::linear_cross_entropy_saved``, the ``cross_entropy`` kernel of
``compile.kernels``) trades the other way, for speed at torch's memory: one cuBLAS
matmul into a full (N, V) logits buffer, the same row kernel overwriting it with the logit
gradients, and that buffer kept for the backward, where ``dlogits @ W`` and ``dlogits.T @ x`` run
(scaled after, in fp32). Compiled ``F.cross_entropy`` keeps the same (N, V) buffer (the logits)
but reads it in a forward kernel and again, with a write, in a backward kernel; here it is read
and rewritten once (the kernel's second read of a row mostly hits L2).

The compute dtype is the autocast dtype when autocast is on for x's device, else x's dtype;
softmax and logsumexp accumulate in fp32, the loss is fp32, and the gradients come back in the
dtypes of x and weight.

Triton runs on CUDA tensors, and on CPU tensors when ``TRITON_INTERPRET=1`` was set before
``triton`` was first imported (Triton reads it when ``@triton.jit`` decorates, its own
``tl.max``/``tl.sum`` included). Otherwise CPU tensors take ``_cross_entropy_rows_torch``, the
same per-chunk step written with PyTorch ops, so the op works everywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from trainer.ops import warm
from trainer.ops.utils import autocast_dtype, interpreted, triton_can_run

__all__ = ["linear_cross_entropy"]

_DEFAULT_CHUNK_BYTES = 512 * 2**20
"""Cap on the logits buffer: 4 chunks of 4096 rows for the gpt2-small head in bf16."""

_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Tile of the row kernel, in elements. On the GPU 16K elements (64 KB of fp32 in registers over
# 16 warps) is one row of a large vocabulary per program, or several rows of a small one.
# The interpreter pays ~15 ms per program, whatever the tile, so it gets larger tiles.
_MAX_BLOCK_SIZE = 16384
_TILE_ELEMENTS = 16384
_INTERPRETER_TILE_ELEMENTS = 65536


@triton.jit
def _linear_cross_entropy_kernel(
    X_ptr,
    X_row_stride,
    Target_ptr,
    Loss_ptr,
    n_rows,
    n_cols,
    ignore_index,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    EVICT_PASS1: tl.constexpr = "evict_last",
    EVICT_PASS2: tl.constexpr = "evict_first",
):
    """Per-row cross-entropy of logits ``X`` (n_rows, n_cols); ``X`` becomes its gradient.

    Loss_ptr[r] = logsumexp(X[r]) - X[r, target[r]], or 0 where target[r] == ignore_index.
    With COMPUTE_GRAD, X[r] is overwritten with softmax(X[r]) - onehot(target[r]) (zeros for
    ignored rows): the gradient of the summed loss. All arithmetic is fp32.

    L2 eviction policies: pass 1 asks L2 to keep the row (``evict_last``) and pass 2 lets it go
    (``evict_first``), so that pass 2's read of the row is served from L2, not HBM ("": none).
    """
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    # Rows past the end recompute the last row instead of reading past the targets and logits;
    # their stores are masked.
    rows = tl.minimum(rows, n_rows - 1).to(tl.int64)
    target = tl.load(Target_ptr + rows)
    valid = row_mask & (target != ignore_index)
    X_rows = X_ptr + rows[:, None] * X_row_stride  # (BLOCK_ROWS, 1) row pointers

    # Pass 1: online max and sum of exponentials. Every row has at least one column, so the
    # running max is finite after the first block and exp(m - m_new) never sees -inf - -inf.
    m = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
    d = tl.zeros([BLOCK_ROWS], tl.float32)
    for off in range(0, n_cols, BLOCK_SIZE):
        cols = off + tl.arange(0, BLOCK_SIZE)
        col_ok = cols[None, :] < n_cols
        z = tl.load(X_rows + cols[None, :], mask=col_ok, other=float("-inf"), eviction_policy=EVICT_PASS1)
        z = z.to(tl.float32)  # bf16 arithmetic is wrong in the interpreter; fp32 is what we want anyway
        m_new = tl.maximum(m, tl.max(z, axis=1))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m = m_new
    lse = m + tl.log(d)
    # The target logit, read before pass 2 overwrites it; ignored rows read nothing.
    safe_target = tl.where(valid, target, 0)
    z_target = tl.load(X_ptr + rows * X_row_stride + safe_target, mask=valid, other=0.0).to(tl.float32)
    tl.store(Loss_ptr + rows, tl.where(valid, lse - z_target, 0.0), mask=row_mask)

    # Pass 2: the gradient of the summed loss, in place.
    if COMPUTE_GRAD:
        for off in range(0, n_cols, BLOCK_SIZE):
            cols = off + tl.arange(0, BLOCK_SIZE)
            mask = row_mask[:, None] & (cols[None, :] < n_cols)
            z = tl.load(X_rows + cols[None, :], mask=mask, other=0.0, eviction_policy=EVICT_PASS2).to(tl.float32)
            grad = tl.exp(z - lse[:, None]) - tl.where(cols[None, :] == safe_target[:, None], 1.0, 0.0)
            grad = tl.where(valid[:, None], grad, 0.0).to(X_ptr.dtype.element_ty)
            tl.store(X_rows + cols[None, :], grad, mask=mask, eviction_policy=EVICT_PASS2)


_INTERPRETED = interpreted(_linear_cross_entropy_kernel)  # see utils.interpreted: when a CPU process can run it


def _use_triton(device: torch.device) -> bool:
    """Whether the Triton kernel can run on tensors of ``device`` in this process."""
    return triton_can_run(device, _linear_cross_entropy_kernel)


def _cross_entropy_rows_triton(
    logits: Tensor,
    targets: Tensor,
    loss_rows: Tensor,
    ignore_index: int,
    compute_grad: bool,
    block_size: int | None = None,
    block_rows: int | None = None,
    num_warps: int | None = None,
    l2_hints: bool = True,
) -> None:
    """Launch ``_linear_cross_entropy_kernel`` on one chunk; block sizes default to the heuristic."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    assert logits.stride(1) == 1 and targets.is_contiguous() and loss_rows.is_contiguous()
    if block_size is None:
        block_size = min(triton.next_power_of_2(n_cols), _MAX_BLOCK_SIZE)
    tile = _INTERPRETER_TILE_ELEMENTS if _INTERPRETED else _TILE_ELEMENTS
    if block_rows is None:
        block_rows = min(max(1, tile // block_size), triton.next_power_of_2(n_rows))
    if num_warps is None:
        num_warps = min(16, max(4, block_rows * block_size // 1024))
    grid = (triton.cdiv(n_rows, block_rows),)
    _linear_cross_entropy_kernel[grid](
        logits,
        logits.stride(0),
        targets,
        loss_rows,
        n_rows,
        n_cols,
        ignore_index,
        BLOCK_ROWS=block_rows,
        BLOCK_SIZE=block_size,
        COMPUTE_GRAD=compute_grad,
        **({} if l2_hints else {"EVICT_PASS1": "", "EVICT_PASS2": ""}),
        num_warps=num_warps,
    )


def _cross_entropy_rows_torch(
    logits: Tensor, targets: Tensor, loss_rows: Tensor, ignore_index: int, compute_grad: bool
) -> None:
    """The kernel's contract in PyTorch ops, for CPU tensors when Triton cannot run on them."""
    z = logits.float()  # (rows, V)
    lse = torch.logsumexp(z, dim=1)
    valid = targets != ignore_index
    safe_target = torch.where(valid, targets, 0)
    z_target = z.gather(1, safe_target[:, None]).squeeze(1)
    loss_rows.copy_(torch.where(valid, lse - z_target, 0.0))
    if compute_grad:
        grad = torch.exp(z - lse[:, None])
        grad.scatter_add_(1, safe_target[:, None], grad.new_full((z.shape[0], 1), -1.0))
        logits.copy_(grad.masked_fill_(~valid[:, None], 0.0))


def _cross_entropy_rows_(
    logits: Tensor, targets: Tensor, loss_rows: Tensor, ignore_index: int, compute_grad: bool
) -> None:
    if _use_triton(logits.device):
        _cross_entropy_rows_triton(logits, targets, loss_rows, ignore_index, compute_grad)
    else:
        _cross_entropy_rows_torch(logits, targets, loss_rows, ignore_index, compute_grad)


_VOCAB_ALIGN = 64
"""The logits' rows are padded to a multiple of this many columns. A vocabulary like GPT-2's 50257 leaves every
row of the (N, V) logits misaligned, and cuBLAS takes a slow path for the head's three matmuls (Inductor pads
them for the same reason; docs/performance.md has the step without it)."""


def _pad_rows(weight: Tensor) -> Tensor:
    """``weight`` (V, C) with zero rows appended up to a multiple of :data:`_VOCAB_ALIGN` (itself if aligned): the
    padded logits are exact zeros, which the row kernel never reads (it stops at V) and whose gradient stays 0."""
    pad = -weight.shape[0] % _VOCAB_ALIGN
    return F.pad(weight, (0, 0, 0, pad)) if pad else weight


def _default_chunk_size(n_cols: int, compute_dtype: torch.dtype) -> int:
    """Rows per chunk so that the logits buffer stays under ``_DEFAULT_CHUNK_BYTES``."""
    return max(1, _DEFAULT_CHUNK_BYTES // (n_cols * compute_dtype.itemsize))


def _balanced_chunk_rows(n_rows: int, chunk_size: int) -> int:
    """At most ``chunk_size`` rows per chunk, spread evenly: 16384 rows at 5000 -> 4 x 4096."""
    n_chunks = max(1, -(-n_rows // chunk_size))
    return max(1, -(-n_rows // n_chunks))


def _fp32_out_mm(device: torch.device) -> bool:
    """Whether ``torch.mm``/``torch.addmm`` take ``out_dtype=torch.float32`` for half-precision operands on
    ``device``: on CUDA, in the torch versions that have those overloads (CPU has no kernel for them)."""
    return device.type == "cuda" and "dtype_out" in torch.ops.aten.addmm.overloads()


def _check_targets(targets: Tensor, ignore_index: int, n_cols: int) -> None:
    """On the device, no sync: fail when a target is neither in [0, V) nor ignore_index."""
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= n_cols))
    torch._assert_async(~bad.any(), "linear_cross_entropy: a target is outside [0, V) and not ignore_index")


@torch.library.custom_op("trainer::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(
    x: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int,
    reduction: str,
    compute_dtype: torch.dtype,
    chunk_size: int,
    grad_x: bool,
    grad_weight: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(loss, d(sum of row losses)/dx, d(sum of row losses)/dweight)``.

    A gradient that is not asked for comes back as an empty tensor. ``linear_cross_entropy``
    is the user-facing function; the extra outputs exist so that the backward can use them.
    """
    warm.finish()
    n_rows, n_cols = x.shape[0], weight.shape[0]
    with torch.autocast(x.device.type, enabled=False):  # dtypes are explicit below
        _check_targets(targets, ignore_index, n_cols)
        targets = targets.contiguous()
        w = _pad_rows(weight.to(compute_dtype))  # (V', C), V' >= V aligned; no copy when nothing changes
        loss_rows = x.new_empty(n_rows, dtype=torch.float32)
        dx = x.new_empty(x.shape) if grad_x else x.new_empty(0)
        # The matmul itself writes (chunk 0) and then adds into the fp32 accumulator: in fp32, or from bf16/fp16
        # operands through out_dtype (no (V, C) product in between). Otherwise a product in the compute dtype is added.
        fp32_out = {"out_dtype": torch.float32} if compute_dtype != torch.float32 else {}
        in_matmul = compute_dtype == torch.float32 or _fp32_out_mm(x.device)
        if not grad_weight:
            dw = weight.new_empty(0)
        else:
            dw = (weight.new_empty if in_matmul and n_rows else weight.new_zeros)(w.shape, dtype=torch.float32)
        rows = _balanced_chunk_rows(n_rows, chunk_size)
        logits_buf = x.new_empty((min(rows, n_rows), w.shape[0]), dtype=compute_dtype)
        for start in range(0, n_rows, rows):
            end = min(start + rows, n_rows)
            x_chunk = x[start:end].to(compute_dtype)  # (rows, C)
            logits = logits_buf[: end - start]  # (rows, V')
            torch.mm(x_chunk, w.t(), out=logits)
            ce_rows = logits[:, :n_cols]  # (rows, V): the padding stays 0
            _cross_entropy_rows_(ce_rows, targets[start:end], loss_rows[start:end], ignore_index, grad_x or grad_weight)
            # logits now holds dlogits = softmax - onehot
            if grad_x:
                if dx.dtype == compute_dtype:
                    torch.mm(logits, w, out=dx[start:end])
                else:
                    dx[start:end] = logits @ w
            if grad_weight and not in_matmul:
                dw += logits.t() @ x_chunk  # (V, C) product in the compute dtype, summed in fp32
            elif grad_weight and start == 0:
                torch.mm(logits.t(), x_chunk, out=dw, **fp32_out)
            elif grad_weight:
                torch.addmm(dw, logits.t(), x_chunk, out=dw, **fp32_out)
        loss = loss_rows.sum()
        if reduction == "mean":
            loss = loss / (targets != ignore_index).sum()  # 0 / 0 = nan when all are ignored, as F.cross_entropy
    return loss, dx, dw[:n_cols].to(weight.dtype)


@_linear_cross_entropy_op.register_fake
def _(x, weight, targets, ignore_index, reduction, compute_dtype, chunk_size, grad_x, grad_weight):
    args = (x, weight, targets, ignore_index, reduction, compute_dtype, chunk_size, grad_x, grad_weight)
    warm.record(__name__, "linear_cross_entropy", args)
    loss = x.new_empty((), dtype=torch.float32)
    dx = x.new_empty(x.shape) if grad_x else x.new_empty(0)
    dw = weight.new_empty(weight.shape) if grad_weight else weight.new_empty(0)
    return loss, dx, dw


def _setup_context(ctx, inputs, output):
    _, _, targets, ignore_index, reduction, *_ = inputs
    _, dx, dw = output
    ctx.mark_non_differentiable(dx, dw)
    ctx.save_for_backward(dx, dw, targets)
    ctx.ignore_index = ignore_index
    ctx.reduction = reduction


def _scale(grad: Tensor, scale: Tensor) -> Tensor:
    # In fp32: a bf16 multiply would round 1 / n_valid first, a bias shared by every element.
    return (grad.float() * scale).to(grad.dtype)


def _backward_scale(ctx, grad_loss: Tensor, targets: Tensor) -> Tensor:
    """The fp32 factor on the gradients of the summed row losses: grad_output, over n_valid for "mean"."""
    if torch.is_grad_enabled():
        # create_graph=True: the saved gradients carry no graph back to x and weight, so a
        # second derivative would silently miss the softmax Hessian. AOTAutograd and compiled
        # autograd trace the backward with grad mode off.
        raise RuntimeError("trainer::linear_cross_entropy does not support double backward (create_graph=True)")
    scale = grad_loss.float()
    if ctx.reduction == "mean":
        # All rows ignored: the saved gradients are zero and so are F.cross_entropy's.
        scale = scale / (targets != ctx.ignore_index).sum().clamp(min=1)
    return scale


def _backward(ctx, grad_loss, _grad_dx, _grad_dw):
    dx, dw, targets = ctx.saved_tensors
    scale = _backward_scale(ctx, grad_loss, targets)
    grads = []
    for needed, saved, name in ((ctx.needs_input_grad[0], dx, "grad_x"), (ctx.needs_input_grad[1], dw, "grad_weight")):
        if not needed:
            grads.append(None)
            continue
        if saved.dim() != 2:  # not computed in the forward: an empty (0,) placeholder
            raise RuntimeError(f"trainer::linear_cross_entropy was called with {name}=False but its input needs a grad")
        grads.append(_scale(saved, scale))
    return grads[0], grads[1], None, None, None, None, None, None, None


_linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("trainer::linear_cross_entropy_saved", mutates_args=())
def _saved_op(
    x: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, reduction: str, compute_grad: bool
) -> tuple[Tensor, Tensor]:
    """Returns ``(loss, dlogits)``: ``x`` and ``weight`` already in the compute dtype; the (N, V) logits
    buffer, after the kernel, holds d(sum of row losses)/dlogits (with ``compute_grad``) and is what the
    backward keeps."""
    warm.finish()
    n_cols = weight.shape[0]
    with torch.autocast(x.device.type, enabled=False):
        _check_targets(targets, ignore_index, n_cols)
        targets = targets.contiguous()
        logits = torch.mm(x, _pad_rows(weight).t())  # (N, V'), cuBLAS; V' >= V aligned, the padding 0
        loss_rows = x.new_empty(x.shape[0], dtype=torch.float32)
        # logits -> softmax - onehot, in the first V columns
        _cross_entropy_rows_(logits[:, :n_cols], targets, loss_rows, ignore_index, compute_grad)
        loss = loss_rows.sum()
        if reduction == "mean":
            loss = loss / (targets != ignore_index).sum()  # 0 / 0 = nan when all are ignored, as F.cross_entropy
    return loss, logits


@_saved_op.register_fake
def _(x, weight, targets, ignore_index, reduction, compute_grad):
    warm.record(__name__, "linear_cross_entropy_saved", (x, weight, targets, ignore_index, reduction, compute_grad))
    padded = weight.shape[0] - weight.shape[0] % -_VOCAB_ALIGN  # V rounded up, as _pad_rows
    return x.new_empty((), dtype=torch.float32), x.new_empty((x.shape[0], padded))


def _saved_setup_context(ctx, inputs, output):
    x, weight, targets, ignore_index, reduction, compute_grad = inputs
    _, dlogits = output
    ctx.mark_non_differentiable(dlogits)
    ctx.save_for_backward(x, weight, dlogits, targets)
    ctx.compute_grad = compute_grad
    ctx.ignore_index = ignore_index
    ctx.reduction = reduction


def _saved_backward(ctx, grad_loss, _grad_dlogits):
    x, weight, dlogits, targets = ctx.saved_tensors
    if not ctx.compute_grad:  # the buffer holds the logits, not their gradient
        raise RuntimeError("trainer::linear_cross_entropy_saved was called with compute_grad=False but needs a grad")
    scale = _backward_scale(ctx, grad_loss, targets)
    # The two gradient matmuls on the unscaled dlogits, scaled after in fp32 (N x C and V x C values
    # instead of N x V; under torch.compile the scaling fuses into the cast that follows).
    v = weight.shape[0]  # dlogits has the padded width, zero past v
    dx = _scale(dlogits @ _pad_rows(weight), scale) if ctx.needs_input_grad[0] else None
    dw = _scale(dlogits[:, :v].t() @ x, scale) if ctx.needs_input_grad[1] else None
    return dx, dw, None, None, None, None


_saved_op.register_autograd(_saved_backward, setup_context=_saved_setup_context)


def linear_cross_entropy(
    x: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
    save_logit_grads: bool = False,
) -> Tensor:
    """``F.cross_entropy(x @ weight.T, targets)`` without materialising the (N, V) logits.

    Works in and outside ``torch.autocast`` and under ``torch.compile(fullgraph=True)``. Under
    autocast the matmuls run in the autocast dtype (the weight, typically an fp32 master
    weight, is cast inside); softmax and logsumexp accumulate in fp32.

    Args:
        x: (N, C) hidden states, fp32, bf16 or fp16. A GPT passes ``h.view(-1, C)``.
        weight: (V, C) LM-head weight, any float dtype; its gradient comes back in that dtype.
        targets: (N,) int64 class indices in [0, V), or ``ignore_index``.
        ignore_index: Target value whose rows add nothing to the loss or the gradients.
        reduction: ``"mean"`` over the non-ignored rows (nan when there are none, as
            ``F.cross_entropy``) or ``"sum"``.
        chunk_size: Most rows per chunk; chunks are then evened out. Default: as many as keep
            the chunk logits under 512 MiB (4096 rows of a 50304 vocabulary in bf16).
        save_logit_grads: The other trade: one (N, V) logits buffer in the compute dtype (as
            ``F.cross_entropy`` on compiled logits keeps), overwritten by the kernel with the logit
            gradients and kept for the backward, where the two gradient matmuls run. The memory of
            torch's compiled loss, with the loss kernel reading the logits once and writing their
            gradient once instead of Inductor's two passes (forward and backward) over them.
            ``chunk_size`` does not apply.

    Returns:
        The fp32 scalar loss.

    Raises:
        ValueError: On shapes, dtypes, devices or a ``reduction`` this op does not take.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"expected x (N, C) and weight (V, C), got {tuple(x.shape)} and {tuple(weight.shape)}")
    if targets.shape != (x.shape[0],) or targets.dtype != torch.int64:
        raise ValueError(f"expected int64 targets of shape ({x.shape[0]},), got {targets.dtype} {tuple(targets.shape)}")
    if not (x.device == weight.device == targets.device):
        raise ValueError(
            f"x, weight and targets must share a device, got {x.device}, {weight.device}, {targets.device}"
        )
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r} (use F.cross_entropy for 'none')")
    if not weight.dtype.is_floating_point:
        raise ValueError(f"weight must be floating point, got {weight.dtype}")
    compute_dtype = autocast_dtype(x)
    if compute_dtype not in _COMPUTE_DTYPES:
        raise ValueError(f"linear_cross_entropy computes in fp32, bf16 or fp16, not {compute_dtype}")
    if save_logit_grads:
        if chunk_size is not None:
            raise ValueError("chunk_size does not apply with save_logit_grads=True (one (N, V) buffer)")
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        xc, wc = x.to(compute_dtype), weight.to(compute_dtype)  # autograd casts the gradients back
        loss, _ = _saved_op(xc, wc, targets, ignore_index, reduction, needs_grad)
        return loss
    if chunk_size is None:
        chunk_size = _default_chunk_size(weight.shape[0], compute_dtype)
    elif chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of rows, got {chunk_size}")
    grad_enabled = torch.is_grad_enabled()
    loss, _, _ = _linear_cross_entropy_op(
        x,
        weight,
        targets,
        ignore_index,
        reduction,
        compute_dtype,
        chunk_size,
        grad_enabled and x.requires_grad,
        grad_enabled and weight.requires_grad,
    )
    return loss
