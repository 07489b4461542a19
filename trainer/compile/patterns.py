"""trainer's Triton kernels substituted into any captured graph: no switches inside a model.

A pass over each FX graph that Dynamo captures recognises patterns by what the graph computes, whatever the
model's module names or classes, and replaces them with trainer's ``torch.library`` ops:

- ``add_layer_norm``: ``layer_norm(x + inc, ...)`` (the residual add and the LayerNorm that reads it; the add's
  result stays the residual stream) as one kernel each way; a LayerNorm that reads no add gets the same kernel
  without ``inc``. The bias of the matmul that made ``inc`` moves into the kernel, whose backward already sums
  the column gradients it needs.
- ``add_rms_norm``: the same for RMSNorm, both ``F.rms_norm`` and the hand-written form of Hugging Face's Llama,
  Mistral and Qwen (``h.to(float32)``, ``pow(2).mean(-1, keepdim=True)``, ``rsqrt(var + eps)``, times the weight).
- ``cross_entropy`` / ``linear_cross_entropy``: ``cross_entropy(linear(h, W), targets)`` through views,
  reshapes and a ``.float()`` upcast, with ``ignore_index``: trainer's loss row kernel on the logits (``cross_entropy``:
  logits kept, their gradient written over them in the forward) or the chunked fused linear + cross-entropy that
  never holds the whole logits (``linear_cross_entropy``). With both enabled, the vocabulary decides
  (:data:`FUSED_LOSS_MIN_VOCAB`).
- ``causal_attention``: an attention mask built in the graph that equals the causal mask becomes ``is_causal=True``,
  and keys and values repeated to every query head become ``enable_gqa=True`` (:mod:`trainer.compile.attention`):
  SDPA's causal kernels then skip the masked half. Not a trainer kernel: it lets torch's fastest one run.

Where it runs: in trainer's Dynamo backend, on the torch-level graph Dynamo hands over, before AOTAutograd. There the
graph still says ``layer_norm``, ``add`` and ``cross_entropy`` (after AOTAutograd they are decomposed into dozens
of aten ops, with the backward already derived), the pass is the same for every backend (Inductor, ``aot_eager``
on a CPU with ``TRITON_INTERPRET=1``), and AOTAutograd then differentiates trainer's ops through their registered
autograd like any op. The distributed layer's graph splitter calls the same backend for each piece, so the pass
runs inside DDP's pieces too (a pattern cut by a piece boundary stays as it was), and inside the bodies of
activation-checkpointed regions (``train.activation_checkpointing``), which Dynamo captures as subgraphs.

Numerics follow the reference: sums and statistics in fp32, outputs rounded once. A near-match whose meaning
differs (no affine weight, a weight of ``1 + w``, eps outside the root, a norm over another dimension, a head
with a bias, logits used elsewhere) is left alone; ``trainer explain --verbose`` lists each with the reason.
"""

from __future__ import annotations

import operator
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx

from trainer.compile.graph_edit import erase_dead as _erase_dead
from trainer.compile.graph_edit import erased as _erased
from trainer.compile.graph_edit import in_place as _in_place
from trainer.compile.graph_edit import inputs as _inputs

__all__ = ["KERNEL_NAMES", "KernelLog", "substitute", "substituting", "FUSED_LOSS_MIN_VOCAB"]

KERNEL_NAMES = ("add_layer_norm", "add_rms_norm", "cross_entropy", "linear_cross_entropy", "causal_attention")
"""The kernels this pass substitutes (``compile.kernels`` names them)."""

FUSED_LOSS_MIN_VOCAB = 65536
"""With both loss kernels enabled: the fused linear + cross-entropy from this vocabulary up, the row kernel below.
At GPT-2's 50304 the row kernel on compiled logits is the faster (docs/performance.md, "The loss kernels"); at
Llama 3's 128256 the logits alone would be 2.1 GB in bf16 for 8192 tokens."""

_MAX_COLS = 16384  # the norm kernels keep one row in registers


# ---- what was substituted, and what was not ------------------------------------------------------


