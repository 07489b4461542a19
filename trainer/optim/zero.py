"""Optimizer-state sharding for ddp over the bucket plan (``distributed.shard_optimizer``, ZeRO-1/2 style).

Each bucket of the plan (:mod:`trainer.distributed.buckets`) becomes one flat parameter buffer, padded to a multiple
of the world size; the model's parameters are re-pointed into it (values kept), in bucket order. Rank ``r`` owns the
contiguous range ``[r * S, (r + 1) * S)`` of every bucket's buffer (``S`` = padded length / world size): it keeps
the optimizer state of that range only, and updates only it.

Per step:

- the backward: when a bucket's gradients are complete, :class:`~trainer.distributed.ddp.DataParallel` flattens them
  into one padded buffer and starts a reduce-scatter of it into this rank's gradient shard of the bucket
  (:meth:`BucketShards.reduce_scatter`); the parameters' whole gradients are dropped right after the flattening, so
  only the shard outlives the backward (ZeRO-2's saving; ZeRO-1's is the optimizer state);
- :meth:`ShardedOptimizer.grad_norm`: the global norm from the shards (each rank's sum of squares, all-reduced;
  padding is zero), on the device;
- :meth:`ShardedOptimizer.step`: the shards scaled by the clip coefficient, the inner optimizer's step over this
  rank's *segments*, then each bucket's buffer all-gathered from the shards, so every rank holds every parameter.

A segment is the part of one parameter inside this rank's range: a view of the flat buffer (at most one per
parameter and rank) whose ``.grad`` is the matching slice of the gradient shard. The inner optimizer is an ordinary
torch optimizer over the segments (elementwise updates: the same numbers as over whole parameters), each segment in
its parameter's weight-decay group. The Triton optimizers are refused (config): they move their parameters into flat
buffers of their own, and a segment must stay a view of its bucket's buffer. So are compiled autograd (the
reduce-scatters are not traced into its graph), fp16's grad scaler (it unscales and checks whole gradients) and the
graphed step (the optimizer keeps a float lr and is not made capturable).

Checkpoints hold the whole state: :meth:`ShardedOptimizer.state_dict` (a collective) gathers it into exactly what the
unsharded optimizer over the same parameter groups returns, and :meth:`ShardedOptimizer.load_state_dict` takes that
format from any run (sharded or not, any world size) and keeps this rank's slices.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from trainer.distributed.buckets import BucketPlan

# torch 2.13 names the tensor collectives *_single and deprecates the old names (a FutureWarning per call); 2.11 has
# only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclasses.dataclass(frozen=True)
class Segment:
    """The part of one parameter that one rank owns: elements ``[start, stop)`` of its bucket's flat buffer."""

    param: int  # the parameter's position in its bucket
    offset: int  # where the parameter starts in the flat buffer
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def padded_numel(numels: Sequence[int], world: int) -> int:
    """A bucket's flat length: its parameters' elements rounded up to a multiple of ``world`` (at least ``world``)."""
    return max(1, -(-sum(numels) // world)) * world


def rank_segments(numels: Sequence[int], world: int, rank: int) -> list[Segment]:
    """The segments ``rank`` owns of a bucket whose parameters have ``numels`` elements, in bucket order: for each
    parameter, its overlap with ``[rank * S, (rank + 1) * S)``; none for a parameter outside (or for padding)."""
    shard = padded_numel(numels, world) // world
    lo, hi = rank * shard, (rank + 1) * shard
    out, offset = [], 0
    for i, n in enumerate(numels):
        start, stop = max(offset, lo), min(offset + n, hi)
        if start < stop:
            out.append(Segment(i, offset, start, stop))
        offset += n
    return out


class BucketShards:
    """The plan's buckets as flat buffers and this rank's shards of their gradients (see the module docstring).

    Building it re-points every parameter of ``plan`` into its bucket's flat buffer (values kept): build it before
    anything reads the parameters' storage (compilation, DataParallel's broadcast, which then writes into it).

    Args:
        plan: the bucket plan of the unwrapped model.
        group: the process group (default: the world).
    """

    def __init__(self, plan: BucketPlan, group=None):
        self.plan = plan
        self.group = group if group is not None else dist.group.WORLD
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.flats: list[torch.Tensor] = []  # per bucket: (padded,) the parameters, then zeros
        self.own: list[torch.Tensor] = []  # per bucket: this rank's range of the flat buffer, the all-gather's input
        self.grad_shards: list[torch.Tensor] = []  # per bucket: (padded / world,) this rank's reduced gradients
        self.segment_of: dict[int, torch.Tensor] = {}  # id(param) -> its segment (a view of the flat buffer)
        self.range_of: dict[int, tuple[int, int]] = {}  # id(param) -> the segment's elements inside the parameter
        with torch.no_grad():
            for bucket in plan.buckets:
                numels = [p.numel() for p in bucket.params]
                flat = torch.zeros(padded_numel(numels, self.world), dtype=bucket.dtype, device=bucket.params[0].device)
                offset = 0
                for p, n in zip(bucket.params, numels):
                    view = flat[offset : offset + n]
                    view.copy_(p.detach().reshape(-1))
                    p.data = view.view(p.shape)
                    offset += n
                shard = flat.numel() // self.world
                grad_shard = torch.zeros(shard, dtype=flat.dtype, device=flat.device)
                base = self.rank * shard
                for s in rank_segments(numels, self.world, self.rank):
                    seg = flat[s.start : s.stop]
                    seg.grad = grad_shard[s.start - base : s.stop - base]  # set once: the shard is rewritten in place
                    p = bucket.params[s.param]
                    self.segment_of[id(p)] = seg
                    self.range_of[id(p)] = (s.start - s.offset, s.stop - s.offset)
                self.flats.append(flat)
                self.own.append(flat[base : base + shard])
                self.grad_shards.append(grad_shard)

    @property
    def device(self) -> torch.device:
        return self.flats[0].device

    def shard_of(self, b: int) -> tuple[int, int]:
        """This rank's range ``[start, stop)`` of bucket ``b``'s flat buffer."""
        shard = self.flats[b].numel() // self.world
        return self.rank * shard, (self.rank + 1) * shard

    def reduce_scatter(self, b: int, grads: list[torch.Tensor], dtype: torch.dtype, scale: float, op) -> tuple:
        """Start the reduce-scatter of bucket ``b``'s gradients ``grads`` (reduced in ``dtype``, pre-scaled by
        ``scale`` where the backend cannot average) into this rank's gradient shard; returns what :meth:`wait`
        needs. The parameters' whole gradients are dropped: only the shard is kept."""
        bucket = self.plan.buckets[b]
        n = bucket.numel
        flat = torch.empty(self.flats[b].numel(), dtype=dtype, device=grads[0].device)
        torch.cat([g.reshape(-1) for g in grads], out=flat[:n])  # the cast to ``dtype`` included
        flat[n:].zero_()  # padding: zero in the norm and the update
        if scale != 1.0:  # gloo (no average)
            flat.mul_(scale)
        shard = self.grad_shards[b]
        out = shard if dtype == shard.dtype else torch.empty(shard.shape, dtype=dtype, device=shard.device)
        work = _reduce_scatter(out, flat, op=op, group=self.group, async_op=True)
        for p in bucket.params:
            p.grad = None
        return flat, out, work  # the input stays referenced until the collective is waited for

    def wait(self, pending: Sequence[tuple | None]) -> None:
        """Wait for the reduce-scatters :meth:`reduce_scatter` started (one entry per bucket); the gradient shards
        then hold the reduced gradients (cast back from the reduction's dtype)."""
        for b, entry in enumerate(pending):
            assert entry is not None, f"bucket {b} was not reduced"
            _, out, work = entry
            work.wait()
            if out is not self.grad_shards[b]:
                self.grad_shards[b].copy_(out)

    def all_gather_params(self) -> None:
        """Every rank's updated shard into every bucket's flat buffer (in place: the input is the output's slice)."""
        works = [_all_gather(flat, own, group=self.group, async_op=True) for flat, own in zip(self.flats, self.own)]
        for work in works:
            work.wait()

    def gather(self, b: int, local: torch.Tensor) -> torch.Tensor:
        """Bucket ``b``'s whole flat tensor from each rank's ``local`` shard of it (a collective)."""
        full = torch.empty(self.flats[b].numel(), dtype=local.dtype, device=local.device)
        _all_gather(full, local, group=self.group)
        return full


class ShardedOptimizer(torch.optim.Optimizer):
    """An optimizer whose state is sharded over the ranks by bucket ranges (see the module docstring).

    To the trainer and a LR scheduler it looks like the unsharded optimizer over ``param_groups``: its
    ``param_groups`` hold the model's parameters and the hyperparameters (a changed ``lr`` reaches the inner
    optimizer at the next step), ``zero_grad`` clears the parameters' gradients, and ``state_dict`` /
    ``load_state_dict`` use the unsharded format. It clips itself (``clips_grad_norm``): ``grad_norm()`` is the
    global norm from the gradient shards, and ``step()`` scales the shards by ``min(1, max_grad_norm / (norm +
    1e-6))`` (as ``clip_grad_norm_``) when ``max_grad_norm > 0``.

    Args:
        param_groups: the model's parameter groups (:func:`trainer.optim.param_groups`): exactly ``plan``'s
            parameters.
        plan: the bucket plan whose buffers the parameters move into (:class:`BucketShards`); DataParallel must
            reduce over this plan with :attr:`shards`.
        build_inner: ``build_inner(groups) -> optimizer`` over the segments' groups (the same keys as
            ``param_groups``); it must not clip.
        max_grad_norm: clip to this global norm (0: the norm is measured, nothing is clipped).
        group: the process group (default: the world).
    """

    clips_grad_norm = True  # trainer.step reads the norm from grad_norm(): no rank has the whole gradients
    before_graph_replay = after_graph_replay = None  # its inner torch optimizer is made capturable for a graph

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        plan: BucketPlan,
        build_inner: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
        *,
        max_grad_norm: float = 0.0,
        group=None,
    ):
        grouped = [p for g in param_groups for p in g["params"]]
        planned = {id(p) for b in plan.buckets for p in b.params}
        assert len(grouped) == len(planned) == len({id(p) for p in grouped}) and planned == {id(p) for p in grouped}
        # Optimizer.__init__ wires the hooks; the groups are replaced below (as CompiledOptimizer does).
        super().__init__([{"params": []}], {})
        self.shards = BucketShards(plan, group)
        self.max_grad_norm = float(max_grad_norm)
        segment_of = self.shards.segment_of
        self.inner = build_inner(
            [
                {**_hparams(g), "params": [segment_of[id(p)] for p in g["params"] if id(p) in segment_of]}
                for g in param_groups
            ]
        )
        self.defaults = self.inner.defaults
        self.param_groups = [
            {**_hparams(inner), "params": list(g["params"])} for g, inner in zip(param_groups, self.inner.param_groups)
        ]
        self.impl = getattr(self.inner, "impl", type(self.inner).__name__)
        self.shard_world = self.shards.world
        self.last_grad_norm: torch.Tensor | None = None
        self._pending_norm: torch.Tensor | None = None  # from grad_norm(), used by the next step

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the reduced gradients, a 0-dim fp32 device tensor (a collective; no host sync).

        The next ``step()`` clips with it. Call it after the gradient sync (``DataParallel.finish_grad_sync``).
        """
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in self.shards.grad_shards])
        sq = norms.square().sum()
        dist.all_reduce(sq, group=self.shards.group)
        self._pending_norm = sq.sqrt()
        return self._pending_norm

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """Clip the gradient shards, update this rank's segments, all-gather the parameters (waited for). No
        closure: the gradients are those the last backward reduce-scattered."""
        assert closure is None, "ShardedOptimizer.step takes no closure"
        norm = self._pending_norm if self._pending_norm is not None else self.grad_norm()
        self._pending_norm, self.last_grad_norm = None, norm
        if self.max_grad_norm > 0:
            coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)  # clip_grad_norm_'s coefficient
            torch._foreach_mul_(self.shards.grad_shards, coef)  # the segments' .grad are views of the shards
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update(_hparams(outer))  # a scheduler's lr, a loaded group's settings
        self.inner.step()
        self.shards.all_gather_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model parameters' gradients (the shards are rewritten by the next reduction)."""
        self._pending_norm = None
        super().zero_grad(set_to_none=set_to_none)

    # -- checkpoints: the unsharded format -------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What the unsharded optimizer of the inner one's class over ``param_groups`` would return: every
        parameter's whole state, gathered from the ranks' shards. A collective: every rank calls it."""
        params = [p for g in self.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(params)}
        groups = [{**_hparams(g), "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]
        kinds = self._state_kinds()  # per group: {key: (elementwise, dtype, device)}, the same on every rank
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        per_param: dict[int, dict[str, Any]] = {}
        keys = list(dict.fromkeys(k for kind in kinds for k in kind))
        scalar_keys = [k for k in keys if any(k in kind and not kind[k][0] for kind in kinds)]
        for key in scalar_keys:
            values = self._gather_scalars(params, key)
            for i, p in enumerate(params):
                kind = kinds[group_of[id(p)]].get(key)
                if kind is not None and not kind[0]:
                    per_param.setdefault(i, {})[key] = torch.tensor(values[i], dtype=kind[1], device=kind[2])
        for key in [k for k in keys if k not in scalar_keys]:
            dtype = next(kind[key][1] for kind in kinds if key in kind)
            for b, bucket in enumerate(self.shards.plan.buckets):
                full = self.shards.gather(b, self._local_shard(b, key, dtype))
                offset = 0
                for p in bucket.params:
                    if key in kinds[group_of[id(p)]]:  # a copy: each tensor on its own storage, as torch's
                        whole = full[offset : offset + p.numel()].view(p.shape).clone()
                        per_param.setdefault(index[id(p)], {})[key] = whole
                    offset += p.numel()
        state = {}
        for i in sorted(per_param):  # keys in the inner optimizer's order
            kind = kinds[group_of[id(params[i])]]
            state[i] = {k: per_param[i][k] for k in kind if k in per_param[i]}
        return {"state": state, "param_groups": groups}

    def _state_kinds(self) -> list[dict[str, tuple[bool, torch.dtype, torch.device]]]:
        """Per parameter group, the inner optimizer's state keys: ``(elementwise, dtype, device)`` each, from the
        first rank that holds state for the group (a rank may hold no segment of a group; the ranks agree)."""
        mine: list[dict] = []
        for g in self.inner.param_groups:
            kind: dict[str, tuple[bool, str, str]] = {}
            for seg in g["params"]:
                for key, value in self.inner.state.get(seg, {}).items():
                    if isinstance(value, torch.Tensor):
                        elementwise = value.dim() > 0 and value.numel() == seg.numel()
                        kind[key] = (elementwise, str(value.dtype), "cpu" if value.device.type == "cpu" else "param")
                if kind:
                    break
            mine.append(kind)
        every: list[list[dict]] = [None] * self.shards.world  # type: ignore[list-item]
        dist.all_gather_object(every, mine, group=self.shards.group)  # checkpoint time only: a host round trip
        out = []
        for gi in range(len(self.param_groups)):
            kind = next((ranks[gi] for ranks in every if ranks[gi]), {})
            out.append(
                {
                    k: (
                        elementwise,
                        getattr(torch, dtype.removeprefix("torch.")),
                        torch.device("cpu") if where == "cpu" else self.shards.device,
                    )
                    for k, (elementwise, dtype, where) in kind.items()
                }
            )
        return out

    def _gather_scalars(self, params: list[torch.Tensor], key: str) -> list[float]:
        """Each parameter's scalar state ``key`` (the step count) from a rank that holds a segment of it."""
        values = torch.full((len(params),), float("-inf"), dtype=torch.float64, device=self.shards.device)
        segments = [self.shards.segment_of.get(id(p)) for p in params]
        held = [
            (i, self.inner.state[seg][key])
            for i, seg in enumerate(segments)
            if seg is not None and key in self.inner.state.get(seg, {})
        ]
        if held:
            idx = torch.tensor([i for i, _ in held], device=values.device)
            values[idx] = torch.stack([v.to(values.device, torch.float64) for _, v in held])
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.shards.group)  # -inf where another rank holds it
        return values.tolist()

    def _local_shard(self, b: int, key: str, dtype: torch.dtype) -> torch.Tensor:
        """This rank's range of bucket ``b`` for state ``key``: its segments' state in place, zeros elsewhere."""
        start, stop = self.shards.shard_of(b)
        local = torch.zeros(stop - start, dtype=dtype, device=self.shards.device)
        for p in self.shards.plan.buckets[b].params:
            seg = self.shards.segment_of.get(id(p))
            value = self.inner.state.get(seg, {}).get(key) if seg is not None else None
            if value is not None:
                lo = seg.storage_offset() - self.shards.flats[b].storage_offset() - start
                local[lo : lo + seg.numel()] = value.reshape(-1)
        return local

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the unsharded format (a sharded or unsharded run's, any world size): this rank's slice of each
        parameter's state goes to its segment, and the groups' settings to both the outer and the inner groups (but
        this run's implementation flags: ``foreach``, ``fused``, ...).

        Raises:
            ValueError: The state dict does not fit: another number of groups or parameters (torch's check), or a
                state tensor not of its parameter's size.
        """
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(self.param_groups, saved_groups)):
            raise ValueError(
                "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
            )
        saved_state = state_dict["state"]
        inner_groups, inner_state, i = [], {}, 0  # numbered as the inner optimizer's segments
        for g, s in zip(self.param_groups, saved_groups):
            ids = []
            for p, k in zip(g["params"], s["params"]):
                if id(p) not in self.shards.segment_of:  # no element of it on this rank
                    continue
                if k in saved_state:
                    inner_state[i] = {key: self._slice(v, p, k, key) for key, v in saved_state[k].items()}
                ids.append(i)
                i += 1
            inner_groups.append({**_hparams(s), **_impl(g), "params": ids})
        self.inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        for g, s in zip(self.param_groups, saved_groups):  # in place: a scheduler holds these dicts
            params, impl = g["params"], _impl(g)
            g.clear()
            g.update({**_hparams(s), **impl, "params": params})
        self._pending_norm = None

    def _slice(self, value: Any, p: torch.Tensor, k: int, key: str) -> Any:
        """This rank's part of a loaded state value of parameter ``p``: its segment's elements of an elementwise
        tensor (copied: the loaded whole is not kept alive), a copy of a scalar one, other values as they are."""
        if not isinstance(value, torch.Tensor):
            return value
        if value.dim() == 0 and (p.dim() > 0 or key == "step"):  # a 0-dim parameter's moments are 0-dim too
            return value.clone()
        if value.numel() != p.numel():
            raise ValueError(
                f"optimizer state dict does not fit: state[{k!r}][{key!r}] has shape {tuple(value.shape)}, its "
                f"parameter has {tuple(p.shape)}. Was it saved for another model? Load the checkpoint of this model"
            )
        lo, hi = self.shards.range_of[id(p)]
        return value.reshape(-1)[lo:hi].clone()


def _hparams(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's settings: everything but its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


# The implementation this run chose (optim.impl), kept when a checkpoint loads: a checkpoint of the Triton AdamW (the
# unsharded default on CUDA) says fused=None, which would turn the inner torch AdamW from fused to foreach.
_IMPL_KEYS = ("foreach", "fused", "capturable", "differentiable")


def _impl(group: dict[str, Any]) -> dict[str, Any]:
    return {k: group[k] for k in _IMPL_KEYS if k in group}
