"""FSDP2: ``fully_shard`` on units of blocks and on the root, mixed precision, DCP checkpoints.

Order (torchtitan's, and the one that is correct with compile, see PYTORCH_NOTES): compile each
block in place, then ``fully_shard`` the blocks, then the root. The root is never compiled: FSDP's
hooks are ``dynamo.disable``-d, so a compiled root drops to eager; compiling per block keeps every
block's compute compiled.

Units: the blocks are grouped as the bucket plan packs them (:mod:`trainer.distributed.buckets`,
whole blocks up to ``distributed.fsdp_unit_mb``), one ``fully_shard`` unit per group, so one all-gather
and one reduce-scatter per group rather than per block. FSDP2's hooks cost host time per unit and per
collective, and a small model's step is host-bound (GPT-2 124M with a unit per block leaves the GPU idle
most of the step; docs/performance.md). What is not in a block (embeddings,
final norm, head) stays with the root.

The model is built whole by rank 0 alone (on its GPU, where it fits: ``trainer.build.make_model``); the other
ranks build it with its parameters on the meta device (no memory:
:func:`trainer.models.no_init.parameters_on_meta`), shard it as rank 0 does, and receive their shards from rank 0's
parameters (:func:`materialize_from_rank0`). Memory at start is one model's, not one per rank (an 8B model is 32 GB
in fp32), and every rank starts from the values a single process builds with the same seed.

Checkpoints of a sharded model go through ``torch.distributed.checkpoint`` (DCP; :mod:`trainer.checkpoint`, the
model's and optimizer's state dicts in :mod:`trainer.checkpoint.states`): each rank writes its shards, and a load
reshards to whatever the current world size is (or to whole tensors in one process).
"""

from __future__ import annotations

import torch
import torch.nn as nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def apply_fsdp(
    model: nn.Module,
    units: list[list[nn.Module]],
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    reshard_after_forward: bool,
    keep_gathered: int = 0,
    mesh=None,
) -> nn.Module:
    """Shard ``model`` in place: each unit of blocks (see :func:`block_units`), then the root. Returns ``model``.

    Args:
        units: the blocks, grouped; each group is one ``fully_shard`` unit.
        param_dtype: dtype parameters are gathered in for compute (None: as stored, fp32).
        reduce_dtype: dtype gradients are reduce-scattered in (None: ``param_dtype``).
        reshard_after_forward: free each unit's gathered parameters after its forward (gathered
            again for the backward). The root keeps them: its backward comes first.
        keep_gathered: with ``reshard_after_forward``, the first this-many of ``units`` (the forward's last) keep
            theirs too: the backward starts with them.
        mesh: the ``DeviceMesh`` to shard over (:meth:`trainer.distributed.mesh.Mesh.fsdp_mesh`): one dimension
            (FSDP), or two, replicate and shard (HSDP: reduce-scatter within a shard group, all-reduce across);
            None: every rank.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kept = kept_units(len(units), reshard_after_forward, keep_gathered)
    for i, unit in enumerate(units):
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, mp_policy=mp, reshard_after_forward=i >= kept)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    return model


def full_state(model: nn.Module) -> dict:
    """The unsharded model's state dict under the names sharding keeps (what :func:`materialize_from_rank0`
    sends): rank 0's, taken before ``fully_shard`` replaces its parameters by shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def materialize_from_rank0(model: nn.Module, full: dict | None, device: torch.device) -> None:
    """After ``fully_shard``: every rank's shards and buffers become rank 0's values. ``full``: rank 0's
    :func:`full_state` (None on the other ranks, whose parameters are on the meta device and are allocated here).
    One tensor at a time goes from rank 0 to every rank, which keeps its shard of it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank = dist.get_rank()
    if rank != 0:
        model.to_empty(device=device)  # the shards allocated (and the buffers, refilled below)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    set_model_state_dict(model, full if rank == 0 else {}, options=options)
    with torch.no_grad():  # every buffer, those outside the state dict (non-persistent) too
        for b in model.buffers():
            dist.broadcast(b, src=0)
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise RuntimeError(f"fsdp: parameters left on the meta device after sharding: {', '.join(meta[:3])}")


def block_units(model: nn.Module, blocks: str | None, unit_mb: float | None) -> list[list[nn.Module]]:
    """The repeated blocks grouped into FSDP units, in gradient-ready order (last block's unit first).

    With ``unit_mb``: the blocks of each bucket of :func:`trainer.distributed.buckets.plan_buckets` (whole
    blocks up to ``unit_mb`` MiB, without DDP's tail rule: units gain from being few) form one unit; units that
    are not blocks (embeddings, head) are left to the root. Without: one unit per block.
    """
    from trainer.distributed.buckets import plan_buckets
    from trainer.models.blocks import find_blocks

    path, block_list = find_blocks(model, blocks)
    if unit_mb is None:
        return [[b] for b in reversed(block_list)]
    prefix = f"{path}." if path else ""
    by_name = {f"{prefix}{i}": b for i, b in enumerate(block_list)}
    plan = plan_buckets(model, unit_mb, path, split_tail=False)
    units = [[by_name[u] for u in bucket.units if u in by_name] for bucket in plan.buckets]
    return [u for u in units if u]


def kept_units(n_units: int, reshard_after_forward: bool, keep_gathered: int) -> int:
    """How many of the units (the first, in gradient-ready order) keep their gathered parameters from the forward
    into the backward."""
    return min(keep_gathered, n_units) if reshard_after_forward else n_units


def describe_units(model: nn.Module, units: list[list[nn.Module]], unit_mb: float | None, kept: int = 0) -> str:
    """``trainer explain``'s view of the FSDP units: one line per unit (its blocks, MiB of parameters as stored,
    and whether it stays gathered into the backward: the first ``kept``)."""
    names = {id(m): n for n, m in model.named_modules()}
    cap = f"cap {unit_mb:g} MiB" if unit_mb else "a unit per block"
    lines = [f"fsdp: {len(units)} fully_shard unit(s) of blocks ({cap}), in gradient-ready order, then the root"]
    for i, unit in enumerate(units):
        first, last = names[id(unit[0])], names[id(unit[-1])]
        span = first if len(unit) == 1 else f"{first} .. {last} ({len(unit)} blocks)"
        mib = sum(p.numel() * p.element_size() for m in unit for p in m.parameters()) / (1 << 20)
        keep = " | kept gathered into the backward" if i < kept else ""
        lines.append(f"  unit {i:>2} | {span:<50} | {mib:8.2f} MiB{keep}")
    rest = {id(p) for u in units for m in u for p in m.parameters()}
    root = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in rest) / (1 << 20)
    lines.append(f"  root    | {'everything else (embeddings, head)':<50} | {root:8.2f} MiB")
    return "\n".join(lines)


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)
