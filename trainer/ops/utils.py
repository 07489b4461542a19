"""What trainer's Triton kernels share: where they run, what they compute in, the flat-buffer checks of the update
kernels, and the row-norm backwards' program plan and column sums.

A row norm's backward runs a few programs per SM; each sums its rows' weight gradients in registers and writes one
row of partial sums. One more launch (:func:`sum_parts`) adds those rows up per column, in program order
(deterministic).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def interpreted(kernel: Any) -> bool:
    """Whether ``kernel`` (a ``@triton.jit`` function) runs in the Triton interpreter.

    Triton chooses when it decorates: ``TRITON_INTERPRET=1`` must have been set when the kernel's module was
    imported and also when ``triton`` itself was first imported (it decorates its own ``tl.sum``/``tl.max``
    then); set in between, the kernel can run nowhere on CPU.
    """
    return all(type(f).__name__ == "InterpretedFunction" for f in (kernel, tl.sum))


def triton_can_run(device: torch.device, kernel: Any) -> bool:
    """Whether ``kernel`` (a ``@triton.jit`` function) can run on tensors of ``device``: CUDA always can, CPU
    tensors only under the interpreter (:func:`interpreted`)."""
    return device.type == "cuda" or (device.type == "cpu" and interpreted(kernel))


def autocast_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype trainer's ops compute in for ``x``: the autocast dtype while autocast is on for x's device type,
    else x's own (what the matmul that follows would read)."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


def check_flat_args(
    param: torch.Tensor,
    grad: torch.Tensor,
    states: list[torch.Tensor],
    step: torch.Tensor,
    hparams,
    n_hparams: int,
    states_like_param: bool = False,
) -> None:
    """Raise ValueError unless an optimizer kernel's flat buffers agree: contiguous, one device and length, the
    gradient in the parameters' dtype, fp32 states (``states_like_param``: bf16 parameters and states, for
    stochastic rounding), a one-element fp32 step and ``n_hparams`` float64 scalars."""
    for name, t in [("param", param), ("grad", grad)] + [(f"state {i}", s) for i, s in enumerate(states)]:
        if t.device != param.device or not t.is_contiguous() or t.numel() != param.numel():
            raise ValueError(
                f"{name}: expected a contiguous tensor of {param.numel()} elements on {param.device}, "
                f"got {tuple(t.shape)} on {t.device} (contiguous={t.is_contiguous()})"
            )
    state_dtype = torch.bfloat16 if states_like_param else torch.float32
    if states_like_param and param.dtype != torch.bfloat16:
        raise ValueError(f"stochastic rounding stores bf16 parameters, got {param.dtype}")
    if grad.dtype != param.dtype or any(s.dtype != state_dtype for s in states):
        raise ValueError(f"grad must have the param dtype ({param.dtype}) and states must be {state_dtype}")
    if step.dtype != torch.float32 or step.numel() != 1 or step.device != param.device:
        raise ValueError("step must be a one-element float32 tensor on the param device")
    if hparams.dtype != torch.float64 or hparams.numel() != n_hparams or hparams.device != param.device:
        raise ValueError(f"hparams must be a float64 tensor of {n_hparams} elements on the param device")


# ---- the row norms' backward ------------------------------------------------------------------

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
