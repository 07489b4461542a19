"""What the row-norm kernels share: how many backward programs split the rows, and the launch that finishes the
programs' partial column sums (the norms' weight and bias gradients).

A norm's backward runs a few programs per SM; each sums its rows' weight gradients in registers and writes one row
of partial sums. One more launch adds those rows up per column, in program order (deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

SUM_COLS = 32
"""Columns per program of the finishing launch."""
SUM_PARTS = 64
"""Partial rows it adds per step."""


def plan_programs(
    n_rows: int, block_rows: int, per_sm: int, device: torch.device, interpreted: bool
) -> tuple[int, int]:
    """``(programs, rows_per_program)`` for a backward over ``n_rows`` rows, ``block_rows`` at a time: ``per_sm``
    programs per SM (three in the interpreter, so that CPU tests cover the partial sums of several programs)."""
    programs = 3 if interpreted else per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    programs = max(1, min(programs, triton.cdiv(n_rows, block_rows)))
    rows_per_program = max(1, triton.cdiv(triton.cdiv(n_rows, programs), block_rows)) * block_rows
    return max(1, triton.cdiv(n_rows, rows_per_program)), rows_per_program


@triton.jit
def sum_parts_kernel(
    PARTS,
    OUT0,
    OUT1,
    OUT2,
    n_parts,
    n_cols,
    BLOCK_PARTS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """OUTk[c] = sum over p of PARTS[k, p, c] (fp32, in order of p: deterministic), cast to OUTk's
    dtype; program (k, j) takes columns ``[j * BLOCK_COLS, +BLOCK_COLS)`` of array k."""
    k = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_ok = cols < n_cols
    base = PARTS + k.to(tl.int64) * n_parts * n_cols
    acc = tl.zeros([BLOCK_COLS], tl.float32)
    for first in range(0, n_parts, BLOCK_PARTS):
        p = first + tl.arange(0, BLOCK_PARTS)
        mask = (p < n_parts)[:, None] & col_ok[None, :]
        acc += tl.sum(tl.load(base + p[:, None] * n_cols + cols[None, :], mask=mask, other=0.0), axis=0)
    if k == 0:
        tl.store(OUT0 + cols, acc.to(OUT0.dtype.element_ty), mask=col_ok)
    elif k == 1:
        tl.store(OUT1 + cols, acc.to(OUT1.dtype.element_ty), mask=col_ok)
    else:
        tl.store(OUT2 + cols, acc.to(OUT2.dtype.element_ty), mask=col_ok)


def sum_parts(parts: Tensor, outs: list[Tensor]) -> None:
    """``outs[k] = parts[k].sum(0)`` for ``parts`` of shape (len(outs), programs, n_cols), fp32; one to three
    outputs, each cast to its own dtype, in one launch."""
    n_sums, n_parts, n_cols = parts.shape
    assert n_sums == len(outs) and 1 <= n_sums <= 3
    padded = [*outs, *outs[:1] * (3 - n_sums)]  # unused pointers: the programs of array k touch OUTk alone
    sum_parts_kernel[(n_sums, triton.cdiv(n_cols, SUM_COLS))](
        parts, *padded, n_parts, n_cols, BLOCK_PARTS=SUM_PARTS, BLOCK_COLS=SUM_COLS
    )
