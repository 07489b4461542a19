"""The pass over each captured graph and the Dynamo backend that runs it (:func:`substituting`), and the log of what
it substituted and what it left alone (the compile report reads :data:`LOG`).
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import fx

from trainer.compile.passes import KERNEL_NAMES
from trainer.compile.passes.loss import losses
from trainer.compile.passes.norms import layer_norms, rms_norms

__all__ = ["KernelLog", "LOG", "substitute", "substituting", "checkpointed_regions", "cache_marks"]

GRAPH_FUNCTIONS = (
    "trainer.compile.passes.norms._add_layer_norm",
    "trainer.compile.passes.norms._add_rms_norm",
    "trainer.compile.passes.loss._loss",
)
"""The functions the passes call from a graph, by the name the compile caches know them by (module and name)."""


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
        from trainer.compile.passes.attention import causal_attention

        causal_attention(gm, hits, bound)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    if "add_layer_norm" in kernels:
        layer_norms(gm, hits, order)
    if "add_rms_norm" in kernels:
        rms_norms(gm, hits, order)
    if kernels & {"cross_entropy", "linear_cross_entropy"}:
        losses(gm, kernels, hits, order)
    for body, operands in checkpointed_regions(gm):
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        inner = {p: (gm, a) for p, a in zip(placeholders, operands) if isinstance(a, fx.Node)}
        inner = {p: bound.get(a, (g, a)) if a.op == "placeholder" else (g, a) for p, (g, a) in inner.items()}
        _substitute_graph(body, kernels, hits, inner)
    gm.graph.lint()
    gm.recompile()


@functools.cache
def cache_marks() -> dict[str, str]:
    """Inductor's ``unsafe_marked_cacheable_functions`` for :data:`GRAPH_FUNCTIONS`: each keyed by a digest of the
    source of the passes and of :mod:`trainer.ops`, so that an edit to either is a new cache key.

    AOTAutograd's cache leaves out a graph that calls a Python function it does not know (it cannot tell from the
    graph what the function computes); without the marks every start traces the joint graph again (8.6 s of a
    Llama-3.2-1B resume's first step on an H200)."""
    import trainer.ops

    h = hashlib.sha256()
    for folder in (Path(__file__).parent, Path(trainer.ops.__file__).parent):
        for f in sorted(folder.glob("*.py")):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    digest = h.hexdigest()[:32]
    return {name: digest for name in GRAPH_FUNCTIONS}


def substituting(inner: Callable, kernels, log: KernelLog | None = None) -> Callable:
    """A Dynamo backend: :func:`substitute` ``kernels`` into each graph, then compile it with ``inner``."""
    kernels = set(kernels)
    if not kernels:
        return inner

    def backend(gm: fx.GraphModule, example_inputs):
        return inner(substitute(gm, kernels, log), example_inputs)

    backend.__name__ = f"substituting_{getattr(inner, '__name__', 'backend')}"
    return backend
