"""compile_optimizer: eager parity for every torch optimizer, no recompiles under schedulers, checkpoints.

Compiles use ``aot_eager`` (the capture and the functional optimizer code are what is tested);
one test uses Inductor's C++ backend, whose generated code is what users get on CPU.
"""

import os

import torch

# Importing torch._dynamo imports triton; set the interpreter flag first so that the Triton kernel
# tests collected after this module still run on CPU (see tests/test_optim_kernels.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import copy  # noqa: E402
import io  # noqa: E402

import pytest  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from trainer.compile import compile_optimizer  # noqa: E402
from trainer.optim import build_optimizer  # noqa: E402
from trainer.optim.compiled import CompiledOptimizer  # noqa: E402
from trainer.optim.factory import resolve_impl  # noqa: E402

BACKEND = "aot_eager"
optim = torch.optim

# name -> (class, kwargs, parameter shapes, atol after 15 steps on O(1) parameters). Observed
# maxima (torch 2.13, CPU) in the comments. The compiled step runs torch's capturable
# formulas (bias corrections as fp32 tensors on the device instead of float64 on the host, a
# tensor lr) and aot_eager's decompositions of lerp/addcdiv, so it rounds differently from the
# eager step: a few fp32 ulps per step, not compounding.
W = [(5, 3), (3,)]
CASES = {
    "SGD": (optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01), W, 2e-6),  # 1.2e-7
    "Adam": (optim.Adam, dict(lr=0.01, weight_decay=0.1), W, 2e-6),  # 6e-8
    "AdamW": (optim.AdamW, dict(lr=0.01, weight_decay=0.1, amsgrad=True), W, 2e-6),  # 1.2e-7
    "RMSprop": (optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True), W, 2e-6),  # 1.5e-7
    "Adagrad": (optim.Adagrad, dict(lr=0.05, lr_decay=0.01), W, 2e-6),  # 0
    "Adadelta": (optim.Adadelta, dict(lr=0.5), W, 2e-6),  # 0
    "NAdam": (optim.NAdam, dict(lr=0.01), W, 5e-6),  # 4.8e-7
    "RAdam": (optim.RAdam, dict(lr=0.01), W, 1e-5),  # 1.8e-6 (rectified from step 6 on: both branches run)
    "Adamax": (optim.Adamax, dict(lr=0.01), W, 2e-6),  # 3e-8
    "ASGD": (optim.ASGD, dict(lr=0.01, t0=5), W, 5e-6),  # 9.5e-7 (averaging from step 5)
    "Rprop": (optim.Rprop, dict(lr=0.01), W, 2e-6),  # 0
}
if hasattr(optim, "Muon"):
    # Muon orthogonalises in bf16 (Newton-Schulz on grad.bfloat16()): the decomposed matmul
    # chain rounds in bf16 at other points than eager; observed 4.4e-5 on updates of ~1e-2.
    CASES["Muon"] = (optim.Muon, dict(lr=0.01), [(8, 6), (6, 4)], 2e-4)

SCHEDULERS = {
    "StepLR": lambda o: optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
    "ReduceLROnPlateau": lambda o: optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=1),
}


def _params(shapes, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]


def _clone(ps):
    return [torch.nn.Parameter(p.detach().clone()) for p in ps]


