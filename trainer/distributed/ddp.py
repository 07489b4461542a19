"""Data parallel over the bucket plan: bucketed all-reduce during the backward, graphs split at buckets.

Two pieces, both driven by one :class:`~trainer.distributed.buckets.BucketPlan`:

:class:`DataParallel` wraps the (compiled) model. A post-accumulate-grad hook on every parameter
counts the bucket's ready gradients; when the last one arrives it starts one all-reduce of the
bucket. Nothing waits for it until :meth:`DataParallel.finish_grad_sync`, called once after the
last micro-batch's backward. Inside :meth:`no_sync` the hooks do nothing, so gradient accumulation
reduces once, on the last micro-step.

The same hook runs eagerly after each compiled backward piece and, under compiled autograd, is
traced by Dynamo into the one backward graph. Eagerly it reduces the gradients where they are:
one coalesced all-reduce over the bucket's ``.grad`` tensors (``allreduce_coalesced``; NCCL runs
the group as one kernel), no copy, unless a gradient is a view of memory the backward still reads
(:meth:`DataParallel._in_place_ok`). Flattening first (``torch.cat``) would read and write every
gradient byte once more (for GPT-2 124M about a gigabyte of memory traffic a step). A bucket is
flattened only when it must be: ``reduce_dtype`` narrower than the
gradients (the cast needs a buffer), or under compiled autograd, where the functional all-reduce
of the flat bucket is what Dynamo can put in the graph (the all-reduces are then nodes of the
compiled backward and the waits sit at its end); the gradients become views of the reduced
buffer. (torch's own ``optimize_ddp="python_reducer"``
issues one collective per parameter and leaves bucketing to Inductor passes that only run under
Inductor; the buckets here are the plan's on every backend.)

:class:`PlanSplitter` is the Dynamo backend that splits the forward graph at the plan's bucket
boundaries. We reuse torch's DDPOptimizer machinery (``split_module`` plus its ``SubmodCompiler``,
which compiles each piece with fake inputs) but not its bucket choice: DDPOptimizer counts bytes
in reverse graph order against a cap and cannot be given buckets, so its pieces need not match
any reducer's buckets (the C++ reducer even rebuilds its buckets after the first step). The splitter
here starts a piece at the first forward use of a bucket's parameters, so the backward of piece ``k``
completes exactly bucket ``n-1-k``, whose all-reduce then overlaps the backward of the pieces
before it.

With ``shards`` (``distributed.shard_optimizer``, :mod:`trainer.optim.zero`) each bucket is flattened into a
padded buffer and reduce-scattered instead: each rank receives its shard of the reduced bucket, for the sharded
optimizer, and the parameters' ``.grad`` are dropped (no rank has the whole reduced gradients).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _unflatten_dense_tensors

from trainer import console
from trainer.distributed.buckets import BucketPlan
from trainer.distributed.env import per_rank


class DataParallel(nn.Module):
    """Replicated data parallelism over ``plan``'s buckets (see the module docstring).

    Args:
        module: the model to call (compiled or not); its parameters must be ``plan``'s.
        plan: the bucket plan of the unwrapped model.
        group: the process group (default: the world).
        broadcast: copy rank 0's parameters and buffers to every rank first.
        reduce_dtype: dtype the buckets are all-reduced in (None: the gradients' own). A narrower one
            (bf16 for fp32 gradients) halves the bytes on the wire and rounds each rank's gradient to it
            before the sum; the reduced bucket is cast back to the gradients' dtype.
        shards: a :class:`~trainer.optim.zero.BucketShards` over ``plan`` (its parameters live in its flat
            buffers): each bucket is reduce-scattered into this rank's gradient shard (not under compiled autograd).
    """

    def __init__(
        self,
        module: nn.Module,
        plan: BucketPlan,
        group=None,
        *,
        broadcast: bool = True,
        reduce_dtype: torch.dtype | None = None,
        shards=None,
    ):
        super().__init__()
        self.module = module
        self.plan = plan
        self._group = group if group is not None else dist.group.WORLD
        # NCCL averages in the collective; gloo has no AVG: gradients pre-scaled by 1/world, summed.
        self._op = "avg" if dist.get_backend(self._group) == "nccl" else "sum"  # a functional collective's name
        self._reduce_op = dist.ReduceOp.AVG if self._op == "avg" else dist.ReduceOp.SUM  # the eager collectives'
        self._scale = 1.0 if self._op == "avg" else 1.0 / dist.get_world_size(self._group)
        self._sync = True
        self._reduce_dtype = reduce_dtype
        self._shards = shards
        n = len(plan.buckets)
        self._counts = [len(b.params) for b in plan.buckets]
        self._ready = [0] * n
        # Per bucket: eagerly (buffer, NCCL work); traced, the functional all-reduce's output.
        self._reduced: list[tuple[torch.Tensor, dist.Work] | torch.Tensor | None] = [None] * n
        self._next = [0]  # the next bucket to start: collectives start in plan order on every rank
        self._warned_late: set[int] = set()
        if broadcast:
            with torch.no_grad():
                for t in [*module.parameters(), *module.buffers()]:
                    dist.broadcast(t, src=dist.get_global_rank(self._group, 0), group=self._group)
        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(b.index)) for b in plan.buckets for p in b.params
        ]

    def remove_hooks(self) -> None:
        """Unregister the gradient hooks (before wrapping the same parameters again, e.g. after a compile failure)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; nothing is reduced."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    def _make_hook(self, b: int) -> Callable[[nn.Parameter], None]:
        def hook(param: nn.Parameter) -> None:
            if not self._sync:
                return
            self._ready[b] += 1
            # Start this bucket and any complete ones after it, strictly in plan order: NCCL pairs the
            # ranks' collectives by order, so no rank may start bucket k+1 before bucket k.
            while self._next[0] < len(self._counts) and self._ready[self._next[0]] == self._counts[self._next[0]]:
                self._launch(self._next[0])
                self._next[0] += 1

        return hook

    def _launch(self, b: int) -> None:
        grads = [p.grad for p in self.plan.buckets[b].params]
        dtype = self._reduce_dtype or grads[0].dtype
        traced = torch.compiler.is_compiling()  # by compiled autograd: the all-reduce must be a graph node
        if self._shards is not None:  # refused with compiled autograd by the config
            assert not traced, "distributed.shard_optimizer under compiled autograd"
            self._reduced[b] = self._shards.reduce_scatter(b, grads, dtype, self._scale, self._reduce_op)
            return
        if not traced and dtype == grads[0].dtype and self._in_place_ok(grads):
            # The gradients are reduced where they are, by one coalesced collective over the bucket's tensors
            # (NCCL: one group, one kernel): no flat copy, so no read and write of every gradient byte.
            if self._scale != 1.0:  # gloo (no average)
                torch._foreach_mul_(grads, self._scale)
            opts = dist.AllreduceCoalescedOptions()
            opts.reduceOp = self._reduce_op
            self._reduced[b] = (None, self._group.allreduce_coalesced(grads, opts))
            return
        grads = [g.reshape(-1) for g in grads]
        if traced:
            flat = torch.cat(grads).to(dtype)
        else:  # one buffer, written once by the cat (cast included), then reduced in place
            flat = torch.cat(grads, out=torch.empty(sum(g.numel() for g in grads), dtype=dtype, device=grads[0].device))
        if self._scale != 1.0:  # gloo (no average)
            flat = flat * self._scale
        if traced:
            import torch.distributed._functional_collectives as funcol

            self._reduced[b] = funcol.all_reduce(flat, self._op, self._group)
        else:
            self._reduced[b] = (flat, dist.all_reduce(flat, op=self._reduce_op, group=self._group, async_op=True))

    def _in_place_ok(self, grads: list[torch.Tensor]) -> bool:
        """Whether the bucket's ``.grad`` tensors may be reduced (and scaled) in place.

        Only when each gradient is the one tensor on its memory. Autograd adopts an incoming gradient
        as ``.grad`` without copying when nothing else holds that tensor object, but a view shares
        memory with the tensor it views (``p.unsqueeze(0)``'s gradient is a view of the output's,
        which the rest of the backward still reads), and ``._base`` does not tell: the adopted
        gradient is detached. So the storage's reference count decides (:func:`_sole_owner`, calibrated
        on a lone tensor). Anything else (a view of a live tensor, a slice of a
        larger buffer) takes the flat copy, which is always safe. Not for gloo with CUDA tensors
        either: its coalesced all-reduce takes CPU tensors only (a flat buffer goes through its
        one-tensor path). And the collective needs contiguous tensors.
        """
        if self._op != "avg" and grads[0].device.type != "cpu":
            return False
        return all(g.is_contiguous() and _sole_owner(g) for g in grads)

    def finish_grad_sync(self, norm: bool = False) -> torch.Tensor | None:
        """Wait for every bucket's all-reduce; the reduced gradients are then in ``param.grad``.

        Call once after the backward of the last micro-batch (outside :meth:`no_sync`). A bucket
        whose parameters did not all get a gradient (an unused layer) is reduced here, late, with
        zeros for the missing ones, and so is every bucket after it (collectives start in plan order).
        Such parameters then have a zero gradient, not None: AdamW still decays them.

        With ``norm=True`` it returns the reduced gradients' global 2-norm (what
        ``torch.nn.utils.get_total_norm`` gives over all of them, to rounding), on the device, no sync.
        Each bucket's share is computed as soon as that bucket is reduced, while the later buckets'
        all-reduces still run: the norm of every bucket but the last hides under the last reduction
        (GPT-2's embedding table, reduced after the whole backward), instead of starting after it.
        Returns None without ``norm`` or inside :meth:`no_sync`.

        With ``shards`` the reduced gradients are this rank's shards only (the sharded optimizer computes the norm
        from them); ``norm`` is then ignored and None returned.
        """
        if not self._sync:
            return None
        for bucket in self.plan.buckets[self._next[0] :]:  # in plan order, after the ones already started
            self._late(bucket)
        if self._shards is not None:
            self._shards.wait(self._reduced)
            self._reduced[:] = [None] * len(self._reduced)
            self._ready[:] = [0] * len(self._ready)
            self._next[0] = 0
            return None
        norms = []
        for bucket in self.plan.buckets:
            reduced = self._reduced[bucket.index]
            if isinstance(reduced, tuple):  # eager: (buffer, work); wait() makes this stream wait for NCCL's
                flat, work = reduced
                work.wait()
            else:  # the output of a compiled-autograd graph, already waited for inside it
                flat = reduced
            if flat is not None:  # reduced as a flat buffer: the gradients become views of it
                flat = flat.to(bucket.params[0].dtype)  # back from reduce_dtype (no copy when it is the same)
                # Views of the flat buffer made in C++, not one Python slice and view per parameter (host time).
                for p, grad in zip(bucket.params, _unflatten_dense_tensors(flat, bucket.params)):
                    p.grad = grad
            if norm:
                norms.append(torch.nn.utils.get_total_norm([p.grad for p in bucket.params]))
            self._reduced[bucket.index] = None
            self._ready[bucket.index] = 0
        self._next[0] = 0
        return torch.linalg.vector_norm(torch.stack(norms)) if norm else None

    def _late(self, bucket) -> None:
        missing = [n for n, p in zip(bucket.names, bucket.params) if p.grad is None]
        if missing and bucket.index not in self._warned_late:  # complete buckets queued behind it say nothing
            self._warned_late.add(bucket.index)
            names = ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else "")
            console.warn(
                f"bucket {bucket.index}: {len(missing)} parameter(s) got no gradient this step ({names}); the bucket "
                "is reduced after the backward, without overlap"
            )
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._launch(bucket.index)


