"""The bucket plan: the one place where gradient buckets are decided.

A bucket is a group of parameters whose gradients are reduced by one collective. The plan
decides three things at once, so they cannot disagree:

- which gradients each all-reduce carries (:class:`trainer.distributed.ddp.DataParallel`),
- where the compiled forward graph is split (:class:`trainer.distributed.ddp.PlanSplitter`):
  each graph piece's backward produces exactly one bucket's gradients, so that bucket's
  all-reduce starts while the backward of the pieces before it runs,
- the flat buffer each bucket's reduced gradients live in (the parameters' ``.grad`` are
  views into it after the reduction).

Default rule: whole blocks per bucket. The model is cut into *units* — everything registered
before the repeated blocks (embeddings), each block, everything after (final norm, head) — and
units are packed, in the order their gradients become ready (the reverse of the forward: head
first, embeddings last), into buckets of at most ``bucket_mb`` MiB. A unit is never split: a
block larger than the cap is a bucket of its own. A model without repeated blocks is packed
parameter by parameter, in reverse registration order.

The tail (``split_tail``, default on; models with blocks): the unit ready just before the last
one (GPT-2's first block) is a bucket of its own. Whatever is reduced after the last block's
backward is exposed: only the embedding backward is left to hide it. Packed with the blocks
before it, those blocks' all-reduce would wait for it (GPT-2 124M at 100 MiB: three blocks, 81 MiB,
instead of one, 27 MiB); alone, they are reduced during its backward.

A parameter shared by two modules (GPT-2's tied embedding and output head) appears once, under
the name :meth:`nn.Module.named_parameters` gives it first (the embedding), so it is reduced with
the embedding's bucket, the last: its gradient is complete only after the embedding's backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

MiB = 1 << 20


@dataclass(frozen=True)
class Bucket:
    index: int  # position in gradient-ready order: bucket 0 is reduced first
    names: tuple[str, ...]
    params: tuple[nn.Parameter, ...] = field(repr=False, compare=False)
    units: tuple[str, ...]  # the whole units it holds, e.g. ("transformer.h.11",)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype


@dataclass(frozen=True)
class BucketPlan:
    buckets: tuple[Bucket, ...]  # gradient-ready order
    cap_bytes: int
    blocks: str | None  # the repeated blocks' path, or None when packed per parameter

    def bucket_of(self) -> dict[int, int]:
        """``id(param) -> bucket index``."""
        return {id(p): b.index for b in self.buckets for p in b.params}

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def describe(self, pieces: dict[int, int] | None = None) -> str:
        """A table: bucket -> units -> parameters -> bytes (-> graph piece when ``pieces`` is given)."""
        head = f"bucket plan: {len(self.buckets)} buckets, cap {self.cap_bytes / MiB:.3g} MiB, "
        head += f"{self.nbytes / MiB:.1f} MiB of gradients, reduced in this order (first ready first)"
        lines = [head]
        for b in self.buckets:
            piece = "" if pieces is None else f" | graph piece {pieces.get(b.index, '-')}"
            units = _short_units(b.units)
            lines.append(
                f"  bucket {b.index:>2} | {units:<28} | {len(b.params):>3} params | {b.nbytes / MiB:8.2f} MiB{piece}"
            )
        return "\n".join(lines)

    def describe_params(self) -> str:
        return "\n".join(f"  bucket {b.index:>2}: {', '.join(b.names)}" for b in self.buckets)


def _short_units(units: tuple[str, ...]) -> str:
    if len(units) <= 2:
        return " + ".join(units)
    return f"{units[0]} .. {units[-1]} ({len(units)} units)"


Unit = tuple[str, list[tuple[str, nn.Parameter]]]  # (unit name, [(parameter name, parameter), ...])


def _units(model: nn.Module, blocks_path: str | None) -> tuple[list[Unit], str | None]:
    """``[(unit name, [(param name, param), ...]), ...]`` in forward (registration) order."""
    from trainer.models.blocks import find_blocks

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    try:
        path, _ = find_blocks(model, blocks_path)
    except ValueError:
        if blocks_path is not None:
            raise
        return [(n, [(n, p)]) for n, p in named], None
    prefix = f"{path}." if path else ""
    units: list[tuple[str, list]] = []
    before, after, per_block = [], [], {}
    for n, p in named:
        index = n[len(prefix) :].split(".", 1)[0] if n.startswith(prefix) else ""
        if index.isdigit():
            per_block.setdefault(int(index), []).append((n, p))
        elif not per_block:
            before.append((n, p))
        else:
            after.append((n, p))
    if before:
        units.append(("embeddings" if path else "before blocks", before))
    units += [(f"{prefix}{i}", per_block[i]) for i in sorted(per_block)]
    if after:
        units.append(("head", after))
    return units, path


def plan_buckets(model: nn.Module, bucket_mb: float, blocks: str | None = None, split_tail: bool = True) -> BucketPlan:
    """Pack ``model``'s trainable parameters into buckets of whole units, at most ``bucket_mb`` MiB each.

    Args:
        model: the unwrapped model (not compiled, not sharded).
        bucket_mb: the cap; a unit larger than it is a bucket of its own.
        blocks: the repeated blocks' path (``compile.blocks``); None finds them (see
            :func:`trainer.models.blocks.find_blocks`) or packs per parameter if there are none.
        split_tail: the unit ready just before the last one is a bucket of its own (module docstring).
    """
    if bucket_mb <= 0:
        raise ValueError(f"distributed.bucket_mb: expected a positive size, got {bucket_mb}")
    cap = int(bucket_mb * MiB)
    units, path = _units(model, blocks)
    out: list[Bucket] = []
    cur: list[tuple[str, nn.Parameter]] = []
    cur_units: list[str] = []
    cur_bytes = 0

    def close():
        nonlocal cur, cur_units, cur_bytes
        if cur:
            out.append(Bucket(len(out), tuple(n for n, _ in cur), tuple(p for _, p in cur), tuple(cur_units)))
        cur, cur_units, cur_bytes = [], [], 0

    ready = list(reversed(units))  # gradient-ready order
    tail = len(ready) - 2 if split_tail and path is not None and len(ready) > 2 else None  # units, not params
    for i, (unit, params) in enumerate(ready):
        if i == tail:
            close()
        params = list(reversed(params))
        # One dtype per bucket (one flat buffer); a unit with several dtypes is split by dtype.
        by_dtype: dict[torch.dtype, list] = {}
        for n, p in params:
            by_dtype.setdefault(p.dtype, []).append((n, p))
        for group in by_dtype.values():
            size = sum(p.numel() * p.element_size() for _, p in group)
            if cur and (cur_bytes + size > cap or cur[0][1].dtype != group[0][1].dtype):
                close()
            cur += group
            cur_units.append(unit)
            cur_bytes += size
        if i == tail:
            close()
    close()
    if not out:
        raise ValueError("distributed: the model has no trainable parameters to reduce")
    return BucketPlan(tuple(out), cap, path)
