"""A training step's activations and temporaries, counted from its traced graphs: no device, nothing computed.

The model is built on the meta device with one, then two, of its repeated blocks, and its parameters become empty
host tensors (allocated, never written). Its step is captured as ``trainer fit`` captures it: Dynamo, trainer's
kernel substitutions for the target device, activation checkpointing in the mode asked, autocast in the run's
precision. AOTAutograd then differentiates and partitions it as Inductor does (Inductor's decompositions, its
joint-graph passes, the min-cut partitioner with the parameters free to save), and the capture stops there: no
code is generated and no op runs.

Over the partitioned forward and backward graphs, in their order, each op's result is allocated when made and
freed after the last op that reads its storage (views and in-place results share their source's); the forward's
outputs stay (its saved tensors). The backward starts with the saved tensors (less the parameters and inputs, which
exist anyway); its outputs, the gradients, are counted apart, as the bytes made so far after each op, so that the
estimate can hold them as the run does: as made (one micro-batch a step, the gradients made in the backward: whole
on one GPU, each rank's shard under fsdp) or not at all (with accumulation they are added to gradients that exist,
a part of their own). The live bytes after each op are kept in two parts: what scales with the micro-batch (a
result computed from the token inputs with a dimension of B or B·T) and what does not; so one trace, at micro-batch
:data:`TRACE_BATCH`, gives the peak at any micro-batch.

The full depth of L blocks, from the traces with one and two blocks: each point of the two-block step plus L-2
times what one more block holds there. In the forward, and in the backward until the first block's gradients are
all made, that is what one more block saves (every block's saved tensors are live at the forward's end); once
every block's gradients are made, it is one more block's gradients; in between (the second block's backward, which
stands for any of the blocks below the first at full depth) the larger of the two. A model without repeated blocks
is traced whole.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from torch import fx

from trainer import console
from trainer.config import Config

TRACE_BATCH = 3  # the traced micro-batch: a dimension of 3 or 3·T is the batch's (no weight is 3 or 6144 wide)


@dataclass
class Walk:
    """One depth's step at :data:`TRACE_BATCH`: the live bytes after each op of the forward as ``(scaling, fixed)``;
    of the backward as ``(scaling, fixed, gradients, blocks)``: its activations and temporaries, the bytes of the
    gradients made so far (as traced) and how many blocks have all their gradients made; the bytes saved for the
    backward, and of every gradient the backward makes (as traced)."""

    forward: list[tuple[int, int]]
    backward: list[tuple[int, int, int, int]]
    saved: tuple[int, int]
    grads: int

    def peak(self, micro_batch: int, grad_scale: float, block_saved: float = 0.0, block_grads: float = 0.0,
             more: int = 0) -> float:  # fmt: skip
        """The peak at ``micro_batch`` with each traced gradient byte held as ``grad_scale`` bytes (0: not held), and
        ``more`` blocks than traced: each holding ``block_saved`` bytes in the forward and until the first block's
        gradients are made, ``block_grads`` bytes once every traced block's are, the larger of the two between."""
        x = micro_batch / TRACE_BATCH
        forward = max(fixed + scaling * x for scaling, fixed in self.forward) + more * block_saved
        depth = max((done for *_, done in self.backward), default=0)

        def extra(done: int) -> float:
            if done == 0:
                return more * block_saved
            return more * (block_grads if done >= depth else max(block_saved, block_grads))

        backward = max(
            (fixed + scaling * x + grads * grad_scale + extra(done) for scaling, fixed, grads, done in self.backward),
            default=0.0,
        )
        return max(forward, backward)

    def saved_at(self, micro_batch: int) -> float:
        return self.saved[1] + self.saved[0] * micro_batch / TRACE_BATCH