@dataclass
class KernelLog:
    """Substitutions and near-misses over every graph the pass has seen (the compile report reads it).

    A graph compiled again (a recompile: the evaluation's no-grad graph, a new shape) substitutes the same sites
    again; it is counted once, by the graph's inputs and its substitutions."""

    counts: Counter = field(default_factory=Counter)
    sources: dict[str, list[str]] = field(default_factory=dict)
    near_misses: list[tuple[str, str, str]] = field(default_factory=list)  # (kernel, source, reason)
    _graphs: set = field(default_factory=set)

    def add_graph(self, inputs: tuple[str, ...], hits: list[tuple[str, str | None]]) -> None:
        """Record one graph's substitutions ``[(kernel, source), ...]``, unless the same graph was seen."""
        key = (inputs, tuple(hits))
        if key in self._graphs:
            return
        self._graphs.add(key)
        for name, src in hits:
            self.counts[name] += 1
            where = self.sources.setdefault(name, [])
            if src and src not in where:
                where.append(src)

    def miss(self, name: str, node: fx.Node, reason: str) -> None:
        entry = (name, _source(node) or node.name, reason)
        if entry not in self.near_misses:
            self.near_misses.append(entry)

    def report(self) -> list[dict]:
        """``[{"name", "count", "sources"}, ...]``: the compile report's ``kernels``."""
        return [{"name": n, "count": c, "sources": self.sources.get(n, [])} for n, c in sorted(self.counts.items())]

    def clear(self) -> None:
        self.counts.clear()
        self.sources.clear()
        self.near_misses.clear()
        self._graphs.clear()


class _Hits(list):
    """One graph's substitutions, ``(kernel, source)`` each; passed where the log was (``hit`` / ``miss``)."""

    def __init__(self, log: KernelLog):
        super().__init__()
        self.log = log

    def hit(self, name: str, node: fx.Node) -> None:
        self.append((name, _source(node)))

    def miss(self, name: str, node: fx.Node, reason: str) -> None:
        self.log.miss(name, node, reason)


LOG = KernelLog()
"""The process's log: every substituting backend records here unless given another."""


def _source(node: fx.Node) -> str | None:
    """The user's ``file:line`` that produced ``node`` (the innermost frame of Dynamo's stack trace)."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else None


# ---- the ops the graph calls (AOTAutograd traces through these) ---------------------------------


def _add_layer_norm(x, inc, inc_bias, weight, bias, eps, out_dtype):
    from trainer.compile.kernels.add_layer_norm import add_layer_norm_op

    return add_layer_norm_op(x, inc, weight, bias, eps, out_dtype, inc_bias=inc_bias)


def _add_rms_norm(x, inc, weight, eps, out_dtype):
    from trainer.compile.kernels.add_rms_norm import add_rms_norm, rms_norm

    if inc is None:
        return x, rms_norm(x, weight, eps, out_dtype)
    return add_rms_norm(x, inc, weight, eps, out_dtype)


def _loss(h, weight, targets, ignore_index, reduction, save_logit_grads):
    from trainer.compile.kernels.linear_cross_entropy import linear_cross_entropy

    h2 = h.reshape(-1, h.shape[-1])  # (N, C)
    return linear_cross_entropy(
        h2, weight, targets.reshape(-1), ignore_index, reduction, save_logit_grads=save_logit_grads
    )


# ---- graph helpers -------------------------------------------------------------------------------


def _val(n):
    return n.meta.get("example_value") if isinstance(n, fx.Node) else None


def _dtype(n):
    v = _val(n)
    return v.dtype if isinstance(v, torch.Tensor) else None


def _shape(n):
    v = _val(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _is_call(n, *targets) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def _is_method(n, *names) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_method" and n.target in names


def _arg(n: fx.Node, i: int, name: str, default=None):
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


# Out-of-place only: ``x += y`` mutates x, which later readers of x would see; a rewrite would lose that.
_ADDS = (operator.add, torch.add)
_MULS = (operator.mul, torch.mul)


def _add_operands(n) -> tuple[fx.Node, fx.Node] | None:
    """``(a, b)`` of a tensor ``a + b`` with no alpha, else None."""
    if _is_call(n, *_ADDS) or _is_method(n, "add"):
        if len(n.args) == 2 and not n.kwargs and all(isinstance(a, fx.Node) for a in n.args):
            return n.args[0], n.args[1]
    return None


def _skip_dropout0(n):
    """Through ``dropout(x, p=0)`` (a no-op the model keeps for its config)."""
    while _is_call(n, F.dropout) and _arg(n, 1, "p", 0.5) == 0.0 and len(n.users) == 1:
        n = n.args[0]
    return n


def _float32_cast(n) -> bool:
    if _is_method(n, "float"):
        return True
    if _is_method(n, "to") or _is_call(n, torch.Tensor.to):
        return torch.float32 in (*n.args[1:], *n.kwargs.values())
    return False


# ---- the residual add, shared by both norms ------------------------------------------------------


@dataclass
class _Add:
    node: fx.Node  # the add
    x: fx.Node  # the operand whose dtype the sum has (the residual stream)
    inc: fx.Node  # the branch
    inc_bias: fx.Node | None = None  # the bias of the linear that made inc, moved into the kernel
    linear: fx.Node | None = None


_DROPOUT = object()  # the residual add reads a live dropout


def _residual_add(n, fold_bias: bool) -> _Add | None:
    ops = _add_operands(n)
    if ops is None:
        return None
    a, b = ops
    if not (_shape(a) == _shape(b) == _shape(n)) or _dtype(n) is None or not _dtype(n).is_floating_point:
        return None  # a broadcast, or not a tensor sum
    if _dtype(a) == _dtype(n):
        x, inc = a, b
    elif _dtype(b) == _dtype(n):
        x, inc = b, a
    else:
        return None
    if _is_call(inc, F.dropout) and _arg(inc, 1, "p", 0.5) != 0.0 and _arg(inc, 2, "training", True) is not False:
        return _DROPOUT  # Inductor fuses the dropout, the add and the norm into one kernel: leave them to it
    add = _Add(n, x, inc)
    lin = _skip_dropout0(inc)
    if fold_bias and _is_call(lin, F.linear) and len(lin.users) == 1 and isinstance(_arg(lin, 2, "bias"), fx.Node):
        if _shape(_arg(lin, 2, "bias")) == (_shape(n)[-1],):
            add.inc_bias, add.linear = _arg(lin, 2, "bias"), lin
    return add


def _out_dtype(norm: fx.Node):
    """The dtype the norm's output is written in: what every reader would cast it to, if they all are linears
    under autocast (a bf16 write instead of fp32, and no cast kernel), else the norm's own."""
    users = list(norm.users)
    if users and all(_is_call(u, F.linear) and u.args[0] is norm for u in users):
        dtypes = {_dtype(u) for u in users}
        if len(dtypes) == 1 and None not in dtypes:
            return dtypes.pop()
    return _dtype(norm)


