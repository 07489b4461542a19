"""A training step's activations and temporaries, counted from its traced graphs: no device, nothing computed.

The model is built on the meta device with one, then two, of its repeated blocks, and its parameters become empty
host tensors (allocated, never written). Its step is captured as ``trainer fit`` captures it: Dynamo, trainer's
kernel substitutions for the target device, activation checkpointing in the mode asked, autocast in the run's
precision. AOTAutograd then differentiates and partitions it as Inductor does (Inductor's decompositions, its
joint-graph passes, the min-cut partitioner with the parameters free to save), and the capture stops there: no
code is generated and no op runs.

Over the partitioned forward and backward graphs, in their order, each op's result is allocated when made and
freed after the last op that reads its storage (views and in-place results share their source's); a graph's
outputs stay: the forward's saved tensors, and the backward's gradients where the step makes them (one micro-batch
a step; with accumulation each is added to a gradient that exists and freed). The backward starts with the saved
tensors (less the parameters and inputs, which exist anyway). The live bytes after each op are kept in two parts:
what scales with the micro-batch (a result computed from the token inputs with a dimension of B or B·T) and what
does not; so one trace, at micro-batch :data:`TRACE_BATCH`, gives the peak at any micro-batch.

The full depth of L blocks: the peak with two blocks plus L-2 times what one more block saves. The peak comes at
the forward's end or early in the backward, while every block's saved tensors are live; a model without repeated
blocks is traced whole.
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
    """One depth's step: live bytes after each op as ``(scaling, fixed)`` at :data:`TRACE_BATCH`, for the forward,
    and for the backward with its gradients kept and freed; and the bytes saved for the backward."""

    forward: list[tuple[int, int]]
    backward_keeping: list[tuple[int, int]]
    backward_adding: list[tuple[int, int]]
    saved: tuple[int, int]

    def peak(self, micro_batch: int, keep_grads: bool) -> float:
        series = self.forward + (self.backward_keeping if keep_grads else self.backward_adding)
        return max(fixed + scaling * micro_batch / TRACE_BATCH for scaling, fixed in series)

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

    def activations(self, micro_batch: int, keep_grads: bool) -> float:
        """The peak bytes of the step's activations and temporaries (and, with ``keep_grads``, its gradients made in
        the backward) at ``micro_batch``."""
        if self.two is None:
            return self.one.peak(micro_batch, keep_grads)
        per_block = self.two.saved_at(micro_batch) - self.one.saved_at(micro_batch)
        return self.two.peak(micro_batch, keep_grads) + (self.blocks - 2) * per_block

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
        walks = {k: Walk(**{f: tuple(v) if f == "saved" else [tuple(x) for x in v] for f, v in d[k].items()})
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
    fw, bw = _capture(cfg, vocab_size, mode, device_type, depth, sharded)
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
    return Walk(
        forward=_live(fw, fw_scaling, set(), keep_outputs=True),
        backward_keeping=_live(bw, bw_scaling, made, keep_outputs=True),
        backward_adding=_live(bw, bw_scaling, made, keep_outputs=False),
        saved=tuple(saved_bytes),
    )


def _capture(cfg: Config, vocab_size: int, mode: str, device_type: str, depth: int | None, sharded: bool):
    """The partitioned forward and backward graphs of the step of ``cfg`` at micro-batch :data:`TRACE_BATCH`."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.compile_fx import _recursive_joint_graph_passes
    from torch._inductor.decomposition import select_decomp_table

    from trainer import build
    from trainer import plan as plan_rules
    from trainer.compile.capture import LossOnly, resolve_kernels
    from trainer.compile.passes.substitute import KernelLog, substituting

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
    kernels = resolve_kernels(cfg.compile.kernels, device_type)
    backend = substituting(aot, kernels, KernelLog())  # a log of its own: the run's report is not this trace's
    model = _model(cfg, vocab_size, depth, sharded)
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
    return got["graphs"]


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


def _live(gm: fx.GraphModule, scaling: set[str], live_inputs: set[str], keep_outputs: bool) -> list[tuple[int, int]]:
    """Live bytes ``(scaling, fixed)`` after each op of ``gm`` (the points that can be the peak): the placeholders
    named in ``live_inputs`` live from the start, each op's result from when it is made; each freed after its
    storage's last reader (one that nothing reads, at once), unless the graph returns it and ``keep_outputs``."""
    nodes = list(gm.graph.nodes)
    base: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        src = _alias_source(n) if n.op == "call_function" else None
        if src is not None:
            base[n] = base.get(src, src)
    outputs = {base.get(a, a) for a in gm.graph.output_node().all_input_nodes}
    last: dict[fx.Node, int] = {}  # the last reader of each storage, the output aside
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes if n.op != "output" else ():
            last[base.get(a, a)] = i
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
