"""The loss pass: ``cross_entropy(linear(h, W), targets)``, through views, reshapes, a ``.float()`` upcast and a
constant scale of the logits, with ``ignore_index``, becomes ``trainer::linear_cross_entropy``: trainer's loss row
kernel on the logits (``cross_entropy``: logits kept, their gradient written over them in the forward) or the chunked
fused linear + cross-entropy that never holds the whole logits (``linear_cross_entropy``). With both enabled, the
vocabulary decides (:data:`FUSED_LOSS_MIN_VOCAB`).
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

from trainer.compile.passes.graph_edit import arg, erase_dead, float32_cast, is_call, is_method, shape_of

FUSED_LOSS_MIN_VOCAB = 65536
"""With both loss kernels enabled: the fused linear + cross-entropy from this vocabulary up, the row kernel below.
At GPT-2's 50304 the row kernel on compiled logits is the faster (docs/performance.md, "The loss kernels"); at
Llama 3's 128256 the logits alone would be 2.1 GB in bf16 for 8192 tokens."""


# ---- the op the graph calls (AOTAutograd traces through it) -------------------------------------


def _loss(h, weight, targets, ignore_index, reduction, save_logit_grads):
    from trainer.ops.linear_cross_entropy import linear_cross_entropy

    h2 = h.reshape(-1, h.shape[-1])  # (N, C)
    return linear_cross_entropy(
        h2, weight, targets.reshape(-1), ignore_index, reduction, save_logit_grads=save_logit_grads
    )


# ---- the head and the loss -----------------------------------------------------------------------

_SHAPE_ONLY = ("view", "reshape", "contiguous", "flatten")


def _logits_source(n: fx.Node) -> fx.Node | None:
    """Through views, reshapes and a float32 upcast with no other readers, to the node that made the logits."""
    while (is_method(n, *_SHAPE_ONLY) or is_call(n, torch.reshape, torch.flatten) or float32_cast(n)) and len(
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
    if not (is_call(n, *_SCALES) or is_method(n, "mul", "div")) or len(n.args) != 2 or n.kwargs or len(n.users) != 1:
        return None
    divide = n.target in (operator.truediv, torch.div, "div")
    lin, c = n.args if divide or isinstance(n.args[1], int | float) else n.args[::-1]  # c * logits too
    if isinstance(c, bool) or not isinstance(c, int | float) or not is_call(lin, F.linear) or len(lin.users) != 1:
        return None
    if arg(lin, 2, "bias") is not None:
        return None
    x = lin.args[0]
    with g.inserting_before(lin):
        h = g.call_function(operator.truediv if divide else operator.mul, (x, c))
    h.meta.update({k: v for k, v in x.meta.items() if k in ("example_value", "val", "tensor_meta", "stack_trace")})
    lin.update_arg(0, h)
    n.replace_all_uses_with(lin)
    g.erase_node(n)
    return lin


def losses(gm, kernels: set[str], log, order) -> None:
    g = gm.graph
    for n in list(g.nodes):
        if not is_call(n, F.cross_entropy):
            continue
        logits, targets = n.args[0], arg(n, 1, "target")
        name = "cross_entropy" if "cross_entropy" in kernels else "linear_cross_entropy"
        reduction = arg(n, 7, "reduction", "mean")
        ignore_index = arg(n, 4, "ignore_index", -100)
        if arg(n, 2, "weight") is not None or arg(n, 8, "label_smoothing", 0.0) or reduction not in ("mean", "sum"):
            log.miss(name, n, "class weights, label smoothing or reduction='none'")
            continue
        if arg(n, 3, "size_average") is not None or arg(n, 5, "reduce") is not None:
            log.miss(name, n, "legacy size_average/reduce arguments")
            continue
        if shape_of(logits) is None or len(shape_of(logits)) != 2 or shape_of(targets) != shape_of(logits)[:1]:
            log.miss(name, n, f"logits of shape {shape_of(logits)}: expected (tokens, vocabulary)")
            continue
        lin = _logits_source(logits)
        lin = _scaled_head(g, lin) or lin
        if not is_call(lin, F.linear):
            log.miss(name, n, "the logits do not come from a linear layer (or are also read elsewhere)")
            continue
        h, w = lin.args[0], arg(lin, 1, "weight")
        if arg(lin, 2, "bias") is not None:
            log.miss(name, n, "the head has a bias")
            continue
        if len(lin.users) != 1:
            log.miss(name, n, "the logits are also used elsewhere (returned by the model?)")
            continue
        vocab = shape_of(w)[0]
        save = "cross_entropy" in kernels and not ("linear_cross_entropy" in kernels and vocab >= FUSED_LOSS_MIN_VOCAB)
        name = "cross_entropy" if save else "linear_cross_entropy"
        with g.inserting_before(n):
            call = g.call_function(_loss, (h, w, targets, ignore_index, reduction, save))
        call.meta["stack_trace"] = n.meta.get("stack_trace")
        log.hit(name, n)
        n.replace_all_uses_with(call)
        erase_dead(g, n)