def _fuse_norm(gm, norm, x_in, add: _Add | None, kernel, args, name, log, order) -> None:
    """Replace ``norm`` (whose input is ``x_in``, or ``add``'s sum) by one ``kernel(x, inc, *args) -> (s, y)``."""
    g = gm.graph
    params = [p for p in _inputs(args) if p.op != "placeholder"]
    if add is not None and _writes_between(add.node, norm):
        log.miss(name, norm, "a tensor is written in place between the residual add and the norm")
        add = None
    if add is not None and not _hoist(params, add.node, order):
        log.miss(name, norm, "the norm's parameters are computed after the residual add, from what it computes")
        add = None
    anchor = add.node if add is not None else norm
    if add is not None and add.inc_bias is not None:  # the linear's bias moves into the kernel
        if len(add.linear.args) > 2:
            add.linear.update_arg(2, None)
        else:
            add.linear.update_kwarg("bias", None)
    x, inc = (add.x, add.inc) if add is not None else (x_in, None)
    extra = (add.inc_bias if add is not None else None,) if kernel is _add_layer_norm else ()
    with g.inserting_before(anchor):
        call = g.call_function(kernel, (x, inc, *extra, *args))
        s, y = g.call_function(operator.getitem, (call, 0)), g.call_function(operator.getitem, (call, 1))
    call.meta["stack_trace"] = norm.meta.get("stack_trace")
    log.hit(name, norm)
    norm.replace_all_uses_with(y)
    _erase_dead(g, norm)
    if add is not None and not _erased(add.node):  # the norm may have been its last reader
        add.node.replace_all_uses_with(s)
        g.erase_node(add.node)


def _hoist(nodes: list[fx.Node], anchor: fx.Node, order: dict) -> bool:
    """Move the computation of ``nodes`` (a norm's weight computed in the graph: Gemma's ``1 + w``) before
    ``anchor`` (the residual add the kernel replaces), where it reads nothing computed at or after the anchor and
    has no side effect (no in-place op). False, and nothing moved, where it cannot."""
    if anchor not in order:
        return False
    moving, todo = set(), list(nodes)
    while todo:
        n = todo.pop()
        if n in moving or (n in order and order[n] < order[anchor]):
            continue
        pure = n.op == "get_attr" or (n.op in ("call_function", "call_method") and not _in_place(n))
        if n is anchor or n not in order or not pure:
            return False
        moving.add(n)
        todo.extend(_inputs((n.args, n.kwargs)))
    for i, n in enumerate(sorted(moving, key=order.__getitem__)):  # in graph order, so inputs stay first
        anchor.prepend(n)
        order[n] = order[anchor] - 1 + (i + 1) / (len(moving) + 1)
    return True


