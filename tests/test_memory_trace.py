"""The traced step of the memory model (trainer/memory/trace.py) on small graphs: what each op's result holds and
when it is freed, the backward's gradients counted apart, and the rule that takes two traced blocks to the full
depth."""

import torch

from trainer import memory


def test_the_walk_counts_a_view_once_frees_after_the_last_reader_and_keeps_outputs():
    from torch.fx.experimental.proxy_tensor import make_fx

    from trainer.memory.trace import _envelope, _live

    def step(x, w):
        a = x * 2  # 96 bytes, scales with the batch
        b = a.view(-1)  # a's storage
        c = b + 1  # 96 bytes; a is freed after it
        d = w * 3  # 20 bytes, fixed
        return c, d

    gm = make_fx(step, tracing_mode="fake")(torch.zeros(3, 8), torch.zeros(5))
    names = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    scaling = {names[0], names[1], names[2]}
    assert _live(gm, scaling, set(), keep_outputs=True) == [(96, 20), (192, 0)]  # the envelope of the series
    kept = _live(gm, scaling, set(), keep_outputs=False)
    assert kept == [(0, 20), (192, 0)]  # c freed once made: d is made with nothing else live
    assert _envelope([(0, 5), (10, 5), (10, 7), (20, 1)]) == [(10, 7), (20, 1)]


def test_the_backward_counts_its_gradients_apart_and_the_blocks_whose_gradients_are_made():
    from torch.fx.experimental.proxy_tensor import make_fx

    from trainer.memory.trace import _backward

    def backward(saved, g):
        a = g * saved  # 96 bytes, scales with the batch; saved is freed after it
        head = g.sum(0)  # 32 bytes: the gradient of no block
        grad1 = a.sum(0)  # 32 bytes: block 1's gradient (its only one)
        b = a * 2  # 96 bytes; a is freed after it
        grad0 = b.sum(0)  # 32 bytes: block 0's
        return head, grad1, grad0

    gm = make_fx(backward, tracing_mode="fake")(torch.zeros(3, 8), torch.zeros(3, 8))
    saved, _ = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    a, b = [n.name for n in gm.graph.nodes if n.target == torch.ops.aten.mul.Tensor]
    points, grads = _backward(gm, {saved, a, b}, {saved}, [None, 1, 0])
    assert grads == 96
    # (scaling, fixed, gradients made, blocks with every gradient made), the dominated points left out
    assert points == [(192, 0, 64, 1), (192, 0, 0, 0), (96, 0, 96, 2), (96, 0, 32, 0)]


def test_the_full_depth_holds_saved_tensors_until_the_first_block_is_done_then_gradients():
    """Blocks of 30 saved bytes and 20 of gradients (as traced), 5 of the head's gradient made first; ten blocks."""
    from trainer.memory.trace import Traced, Walk

    one = Walk(forward=[(30, 0)], backward=[(30, 0, 5, 0), (0, 0, 25, 1)], saved=(30, 0), grads=25)
    two = Walk(forward=[(60, 0)], backward=[(60, 0, 5, 0), (30, 0, 25, 1), (0, 0, 45, 2)], saved=(60, 0), grads=45)
    traced = Traced("none", 10, one, two)
    assert traced.grads() == 10 * 20 + 5
    # gradients not held (accumulation: a part of their own): every block's saved tensors at the backward's start
    assert traced.activations(3, 0.0) == 60 + 8 * 30
    # held as traced: the head's at the backward's start (305); at its end every gradient and no saved tensor
    assert traced.activations(3, 1.0) == 60 + 5 + 8 * 30
    assert traced.activations(3, 4.0) == 4 * (10 * 20 + 5)
    # the estimate holds them as its gradients part says, and holds them all while the optimizer steps
    parts = {"parameters": (100.0, ""), "gradients": (4.0 * traced.grads(), "")}
    est = memory.Estimate(parts, 8, traced={"none": traced}, transient=(50.0, ""))
    assert est.peak("none", 3) == 100 + 4 * (10 * 20 + 5) + 50
    est.keep_grads = False
    assert est.peak("none", 3) == 100 + 4 * (10 * 20 + 5) + max(60 + 8 * 30, 50)
