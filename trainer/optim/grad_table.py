"""Optimizer steps and the gradient norm through address tables: gradients (and parameters) left where they are.

:class:`~trainer.optim.flat_group.FlatGroup` keeps every ``p.grad`` as a view into one flat buffer, so
autograd adds each new gradient into it (``grad += new``: read, read, write) and ``zero_grad`` writes
zeros: ~16 bytes per fp32 parameter per step on top of the optimizer's 28, more than the flat kernel saves
over torch's fused AdamW on one GPU. Here only parameters and optimizer states are flat (unless in place,
below), each parameter starting on a ``BLOCK_SIZE`` boundary so that every block of the flat layout belongs to
one parameter; gradients are whatever tensors autograd assigned (``zero_grad(set_to_none=True)`` as usual), and
each program reads its block's gradient through a table of their addresses:

- ``block_tensor[b]``, ``block_start[b]``: the parameter block ``b`` belongs to and where the block starts
  inside it (static, built once per layout);
- ``grad_ptrs[i]``: the address of parameter ``i``'s gradient this step, 0 for ``None`` (read as zeros);
- in place only: ``param_ptrs[i]``, the address of parameter ``i`` itself, and one table per optimizer state.

In place (``in_place=True``) nothing is flat: the layout only numbers the blocks, and the kernels read and
write each parameter where it lives. This is how FSDP2's parameters are updated: each is a ``DTensor`` whose
local shard (``p._local_tensor``, a view of FSDP's own sharded storage, which its all-gather reads) must stay
where FSDP put it, and whose gradient is a ``DTensor`` of the same local shape. Every table then holds the
local shards, and each optimizer state is one tensor per parameter shaped like its local shard, as torch's
optimizers keep them (why not a flat buffer: :mod:`~trainer.optim.flat`), read through its own table.

The addresses are copied to the device from a pinned host buffer that is never rewritten (one per
distinct set of addresses, a few at most), so the copy can be captured in a CUDA graph: a replay re-reads
the addresses the graph's own gradients have.

The updates are the flat kernels', element for element: AdamW's through ``adamw.adamw_update_block``; SGD's
shares ``sgd._sgd_kernel``'s arithmetic (``sgd.sgd_update_block``). The norm is accumulated in fp32 per block, then
summed in one program (deterministic, no atomics); over shards (``tables_norm(..., groups)``) the partial sum
of squares is all-reduced on the device before the square root.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from trainer.ops.utils import capturing
from trainer.optim.adamw import NUM_WARPS, adamw_coefs, adamw_update_block
from trainer.optim.grad_norm import FINISH_BLOCK_SIZE, _sumsq_finish_kernel
from trainer.optim.sgd import N_COEFS as SGD_N_COEFS
from trainer.optim.sgd import _sgd_coefs_kernel, sgd_update_block

BLOCK_SIZE = 2048
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_MAX_CACHED_TABLES = 8


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (FSDP2's parameters and gradients)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``t``'s values on this rank: a ``DTensor``'s local tensor (for FSDP2: a view of
    its sharded storage), unwrapped from a wrapper subclass that has no storage of its own, else ``t`` itself.

    ``_local_tensor`` rather than ``to_local()``: the same storage without an autograd node per call (per parameter
    per step on the host); FSDP2 itself reads it. tests/test_fsdp_optim.py pins that the optimizer writes there.
    A wrapper subclass (torchao's float8 weights, ``WeightWithDynamicFloat8CastTensor``, under fsdp) reports
    ``data_ptr() == 0``; its one inner tensor of the same shape and dtype (beside a precomputed scale) is where its
    values live, and what an in-place update must write (torch's optimizers reach it through the subclass's
    dispatch).
    """
    t = t._local_tensor if is_dtensor(t) else t
    while is_traceable_wrapper_subclass(t) and not is_dtensor(t):
        names, _ = t.__tensor_flatten__()
        inner = [x for x in (getattr(t, n) for n in names) if x.shape == t.shape and x.dtype == t.dtype]
        if len(inner) != 1:  # its values are not one inner tensor (a precomputed scale beside them is no matter)
            break
        t = inner[0]
    return t


def _address(t: torch.Tensor, kind: str) -> int:
    """``t``'s data address for a kernel's table; an error for a tensor with no storage of its own (address 0, which
    the kernels read as "no tensor" for a gradient and would write through for a parameter). ``kind``: parameter or
    gradient, for the message."""
    address = t.data_ptr()
    if address == 0 and t.numel() > 0:
        raise ValueError(
            f"a {tuple(t.shape)} {kind} of type {type(t).__name__} has no storage of its own (data_ptr() is 0): the "
            "Triton optimizer cannot update it in place; set optim.impl=fused"
        )
    return address


