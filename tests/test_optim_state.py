"""Our Triton optimizers' state: state_dict interchanges with torch's, and load_state_dict copies into the flat
buffers a captured step reads (no new buffers, no recompiles).

On CPU the kernels run under ``TRITON_INTERPRET=1`` (set by tests/test_optim_kernels.py, imported first).
"""

from tests.test_optim_kernels import (  # noqa: I001 - sets TRITON_INTERPRET before triton is imported
    DEVICE,
    _clone_params,
    _params,
    _run_pair,
)

import copy  # noqa: E402
import io  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from trainer.optim.optimizers import TritonAdam, TritonAdamW, TritonSGD  # noqa: E402


def _states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        # Observed 2.4e-7: the two optimizers' fp32 rounding after the same steps.
        torch.testing.assert_close(a[k].double().cpu(), b[k].double().cpu(), rtol=0, atol=2e-6)


@pytest.mark.parametrize(
    "ours_cls,theirs_cls,kw",
    [
        (TritonAdamW, torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
        (TritonSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1)),
    ],
    ids=["adamw", "sgd"],
)
def test_state_dict_interchanges_with_torch_mid_run(ours_cls, theirs_cls, kw):
    ps = _params([(5, 3), (7,), (1,)])
    qs = _clone_params(ps)
    ours, theirs = ours_cls(ps, **kw), theirs_cls(qs, **kw)
    _run_pair(ours, theirs, ps, qs, steps=3)
    sd_ours, sd_theirs = ours.state_dict(), theirs.state_dict()
    # Same layout: same group keys and values, same per-parameter keys, a CPU 'step' per parameter.
    assert sd_ours["param_groups"] == sd_theirs["param_groups"]
    assert sd_ours["state"].keys() == sd_theirs["state"].keys()
    for i in sd_theirs["state"]:
        _states_equal(sd_ours["state"][i], sd_theirs["state"][i])
        if "step" in sd_ours["state"][i]:
            assert sd_ours["state"][i]["step"].device.type == "cpu"
    steps = [s["step"] for s in sd_ours["state"].values() if "step" in s]
    assert len({id(s) for s in steps}) == len(steps)  # not one shared tensor

    # torch -> ours: a fresh Triton optimizer continues torch's run; ours -> torch likewise.
    ps2, qs2 = _clone_params(qs), _clone_params(ps)
    ours2, theirs2 = ours_cls(ps2, **kw), theirs_cls(qs2, **kw)
    # deepcopy: state_dict() hands out live state tensors (torch's do too) and torch's
    # load_state_dict keeps them, so two live optimizers would otherwise share moments.
    ours2.load_state_dict(copy.deepcopy(theirs.state_dict()))
    theirs2.load_state_dict(copy.deepcopy(ours.state_dict()))
    _run_pair(ours2, theirs, ps2, qs, steps=3, seed=7)
    _run_pair(ours, theirs2, ps, qs2, steps=3, seed=7)
    for a, b, c, d in zip(ps2, qs, ps, qs2):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6)  # observed 2.4e-7 (SGD), 3e-8 (AdamW)
        torch.testing.assert_close(c, d, rtol=0, atol=2e-6)
    # Loading into a Triton optimizer that has already stepped replaces its state.
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
    for i, p in enumerate(ps):
        _states_equal(ours.state[p], theirs.state_dict()["state"][i])