@dataclass
class Traced:
    """A mode's step at the model's full depth (:attr:`blocks`), from one or two traced depths."""

    mode: str
    blocks: int
    one: Walk
    two: Walk | None = None  # None: the model was traced whole
    seconds: float = 0.0

    def activations(self, micro_batch: int, grad_scale: float) -> float:
        """The peak bytes of the step's activations and temporaries at ``micro_batch``, with the gradients the
        backward makes held as made, each traced byte as ``grad_scale`` bytes (1: as traced, one GPU; a rank's shard
        under fsdp; 0: not held, counted as a part of their own)."""
        if self.two is None:
            return self.one.peak(micro_batch, grad_scale)
        block_saved = self.two.saved_at(micro_batch) - self.one.saved_at(micro_batch)
        block_grads = (self.two.grads - self.one.grads) * grad_scale
        return self.two.peak(micro_batch, grad_scale, block_saved, block_grads, self.blocks - 2)

    def grads(self) -> float:
        """Bytes of every gradient the backward makes at full depth, as traced."""
        if self.two is None:
            return self.one.grads
        return self.two.grads + (self.blocks - 2) * (self.two.grads - self.one.grads)

    def saved_per_sequence(self) -> float:
        """Bytes saved for the backward per sequence, at full depth."""
        if self.two is None:
            return self.one.saved[0] / TRACE_BATCH
        block = (self.two.saved[0] - self.one.saved[0]) / TRACE_BATCH
        return self.two.saved[0] / TRACE_BATCH + (self.blocks - 2) * block

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Traced:
        walks = {k: Walk(**{f: tuple(v) if f == "saved" else [tuple(x) for x in v] if isinstance(v, list) else v
                            for f, v in d[k].items()})
                 for k in ("one", "two") if d.get(k)}  # fmt: skip
        return cls(d["mode"], d["blocks"], walks["one"], walks.get("two"), d.get("seconds", 0.0))


class _Captured(Exception):
    """Raised by the capture's compiler once the partitioned graphs are in hand: nothing is compiled or run."""


def trace_mode(cfg: Config, vocab_size: int, mode: str, device_type: str = "cuda", sharded: bool = False) -> Traced:
    """:class:`Traced` for ``train.activation_checkpointing=mode`` of ``cfg``'s model and step as they would run on
    ``device_type``, traced on the host. ``sharded``: under fsdp on several ranks, whose blocks compute with the
    gathered parameters in ``distributed.param_dtype`` (counted as a part): no cast of them is made or saved."""
    import time

    from trainer.models.blocks import find_blocks

    start = time.perf_counter()
    with torch.device("meta"):
        probe = _build(cfg, vocab_size)
    try:
        blocks = len(find_blocks(probe, cfg.compile.blocks)[1])
    except ValueError:
        blocks = 0
    if blocks >= 3:
        walks = [_walk(cfg, vocab_size, mode, device_type, depth, sharded) for depth in (1, 2)]
        return Traced(mode, blocks, walks[0], walks[1], seconds=time.perf_counter() - start)
    whole = _walk(cfg, vocab_size, mode, device_type, None, sharded)
    return Traced(mode, blocks, whole, seconds=time.perf_counter() - start)


def _build(cfg: Config, vocab_size: int) -> nn.Module:
    from trainer.model_setup import build_model_of

    with console.quiet():
        return build_model_of(cfg, vocab_size, pretrained=False)


def _model(cfg: Config, vocab_size: int, depth: int | None, sharded: bool = False) -> nn.Module:
    """The model with ``depth`` of its blocks (None: all), its parameters empty host tensors, shared ones still
    shared (a tied head); ``sharded``: in fsdp's ``distributed.param_dtype``."""
    from trainer.model_setup import master_weights
    from trainer.models.blocks import find_blocks

    with torch.device("meta"):
        model = _build(cfg, vocab_size)
    if depth is not None:
        del find_blocks(model, cfg.compile.blocks)[1][depth:]
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for name, p in m.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((m, name))
    model.to_empty(device="cpu")  # to_empty makes each module's parameter anew: tie them again
    for places in owners.values():
        first = getattr(*places[0])
        for m, name in places[1:]:
            setattr(m, name, first)
    if sharded:
        from trainer.distributed.fsdp import DTYPES
        from trainer.plan import param_dtype, precision

        compute = param_dtype(cfg.distributed.param_dtype, precision(cfg.train.precision, torch.device("cuda")))
        return model.to(DTYPES[compute])
    return master_weights(model, cfg)


