"""Attention in any captured graph: a causal mask built in the graph becomes ``is_causal``, keys and values
repeated to every query head become grouped-query attention.

Hugging Face models build their attention mask inside ``forward``. Under ``torch.compile`` they cannot skip it (the
check that would is off while tracing), so ``scaled_dot_product_attention`` receives a ``(B, 1, T, T)`` mask with
``is_causal=False``: the kernel then computes the masked half of the scores as well and reads the mask. Without a
mask, Hugging Face repeats the keys and values of grouped-query attention to every query head (a copy each way).

A mask that depends on no input of the graph (built from ``arange`` of static sizes, as Hugging Face's is) is the
same on every call. The pass computes it once, at compile time. Where it equals SDPA's own causal mask (true on
and below the diagonal for a boolean mask; 0 there and ``-inf`` or the dtype's lowest value above it for an
additive one), the call gets ``attn_mask=None, is_causal=True``, which is the same function. A mask read from an
input, built from random ops, or of another shape is left alone (``trainer explain --verbose`` says why).

Keys and values made by ``x[:, :, None].expand(B, KV, R, T, D).reshape(B, KV * R, T, D)`` (Hugging Face's
``repeat_kv``) are replaced by ``x`` with ``enable_gqa=True``: SDPA's kernels read the shared heads in place.
"""

from __future__ import annotations

import operator
import re

import torch
import torch.nn.functional as F
from torch import fx

from trainer.compile.passes.graph_edit import erase_dead, inputs

_RANDOM = re.compile(r"rand|bernoulli|dropout|normal|uniform|multinomial|poisson|exponential|seed", re.I)
_MAX_MASK_ELEMENTS = 1 << 28  # evaluated once at compile time; larger masks are left alone


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _call(n: fx.Node) -> dict:
    """An SDPA call's arguments by name (positional ones too)."""
    return {**dict(zip(_SDPA_ARGS, n.args)), **n.kwargs}


def _set_call(n: fx.Node, call: dict) -> None:
    n.args = (call.pop("query"), call.pop("key"), call.pop("value"))
    n.kwargs = call


def _ancestors(node: fx.Node) -> list[fx.Node] | str:
    """``node`` and what it is computed from, in graph order; or why it is not a compile-time constant."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op in ("placeholder", "get_attr"):
            return "the mask is read from an input of the graph"
        name = getattr(n.target, "__name__", str(n.target))
        if _RANDOM.search(name):
            return f"the mask is built with a random op ({name})"
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _evaluate(gm: fx.GraphModule, nodes: list[fx.Node]) -> torch.Tensor:
    """The value of ``nodes[-1]``, computed by a graph of ``nodes`` alone (none of them reads an input)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        env[n] = g.node_copy(n, env.__getitem__)
    g.output(env[nodes[-1]])
    with torch.no_grad():
        return fx.GraphModule(gm, g)()


def _is_causal_mask(mask: torch.Tensor, q_len: int, kv_len: int) -> bool:
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (q_len, kv_len):
        return False
    keep = torch.ones(q_len, kv_len, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        return bool((mask == keep).all())
    if not mask.is_floating_point():
        return False
    masked = (mask == float("-inf")) | (mask == torch.finfo(mask.dtype).min)
    return bool(((mask == 0) == keep).all() and (masked == ~keep).all())


def _repeated_heads(n) -> tuple[fx.Node, int] | None:
    """``(x, R)`` where ``n`` is ``x[:, :, None].expand(B, KV, R, T, D).reshape(B, KV * R, T, D)``."""
    if not (isinstance(n, fx.Node) and n.op == "call_method" and n.target in ("reshape", "view")):
        return None
    e = n.args[0]
    if not (isinstance(e, fx.Node) and e.op == "call_method" and e.target == "expand"):
        return None
    g = e.args[0]
    if not (isinstance(g, fx.Node) and g.op == "call_function" and g.target is operator.getitem):
        return None
    x, index = g.args
    full = slice(None, None, None)
    if not (
        isinstance(index, tuple)
        and len(index) >= 3
        and index[2] is None
        and all(i == full for i in index[:2])
        and all(i == full or i is Ellipsis for i in index[3:])
    ):
        return None
    xs, es, ns = (v.meta.get("example_value") for v in (x, e, n))
    if not all(isinstance(v, torch.Tensor) for v in (xs, es, ns)) or xs.dim() != 4 or es.dim() != 5:
        return None
    b, kv, t, d = xs.shape
    r = es.shape[2]
    if tuple(es.shape) != (b, kv, r, t, d) or tuple(ns.shape) != (b, kv * r, t, d):
        return None
    return x, r


def _sdpa_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is F.scaled_dot_product_attention]


def causal_attention(gm: fx.GraphModule, hits, bound: dict | None = None) -> None:
    """Rewrite each SDPA call of ``gm`` as the module docstring says; record hits and near-misses on ``hits``.

    ``bound`` maps placeholders of ``gm`` to the ``(graph, node)`` they receive (``gm`` is the body of a checkpointed
    region): a mask passed into the region is evaluated in the graph that built it."""
    for n in _sdpa_nodes(gm):
        call = _call(n)
        read = inputs((n.args, n.kwargs))
        changed = False
        if isinstance(call.get("attn_mask"), fx.Node) and not call.get("is_causal"):
            changed = _drop_causal_mask(gm, n, call, hits, bound or {})
        if call.get("attn_mask") is None and not call.get("enable_gqa"):
            changed = _group_heads(call) or changed
        if changed:
            _set_call(n, call)
            hits.hit("causal_attention", n)
            # What only the old arguments read (the mask, the repeated heads), not the graph's dead code at large:
            # FX counts every call_method pure, so its dead-code pass would also drop `x.mul_(2)` statements.
            for old in read:
                erase_dead(gm.graph, old)


def _drop_causal_mask(gm: fx.GraphModule, n: fx.Node, call: dict, hits, bound: dict) -> bool:
    """Set ``attn_mask=None, is_causal=True`` in ``call`` where its mask is the causal one; else log why not."""
    mask = call["attn_mask"]
    gm, mask = bound.get(mask, (gm, mask))  # a region's input: the mask as the enclosing graph computes it
    nodes = _ancestors(mask)
    if isinstance(nodes, str):
        hits.miss("causal_attention", n, nodes)
        return False
    value = mask.meta.get("example_value")
    if isinstance(value, torch.Tensor) and value.numel() > _MAX_MASK_ELEMENTS:
        hits.miss("causal_attention", n, f"the mask has {value.numel()} elements, too many to check at compile time")
        return False
    q, k = (call[name].meta.get("example_value") for name in ("query", "key"))
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)):
        return False
    if not _is_causal_mask(_evaluate(gm, nodes), q.shape[-2], k.shape[-2]):
        hits.miss("causal_attention", n, "the mask is not the causal mask (a padding, sliding-window or other mask)")
        return False
    call.update(attn_mask=None, is_causal=True)
    return True


def _group_heads(call: dict) -> bool:
    """Replace repeated keys and values in ``call`` by the shared heads, with ``enable_gqa=True``."""
    rk, rv = _repeated_heads(call["key"]), _repeated_heads(call["value"])
    if rk is None or rv is None or rk[1] != rv[1] or rk[1] == 1:
        return False
    call.update(key=rk[0], value=rv[0], enable_gqa=True)
    return True
