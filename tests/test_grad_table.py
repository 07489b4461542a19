"""TritonAdamW with flat_grads=False (what optim.impl=triton builds): gradients read through the address
table of trainer/optim/grad_table.py. Its arithmetic against float64 and torch is covered with the flat
mode's in test_optim_kernels.py ("-table" cases); here what differs: gradients left to autograd, and the step
captured in a CUDA graph (GPU).
"""

import pytest
import torch

from tests.test_optim_kernels import DEVICE, _clone_params, _params  # sets TRITON_INTERPRET first on CPU
from trainer.optim.optimizers import TritonAdamW


def test_table_mode_leaves_gradients_to_autograd():
    """flat_grads=False: gradients are autograd's own tensors (not copied into a buffer), zero_grad sets them
    to None as torch's does, and a None gradient counts as zero, as in the flat mode."""
    shapes = [(5, 3), (7,), (2049,)]
    ps_flat, ps_table = _params(shapes), _params(shapes)
    flat = TritonAdamW(ps_flat, lr=0.01, weight_decay=0.1, max_grad_norm=1.0)
    table = TritonAdamW(ps_table, lr=0.01, weight_decay=0.1, max_grad_norm=1.0, flat_grads=False)
    gen = torch.Generator().manual_seed(4)
    for k in range(4):
        grads = [torch.randn(s, generator=gen).to(DEVICE) for s in shapes]
        if k == 2:
            grads[1] = None  # one parameter without a gradient this step
        for p, q, g in zip(ps_flat, ps_table, grads):
            p.grad = None if g is None else g.clone()
            q.grad = g
        table_grads = [q.grad for q in ps_table]
        flat.step()
        table.step()
        assert all(q.grad is g for q, g in zip(ps_table, table_grads))  # untouched, not re-pointed
        for p, q in zip(ps_flat, ps_table):
            # The same update arithmetic; the norms' partial sums group differently (fp32 rounding of the clip
            # coefficient): observed 0 or 1 ulp of O(1) params.
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
        torch.testing.assert_close(flat.last_grad_norm, table.last_grad_norm, rtol=1e-6, atol=0)
        flat.zero_grad()
        table.zero_grad()
        assert all(q.grad is None for q in ps_table)
    assert table.state_dict()["state"][0]["step"].item() == 4


def test_table_mode_refuses_a_strided_gradient():
    (p,) = _params([(8,)])
    opt = TritonAdamW([p], lr=0.01, flat_grads=False)
    p.grad = torch.zeros(16, device=DEVICE)[::2]  # the kernel reads whole contiguous gradients
    with pytest.raises(ValueError, match="gradient of a \\(8,\\) parameter: expected a contiguous torch.float32"):
        opt.step()


@pytest.mark.gpu
def test_triton_adamw_table_step_replays_in_a_cuda_graph():
    """flat_grads=False captured in a CUDA graph: each replay reads that step's gradients (the addresses copied
    inside the graph), the schedule's lr written by before_graph_replay, and the host counts the steps."""
    shapes = [(50304, 64), (64,), (192, 64), (3,)]
    ps = _params(shapes)
    qs = _clone_params(ps)
    ours = TritonAdamW(ps, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0, flat_grads=False)
    theirs = torch.optim.AdamW(qs, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (ours, theirs)]
    gen = torch.Generator(device="cuda").manual_seed(5)
    static = [torch.empty(s, device="cuda") for s in shapes]  # the gradients the graph reads

    def new_grads():
        for g in static:
            g.normal_(generator=gen)
        for p, q, g in zip(ps, qs, static):
            p.grad = g
            q.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(qs, 1.0)

    new_grads()
    ours.step()  # one ordinary step first: builds the flat buffers (not capturable)
    theirs.step()
    for s in scheds:
        s.step()
    graph = torch.cuda.CUDAGraph()
    ours.before_graph_replay()
    with torch.cuda.graph(graph):
        ours.step()
    for _ in range(5):
        new_grads()
        ours.before_graph_replay()
        graph.replay()
        ours.after_graph_replay()
        theirs.step()
        for s in scheds:
            s.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)  # fp32, other operation order: ~1 ulp per step
    assert ours.state_dict()["state"][0]["step"].item() == theirs.state_dict()["state"][0]["step"].item() == 6