def _walk(cfg: Config, vocab_size: int, mode: str, device_type: str, depth: int | None, sharded: bool) -> Walk:
    fw, bw, owners = _capture(cfg, vocab_size, mode, device_type, depth, sharded)
    B, T = TRACE_BATCH, cfg.data.seq_len
    tokens = {n.name for n in fw.graph.nodes if n.op == "placeholder" and _is_tokens(n, B, T)}
    fw_scaling = _scaling(fw, tokens, B, T)
    inputs = {n.name for n in fw.graph.nodes if n.op == "placeholder"}
    saved = [n for n in bw.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    made = {n.name for n in saved if n.name not in inputs}  # saved tensors the forward made (not parameters)
    bw_scaling = _scaling(bw, {n for n in made if n in fw_scaling}, B, T)
    saved_bytes = [0, 0]
    for n in saved:
        if n.name in made:
            saved_bytes[0 if n.name in fw_scaling else 1] += _bytes(n)
    backward, grads = _backward(bw, bw_scaling, made, owners)
    return Walk(
        forward=_live(fw, fw_scaling, set(), keep_outputs=True),
        backward=backward,
        saved=tuple(saved_bytes),
        grads=grads,
    )


def _capture(cfg: Config, vocab_size: int, mode: str, device_type: str, depth: int | None, sharded: bool):
    """The partitioned forward and backward graphs of the step of ``cfg`` at micro-batch :data:`TRACE_BATCH`, and
    for each of the backward's outputs (the gradients of the forward's inputs, in their order) the index of the
    repeated block whose parameter it is the gradient of (None: not a block's)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.compile_fx import _recursive_joint_graph_passes
    from torch._inductor.decomposition import select_decomp_table

    from trainer import build
    from trainer import plan as plan_rules
    from trainer.compile.capture import LossOnly, resolve_kernels
    from trainer.compile.passes.substitute import KernelLog, substituting
    from trainer.models.blocks import find_blocks

    cfg = copy.deepcopy(cfg)
    cfg.train.activation_checkpointing = mode
    cfg.train.device = "cpu"
    plan = plan_rules.one_process(cfg, "cpu")
    got = {}

    def partition(joint, inputs, **kwargs):  # as Inductor's: its joint-graph passes, then the min-cut partitioner
        joint = _recursive_joint_graph_passes(joint, skip_invoke_subgraph=True, input_device=torch.device("cpu"))
        got["graphs"] = min_cut_rematerialization_partition(joint, inputs, compiler="inductor", **kwargs)
        return got["graphs"]

    def stop(gm, example_inputs):
        raise _Captured

    aot = aot_autograd(fw_compiler=stop, bw_compiler=stop, partition_fn=partition, decompositions=select_decomp_table())

    def recording(gm, example_inputs):  # the graph's inputs: the forward's primals, in order
        got["inputs"] = list(example_inputs)
        return aot(gm, example_inputs)

    kernels = resolve_kernels(cfg.compile.kernels, device_type)
    backend = substituting(recording, kernels, KernelLog())  # a log of its own: the run's report is not this trace's
    model = _model(cfg, vocab_size, depth, sharded)
    try:
        block_of = {id(p): i for i, b in enumerate(find_blocks(model, cfg.compile.blocks)[1]) for p in b.parameters()}
    except ValueError:  # no repeated blocks: traced whole
        block_of = {}
    with console.quiet():
        build.checkpoint_activations(model, plan)
    tokens = torch.zeros(TRACE_BATCH, cfg.data.seq_len, dtype=torch.long)
    torch._dynamo.reset()
    step = torch.compile(LossOnly(model), backend=backend, dynamic=False)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}.get(cfg.train.precision)
    try:
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            step(tokens, tokens)
    except Exception as e:  # Dynamo wraps the backend's exception
        if not _captured(e):
            raise
    finally:
        torch._dynamo.reset()
    if "graphs" not in got:
        raise RuntimeError("the step's graphs were not captured (a graph break before the loss?)")
    fw, bw = got["graphs"]
    grads = list(bw.graph.output_node().args[0])
    primals = [n for n in fw.graph.nodes if n.op == "placeholder"]
    inputs = got.get("inputs", [])
    # The backward returns one gradient (or None) per primal; the primals are the graph's inputs in order. Where
    # that does not hold, no gradient is attributed to a block (the full depth then counts saved tensors alone).
    aligned = len(grads) == len(primals) == len(inputs)
    owners = [block_of.get(id(t)) if aligned else None for t in (inputs if aligned else grads)]
    return fw, bw, owners


def _captured(e: BaseException | None) -> bool:
    while e is not None:
        if isinstance(e, _Captured):
            return True
        e = getattr(e, "inner_exception", None) or e.__cause__
    return False


def _is_tokens(n: fx.Node, B: int, T: int) -> bool:
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and v.dtype == torch.int64 and tuple(v.shape) == (B, T)


def _bytes(n: fx.Node) -> int:
    v = n.meta.get("val")
    return _int(v.numel()) * v.element_size() if isinstance(v, torch.Tensor) else 0


def _int(x) -> int:
    """A size; a symbolic one by its hint (0 for a data-dependent size, which has none)."""
    if isinstance(x, int):
        return x
    hint = getattr(getattr(x, "node", None), "hint", None)
    return int(hint) if hint is not None else 0


def _scaling(gm: fx.GraphModule, seeds: set[str], B: int, T: int) -> set[str]:
    """The nodes of ``gm`` computed from ``seeds`` whose result has a dimension of ``B`` or ``B*T``: the bytes that
    scale with the micro-batch."""
    derived, out = set(seeds), set()
    for n in gm.graph.nodes:
        if n.name in seeds or any(a.name in derived for a in n.all_input_nodes):
            derived.add(n.name)
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor) and any(d in (B, B * T) for d in v.shape):
                out.add(n.name)
    return out


def _alias_source(n: fx.Node) -> fx.Node | None:
    """The node whose storage ``n``'s result shares (a view, an in-place op), or None."""
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        returns = t._schema.returns
        if returns and returns[0].alias_info is not None and n.args and isinstance(n.args[0], fx.Node):
            return n.args[0]
    return None


def _storages(gm: fx.GraphModule) -> tuple[list[fx.Node], dict[fx.Node, fx.Node], dict[fx.Node, int]]:
    """``gm``'s nodes in order; the storage each view or in-place result shares (its source's, followed to the end);
    and the index of each storage's last reader, the output aside."""
    nodes = list(gm.graph.nodes)
    base: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        src = _alias_source(n) if n.op == "call_function" else None
        if src is not None:
            base[n] = base.get(src, src)
    last: dict[fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes if n.op != "output" else ():
            last[base.get(a, a)] = i
    return nodes, base, last


def _live(gm: fx.GraphModule, scaling: set[str], live_inputs: set[str], keep_outputs: bool) -> list[tuple[int, int]]:
    """Live bytes ``(scaling, fixed)`` after each op of ``gm`` (the points that can be the peak): the placeholders
    named in ``live_inputs`` live from the start, each op's result from when it is made; each freed after its
    storage's last reader (one that nothing reads, at once), unless the graph returns it and ``keep_outputs``."""
    nodes, base, last = _storages(gm)
    outputs = {base.get(a, a) for a in gm.graph.output_node().all_input_nodes}
    live, size = [0, 0], {}

    def add(n: fx.Node) -> None:
        size[n] = _bytes(n)  # a tuple's result is 0 here: its getitems count
        live[n.name not in scaling] += size[n]

    for n in nodes:
        if n.op == "placeholder" and n.name in live_inputs:
            add(n)
    series = [tuple(live)]
    for i, n in enumerate(nodes):
        if n.op == "output":
            break
        if n.op == "call_function" and n not in base:
            add(n)
        series.append(tuple(live))
        for a in {*n.all_input_nodes, n}:
            b = base.get(a, a)
            if b in size and last.get(b, i) <= i and (b not in outputs or not keep_outputs):
                live[b.name not in scaling] -= size.pop(b)
    return _envelope(series)


def _backward(
    gm: fx.GraphModule, scaling: set[str], live_inputs: set[str], owners: list[int | None]
) -> tuple[list[tuple[int, int, int, int]], int]:
    """The backward's points ``(scaling, fixed, gradients, blocks)`` after each op (those that can be the peak) and
    the bytes of all its gradients: the placeholders named in ``live_inputs`` live from the start and each op's result
    from when it is made, freed after its storage's last reader, as :func:`_live` counts them; the graph's outputs
    (the gradients, ``owners[i]`` the block of the ``i``-th, or None) apart: ``gradients`` the bytes made so far,
    ``blocks`` how many blocks have every gradient made."""
    nodes, base, last = _storages(gm)
    pending: dict[int, set[fx.Node]] = {}  # per block, the storages of its gradients not made yet
    outputs: set[fx.Node] = set()
    for owner, a in zip(owners, gm.graph.output_node().args[0]):
        if isinstance(a, fx.Node):
            outputs.add(base.get(a, a))
            if owner is not None:
                pending.setdefault(owner, set()).add(base.get(a, a))
    live, size, grads = [0, 0], {}, 0

    def make(n: fx.Node) -> None:
        nonlocal grads
        if n in outputs:  # a gradient: counted apart, from when it is made
            grads += _bytes(n)
            for todo in pending.values():
                todo.discard(n)
            return
        size[n] = _bytes(n)
        live[n.name not in scaling] += size[n]

    def point() -> tuple[int, int, int, int]:
        return live[0], live[1], grads, sum(1 for todo in pending.values() if not todo)

    for n in nodes:
        if n.op == "placeholder" and (n.name in live_inputs or n in outputs):
            make(n)
    series = [point()]
    for i, n in enumerate(nodes):
        if n.op == "output":
            break
        if n.op == "call_function" and n not in base:
            make(n)
        series.append(point())
        for a in {*n.all_input_nodes, n}:
            b = base.get(a, a)
            if b in size and last.get(b, i) <= i:
                live[b.name not in scaling] -= size.pop(b)
    return _front(series), grads


def _front(series: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """The points of ``series`` that can be the maximum of ``fixed + scaling * x + gradients * y`` plus a term of
    ``blocks`` for some x, y ≥ 0: of those with the same ``blocks``, the ones no other is at least as large in all
    three."""
    kept: list[tuple[int, int, int, int]] = []
    for p in sorted(set(series), reverse=True):
        if not any(q[3] == p[3] and q[0] >= p[0] and q[1] >= p[1] and q[2] >= p[2] for q in kept):
            kept.append(p)
    return kept


def _envelope(series: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The points of ``series`` that can be the maximum of ``fixed + scaling * x`` for some x ≥ 0 (the rest never
    are): fewer to keep."""
    best: dict[int, int] = {}
    for s, f in series:
        best[s] = max(best.get(s, f), f)
    points = sorted(best.items())  # by scaling
    hull: list[tuple[int, int]] = []
    for s, f in points:
        while hull and hull[-1][1] <= f:  # a point with less scaling and no more fixed never wins
            hull.pop()
        hull.append((s, f))
    return hull