def _writes_between(first: fx.Node, last: fx.Node) -> bool:
    """Whether a node after ``first`` and before ``last`` writes in place (the kernel, placed at ``first``, would
    read its inputs before that write instead of after it)."""
    n = first.next
    while n is not last and n.op != "root":
        if n.op in ("call_function", "call_method") and _in_place(n):
            return True
        n = n.next
    return False


# ---- LayerNorm -----------------------------------------------------------------------------------


def _layer_norms(gm, log, order, fold_bias=True) -> None:
    for n in list(gm.graph.nodes):
        if not _is_call(n, F.layer_norm, torch.layer_norm):
            continue
        x, shape = n.args[0], _arg(n, 1, "normalized_shape")
        weight, bias, eps = _arg(n, 2, "weight"), _arg(n, 3, "bias"), _arg(n, 4, "eps", 1e-5)
        xs = _shape(x)
        if weight is None:
            log.miss("add_layer_norm", n, "no affine weight")
            continue
        if xs is None or tuple(shape) != xs[-1:] or _shape(weight) != xs[-1:]:
            log.miss("add_layer_norm", n, f"normalises over {tuple(shape)}, not the last dimension alone")
            continue
        if xs[-1] > _MAX_COLS or not _dtype(x).is_floating_point:
            log.miss("add_layer_norm", n, f"rows of {xs[-1]} {_dtype(x)} elements")
            continue
        add = _residual_add(x, fold_bias)
        if add is _DROPOUT:
            log.miss("add_layer_norm", n, "a dropout feeds the residual add (Inductor fuses dropout, add and norm)")
            continue
        if add is not None and _dtype(add.x) != _dtype(n):
            add = None
        _fuse_norm(gm, n, x, add, _add_layer_norm, (weight, bias, eps, _out_dtype(n)), "add_layer_norm", log, order)


# ---- RMSNorm -------------------------------------------------------------------------------------


def _hand_written_rms(mul: fx.Node, log) -> tuple[fx.Node, fx.Node, float] | None:
    """``(h, weight, eps)`` if ``mul`` is ``weight * (h32 * rsqrt(mean(h32 ** 2, -1, keepdim) + eps)).to(dtype)``
    with ``h`` fp32 (so both casts are no-ops), else None."""
    if not (_is_call(mul, *_MULS) or _is_method(mul, "mul")) or len(mul.args) != 2:
        return None
    for w, normed in (mul.args, mul.args[::-1]):
        if not isinstance(w, fx.Node) or not isinstance(normed, fx.Node) or _shape(w) is None or len(_shape(w)) != 1:
            continue
        inner = normed.args[0] if (_is_method(normed, "to", "type_as")) else normed
        if not (_is_call(inner, *_MULS) or _is_method(inner, "mul")) or len(inner.args) != 2:
            continue
        for h32, r in (inner.args, inner.args[::-1]):
            if not (_is_call(r, torch.rsqrt) or _is_method(r, "rsqrt")):
                continue
            ops = _add_operands(r.args[0]) if isinstance(r.args[0], fx.Node) else None
            var_eps = None
            if ops is None and (_is_call(r.args[0], *_ADDS) or _is_method(r.args[0], "add")):
                var_eps = r.args[0].args  # var + eps with eps a Python number
            elif ops is not None:
                continue  # eps as a tensor: leave it
            if var_eps is None or len(var_eps) != 2:
                continue
            var, eps = var_eps if isinstance(var_eps[1], float | int) else var_eps[::-1]
            if not isinstance(eps, float | int) or not (_is_method(var, "mean") or _is_call(var, torch.mean)):
                continue
            sq = var.args[0]
            dims = _arg(var, 1, "dim")
            keep = var.kwargs.get("keepdim", var.args[2] if len(var.args) > 2 else False)
            if not ((_is_method(sq, "pow") or _is_call(sq, torch.pow)) and sq.args[1] == 2 and sq.args[0] is h32):
                continue
            xs = _shape(h32)
            if dims not in (-1, [-1], (-1,), len(xs) - 1) or not keep:
                log.miss("add_rms_norm", mul, f"mean over dim {dims}, not the last")
                return None
            h = h32.args[0] if _float32_cast(h32) else h32
            if _dtype(h) != torch.float32 or _dtype(mul) != torch.float32 or _shape(w) != xs[-1:]:
                log.miss("add_rms_norm", mul, f"input {_dtype(h)}: rounds to it before the weight")
                return None
            return h, w, float(eps)
    return None


