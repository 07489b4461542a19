"""Reading and editing a captured FX graph, shared by the passes: what a node holds (its example value's dtype and
shape), what it calls and with which arguments; and, without changing what the graph computes, a node's inputs,
whether a node writes in place, and erasing what a rewrite left unused.

FX's own ``Graph.eliminate_dead_code()`` counts every ``call_method`` node as pure, so it would also drop an in-place
statement whose result nothing reads (``w.mul_(2)``): the passes never call it, and erase only the chains they
replaced (:func:`erase_dead`).
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
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


# ---- reading a node ------------------------------------------------------------------------------


def value(n):
    """The example value Dynamo recorded for ``n`` (a tensor, usually), or None."""
    return n.meta.get("example_value") if isinstance(n, fx.Node) else None


def dtype_of(n):
    v = value(n)
    return v.dtype if isinstance(v, torch.Tensor) else None


def shape_of(n):
    v = value(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def is_call(n, *targets) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def is_method(n, *names) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_method" and n.target in names


def arg(n: fx.Node, i: int, name: str, default=None):
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


# Out-of-place only: ``x += y`` mutates x, which later readers of x would see; a rewrite would lose that.
ADDS = (operator.add, torch.add)
MULS = (operator.mul, torch.mul)


def add_operands(n) -> tuple[fx.Node, fx.Node] | None:
    """``(a, b)`` of a tensor ``a + b`` with no alpha, else None."""
    if is_call(n, *ADDS) or is_method(n, "add"):
        if len(n.args) == 2 and not n.kwargs and all(isinstance(a, fx.Node) for a in n.args):
            return n.args[0], n.args[1]
    return None


def skip_dropout0(n):
    """Through ``dropout(x, p=0)`` (a no-op the model keeps for its config)."""
    while is_call(n, F.dropout) and arg(n, 1, "p", 0.5) == 0.0 and len(n.users) == 1:
        n = n.args[0]
    return n


def float32_cast(n) -> bool:
    if is_method(n, "float"):
        return True
    if is_method(n, "to") or is_call(n, torch.Tensor.to):
        return torch.float32 in (*n.args[1:], *n.kwargs.values())
    return False
