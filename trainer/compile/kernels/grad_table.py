"""AdamW and the gradient norm over gradients left where autograd put them: one launch through a pointer table.

:class:`~trainer.compile.kernels.flat.FlatGroup` keeps every ``p.grad`` as a view into one flat buffer, so
autograd adds each new gradient into it (``grad += new``: read, read, write) and ``zero_grad`` writes
zeros: ~16 bytes per fp32 parameter per step on top of the optimizer's 28, more than the flat kernel saves
over torch's fused AdamW on one GPU. Here only parameters and optimizer states are flat, each parameter
starting on a ``BLOCK_SIZE`` boundary so that every block of the flat layout belongs to one parameter;
gradients are whatever tensors autograd assigned (``zero_grad(set_to_none=True)`` as usual), and each
program reads its block's gradient through a table of their addresses:

- ``block_tensor[b]``, ``block_start[b]``: the parameter block ``b`` belongs to and where the block starts
  inside it (static, built once per layout);
- ``grad_ptrs[i]``: the address of parameter ``i``'s gradient this step, 0 for ``None`` (read as zeros).

The addresses are copied to the device from a pinned host buffer that is never rewritten (one per
distinct set of addresses, a few at most), so the copy can be captured in a CUDA graph: a replay re-reads
the addresses the graph's own gradients have.

The update is the flat kernel's (``adamw.adamw_update_block``), element for element; the norm is
accumulated in fp32 per block, then summed in one program (deterministic, no atomics).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from trainer.compile.kernels.adamw import NUM_WARPS, adamw_coefs, adamw_update_block
from trainer.compile.kernels.grad_norm import FINISH_BLOCK_SIZE, _sumsq_finish_kernel
from trainer.compile.kernels.runtime import capturing

BLOCK_SIZE = 2048
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_MAX_CACHED_TABLES = 8


@triton.jit
def _grad_block(GradPtrs_ptr, BlockTensor_ptr, BlockStart_ptr, Numel_ptr, pid, GRAD_DTYPE: tl.constexpr,
                ALIGNED: tl.constexpr, BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """This program's block of its parameter's gradient, widened to fp32 (zeros past the end or for None).

    ALIGNED: every address is 16-byte aligned and every length a multiple of 16 (the host checked), so the
    loads compile to 16-byte vectors."""
    t = tl.load(BlockTensor_ptr + pid)
    start = tl.multiple_of(tl.load(BlockStart_ptr + pid), BLOCK_SIZE)
    numel = tl.load(Numel_ptr + t)
    address = tl.load(GradPtrs_ptr + t)
    if ALIGNED:
        numel = tl.multiple_of(numel, 16)
    idx = start + tl.arange(0, BLOCK_SIZE)
    present = tl.where(address != 0, numel, 0)  # a None gradient: nothing to load, zeros
    ptrs = address.to(tl.pointer_type(GRAD_DTYPE)) + idx
    if ALIGNED:
        present = tl.multiple_of(present, 16)
        ptrs = tl.max_contiguous(tl.multiple_of(ptrs, 16), 16)
    g = tl.load(ptrs, mask=idx < present, other=0.0).to(tl.float32)
    return g, idx < numel


@triton.jit
def _sumsq_blocks_kernel(GradPtrs_ptr, BlockTensor_ptr, BlockStart_ptr, Numel_ptr, Partials_ptr,
                         GRAD_DTYPE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK_SIZE: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    g, _ = _grad_block(GradPtrs_ptr, BlockTensor_ptr, BlockStart_ptr, Numel_ptr, pid, GRAD_DTYPE, ALIGNED,
                       BLOCK_SIZE)  # fmt: skip
    tl.store(Partials_ptr + pid, tl.sum(g * g, axis=0))


@triton.jit
def _adamw_blocks_kernel(
    Param_ptr,
    ExpAvg_ptr,
    ExpAvgSq_ptr,
    GradPtrs_ptr,
    BlockTensor_ptr,
    BlockStart_ptr,
    Numel_ptr,
    Coefs_ptr,
    DECOUPLED: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    g, mask = _grad_block(GradPtrs_ptr, BlockTensor_ptr, BlockStart_ptr, Numel_ptr, pid, GRAD_DTYPE, ALIGNED,
                          BLOCK_SIZE)  # fmt: skip
    offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    adamw_update_block(Param_ptr, ExpAvg_ptr, ExpAvgSq_ptr, offsets, mask, g, Coefs_ptr, DECOUPLED, HAS_CLIP)


class GradTable:
    """The block table of one flat layout and the device copy of its parameters' gradient addresses.

    Args:
        params: The parameters, in flat-layout order, one dtype and device.
        offsets: Each parameter's start in the flat buffers; multiples of ``BLOCK_SIZE``.
        numel: Length of the flat buffers (a multiple of ``BLOCK_SIZE``).
    """

    def __init__(self, params: Sequence[torch.Tensor], offsets: Sequence[int], numel: int):
        if numel % BLOCK_SIZE or any(o % BLOCK_SIZE for o in offsets):
            raise ValueError(f"GradTable needs a layout aligned to {BLOCK_SIZE} elements")
        self.params = list(params)
        self.device = self.params[0].device
        self.dtype = self.params[0].dtype
        n_blocks = numel // BLOCK_SIZE
        block_tensor = torch.zeros(n_blocks, dtype=torch.int32)
        block_start = torch.full((n_blocks,), 2**40, dtype=torch.int64)  # padding blocks: past every end
        for i, (p, o) in enumerate(zip(self.params, offsets)):
            first, count = o // BLOCK_SIZE, triton.cdiv(p.numel(), BLOCK_SIZE)
            block_tensor[first : first + count] = i
            block_start[first : first + count] = torch.arange(count, dtype=torch.int64) * BLOCK_SIZE
        self.n_blocks = n_blocks
        self.block_tensor = block_tensor.to(self.device)
        self.block_start = block_start.to(self.device)
        self.numels = torch.tensor([p.numel() for p in self.params], dtype=torch.int64, device=self.device)
        self.grad_ptrs = torch.zeros(len(self.params), dtype=torch.int64, device=self.device)
        self.aligned = False  # of the addresses last loaded (see _grad_block)
        self._numels_aligned = all(p.numel() % 16 == 0 for p in self.params)
        self._host: dict[tuple[int, ...], torch.Tensor] = {}  # addresses -> pinned buffer, never rewritten
        self._captured: list[torch.Tensor] = []

    def load_grads(self) -> None:
        """Copy the parameters' current gradient addresses to the device (capturable; no host sync)."""
        addresses = []
        for p in self.params:
            g = p.grad
            if g is not None:
                if g.dtype != self.dtype or g.device != self.device or not g.is_contiguous():
                    raise ValueError(
                        f"gradient of a {tuple(p.shape)} parameter: expected a contiguous {self.dtype} tensor on "
                        f"{self.device}, got {g.dtype} on {g.device} (contiguous={g.is_contiguous()})"
                    )
                if g.shape != p.shape:
                    raise ValueError(f"gradient shape {tuple(g.shape)} differs from its parameter's {tuple(p.shape)}")
            addresses.append(0 if g is None else g.data_ptr())
        key = tuple(addresses)
        host = self._host.get(key)
        if host is None:
            if len(self._host) >= _MAX_CACHED_TABLES:
                self._host.clear()  # addresses of ungraphed steps come and go; captured ones are kept below
            host = torch.tensor(addresses, dtype=torch.int64)
            host = host.pin_memory() if self.device.type == "cuda" else host
            self._host[key] = host
        if capturing():
            self._captured.append(host)  # every replay copies from it: it must outlive the graph, unchanged
        self.grad_ptrs.copy_(host, non_blocking=self.device.type == "cuda")
        self.aligned = self._numels_aligned and all(a % 16 == 0 for a in addresses)

    def launch_partials(self, partials: torch.Tensor) -> None:
        """Write each block's fp32 sum of squared gradients into ``partials[:n_blocks]`` (after ``load_grads``)."""
        if self.n_blocks:
            _sumsq_blocks_kernel[(self.n_blocks,)](
                self.grad_ptrs, self.block_tensor, self.block_start, self.numels, partials,
                GRAD_DTYPE=_TL_DTYPES[self.dtype], ALIGNED=self.aligned, BLOCK_SIZE=BLOCK_SIZE, num_warps=NUM_WARPS,
            )  # fmt: skip

    def launch_adamw(
        self,
        param: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        step: torch.Tensor,
        hparams: torch.Tensor,
        grad_norm: torch.Tensor | None,
        decoupled: bool,
    ) -> None:
        """One Adam(W) step of the flat buffers with the tabled gradients (arguments as ``adamw_step``)."""
        coefs = adamw_coefs(step, hparams, grad_norm)
        if self.n_blocks:
            _adamw_blocks_kernel[(self.n_blocks,)](
                param, exp_avg, exp_avg_sq, self.grad_ptrs, self.block_tensor, self.block_start, self.numels, coefs,
                DECOUPLED=decoupled, HAS_CLIP=grad_norm is not None, GRAD_DTYPE=_TL_DTYPES[self.dtype],
                ALIGNED=self.aligned, BLOCK_SIZE=BLOCK_SIZE, num_warps=NUM_WARPS,
            )  # fmt: skip


def tables_norm(tables: Sequence[GradTable]) -> torch.Tensor:
    """The global L2 norm (0-dim fp32, on the device, no host sync) of every table's gradients, as loaded."""
    device = tables[0].device
    n = sum(t.n_blocks for t in tables)
    partials = torch.empty(max(n, 1), dtype=torch.float32, device=device)
    offset = 0
    for t in tables:
        t.launch_partials(partials[offset:])
        offset += t.n_blocks
    out = torch.empty((), dtype=torch.float32, device=device)
    _sumsq_finish_kernel[(1,)](partials, out, n, BLOCK_SIZE=FINISH_BLOCK_SIZE, num_warps=4)
    return out