def _rms_norms(gm, log, order) -> None:
    for n in list(gm.graph.nodes):
        if _erased(n):
            continue  # with an earlier match
        if _is_call(n, F.rms_norm):
            h, shape, w, eps = n.args[0], _arg(n, 1, "normalized_shape"), _arg(n, 2, "weight"), _arg(n, 3, "eps")
            if w is None:
                log.miss("add_rms_norm", n, "no affine weight")
                continue
            if _shape(h) is None or tuple(shape) != _shape(h)[-1:]:
                log.miss("add_rms_norm", n, f"normalises over {tuple(shape)}, not the last dimension alone")
                continue
            eps = torch.finfo(_dtype(h)).eps if eps is None else float(eps)
        else:
            match = _hand_written_rms(n, log)
            if match is None:
                continue
            h, w, eps = match
        if _shape(h)[-1] > _MAX_COLS:
            log.miss("add_rms_norm", n, f"rows of {_shape(h)[-1]} elements")
            continue
        add = _residual_add(h, fold_bias=False)
        if add is _DROPOUT:
            log.miss("add_rms_norm", n, "a dropout feeds the residual add (Inductor fuses dropout, add and norm)")
            continue
        if add is not None and _dtype(add.x) != _dtype(n):
            add = None
        _fuse_norm(gm, n, h, add, _add_rms_norm, (w, eps, _out_dtype(n)), "add_rms_norm", log, order)


# ---- the head and the loss -----------------------------------------------------------------------

_SHAPE_ONLY = ("view", "reshape", "contiguous", "flatten")


def _logits_source(n: fx.Node) -> fx.Node | None:
    """Through views, reshapes and a float32 upcast with no other readers, to the node that made the logits."""
    while (_is_method(n, *_SHAPE_ONLY) or _is_call(n, torch.reshape, torch.flatten) or _float32_cast(n)) and len(
        n.users
    ) == 1:
        n = n.args[0]
    return n


_SCALES = (operator.mul, operator.truediv, torch.mul, torch.div)


def _scaled_head(g: fx.Graph, n: fx.Node) -> fx.Node | None:
    """Logits scaled by a constant (Granite divides them, Cohere multiplies them): ``linear(h, W) * c`` becomes
    ``linear(h * c, W)``, a scale of the (tokens, width) input instead of the (tokens, vocabulary) logits, so the
    loss pattern sees the linear. Only for a head without a bias (whose scale would not move) that nothing else
    reads. Returns the linear, or None where ``n`` is not such a scale (and then the graph is unchanged)."""
    if not (_is_call(n, *_SCALES) or _is_method(n, "mul", "div")) or len(n.args) != 2 or n.kwargs or len(n.users) != 1:
        return None
    divide = n.target in (operator.truediv, torch.div, "div")
    lin, c = n.args if divide or isinstance(n.args[1], int | float) else n.args[::-1]  # c * logits too
    if isinstance(c, bool) or not isinstance(c, int | float) or not _is_call(lin, F.linear) or len(lin.users) != 1:
        return None
    if _arg(lin, 2, "bias") is not None:
        return None
    x = lin.args[0]
    with g.inserting_before(lin):
        h = g.call_function(operator.truediv if divide else operator.mul, (x, c))
    h.meta.update({k: v for k, v in x.meta.items() if k in ("example_value", "val", "tensor_meta", "stack_trace")})
    lin.update_arg(0, h)
    n.replace_all_uses_with(lin)
    g.erase_node(n)
    return lin