@triton.jit
def _block(BlockTensor_ptr, BlockStart_ptr, Numel_ptr, pid, ALIGNED: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The tensor ``t`` block ``pid`` belongs to, the block's element indices inside it, and its numel."""
    t = tl.load(BlockTensor_ptr + pid)
    start = tl.multiple_of(tl.load(BlockStart_ptr + pid), BLOCK_SIZE)
    numel = tl.load(Numel_ptr + t)
    if ALIGNED:
        numel = tl.multiple_of(numel, 16)
    return t, start + tl.arange(0, BLOCK_SIZE), numel


@triton.jit
def _tabled(Ptrs_ptr, t, idx, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Pointers to elements ``idx`` of tensor ``t`` of an address table, and the address (0: no tensor)."""
    address = tl.load(Ptrs_ptr + t)
    ptrs = address.to(tl.pointer_type(DTYPE)) + idx
    if ALIGNED:
        ptrs = tl.max_contiguous(tl.multiple_of(ptrs, 16), 16)
    return ptrs, address


@triton.jit
def _grad_block(
    GradPtrs_ptr,
    BlockTensor_ptr,
    BlockStart_ptr,
    Numel_ptr,
    pid,
    GRAD_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """This program's block of its parameter's gradient, widened to fp32 (zeros past the end or for None), the
    mask of the block's elements inside the parameter, the parameter's index and the elements' indices in it.

    ALIGNED: every address is 16-byte aligned and every length a multiple of 16 (the host checked), so the
    loads compile to 16-byte vectors."""
    t, idx, numel = _block(BlockTensor_ptr, BlockStart_ptr, Numel_ptr, pid, ALIGNED, BLOCK_SIZE)
    ptrs, address = _tabled(GradPtrs_ptr, t, idx, GRAD_DTYPE, ALIGNED)
    present = tl.where(address != 0, numel, 0)  # a None gradient: nothing to load, zeros
    if ALIGNED:
        present = tl.multiple_of(present, 16)
    g = tl.load(ptrs, mask=idx < present, other=0.0).to(tl.float32)
    return g, idx < numel, t, idx


@triton.jit
def _sumsq_blocks_kernel(
    GradPtrs_ptr,
    BlockTensor_ptr,
    BlockStart_ptr,
    Numel_ptr,
    Partials_ptr,
    GRAD_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    g, _, _, _ = _grad_block(
        GradPtrs_ptr, BlockTensor_ptr, BlockStart_ptr, Numel_ptr, pid, GRAD_DTYPE, ALIGNED, BLOCK_SIZE
    )
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
    STOCHASTIC: tl.constexpr = False,
):
    pid = tl.program_id(0)
    g, mask, _, _ = _grad_block(
        GradPtrs_ptr, BlockTensor_ptr, BlockStart_ptr, Numel_ptr, pid, GRAD_DTYPE, ALIGNED, BLOCK_SIZE
    )
    offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    adamw_update_block(
        Param_ptr, ExpAvg_ptr, ExpAvgSq_ptr, offsets, mask, g, Coefs_ptr, DECOUPLED, HAS_CLIP, STOCHASTIC, offsets
    )


@triton.jit
def _adamw_in_place_kernel(
    ParamPtrs_ptr,
    ExpAvgPtrs_ptr,
    ExpAvgSqPtrs_ptr,
    GradPtrs_ptr,
    BlockTensor_ptr,
    BlockStart_ptr,
    Numel_ptr,
    Coefs_ptr,
    DECOUPLED: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    PARAM_DTYPE: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    STOCHASTIC: tl.constexpr = False,
):
    """``_adamw_blocks_kernel`` with the parameters and both states, too, read and written where they live
    (through their address tables); the states in the parameters' dtype with ``STOCHASTIC`` (bf16), else fp32."""
    pid = tl.program_id(0)
    g, mask, t, idx = _grad_block(
        GradPtrs_ptr, BlockTensor_ptr, BlockStart_ptr, Numel_ptr, pid, GRAD_DTYPE, ALIGNED, BLOCK_SIZE
    )
    params, _ = _tabled(ParamPtrs_ptr, t, idx, PARAM_DTYPE, ALIGNED)
    if STOCHASTIC:
        exp_avg, _ = _tabled(ExpAvgPtrs_ptr, t, idx, PARAM_DTYPE, ALIGNED)
        exp_avg_sq, _ = _tabled(ExpAvgSqPtrs_ptr, t, idx, PARAM_DTYPE, ALIGNED)
    else:
        exp_avg, _ = _tabled(ExpAvgPtrs_ptr, t, idx, tl.float32, ALIGNED)
        exp_avg_sq, _ = _tabled(ExpAvgSqPtrs_ptr, t, idx, tl.float32, ALIGNED)
    positions = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)  # distinct per element: random bits
    # adamw_update_block adds its offsets to each pointer: here blocks of pointers, already at their elements.
    adamw_update_block(params, exp_avg, exp_avg_sq, 0, mask, g, Coefs_ptr, DECOUPLED, HAS_CLIP, STOCHASTIC, positions)


@triton.jit
def _sgd_blocks_kernel(
    Param_ptr,
    ParamPtrs_ptr,
    MomentumBuffer_ptr,
    MomentumBufferPtrs_ptr,
    GradPtrs_ptr,
    BlockTensor_ptr,
    BlockStart_ptr,
    Numel_ptr,
    Coefs_ptr,
    IN_PLACE: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    PARAM_DTYPE: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """SGD with tabled gradients: the parameters and the momentum buffer flat (``Param_ptr``, ``MomentumBuffer_ptr``)
    or, ``IN_PLACE``, where they live (``ParamPtrs_ptr``, ``MomentumBufferPtrs_ptr``: address tables)."""
    pid = tl.program_id(0)
    g, mask, t, idx = _grad_block(
        GradPtrs_ptr, BlockTensor_ptr, BlockStart_ptr, Numel_ptr, pid, GRAD_DTYPE, ALIGNED, BLOCK_SIZE
    )
    if IN_PLACE:
        params, _ = _tabled(ParamPtrs_ptr, t, idx, PARAM_DTYPE, ALIGNED)
        momentum_buffer, _ = _tabled(MomentumBufferPtrs_ptr, t, idx, tl.float32, ALIGNED)
    else:
        offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        params = Param_ptr + offsets
        momentum_buffer = MomentumBuffer_ptr + offsets
    sgd_update_block(params, g, momentum_buffer, mask, Coefs_ptr, HAS_MOMENTUM, NESTEROV, HAS_CLIP)


class GradTable:
    """The block table of one flat layout and the device copies of its tensors' addresses.

    Args:
        params: The parameters, in flat-layout order, one dtype and device (``DTensor``: their local shards).
        offsets: Each parameter's start in the flat buffers; multiples of ``BLOCK_SIZE``.
        numel: Length of the flat buffers (a multiple of ``BLOCK_SIZE``).
        in_place: The kernels read and write the parameters where they live, through ``param_ptrs``, instead of
            a flat parameter buffer (FSDP2's shards), and the states as lists of per-parameter tensors. Each local
            tensor must be contiguous.
    """

    def __init__(self, params: Sequence[torch.Tensor], offsets: Sequence[int], numel: int, *, in_place: bool = False):
        if numel % BLOCK_SIZE or any(o % BLOCK_SIZE for o in offsets):
            raise ValueError(f"GradTable needs a layout aligned to {BLOCK_SIZE} elements")
        self.params = list(params)
        self.in_place = in_place
        local = [local_tensor(p) for p in self.params]
        self.shapes = [t.shape for t in local]
        self.device = local[0].device
        self.dtype = local[0].dtype
        n_blocks = numel // BLOCK_SIZE
        block_tensor = torch.zeros(n_blocks, dtype=torch.int32)
        block_start = torch.full((n_blocks,), 2**40, dtype=torch.int64)  # padding blocks: past every end
        for i, (t, o) in enumerate(zip(local, offsets)):
            first, count = o // BLOCK_SIZE, triton.cdiv(t.numel(), BLOCK_SIZE)
            block_tensor[first : first + count] = i
            block_start[first : first + count] = torch.arange(count, dtype=torch.int64) * BLOCK_SIZE
        self.n_blocks = n_blocks
        self.block_tensor = block_tensor.to(self.device)
        self.block_start = block_start.to(self.device)
        self.numels = torch.tensor([t.numel() for t in local], dtype=torch.int64, device=self.device)
        self.grad_ptrs = torch.zeros(len(self.params), dtype=torch.int64, device=self.device)
        self.param_ptrs = torch.zeros(len(self.params), dtype=torch.int64, device=self.device) if in_place else None
        self.aligned = False  # of the addresses last loaded (see _grad_block)
        self._numels_aligned = all(t.numel() % 16 == 0 for t in local)
        self._params_aligned = True
        self._param_addresses: tuple[int, ...] | None = None
        self._state_ptrs: dict[tuple[int, ...], torch.Tensor] = {}  # in place: the states' address tables
        self._host: dict[tuple[int, ...], torch.Tensor] = {}  # addresses -> pinned buffer, never rewritten
        self._captured: list[torch.Tensor] = []

    def _copy_addresses(self, addresses: list[int], dst: torch.Tensor) -> None:
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
        dst.copy_(host, non_blocking=self.device.type == "cuda")

    def _load_params(self) -> None:
        """In place: copy the parameters' addresses to the device when they changed (FSDP2 may re-point a shard)."""
        local = [local_tensor(p) for p in self.params]
        addresses = tuple(_address(t, "parameter") for t in local)
        if addresses == self._param_addresses:
            return
        for t, shape in zip(local, self.shapes):
            if t.dtype != self.dtype or t.device != self.device or not t.is_contiguous() or t.shape != shape:
                raise ValueError(
                    f"a parameter updated in place must stay a contiguous {self.dtype} tensor of shape "
                    f"{tuple(shape)} on {self.device}; got {t.dtype} {tuple(t.shape)} on {t.device} "
                    f"(contiguous={t.is_contiguous()})"
                )
        self._copy_addresses(list(addresses), self.param_ptrs)
        self._param_addresses = addresses
        self._params_aligned = all(a % 16 == 0 for a in addresses)

    def _states_table(self, states: Sequence[torch.Tensor]) -> torch.Tensor:
        """In place: the device address table of one optimizer state (a tensor per parameter), built once."""
        addresses = tuple(t.data_ptr() for t in states)
        table = self._state_ptrs.get(addresses)
        if table is None:
            for t, shape in zip(states, self.shapes, strict=True):
                assert t.dtype in (torch.float32, torch.bfloat16) and t.device == self.device
                assert t.is_contiguous() and t.shape == shape
            # Each its own allocation (16-byte aligned by every allocator), so the states never spoil ALIGNED.
            assert all(a % 16 == 0 for t, a in zip(states, addresses) if t.numel())
            table = torch.empty(len(addresses), dtype=torch.int64, device=self.device)
            self._copy_addresses(list(addresses), table)
            self._state_ptrs[addresses] = table
        return table

    def load_grads(self) -> None:
        """Copy the parameters' current gradient addresses (and, in place, their own) to the device (capturable;
        no host sync)."""
        if self.in_place:
            self._load_params()
        addresses = []
        for p, shape in zip(self.params, self.shapes):
            g = p.grad
            if g is not None:
                g = local_tensor(g)
                if g.dtype != self.dtype or g.device != self.device or not g.is_contiguous():
                    raise ValueError(
                        f"gradient of a {tuple(p.shape)} parameter: expected a contiguous {self.dtype} tensor on "
                        f"{self.device}, got {g.dtype} on {g.device} (contiguous={g.is_contiguous()})"
                    )
                if g.shape != shape:
                    raise ValueError(f"gradient shape {tuple(g.shape)} differs from its parameter's {tuple(shape)}")
            addresses.append(0 if g is None else _address(g, "gradient"))
        self._copy_addresses(addresses, self.grad_ptrs)
        self.aligned = self._numels_aligned and self._params_aligned and all(a % 16 == 0 for a in addresses)

    def launch_partials(self, partials: torch.Tensor) -> None:
        """Write each block's fp32 sum of squared gradients into ``partials[:n_blocks]`` (after ``load_grads``)."""
        if self.n_blocks:
            _sumsq_blocks_kernel[(self.n_blocks,)](
                self.grad_ptrs,
                self.block_tensor,
                self.block_start,
                self.numels,
                partials,
                GRAD_DTYPE=_TL_DTYPES[self.dtype],
                ALIGNED=self.aligned,
                BLOCK_SIZE=BLOCK_SIZE,
                num_warps=NUM_WARPS,
            )

    def launch_adamw(
        self,
        param: torch.Tensor | None,
        exp_avg: torch.Tensor | Sequence[torch.Tensor],
        exp_avg_sq: torch.Tensor | Sequence[torch.Tensor],
        step: torch.Tensor,
        hparams: torch.Tensor,
        grad_norm: torch.Tensor | None,
        decoupled: bool,
        stochastic: bool = False,
    ) -> None:
        """One Adam(W) step of the flat buffers with the tabled gradients (arguments as ``adamw_step``); in place,
        ``param`` is None (the parameters are updated where they live) and each state is a tensor per parameter."""
        coefs = adamw_coefs(step, hparams, grad_norm)
        if not self.n_blocks:
            return
        table = (self.grad_ptrs, self.block_tensor, self.block_start, self.numels, coefs)
        flags = dict(
            DECOUPLED=decoupled,
            HAS_CLIP=grad_norm is not None,
            GRAD_DTYPE=_TL_DTYPES[self.dtype],
            ALIGNED=self.aligned,
            BLOCK_SIZE=BLOCK_SIZE,
            STOCHASTIC=stochastic,
            num_warps=NUM_WARPS,
        )
        if self.in_place:
            assert param is None
            _adamw_in_place_kernel[(self.n_blocks,)](
                self.param_ptrs,
                self._states_table(exp_avg),
                self._states_table(exp_avg_sq),
                *table,
                PARAM_DTYPE=_TL_DTYPES[self.dtype],
                **flags,
            )
        else:
            _adamw_blocks_kernel[(self.n_blocks,)](param, exp_avg, exp_avg_sq, *table, **flags)

    def launch_sgd(
        self,
        param: torch.Tensor | None,
        momentum_buffer: torch.Tensor | Sequence[torch.Tensor] | None,
        step: torch.Tensor,
        hparams: torch.Tensor,
        grad_norm: torch.Tensor | None,
        nesterov: bool,
    ) -> None:
        """One SGD step with the tabled gradients (arguments as ``sgd_step``); in place, ``param`` is None and the
        momentum buffer a tensor per parameter."""
        coefs = torch.empty(SGD_N_COEFS, dtype=torch.float32, device=step.device)
        has_clip = grad_norm is not None
        _sgd_coefs_kernel[(1,)](step, hparams, grad_norm if has_clip else step, coefs, HAS_CLIP=has_clip, num_warps=1)
        if not self.n_blocks:
            return
        assert (param is None) == self.in_place
        dummy = self.grad_ptrs  # the pointer arguments this launch does not read (flat or in place, momentum or not)
        has_momentum = momentum_buffer is not None
        in_place_buffer = self._states_table(momentum_buffer) if self.in_place and has_momentum else dummy
        _sgd_blocks_kernel[(self.n_blocks,)](
            dummy if self.in_place else param,
            self.param_ptrs if self.in_place else dummy,
            momentum_buffer if has_momentum and not self.in_place else dummy,
            in_place_buffer,
            self.grad_ptrs,
            self.block_tensor,
            self.block_start,
            self.numels,
            coefs,
            IN_PLACE=self.in_place,
            HAS_MOMENTUM=has_momentum,
            NESTEROV=nesterov,
            HAS_CLIP=has_clip,
            PARAM_DTYPE=_TL_DTYPES[self.dtype],
            GRAD_DTYPE=_TL_DTYPES[self.dtype],
            ALIGNED=self.aligned,
            BLOCK_SIZE=BLOCK_SIZE,
            num_warps=NUM_WARPS,
        )


def tables_norm(tables: Sequence[GradTable], groups: Sequence = ()) -> torch.Tensor:
    """The global L2 norm (0-dim fp32, on the device, no host sync) of every table's gradients, as loaded.

    Args:
        tables: The tables (``load_grads`` done).
        groups: Process groups over which the tables hold shards of the gradients (FSDP2's): the local sum of
            squares is all-reduced (summed) over each, on the device, before the square root; every rank of
            each group must call this. Empty: the tables hold whole gradients.
    """
    device = tables[0].device
    n = sum(t.n_blocks for t in tables)
    partials = torch.empty(max(n, 1), dtype=torch.float32, device=device)
    offset = 0
    for t in tables:
        t.launch_partials(partials[offset:])
        offset += t.n_blocks
    if groups:
        # A rank may hold no block at all (every local shard empty): its sum is a zero, not a missing term.
        sumsq = partials[:n].sum()
        for group in groups:
            torch.distributed.all_reduce(sumsq, group=group)
        return sumsq.sqrt()
    out = torch.empty((), dtype=torch.float32, device=device)
    _sumsq_finish_kernel[(1,)](partials, out, n, BLOCK_SIZE=FINISH_BLOCK_SIZE, num_warps=4)
    return out
