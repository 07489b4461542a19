"""The norm passes: ``layer_norm(x + inc)`` becomes ``trainer::add_layer_norm`` and RMSNorm (``F.rms_norm`` or the
hand-written form of Hugging Face's Llama, Mistral and Qwen) with its residual add ``trainer::add_rms_norm``.

The add's result stays the residual stream (the kernel writes it); a norm that reads no add gets the same kernel
without ``inc``. The bias of the matmul that made ``inc`` moves into the LayerNorm kernel, whose backward already
sums the column gradients it needs. Sums and statistics are fp32, outputs rounded once, as the reference.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx

from trainer.compile.passes.graph_edit import (
    ADDS,
    MULS,
    add_operands,
    arg,
    dtype_of,
    erase_dead,
    erased,
    float32_cast,
    in_place,
    inputs,
    is_call,
    is_method,
    shape_of,
    skip_dropout0,
)

_MAX_COLS = 16384  # the norm kernels keep one row in registers


# ---- the ops the graph calls (AOTAutograd traces through these) ---------------------------------


def _add_layer_norm(x, inc, inc_bias, weight, bias, eps, out_dtype):
    from trainer.ops.add_layer_norm import add_layer_norm_op

    return add_layer_norm_op(x, inc, weight, bias, eps, out_dtype, inc_bias=inc_bias)


def _add_rms_norm(x, inc, weight, eps, out_dtype):
    from trainer.ops.add_rms_norm import add_rms_norm, rms_norm

    if inc is None:
        return x, rms_norm(x, weight, eps, out_dtype)
    return add_rms_norm(x, inc, weight, eps, out_dtype)


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
    ops = add_operands(n)
    if ops is None:
        return None
    a, b = ops
    if not (shape_of(a) == shape_of(b) == shape_of(n)) or dtype_of(n) is None or not dtype_of(n).is_floating_point:
        return None  # a broadcast, or not a tensor sum
    if dtype_of(a) == dtype_of(n):
        x, inc = a, b
    elif dtype_of(b) == dtype_of(n):
        x, inc = b, a
    else:
        return None
    if is_call(inc, F.dropout) and arg(inc, 1, "p", 0.5) != 0.0 and arg(inc, 2, "training", True) is not False:
        return _DROPOUT  # Inductor fuses the dropout, the add and the norm into one kernel: leave them to it
    add = _Add(n, x, inc)
    lin = skip_dropout0(inc)
    if fold_bias and is_call(lin, F.linear) and len(lin.users) == 1 and isinstance(arg(lin, 2, "bias"), fx.Node):
        if shape_of(arg(lin, 2, "bias")) == (shape_of(n)[-1],):
            add.inc_bias, add.linear = arg(lin, 2, "bias"), lin
    return add


def _out_dtype(norm: fx.Node):
    """The dtype the norm's output is written in: what every reader would cast it to, if they all are linears
    under autocast (a bf16 write instead of fp32, and no cast kernel), else the norm's own."""
    users = list(norm.users)
    if users and all(is_call(u, F.linear) and u.args[0] is norm for u in users):
        dtypes = {dtype_of(u) for u in users}
        if len(dtypes) == 1 and None not in dtypes:
            return dtypes.pop()
    return dtype_of(norm)


def _fuse_norm(gm, norm, x_in, add: _Add | None, kernel, args, name, log, order) -> None:
    """Replace ``norm`` (whose input is ``x_in``, or ``add``'s sum) by one ``kernel(x, inc, *args) -> (s, y)``."""
    g = gm.graph
    params = [p for p in inputs(args) if p.op != "placeholder"]
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
    erase_dead(g, norm)
    if add is not None and not erased(add.node):  # the norm may have been its last reader
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
        pure = n.op == "get_attr" or (n.op in ("call_function", "call_method") and not in_place(n))
        if n is anchor or n not in order or not pure:
            return False
        moving.add(n)
        todo.extend(inputs((n.args, n.kwargs)))
    for i, n in enumerate(sorted(moving, key=order.__getitem__)):  # in graph order, so inputs stay first
        anchor.prepend(n)
        order[n] = order[anchor] - 1 + (i + 1) / (len(moving) + 1)
    return True


def _writes_between(first: fx.Node, last: fx.Node) -> bool:
    """Whether a node after ``first`` and before ``last`` writes in place (the kernel, placed at ``first``, would
    read its inputs before that write instead of after it)."""
    n = first.next
    while n is not last and n.op != "root":
        if n.op in ("call_function", "call_method") and in_place(n):
            return True
        n = n.next
    return False


# ---- LayerNorm -----------------------------------------------------------------------------------