def _step_both(a, b, ps, qs, steps, scheds=(), seed=1, on_step=None):
    """Feed both optimizers the same gradients for ``steps`` steps; returns the LRs seen."""
    gen = torch.Generator().manual_seed(seed)
    lrs = []
    for i in range(steps):
        for p, q in zip(ps, qs):
            g = torch.randn(p.shape, generator=gen).to(p.device)
            p.grad, q.grad = g.clone(), g
        a.step()
        b.step()
        for s in scheds:
            # ReduceLROnPlateau: a metric that improves every third step, so the LR both holds and drops.
            s.step(float(10 - i // 3)) if isinstance(s, optim.lr_scheduler.ReduceLROnPlateau) else s.step()
        lrs.append((a.param_groups[0]["lr"], b.param_groups[0]["lr"]))
        if on_step:
            on_step(i)
    return lrs


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("sched_name", list(SCHEDULERS))
@pytest.mark.parametrize("name", list(CASES))
def test_trajectory_matches_eager_without_recompiles(name, sched_name):
    cls, kw, shapes, atol = CASES[name]
    ps = _params(shapes)
    qs = _clone(ps)
    compiled, eager = compile_optimizer(cls(ps, **kw), backend=BACKEND), cls(qs, **kw)
    assert compiled.compiled
    scheds = [SCHEDULERS[sched_name](compiled), SCHEDULERS[sched_name](eager)]
    counters.clear()
    warm = {}
    # Warm-up is two steps: SGD's momentum buffers appear in the first (state None -> tensor).
    lrs = _step_both(compiled, eager, ps, qs, 15, scheds, on_step=lambda i: warm.setdefault(i, _graphs()))
    assert 1 <= warm[1] <= 2
    assert _graphs() == warm[1], "recompiled after warm-up"
    assert not counters["graph_break"]
    assert all(isinstance(a, float) and a == b for a, b in lrs)  # floats in the groups, as eager
    assert len({a for a, _ in lrs}) >= 3  # the scheduler really changed the LR
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=0, atol=atol)


def test_onecycle_cycles_betas_without_recompiling():
    # OneCycleLR writes both lr and betas[0] every step; Adam-family betas are device tensors too.
    ps = _params(W)
    qs = _clone(ps)
    compiled, eager = compile_optimizer(optim.AdamW(ps, lr=0.01), backend=BACKEND), optim.AdamW(qs, lr=0.01)
    mk = lambda o: optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=20, cycle_momentum=True)
    counters.clear()
    _step_both(compiled, eager, ps, qs, 15, [mk(compiled), mk(eager)])
    assert _graphs() == 1
    assert compiled.param_groups[0]["betas"] == eager.param_groups[0]["betas"] != (0.9, 0.999)
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-6)  # observed 2.4e-7, as in CASES


def test_scheduled_float_hyperparameter_recompiles_then_falls_back_once(capsys):
    # SGD's momentum cannot be a tensor in the compiled step, so OneCycleLR's momentum cycling
    # recompiles every step; at the recompile limit the drop-in warns once and runs eagerly.
    ps = _params(W)
    qs = _clone(ps)
    compiled = compile_optimizer(optim.SGD(ps, lr=0.01, momentum=0.9), backend=BACKEND)
    eager = optim.SGD(qs, lr=0.01, momentum=0.9)
    mk = lambda o: optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=20, cycle_momentum=True)
    with torch._dynamo.config.patch(recompile_limit=3):
        _step_both(compiled, eager, ps, qs, 10, [mk(compiled), mk(eager)])
    assert not compiled.compiled
    warnings = [line for line in capsys.readouterr().err.splitlines() if "runs eagerly from now on" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: ") and "FailOnRecompileLimitHit" in warnings[0]
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-6)  # observed 0 (fp32 rounding would be ~1e-7, as in CASES)


def test_each_drop_in_has_its_own_compile_cache():
    # Every optimizer instance shares Optimizer.step's code object; with one cache the fourth
    # optimizer here would hit the (lowered) recompile limit and fall back.
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=2):
        for seed in range(4):
            ps = _params(W, seed=seed)
            opt = compile_optimizer(optim.AdamW(ps, lr=0.01), backend=BACKEND)
            _step_both(opt, optim.AdamW(_clone(ps), lr=0.01), ps, _clone(ps), 2)
            assert opt.compiled
    assert _graphs() == 4


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(
    "cls,kw",
    [(optim.AdamW, dict(lr=0.01, weight_decay=0.1)), (optim.SGD, dict(lr=0.05, momentum=0.9))],
    ids=["AdamW", "SGD"],
)
def test_state_dict_interchanges_with_eager_mid_run(cls, kw, device):
    # On CUDA the drop-in keeps 'step' on the GPU (capturable) and eager AdamW on the CPU; both load either.
    ps = _params(W, device=device)
    qs = _clone(ps)
    compiled, eager = compile_optimizer(cls(ps, **kw), backend=BACKEND), cls(qs, **kw)
    _step_both(compiled, eager, ps, qs, 4)
    sd_c, sd_e = compiled.state_dict(), eager.state_dict()
    assert sd_c["param_groups"] == sd_e["param_groups"]  # floats and the user's flags, not our tensors
    assert sd_c["state"].keys() == sd_e["state"].keys()
    for i in sd_e["state"]:
        assert sd_c["state"][i].keys() == sd_e["state"][i].keys()

    # eager -> drop-in and drop-in -> eager, each continued next to the optimizer it came from.
    # deepcopy: state_dict() hands out live tensors and load_state_dict keeps them.
    ps2, qs2 = _clone(qs), _clone(ps)
    compiled2 = compile_optimizer(cls(ps2, **kw), backend=BACKEND)
    compiled2.load_state_dict(copy.deepcopy(sd_e))
    eager2 = cls(qs2, **kw)
    eager2.load_state_dict(copy.deepcopy(sd_c))
    _step_both(compiled2, eager, ps2, qs, 4, seed=5)
    _step_both(compiled, eager2, ps, qs2, 4, seed=5)
    # Loading into a drop-in that has stepped already, mid-run, then continuing.
    compiled.load_state_dict(copy.deepcopy(eager2.state_dict()))
    for p, q in zip(ps, qs2):
        p.data.copy_(q)
    _step_both(compiled, eager2, ps, qs2, 3, seed=9)
    assert compiled.compiled and compiled2.compiled
    for a, b in [(ps2, qs), (ps, qs2)]:
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, rtol=0, atol=2e-6)  # observed 2.4e-7 (AdamW), 1.2e-7 (SGD), as in CASES


