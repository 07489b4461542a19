"""Global L2 norm of gradient buffers on device: ``trainer::grad_norm``.

Two stages, deterministic, no atomics and no host synchronisation: each program of
``_sumsq_partials_kernel`` strides over blocks of one buffer and writes one fp32 partial sum of
squares; ``_sumsq_finish_kernel`` (one program) adds the partials and takes the square root. The
result stays on the device, where the optimizer kernels read it to clip.

The norm is accumulated in fp32 whatever the gradient dtype (``torch.nn.utils.clip_grad_norm_``
returns a bf16 norm for bf16 gradients). Grid size is capped so the finish reads at most
``MAX_PROGRAMS`` partials per buffer: one pass of a 1024-wide block for a single flat buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_SIZE = 4096
NUM_WARPS = 8
# Programs per buffer. ~8 resident programs per SM on an H100 (132 SMs) is ~1056: every program
# runs in one wave and the finish stays a single 1024-wide pass.
MAX_PROGRAMS = 1024
FINISH_BLOCK_SIZE = 1024


@triton.jit
def _sumsq_partials_kernel(X_ptr, Partials_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * BLOCK_SIZE
    stride = tl.num_programs(0).to(tl.int64) * BLOCK_SIZE
    acc = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
    for block_start in range(start, n_elements, stride):
        offsets = block_start + tl.arange(0, BLOCK_SIZE)
        # .to(float32) straight after the load: bf16 arithmetic is wrong under TRITON_INTERPRET.
        x = tl.load(X_ptr + offsets, mask=offsets < n_elements, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(Partials_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def _sumsq_finish_kernel(Partials_ptr, Out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    acc = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
    for block_start in range(0, n_elements, BLOCK_SIZE):
        offsets = block_start + tl.arange(0, BLOCK_SIZE)
        acc += tl.load(Partials_ptr + offsets, mask=offsets < n_elements, other=0.0)
    tl.store(Out_ptr, tl.sqrt_rn(tl.sum(acc, axis=0)))


def launch_grad_norm(
    grads: list[torch.Tensor], out: torch.Tensor, *, block_size: int = BLOCK_SIZE, num_warps: int = NUM_WARPS
) -> None:
    """Write ``sqrt(sum over grads of sum(g**2))`` into the fp32 scalar ``out``.

    Args:
        grads: Contiguous tensors on ``out``'s device (normally the flat gradient buffers).
        out: fp32 tensor with one element.
        block_size: Elements per program per iteration.
        num_warps: Warps per program.
    """
    grids = [min(triton.cdiv(g.numel(), block_size), MAX_PROGRAMS) for g in grads]
    partials = torch.empty(max(sum(grids), 1), dtype=torch.float32, device=out.device)
    offset = 0
    for g, grid in zip(grads, grids):
        if grid:
            _sumsq_partials_kernel[(grid,)](g, partials[offset:], g.numel(), BLOCK_SIZE=block_size, num_warps=num_warps)
            offset += grid
    _sumsq_finish_kernel[(1,)](partials, out, offset, BLOCK_SIZE=FINISH_BLOCK_SIZE, num_warps=4)


@torch.library.custom_op("trainer::grad_norm", mutates_args=())
def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of ``grads`` as a 0-dim fp32 tensor on their device (no host sync).

    Args:
        grads: Non-empty list of contiguous floating-point tensors on one device.

    Returns:
        The norm, accumulated in fp32.
    """
    if not grads:
        raise ValueError("grad_norm needs at least one tensor")
    device = grads[0].device
    for g in grads:
        if g.device != device or not g.is_contiguous() or not g.is_floating_point():
            raise ValueError(
                f"grad_norm needs contiguous floating-point tensors on one device; got {g.dtype} "
                f"{tuple(g.shape)} on {g.device} (contiguous={g.is_contiguous()}) next to {device}"
            )
    out = torch.empty((), dtype=torch.float32, device=device)
    launch_grad_norm(grads, out)
    return out


@grad_norm.register_fake
def _(grads: list[torch.Tensor]) -> torch.Tensor:
    return grads[0].new_empty((), dtype=torch.float32)