def layer_norms(gm, log, order, fold_bias=True) -> None:
    for n in list(gm.graph.nodes):
        if not is_call(n, F.layer_norm, torch.layer_norm):
            continue
        x, shape = n.args[0], arg(n, 1, "normalized_shape")
        weight, bias, eps = arg(n, 2, "weight"), arg(n, 3, "bias"), arg(n, 4, "eps", 1e-5)
        xs = shape_of(x)
        if weight is None:
            log.miss("add_layer_norm", n, "no affine weight")
            continue
        if xs is None or tuple(shape) != xs[-1:] or shape_of(weight) != xs[-1:]:
            log.miss("add_layer_norm", n, f"normalises over {tuple(shape)}, not the last dimension alone")
            continue
        if xs[-1] > _MAX_COLS or not dtype_of(x).is_floating_point:
            log.miss("add_layer_norm", n, f"rows of {xs[-1]} {dtype_of(x)} elements")
            continue
        add = _residual_add(x, fold_bias)
        if add is _DROPOUT:
            log.miss("add_layer_norm", n, "a dropout feeds the residual add (Inductor fuses dropout, add and norm)")
            continue
        if add is not None and dtype_of(add.x) != dtype_of(n):
            add = None
        _fuse_norm(gm, n, x, add, _add_layer_norm, (weight, bias, eps, _out_dtype(n)), "add_layer_norm", log, order)


# ---- RMSNorm -------------------------------------------------------------------------------------


def _hand_written_rms(mul: fx.Node, log) -> tuple[fx.Node, fx.Node, float] | None:
    """``(h, weight, eps)`` if ``mul`` is ``weight * (h32 * rsqrt(mean(h32 ** 2, -1, keepdim) + eps)).to(dtype)``
    with ``h`` fp32 (so both casts are no-ops), else None."""
    if not (is_call(mul, *MULS) or is_method(mul, "mul")) or len(mul.args) != 2:
        return None
    for w, normed in (mul.args, mul.args[::-1]):
        if not isinstance(w, fx.Node) or not isinstance(normed, fx.Node):
            continue
        if shape_of(w) is None or len(shape_of(w)) != 1:
            continue
        inner = normed.args[0] if (is_method(normed, "to", "type_as")) else normed
        if not (is_call(inner, *MULS) or is_method(inner, "mul")) or len(inner.args) != 2:
            continue
        for h32, r in (inner.args, inner.args[::-1]):
            if not (is_call(r, torch.rsqrt) or is_method(r, "rsqrt")):
                continue
            ops = add_operands(r.args[0]) if isinstance(r.args[0], fx.Node) else None
            var_eps = None
            if ops is None and (is_call(r.args[0], *ADDS) or is_method(r.args[0], "add")):
                var_eps = r.args[0].args  # var + eps with eps a Python number
            elif ops is not None:
                continue  # eps as a tensor: leave it
            if var_eps is None or len(var_eps) != 2:
                continue
            var, eps = var_eps if isinstance(var_eps[1], float | int) else var_eps[::-1]
            if not isinstance(eps, float | int) or not (is_method(var, "mean") or is_call(var, torch.mean)):
                continue
            sq = var.args[0]
            dims = arg(var, 1, "dim")
            keep = var.kwargs.get("keepdim", var.args[2] if len(var.args) > 2 else False)
            if not ((is_method(sq, "pow") or is_call(sq, torch.pow)) and sq.args[1] == 2 and sq.args[0] is h32):
                continue
            xs = shape_of(h32)
            if dims not in (-1, [-1], (-1,), len(xs) - 1) or not keep:
                log.miss("add_rms_norm", mul, f"mean over dim {dims}, not the last")
                return None
            h = h32.args[0] if float32_cast(h32) else h32
            if dtype_of(h) != torch.float32 or dtype_of(mul) != torch.float32 or shape_of(w) != xs[-1:]:
                log.miss("add_rms_norm", mul, f"input {dtype_of(h)}: rounds to it before the weight")
                return None
            return h, w, float(eps)
    return None


def rms_norms(gm, log, order) -> None:
    for n in list(gm.graph.nodes):
        if erased(n):
            continue  # with an earlier match
        if is_call(n, F.rms_norm):
            h, shape, w, eps = n.args[0], arg(n, 1, "normalized_shape"), arg(n, 2, "weight"), arg(n, 3, "eps")
            if w is None:
                log.miss("add_rms_norm", n, "no affine weight")
                continue
            if shape_of(h) is None or tuple(shape) != shape_of(h)[-1:]:
                log.miss("add_rms_norm", n, f"normalises over {tuple(shape)}, not the last dimension alone")
                continue
            eps = torch.finfo(dtype_of(h)).eps if eps is None else float(eps)
        else:
            match = _hand_written_rms(n, log)
            if match is None:
                continue
            h, w, eps = match
        if shape_of(h)[-1] > _MAX_COLS:
            log.miss("add_rms_norm", n, f"rows of {shape_of(h)[-1]} elements")
            continue
        add = _residual_add(h, fold_bias=False)
        if add is _DROPOUT:
            log.miss("add_rms_norm", n, "a dropout feeds the residual add (Inductor fuses dropout, add and norm)")
            continue
        if add is not None and dtype_of(add.x) != dtype_of(n):
            add = None
        _fuse_norm(gm, n, h, add, _add_rms_norm, (w, eps, _out_dtype(n)), "add_rms_norm", log, order)