def _through_a_file(state_dict: dict) -> dict:
    """What a checkpoint hands back: new tensors with the saved values."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _feed(opt, ps, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen).to(p.device)
        opt.step()


def _state_tensors(opt, ps) -> dict:
    return {(i, k): t for i, p in enumerate(ps) for k, t in opt.state.get(p, {}).items() if isinstance(t, torch.Tensor)}


def _assert_same_run(ps, qs, a, b):
    """Bit-equal parameters and states: the same compiled step on the same values."""
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)
    sa, sb = _state_tensors(a, ps), _state_tensors(b, qs)
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", list(CASES))
def test_load_state_dict_mid_run_recompiles_nothing(name, device):
    # The compiled step guards on the identity of each state tensor; a load must copy into them.
    cls, kw, shapes, _ = CASES[name]
    ps = _params(shapes, device=device)
    qs, rs = _clone(ps), _clone(ps)
    counter = CompileCounterWithBackend(BACKEND)
    opt = compile_optimizer(cls(ps, **kw), backend=counter)
    ref = compile_optimizer(cls(qs, **kw), backend=BACKEND)  # the same run, never reloaded
    _step_both(opt, ref, ps, qs, 3)
    frames, live = counter.frame_count, _state_tensors(opt, ps)
    assert 1 <= frames <= 2 and live

    # Round trips: the live state dict, and one through a file (what a checkpoint gives back).
    opt.load_state_dict(opt.state_dict())
    opt.load_state_dict(_through_a_file(opt.state_dict()))
    _step_both(opt, ref, ps, qs, 3, seed=2)
    assert counter.frame_count == frames, "recompiled after a round trip"
    _assert_same_run(ps, qs, opt, ref)

    # A checkpoint restore in a live process: another run's state (other gradients, another lr), loaded
    # from its live state dict (copied, not shared), then both continue on the same gradients.
    other = compile_optimizer(cls(rs, **{**kw, "lr": kw["lr"] / 2}), backend=BACKEND)
    _feed(other, rs, 4, seed=3)
    opt.load_state_dict(other.state_dict())
    for p, r in zip(ps, rs):
        p.data.copy_(r)
    assert opt.param_groups[0]["lr"] == kw["lr"] / 2
    _step_both(opt, other, ps, rs, 3, seed=4)
    _assert_same_run(ps, rs, opt, other)

    assert opt.compiled and counter.frame_count == frames, "recompiled after loading another run's state"
    now = _state_tensors(opt, ps)
    assert now.keys() == live.keys() and all(now[k] is live[k] for k in live)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", list(CASES))
def test_load_state_dict_before_the_first_step(name, device):
    # A resume: the state is loaded into a fresh drop-in (lazily initialised, or Adagrad's eager state), the
    # run continues as the saved one does, and a later load mid-run still recompiles nothing.
    cls, kw, shapes, _ = CASES[name]
    ps = _params(shapes, device=device)
    qs = _clone(ps)
    saved = compile_optimizer(cls(ps, **kw), backend=BACKEND)
    _feed(saved, ps, 3, seed=1)
    counter = CompileCounterWithBackend(BACKEND)
    for q, p in zip(qs, ps):
        q.data.copy_(p)
    opt = compile_optimizer(cls(qs, **kw), backend=counter)
    opt.load_state_dict(_through_a_file(saved.state_dict()))
    _step_both(saved, opt, ps, qs, 3, seed=2)
    _assert_same_run(ps, qs, saved, opt)
    opt.load_state_dict(_through_a_file(saved.state_dict()))
    _step_both(saved, opt, ps, qs, 2, seed=3)
    _assert_same_run(ps, qs, saved, opt)
    assert opt.compiled and counter.frame_count == 1


@pytest.mark.parametrize("name", list(CASES))
def test_load_state_dict_of_other_shapes_says_so(name):
    # Another model's state (each matrix transposed: the same number of parameters and elements). torch loads
    # it without a check; the step would then fail inside the compiled code, or broadcast.
    cls, kw, shapes, _ = CASES[name]
    ps = _params(shapes)
    others = _params([s[::-1] for s in shapes])
    source = cls(others, **kw)
    _feed(source, others, 2, seed=1)
    foreign = source.state_dict()
    opt = compile_optimizer(cls(ps, **kw), backend=BACKEND)
    with pytest.raises(ValueError, match=r"does not fit: state\[0\].* has shape .*another model"):
        opt.load_state_dict(foreign)  # before the first step: checked against the parameters
    _feed(opt, ps, 2, seed=2)
    before = {k: t.clone() for k, t in _state_tensors(opt, ps).items()}
    with pytest.raises(ValueError, match="does not fit"):
        opt.load_state_dict(foreign)  # mid-run: against the state it would replace, and nothing changes
    after = _state_tensors(opt, ps)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_checkpoint_of_torch_fused_adamw_keeps_the_drop_in_compiled():
    # A fused optimizer's checkpoint carries fused=True in its groups; the compiled step must not take it (the
    # fused kernel is a graph break, and the drop-in would fall back to eager for good).
    ps = _params(W)
    qs = _clone(ps)
    fused = optim.AdamW(qs, lr=0.01, weight_decay=0.1, fused=True)
    _feed(fused, qs, 3, seed=1)
    counter = CompileCounterWithBackend(BACKEND)
    opt = compile_optimizer(optim.AdamW(ps, lr=0.01, weight_decay=0.1), backend=counter)
    opt.load_state_dict(_through_a_file(fused.state_dict()))
    for p, q in zip(ps, qs):
        p.data.copy_(q)
    _step_both(opt, fused, ps, qs, 4, seed=2)
    assert opt.compiled and counter.frame_count == 1
    assert opt.param_groups[0]["fused"] is True  # the user-visible groups are the checkpoint's, as eagerly
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-6)  # observed 3.6e-7: fused kernel vs capturable foreach, fp32


class _MySGD(optim.Optimizer):
    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                p.add_(p.grad, alpha=-g["lr"])


EAGER_ONLY = {
    "LBFGS": (lambda ps: optim.LBFGS(ps, lr=0.1, max_iter=3), "re-evaluates the closure"),
    "Adafactor": (lambda ps: optim.Adafactor(ps, lr=0.01), "host"),
    "fused": (lambda ps: optim.AdamW(ps, lr=0.01, fused=True), "fused=True"),
    "custom": (lambda ps: _MySGD(ps, lr=0.01), "not one of torch's optimizers"),
}


@pytest.mark.parametrize("name", list(EAGER_ONLY))
def test_what_cannot_compile_runs_eagerly_and_says_so_once(name, capsys):
    make, reason = EAGER_ONLY[name]
    ps = _params(W)
    qs = _clone(ps)
    compiled = compile_optimizer(make(ps), backend=BACKEND)
    compile_optimizer(make(_clone(ps)), backend=BACKEND)  # a second one: no second warning
    assert not compiled.compiled
    assert capsys.readouterr().err.count(reason) <= 1  # none where an earlier test of this process said it
    eager = make(qs)
    if name == "LBFGS":
        loss = lambda params: lambda: sum((p**2).sum() for p in params)
        for _ in range(3):
            compiled.zero_grad()
            eager.zero_grad()
            assert torch.equal(compiled.step(loss(ps)), eager.step(loss(qs)))
    else:
        _step_both(compiled, eager, ps, qs, 3)
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)  # the same eager code on the same inputs


def test_warning_is_said(capsys):
    # The once-only bookkeeping is per message; a fresh message is said.
    class Fresh(_MySGD):
        pass

    compile_optimizer(Fresh(_params(W), lr=0.1), backend=BACKEND)
    assert any("Fresh" in line and "runs eagerly" in line for line in capsys.readouterr().err.splitlines())


def test_drop_in_is_an_optimizer_every_scheduler_accepts():
    ps = _params(W)
    opt = compile_optimizer(optim.AdamW(ps, lr=0.01), backend=BACKEND)
    assert isinstance(opt, optim.Optimizer) and isinstance(opt, CompiledOptimizer)
    for make in [
        lambda o: optim.lr_scheduler.LambdaLR(o, lambda s: 0.9**s),
        lambda o: optim.lr_scheduler.CosineAnnealingLR(o, T_max=10),
        lambda o: optim.lr_scheduler.LinearLR(o, start_factor=0.5, total_iters=4),
        lambda o: optim.lr_scheduler.CyclicLR(o, base_lr=0.001, max_lr=0.01, step_size_up=2),
        lambda o: optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=10),
        lambda o: optim.lr_scheduler.ReduceLROnPlateau(o),
        lambda o: optim.lr_scheduler.SequentialLR(
            o,
            [optim.lr_scheduler.ConstantLR(o, factor=0.5, total_iters=2), optim.lr_scheduler.ExponentialLR(o, 0.9)],
            [2],
        ),
    ]:
        make(opt)
    # The shared groups: a scheduler built on the wrapped optimizer drives the drop-in too.
    assert opt.param_groups is opt.optimizer.param_groups and opt.state is opt.optimizer.state
    calls = []
    opt.register_step_post_hook(lambda o, a, k: calls.append(o))
    for p in ps:
        p.grad = torch.ones_like(p)
    assert opt.step(lambda: torch.tensor(3.0)) == 3.0  # the closure's loss comes back
    assert calls == [opt]
    opt.zero_grad()
    assert all(p.grad is None for p in ps)
    assert repr(opt).startswith("CompiledAdamW")
    with pytest.raises(ValueError, match="compiled already"):
        compile_optimizer(opt)


def test_add_param_group_mid_run():
    ps, extra = _params(W), _params([(4,)], seed=3)
    qs, extra_q = _clone(ps), _clone(extra)
    compiled, eager = compile_optimizer(optim.Adam(ps, lr=0.01), backend=BACKEND), optim.Adam(qs, lr=0.01)
    _step_both(compiled, eager, ps, qs, 2)
    compiled.add_param_group({"params": extra, "lr": 0.05})
    eager.add_param_group({"params": extra_q, "lr": 0.05})
    _step_both(compiled, eager, ps + extra, qs + extra_q, 3, seed=4)
    assert compiled.compiled and len(compiled.optimizer.param_groups) == 2
    for p, q in zip(ps + extra, qs + extra_q):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-6)  # observed 1.3e-7, as in CASES


def test_inductor_backend_matches_eager_without_recompiles():
    # Inductor's C++ code for the foreach step (one compile, ~10 s on 2 cores).
    ps = _params(W)
    qs = _clone(ps)
    kw = dict(lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    compiled, eager = compile_optimizer(optim.AdamW(ps, **kw), backend="inductor"), optim.AdamW(qs, **kw)
    mk = lambda o: optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5)
    counters.clear()
    _step_both(compiled, eager, ps, qs, 10, [mk(compiled), mk(eager)])
    assert compiled.compiled and _graphs() == 1
    for p, q in zip(ps, qs):
        # Observed 3e-8: Inductor fuses the step into one loop with its own operation order.
        torch.testing.assert_close(p, q, rtol=0, atol=2e-6)


# -- build_optimizer (torch implementations; the Triton one is tested in test_optim_kernels) ------


def test_build_optimizer_impls_on_cpu():
    ps = _params(W)
    groups = [{"params": ps[:1], "weight_decay": 0.1}, {"params": ps[1:], "weight_decay": 0.0}]
    common = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, momentum=0.9, max_grad_norm=1.0, device="cpu")
    auto = build_optimizer(groups, name="adamw", impl="auto", weight_decay=0.5, **common)
    assert type(auto) is optim.AdamW and auto.defaults["foreach"] is True and auto.impl == "foreach"
    assert [g["weight_decay"] for g in auto.param_groups] == [0.1, 0.0]  # the groups' own values win
    assert auto.clips_grad_norm is False  # torch's optimizers leave clipping to the loop
    eager = build_optimizer(ps, name="adam", impl="eager", **common)
    assert type(eager) is optim.Adam and eager.defaults["foreach"] is False
    fused = build_optimizer(ps, name="sgd", impl="fused", **common)
    assert type(fused) is optim.SGD and fused.defaults["fused"] is True and fused.defaults["momentum"] == 0.9
    comp = build_optimizer(ps, name="adamw", impl="compiled", **common)
    assert isinstance(comp, CompiledOptimizer) and comp.compiled and not comp.clips_grad_norm
    # auto: ours for Adam(W) on CUDA (measured fastest in the step), torch's fused where ours is not the measured
    # one (SGD, FSDP's DTensors, fp16's grad scaler), foreach off CUDA.
    assert resolve_impl("auto", "cuda") == resolve_impl("auto", "cuda", name="adam") == "triton"
    assert resolve_impl("auto", "cuda", name="sgd") == "fused"
    assert resolve_impl("auto", "cuda", sharded=True) == resolve_impl("auto", "cuda", scaled=True) == "fused"
    assert resolve_impl("auto", "cpu") == "foreach" and resolve_impl("fused", "cpu") == "fused"
    with pytest.raises(ValueError, match="optim.name"):
        build_optimizer(ps, name="lion")
    with pytest.raises(ValueError, match="optim.impl"):
        build_optimizer(ps, impl="apex")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_trajectory_on_cuda_stays_compiled(name):
    # On CUDA the step runs capturable with `step` on the device. Dynamo's eager fallback inside
    # torch's functional optimizers (non-capturable steps on CUDA) would show as compiled == False
    # (fullgraph) or as recompiles.
    cls, kw, shapes, atol = CASES[name]
    ps = _params(shapes, device="cuda")
    qs = _clone(ps)
    compiled, eager = compile_optimizer(cls(ps, **kw), backend=BACKEND), cls(qs, **kw)
    counters.clear()
    warm = {}
    mk = SCHEDULERS["StepLR"]
    _step_both(compiled, eager, ps, qs, 8, [mk(compiled), mk(eager)], on_step=lambda i: warm.setdefault(i, _graphs()))
    assert compiled.compiled and _graphs() == warm[1]
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=0, atol=atol)  # CPU's tolerances; CUDA rounding not measured yet


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_clipping_through_fused_adamw_grad_scale_equals_clip_grad_norm(device):
    """The loop clips for torch's fused AdamW by setting ``opt.grad_scale`` (the kernel divides each gradient
    by it and writes it back) instead of clip_grad_norm_'s own pass. Pins that torch behaviour: the same
    parameters, states and clipped gradients as clip_grad_norm_ + AdamW, to fp32 rounding."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from trainer.step import clip_gradients as _clip

    torch.manual_seed(0)
    ref_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(device)
    model = copy.deepcopy(ref_model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    opt = build_optimizer(model.parameters(), impl="fused", lr=1e-2, weight_decay=0.1, device=device)
    for step in range(4):
        x = torch.randn(32, 8, device=device) * (10 if step % 2 else 0.01)  # clipping on, then off
        for m in (ref_model, model):
            m(x).square().mean().backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5)
        norm = _clip(model, opt, 0.5, clips_itself=False)
        assert hasattr(opt, "grad_scale"), "the fused path was not taken"
        torch.testing.assert_close(norm, ref_norm)
        assert (ref_norm.item() > 0.5) == (opt.grad_scale.item() > 1.0)
        ref_opt.step()
        opt.step()
        for p, q in zip(ref_model.parameters(), model.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7)  # written back clipped
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
        for o in (ref_opt, opt):
            o.zero_grad(set_to_none=True)
    # bf16 parameters (a model.target): the norm comes back in bf16; the divisor must still be fp32.
    low = torch.nn.Linear(4, 4).to(device, torch.bfloat16)
    low_opt = build_optimizer(low.parameters(), impl="fused", lr=1e-2, device=device)
    low(torch.randn(8, 4, device=device, dtype=torch.bfloat16)).float().square().sum().backward()
    _clip(low, low_opt, 0.01, clips_itself=False)
    assert low_opt.grad_scale.dtype == torch.float32
    low_opt.step()