def replicas_differ(params, env) -> str | None:
    """Under ddp every rank holds the same parameters, bit for bit: each applies the same update to the same
    all-reduced gradients. A fingerprint of them (each parameter's norm, weighted by its position, summed: the same
    kernels on the same bits give the same number) is compared over the ranks; None when every rank's equals rank
    0's, else which ranks differ. A collective and a host sync: for evaluation and checkpoint steps."""
    params = [p.detach() for p in params]
    norms = torch.stack(torch._foreach_norm(params, 2, dtype=torch.float32))  # no fp32 copies of bf16 parameters
    weights = torch.arange(1, len(params) + 1, dtype=norms.dtype, device=norms.device)
    every = per_rank((norms * weights).sum(), env).tolist()
    differ = [r for r, x in enumerate(every) if x != every[0]]
    if not differ:
        return None
    return (
        f"the data-parallel replicas' parameters differ: rank(s) {', '.join(map(str, differ))} against rank 0 "
        f"(fingerprints {every}). Each rank applies the same all-reduced gradients, so a collective gave ranks "
        "different results"
    )


def _storage_refs(t: torch.Tensor) -> int:
    storage = t.untyped_storage()  # held while counting, as in the calibration
    return torch._C._storage_Use_Count(storage._cdata)


@functools.cache
def _lone_storage_refs() -> int:
    """What :func:`_storage_refs` counts for a tensor alone on its storage. Calibrated, not assumed: whether the
    Python storage object adds a reference differs between torch versions."""
    return _storage_refs(torch.empty(1))