def _losses(gm, kernels: set[str], log, order) -> None:
    g = gm.graph
    for n in list(g.nodes):
        if not _is_call(n, F.cross_entropy):
            continue
        logits, targets = n.args[0], _arg(n, 1, "target")
        name = "cross_entropy" if "cross_entropy" in kernels else "linear_cross_entropy"
        reduction = _arg(n, 7, "reduction", "mean")
        ignore_index = _arg(n, 4, "ignore_index", -100)
        if _arg(n, 2, "weight") is not None or _arg(n, 8, "label_smoothing", 0.0) or reduction not in ("mean", "sum"):
            log.miss(name, n, "class weights, label smoothing or reduction='none'")
            continue
        if _arg(n, 3, "size_average") is not None or _arg(n, 5, "reduce") is not None:
            log.miss(name, n, "legacy size_average/reduce arguments")
            continue
        if _shape(logits) is None or len(_shape(logits)) != 2 or _shape(targets) != _shape(logits)[:1]:
            log.miss(name, n, f"logits of shape {_shape(logits)}: expected (tokens, vocabulary)")
            continue
        lin = _logits_source(logits)
        lin = _scaled_head(g, lin) or lin
        if not _is_call(lin, F.linear):
            log.miss(name, n, "the logits do not come from a linear layer (or are also read elsewhere)")
            continue
        h, w = lin.args[0], _arg(lin, 1, "weight")
        if _arg(lin, 2, "bias") is not None:
            log.miss(name, n, "the head has a bias")
            continue
        if len(lin.users) != 1:
            log.miss(name, n, "the logits are also used elsewhere (returned by the model?)")
            continue
        vocab = _shape(w)[0]
        save = "cross_entropy" in kernels and not ("linear_cross_entropy" in kernels and vocab >= FUSED_LOSS_MIN_VOCAB)
        name = "cross_entropy" if save else "linear_cross_entropy"
        with g.inserting_before(n):
            call = g.call_function(_loss, (h, w, targets, ignore_index, reduction, save))
        call.meta["stack_trace"] = n.meta.get("stack_trace")
        log.hit(name, n)
        n.replace_all_uses_with(call)
        _erase_dead(g, n)


# ---- the pass and the backend --------------------------------------------------------------------


def substitute(gm: fx.GraphModule, kernels: set[str], log: KernelLog | None = None) -> fx.GraphModule:
    """Rewrite ``gm`` (a graph Dynamo captured) in place with the ``kernels`` named (:data:`KERNEL_NAMES`), and the
    bodies of its checkpointed regions (:func:`checkpointed_regions`) as well."""
    log = LOG if log is None else log
    unknown = set(kernels) - set(KERNEL_NAMES)
    assert not unknown, f"unknown kernels {unknown}"
    inputs = tuple(n.target for n in gm.graph.nodes if n.op == "placeholder")
    hits = _Hits(log)
    _substitute_graph(gm, kernels, hits, {})
    log.add_graph(inputs, list(hits))
    return gm


def checkpointed_regions(gm: fx.GraphModule) -> list[tuple[fx.GraphModule, list]]:
    """The activation-checkpointed regions of ``gm``: for each ``tag_activation_checkpoint`` call, its body (a
    GraphModule) and the nodes of ``gm`` that its placeholders receive, in order."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    regions = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is hop and n.args and getattr(n.args[0], "op", None) == "get_attr":
            body = getattr(gm, n.args[0].target, None)
            if isinstance(body, fx.GraphModule):
                regions.append((body, list(n.args[1:])))
    return regions


def _substitute_graph(gm: fx.GraphModule, kernels: set[str], hits: _Hits, bound: dict) -> None:
    """The pass over one graph; ``bound`` maps the graph's placeholders to ``(graph, node)`` they receive outside
    (a checkpointed region's inputs), so a causal mask built outside a region is still recognised inside it.

    A region is a graph of its own (activation checkpointing recomputes it in the backward), so a pattern across
    its boundary (the residual add of one block and the norm of the next) stays as it was: the norm gets the
    kernel without the add."""
    if "causal_attention" in kernels:
        from trainer.compile.attention import causal_attention

        causal_attention(gm, hits, bound)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    if "add_layer_norm" in kernels:
        _layer_norms(gm, hits, order)
    if "add_rms_norm" in kernels:
        _rms_norms(gm, hits, order)
    if kernels & {"cross_entropy", "linear_cross_entropy"}:
        _losses(gm, kernels, hits, order)
    for body, operands in checkpointed_regions(gm):
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        inner = {p: (gm, a) for p, a in zip(placeholders, operands) if isinstance(a, fx.Node)}
        inner = {p: bound.get(a, (g, a)) if a.op == "placeholder" else (g, a) for p, (g, a) in inner.items()}
        _substitute_graph(body, kernels, hits, inner)
    gm.graph.lint()
    gm.recompile()


def substituting(inner: Callable, kernels, log: KernelLog | None = None) -> Callable:
    """A Dynamo backend: :func:`substitute` ``kernels`` into each graph, then compile it with ``inner``."""
    kernels = set(kernels)
    if not kernels:
        return inner

    def backend(gm: fx.GraphModule, example_inputs):
        return inner(substitute(gm, kernels, log), example_inputs)

    backend.__name__ = f"substituting_{getattr(inner, '__name__', 'backend')}"
    return backend