def _through_a_file(state_dict: dict) -> dict:
    """What a checkpoint hands back: new tensors with the saved values."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _buffers(opt) -> list[torch.Tensor]:
    """Every tensor a captured step reads or writes: flat parameters, states, step counters, hyperparameters."""
    flats = [flat.param for _, flat in opt._flats]
    return flats + [b for bufs in opt._bufs for b in bufs.values()] + opt._steps + opt._hparams_dev


def _assert_same_run(ps, qs, a, b):
    """Bit-equal parameters, states and step counts: the same kernels on the same values."""
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys() and all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i])


TRITON_OPTIMIZERS = {
    "adamw": (TritonAdamW, dict(lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)),
    "adamw-table": (TritonAdamW, dict(lr=0.01, weight_decay=0.1, flat_grads=False)),
    "adam": (TritonAdam, dict(lr=0.01, weight_decay=0.1, max_grad_norm=1.0)),
    "sgd": (TritonSGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
}


@pytest.mark.parametrize("kind", list(TRITON_OPTIMIZERS))
def test_load_state_dict_mid_run_copies_into_the_flat_buffers(kind):
    # A graphed step captured the flat buffers' addresses: a load must write into them, not replace them.
    cls, kw = TRITON_OPTIMIZERS[kind]
    ps = _params([(5, 3), (7,), (1,)])
    qs, rs = _clone_params(ps), _clone_params(ps)
    opt, ref = cls(ps, **kw), cls(qs, **kw)  # ref: the same run, never reloaded
    _run_pair(opt, ref, ps, qs, steps=3)
    bufs, ptrs = _buffers(opt), [p.data_ptr() for p in ps]

    # Round trips: the live state dict, and one through a file (what a checkpoint gives back).
    opt.load_state_dict(opt.state_dict())
    opt.load_state_dict(_through_a_file(opt.state_dict()))
    _run_pair(opt, ref, ps, qs, steps=3, seed=2)
    _assert_same_run(ps, qs, opt, ref)

    # A checkpoint restore in a live process: another run's state (more steps, other gradients, another lr).
    other = cls(rs, **{**kw, "lr": kw["lr"] / 2})
    _run_pair(other, cls(_clone_params(rs), **kw), rs, _clone_params(rs), steps=5, seed=3)
    opt.load_state_dict(other.state_dict())
    for p, r in zip(ps, rs):
        p.data.copy_(r)
    assert opt.param_groups[0]["lr"] == kw["lr"] / 2
    _run_pair(opt, other, ps, rs, steps=3, seed=4)
    _assert_same_run(ps, rs, opt, other)

    now = _buffers(opt)
    assert len(now) == len(bufs) and all(a is b for a, b in zip(now, bufs)), "a buffer was replaced"
    assert [p.data_ptr() for p in ps] == ptrs and all(flat.owns_params() for _, flat in opt._flats)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_load_state_dict_of_other_shapes_says_so(kind):
    # Another model's state (each matrix transposed): copied into a flat view it would fail or broadcast.
    cls, kw = TRITON_OPTIMIZERS[kind]
    ps = _params([(5, 3), (7,)])
    others = _params([(3, 5), (7,)])
    source = cls(others, **kw)
    _run_pair(source, cls(_clone_params(others), **kw), others, _clone_params(others), steps=2)
    foreign = source.state_dict()
    opt = cls(ps, **kw)
    with pytest.raises(ValueError, match=r"does not fit: state\[0\].* has shape \(3, 5\).* has \(5, 3\)"):
        opt.load_state_dict(foreign)  # before the first step
    _run_pair(opt, cls(_clone_params(ps), **kw), ps, _clone_params(ps), steps=2)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="does not fit"):
        opt.load_state_dict(foreign)  # mid-run, and nothing changes
    after = opt.state_dict()
    for i in before["state"]:
        assert all(torch.equal(before["state"][i][k], after["state"][i][k]) for k in before["state"][i])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(TRITON_OPTIMIZERS))
def test_captured_step_replays_on_the_loaded_state(kind):
    # What a graphed training step relies on: load_state_dict mid-run, then the captured step (which reads and
    # writes the flat buffers' addresses) continues from the loaded state, as the run it came from does.
    cls, kw = TRITON_OPTIMIZERS[kind]
    ps = _params([(5, 3), (7,), (1,)])
    rs = _clone_params(ps)
    opt, other = cls(ps, **kw), cls(rs, **{**kw, "lr": kw["lr"] / 2})
    gen = torch.Generator().manual_seed(1)

    def grads_in_place(params):  # a captured step reads the gradients where they were at capture
        for p in params:
            g = torch.randn(p.shape, generator=gen).to(DEVICE)
            p.grad = g if p.grad is None else p.grad.copy_(g)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: builds the flat buffers, compiles the kernels
        for _ in range(2):
            grads_in_place(ps)
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.before_graph_replay()
    with torch.cuda.graph(graph):
        opt.step()
    for _ in range(4):
        grads_in_place(rs)
        other.step()
    opt.load_state_dict(other.state_dict())
    for p, r in zip(ps, rs):
        p.data.copy_(r)
    for _ in range(3):
        grads_in_place(ps)
        for p, r in zip(ps, rs):
            r.grad = p.grad.clone()
        opt.before_graph_replay()
        graph.replay()
        opt.after_graph_replay()
        other.step()
    torch.cuda.synchronize()
    _assert_same_run(ps, rs, opt, other)


def test_bf16_params_keep_fp32_states_through_a_checkpoint():
    ps = _params([(5, 3), (9,)], dtype=torch.bfloat16)
    opt = TritonAdamW(ps, lr=0.01)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    assert sd["state"][0]["exp_avg_sq"].dtype == torch.float32
    fresh = TritonAdamW(_clone_params(ps), lr=0.01)
    fresh.load_state_dict(sd)
    fresh_params = fresh.param_groups[0]["params"]
    for p, q in zip(fresh_params, ps):
        q.grad = torch.randn_like(q)
        p.grad = q.grad.clone()
    fresh.step()
    opt.step()
    # Bit-equal: the loaded fp32 moments were not rounded through bf16.
    for p, q in zip(fresh_params, ps):
        assert torch.equal(p, q)
        assert fresh.state[p]["exp_avg_sq"].dtype == torch.float32
