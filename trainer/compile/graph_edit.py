"""Editing a captured FX graph without changing what it computes: a node's inputs, whether a node writes in place,
and erasing what a rewrite left unused.

FX's own ``Graph.eliminate_dead_code()`` counts every ``call_method`` node as pure, so it would also drop an in-place
statement whose result nothing reads (``w.mul_(2)``): the passes never call it, and erase only the chains they
replaced (:func:`erase_dead`).
"""

from __future__ import annotations

import operator

from torch import fx

_MUTATING = (
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.ipow,
    operator.setitem,
)


def erased(n: fx.Node) -> bool:
    return getattr(n, "_erased", False)  # set by Graph.erase_node (torch 2.11 and 2.13)


def inputs(args) -> list[fx.Node]:
    """The nodes in ``args`` (nested tuples, lists and dicts of a node's arguments)."""
    out = []
    fx.node.map_arg(args, out.append)
    return out


def in_place(n: fx.Node) -> bool:
    """Whether ``n`` writes into one of its inputs: ``x.add_(..)``, ``x += ..``, ``x[i] = ..``, ``out=``."""
    return str(getattr(n.target, "__name__", n.target)).endswith("_") or n.target in _MUTATING or "out" in n.kwargs


def erase_dead(g: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and then whatever only it used (the rest of a replaced chain), never in-place ops."""
    todo = [node]
    while todo:
        n = todo.pop()
        if erased(n) or n.users or n.op not in ("call_function", "call_method") or in_place(n):
            continue
        ins = inputs((n.args, n.kwargs))
        g.erase_node(n)
        todo.extend(ins)