def _sole_owner(t: torch.Tensor) -> bool:
    """Whether ``t`` is the only tensor on its storage (pinned by tests/test_buckets.py: a view is not). False if
    this torch has no storage reference count to ask (the caller then takes the always-safe copy)."""
    if not hasattr(torch._C, "_storage_Use_Count"):
        return False
    return _storage_refs(t) <= _lone_storage_refs()


class PlanSplitter:
    """A Dynamo backend: split the forward graph at ``plan``'s bucket boundaries, compile each piece with ``inner``.

    After compiling, :attr:`pieces` holds one list per captured graph: for each piece, in forward
    order, the bucket indices whose parameters are first used there (the alignment the tests and
    ``trainer explain`` show). :attr:`misaligned` is true when a graph's pieces could not follow
    the plan (parameters used in another order than they are registered).
    """

    def __init__(self, plan: BucketPlan, inner: Callable):
        self.plan = plan
        self.inner = inner
        self.pieces: list[list[list[int]]] = []
        self.misaligned = False

    def __call__(self, gm: torch.fx.GraphModule, example_inputs, **compiler_configs):
        bucket_of = self.plan.bucket_of()
        param_bucket: dict[torch.fx.Node, int] = {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node, value in zip(placeholders, example_inputs):  # parameters are graph inputs (real tensors)
            if id(value) in bucket_of:
                param_bucket[node] = bucket_of[id(value)]
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                value = getattr(gm, node.target, None)
                if id(value) in bucket_of:
                    param_bucket[node] = bucket_of[id(value)]

        nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
        first_use: dict[int, int] = {}  # bucket -> position of the first node using its parameters
        for i, node in enumerate(nodes):
            used = [param_bucket[a] for a in node.all_input_nodes if a in param_bucket]
            if node in param_bucket:
                used.append(param_bucket[node])
            for b in used:
                first_use.setdefault(b, i)
        starts = sorted(set(first_use.values()))
        pieces = [sorted(b for b, s in first_use.items() if s == start) for start in starts]
        # Aligned: one bucket per piece, and pieces in forward order hold buckets in reverse ready order.
        order = [b for piece in pieces for b in piece]
        if any(len(p) > 1 for p in pieces) or order != sorted(order, reverse=True):
            if not self.misaligned:
                console.warn(f"graph pieces do not follow the bucket plan ({pieces}); overlap may suffer")
            self.misaligned = True
        self.pieces.append(pieces)
        if len(starts) <= 1:
            return self.inner(gm, example_inputs, **compiler_configs)

        partition: dict[torch.fx.Node, int] = {}
        piece = 0
        for i, node in enumerate(nodes):
            while piece + 1 < len(starts) and i >= starts[piece + 1]:
                piece += 1
            partition[node] = piece
        return _split_and_compile(gm, example_inputs, partition, self.inner, compiler_configs)


def _split_and_compile(gm, example_inputs, partition, inner, compiler_configs):
    """torch DDPOptimizer's second half (``torch/_dynamo/backends/distributed.py``), fed the plan's partition."""
    from torch._dynamo.backends import distributed as ddpo
    from torch._dynamo.utils import detect_fake_mode
    from torch.fx.passes.split_module import split_module

    split_gm = split_module(gm, None, lambda node: partition[node])
    ddpo.propagate_dynamo_source(gm, split_gm)
    ddpo.propagate_metadata(gm, split_gm)
    fake_mode = detect_fake_mode(example_inputs) or torch._subclasses.fake_tensor.FakeTensorMode()
    # torch 2.13's SubmodCompiler takes the backend's compiler configs; 2.11's takes none.
    extra = compiler_configs if compiler_configs else {}
    submod_compiler = ddpo.SubmodCompiler(split_gm, inner, fake_mode, **extra)
    with torch._dynamo.utils._disable_saved_tensors_hooks_during_tracing():
        submod_compiler.run(*example_inputs)
    split_gm.recompile()
    return split_gm
