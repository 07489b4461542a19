"""Our Triton optimizer kernels against float64 PyTorch references, and TritonAdamW/TritonSGD against torch.

On CPU the kernels run under ``TRITON_INTERPRET=1``; on a GPU machine the same tests run on CUDA,
plus the ``gpu`` tests.
"""

import os

import torch

# Triton picks interpreter or compiler when @triton.jit decorates a function, and it decorates its
# own tl.sum / tl.max when `triton` is first imported: the variable must be set before anything in
# the process imports triton (torch does not on import). test_kernels_run_on_the_test_device fails
# loudly if it was set too late.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import copy  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

from trainer.ops.utils import triton_can_run  # noqa: E402
from trainer.optim import adamw as adamw_mod  # noqa: E402
from trainer.optim import build_optimizer  # noqa: E402
from trainer.optim import grad_norm as grad_norm_mod  # noqa: E402
from trainer.optim import sgd as sgd_mod  # noqa: E402
from trainer.optim.adamw import adamw_step  # noqa: E402
from trainer.optim.flat_group import FlatGroup  # noqa: E402
from trainer.optim.grad_norm import grad_norm  # noqa: E402
from trainer.optim.optimizers import TritonAdam, TritonAdamW, TritonSGD  # noqa: E402
from trainer.optim.sgd import sgd_step  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SIZES = [1, 7, 4097]  # one element, less than a vector, one past two 2048-blocks
DTYPES = [torch.float32, torch.bfloat16]

# Tolerances of one step's param against the float64 reference run from the same stored values
# (params are O(1), updates up to lr = 0.05), and of the fp32 states as max |err| / max |ref|.
# fp32 params: observed 0.78 of rtol=atol=1e-7 on the CPU interpreter: a handful of fp32
# roundings (lerp, addcmul, sqrt, two divisions), each relative to the update or the param; 2x
# margin because the GPU contracts multiply-adds into FMAs (not measured here).
# bf16 params: observed 0.99 of 2^-7 relative: the param is stored in bf16, and the interpreter
# truncates fp32 -> bf16 stores where the GPU rounds to nearest even (triton 3.9
# _convert_float), so a stored value can sit up to one ulp (2^-7 relative at most) from the
# reference's; this bound is exact, not a margin.
PARAM_TOL = {torch.float32: dict(rtol=2e-7, atol=2e-7), torch.bfloat16: dict(rtol=2**-7, atol=1e-6)}
STATE_RTOL = 1e-6  # fp32 states in every case; observed 2.2e-7 (one or two fp32 roundings)
OBSERVED = {"param": {}, "state": 0.0}  # worst errors seen, printed at the end (pytest -s)


def _assert_param_close(ours: torch.Tensor, ref64: torch.Tensor, dtype: torch.dtype) -> None:
    tol = PARAM_TOL[dtype]
    err = ours.double() - ref64
    ratio = (err.abs() / (tol["atol"] + tol["rtol"] * ref64.abs())).max().item()
    OBSERVED["param"][dtype] = max(OBSERVED["param"].get(dtype, 0.0), ratio)
    torch.testing.assert_close(ours.double(), ref64, **tol)


def _assert_state_close(ours: torch.Tensor, ref64: torch.Tensor) -> None:
    scale = ref64.abs().max().clamp_min(1e-30)
    err = ((ours.double() - ref64).abs() / scale).max().item()
    OBSERVED["state"] = max(OBSERVED["state"], err)
    assert err <= STATE_RTOL, err


def teardown_module():
    print("\nworst errors against float64 (fraction of the tolerance for params):", OBSERVED)


def _ref_adamw(p, g, m, v, step, lr, b1, b2, eps, wd, decoupled, clip):
    """float64 Adam(W), the formulas of torch.optim.Adam's docs; returns new (p, m, v)."""
    g = g * clip
    if decoupled:
        p = p * (1 - lr * wd)
    else:
        g = g + wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = v.sqrt() / (1 - b2**step) ** 0.5 + eps
    return p - lr / (1 - b1**step) * m / denom, m, v


def _clip_coef(grads64: list[torch.Tensor], max_norm: float) -> float:
    if max_norm <= 0:
        return 1.0
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads64])).item()
    return min(1.0, max_norm / (norm + 1e-6))


def test_kernels_run_on_the_test_device():
    # Fails if TRITON_INTERPRET was set after triton was imported (see the top of this file).
    for kernel in (adamw_mod._adamw_kernel, sgd_mod._sgd_kernel, grad_norm_mod._sumsq_partials_kernel):
        assert triton_can_run(DEVICE, kernel)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("max_norm", [0.0, 0.5], ids=["noclip", "clip"])
def test_adamw_step_matches_float64_reference(n, dtype, decoupled, max_norm):
    gen = torch.Generator().manual_seed(n)
    lr, b1, b2, eps, wd = 0.05, 0.9, 0.95, 1e-8, 0.1
    p64 = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype).double()
    m64 = torch.zeros(n, dtype=torch.float64)
    v64 = torch.zeros(n, dtype=torch.float64)
    param = p64.to(dtype).to(DEVICE)
    exp_avg = torch.zeros(n, device=DEVICE)
    exp_avg_sq = torch.zeros(n, device=DEVICE)
    step = torch.zeros((), device=DEVICE)
    hparams = torch.tensor([lr, b1, b2, eps, wd, max_norm], dtype=torch.float64, device=DEVICE)
    for k in range(1, 4):
        g64 = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype).double()
        clip = _clip_coef([g64], max_norm)
        norm = grad_norm([g64.to(dtype).to(DEVICE)]) if max_norm > 0 else None
        adamw_step(param, g64.to(dtype).to(DEVICE), exp_avg, exp_avg_sq, step, hparams, norm, decoupled)
        p64, m64, v64 = _ref_adamw(p64, g64, m64, v64, k, lr, b1, b2, eps, wd, decoupled, clip)
        assert step.item() == k
        _assert_param_close(param.cpu(), p64, dtype)
        # The next step starts from our stored values, so each step is checked on its own and
        # fp32 rounding does not compound into the tolerance.
        p64, m64, v64 = param.cpu().double(), exp_avg.cpu().double(), exp_avg_sq.cpu().double()
        _assert_state_close(exp_avg.cpu(), m64)
        _assert_state_close(exp_avg_sq.cpu(), v64)
    if max_norm > 0:  # the test must actually clip
        assert clip < 1.0


def _ref_sgd(p, g, buf, first, lr, momentum, dampening, wd, nesterov, clip):
    g = g * clip + wd * p
    if momentum:
        buf = g.clone() if first else momentum * buf + (1 - dampening) * g
        g = g + momentum * buf if nesterov else buf
    return p - lr * g, buf


SGD_CASES = {
    "plain": dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0),
    "momentum-wd": dict(momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.1),
    "dampening": dict(momentum=0.9, dampening=0.3, nesterov=False, weight_decay=0.0),
    "nesterov-wd": dict(momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.1),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("case", list(SGD_CASES))
@pytest.mark.parametrize("max_norm", [0.0, 0.5], ids=["noclip", "clip"])
def test_sgd_step_matches_float64_reference(n, dtype, case, max_norm):
    c = SGD_CASES[case]
    gen = torch.Generator().manual_seed(n)
    lr = 0.05
    p64 = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype).double()
    buf64 = torch.zeros(n, dtype=torch.float64)
    param = p64.to(dtype).to(DEVICE)
    buf = torch.full((n,), 123.0, device=DEVICE) if c["momentum"] else None  # garbage: step 1 must overwrite it
    step = torch.zeros((), device=DEVICE)
    hparams = torch.tensor(
        [lr, c["momentum"], c["dampening"], c["weight_decay"], max_norm], dtype=torch.float64, device=DEVICE
    )
    for k in range(1, 4):
        g64 = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype).double()
        clip = _clip_coef([g64], max_norm)
        norm = grad_norm([g64.to(dtype).to(DEVICE)]) if max_norm > 0 else None
        sgd_step(param, g64.to(dtype).to(DEVICE), buf, step, hparams, norm, c["nesterov"])
        p64, buf64 = _ref_sgd(
            p64, g64, buf64, k == 1, lr, c["momentum"], c["dampening"], c["weight_decay"], c["nesterov"], clip
        )
        _assert_param_close(param.cpu(), p64, dtype)
        if buf is not None:
            _assert_state_close(buf.cpu(), buf64)
            buf64 = buf.cpu().double()
        p64 = param.cpu().double()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grad_norm_matches_float64(dtype, monkeypatch):
    # Two programs per buffer so each program strides over several blocks, and buffers whose sizes
    # are not multiples of the block; a zero-size buffer launches nothing.
    monkeypatch.setattr(grad_norm_mod, "MAX_PROGRAMS", 2)
    gen = torch.Generator().manual_seed(0)
    sizes = [1, 7, 4097, 3 * 4096 + 5, 0]
    xs = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
    ref = torch.linalg.vector_norm(torch.cat([x.double() for x in xs])).item()
    out = grad_norm([x.to(DEVICE) for x in xs])
    assert out.dtype == torch.float32 and out.shape == ()
    # Observed 1.4e-7 relative (fp32 partial sums of exactly representable squares of bf16/fp32 inputs).
    assert abs(out.item() - ref) / ref < 1e-6


def test_flat_group_views_and_in_place_grad_accumulation():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 1)).to(DEVICE)
    ref = copy.deepcopy(model)
    flat = FlatGroup(list(model.parameters()))
    # Parameters now live in the flat buffer, 64-byte aligned, with their values and shapes.
    for p, q, off in zip(model.parameters(), ref.parameters(), flat.offsets):
        assert p.data_ptr() == flat.param.data_ptr() + off * 4 and off % 16 == 0
        assert torch.equal(p, q)
    x = torch.randn(3, 7, device=DEVICE)
    for _ in range(2):  # the second backward accumulates
        model(x).sum().backward()
        ref(x).sum().backward()
    # Autograd accumulated in place into the views: nothing replaced, values as without flat buffers.
    assert all(p.grad is g for p, g in zip(model.parameters(), flat.grads))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    model.zero_grad(set_to_none=True)  # detaches .grad from the buffer ...
    model(2 * x).sum().backward()
    new = [p.grad.clone() for p in model.parameters()]
    flat.sync_grads()  # ... and sync_grads copies the new gradients back in
    assert all(p.grad is g for p, g in zip(model.parameters(), flat.grads))
    assert all(torch.equal(g, n) for g, n in zip(flat.grads, new))
    flat.zero_grad()
    assert flat.grad.abs().sum() == 0
    with pytest.raises(ValueError, match="one dtype and device"):
        FlatGroup([torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)])


def _params(shapes, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype).to(DEVICE)) for s in shapes]


def _clone_params(ps):
    return [torch.nn.Parameter(p.detach().clone()) for p in ps]


MANY_SMALL = [(i,) for i in range(1, 30)] + [(3, 5), (4097,), (1,)]


def _run_pair(ours, theirs, ps, qs, steps, max_norm=0.0, sched=None, seed=1):
    """Same gradients into both; torch's optimizer gets torch's clip_grad_norm_ first."""
    gen = torch.Generator().manual_seed(seed)
    scheds = [sched(ours), sched(theirs)] if sched else []
    for _ in range(steps):
        for p, q in zip(ps, qs):
            g = torch.randn(p.shape, generator=gen).to(p.dtype).to(DEVICE)
            p.grad = g.clone()  # a fresh tensor: exercises the copy into the flat buffer
            q.grad = g
        if max_norm > 0:
            exact = torch.linalg.vector_norm(torch.cat([q.grad.double().flatten() for q in qs]))
            torch.nn.utils.clip_grad_norm_(qs, max_norm)
        theirs.step()
        ours.step()
        if max_norm > 0:
            # Ours accumulates in fp32 whatever the grad dtype (torch's norm of bf16 grads is bf16 on CUDA), so
            # compare with the float64 norm: observed 2.3e-7 relative on CPU (fp32 sums in another order).
            torch.testing.assert_close(ours.last_grad_norm.double(), exact, rtol=1e-6, atol=0)
        for s in scheds:
            s.step()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("max_norm", [0.0, 1.0], ids=["noclip", "clip"])
@pytest.mark.parametrize("kind", ["adamw", "adamw-table", "sgd"])
def test_optimizers_over_many_small_tensors_match_float64(kind, dtype, max_norm):
    # 32 tensors of 1..4097 elements in one flat group per dtype: every parameter lands at its own
    # offset, block boundaries fall inside tensors, padding sits between them. adamw-table: gradients
    # read through the address table (lengths not multiples of 16: the unaligned kernel variant).
    ps = _params(MANY_SMALL, dtype=dtype)
    lr, wd = 0.05, 0.1
    if kind.startswith("adamw"):
        opt = TritonAdamW(
            ps, lr=lr, betas=(0.9, 0.95), weight_decay=wd, max_grad_norm=max_norm, flat_grads=kind == "adamw"
        )
    else:
        opt = TritonSGD(ps, lr=lr, momentum=0.9, nesterov=True, weight_decay=wd, max_grad_norm=max_norm)
    gen = torch.Generator().manual_seed(2)
    for k in range(1, 4):
        prev = [p.detach().cpu().double() for p in ps]
        keys = TritonAdamW.state_keys if kind.startswith("adamw") else TritonSGD.state_keys
        states = [
            {
                key: (opt.state[p][key].cpu().double() if k > 1 else torch.zeros(p.shape, dtype=torch.float64))
                for key in keys
            }
            for p in ps
        ]
        grads64 = [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype).double() for p in ps]
        for p, g in zip(ps, grads64):
            p.grad = g.to(dtype).to(DEVICE)
        opt.step()
        clip = _clip_coef(grads64, max_norm)
        for p, p64, g64, st in zip(ps, prev, grads64, states):
            if kind.startswith("adamw"):
                ref, m, v = _ref_adamw(
                    p64, g64, st["exp_avg"], st["exp_avg_sq"], k, lr, 0.9, 0.95, 1e-8, wd, True, clip
                )
                _assert_state_close(opt.state[p]["exp_avg"].cpu(), m)
                _assert_state_close(opt.state[p]["exp_avg_sq"].cpu(), v)
            else:
                ref, buf = _ref_sgd(p64, g64, st["momentum_buffer"], k == 1, lr, 0.9, 0.0, wd, True, clip)
                _assert_state_close(opt.state[p]["momentum_buffer"].cpu(), buf)
            _assert_param_close(p.detach().cpu(), ref, dtype)
        if max_norm > 0:
            assert clip < 1.0  # the test really clips
            ref_norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads64]))
            # Observed 5.8e-8 relative: fp32 partial sums against float64.
            torch.testing.assert_close(opt.last_grad_norm.double().cpu(), ref_norm, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "ours_cls,theirs_cls,kw",
    [
        (TritonAdamW, torch.optim.AdamW, dict(lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)),
        (TritonAdamW, torch.optim.AdamW, dict(lr=0.01, betas=(0.9, 0.95), weight_decay=0.1, flat_grads=False)),
        (TritonAdam, torch.optim.Adam, dict(lr=0.01, weight_decay=0.1)),
        (TritonSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ],
    ids=["adamw", "adamw-table", "adam", "sgd"],
)
@pytest.mark.parametrize("max_norm", [0.0, 1.0], ids=["noclip", "clip"])
def test_triton_optimizers_follow_torch(ours_cls, theirs_cls, kw, max_norm):
    ps = _params(MANY_SMALL)
    qs = _clone_params(ps)
    kw = dict(kw)
    wd = kw.pop("weight_decay")
    ours_only = {k: kw.pop(k) for k in ("flat_grads",) if k in kw}
    groups = lambda params: [{"params": params[:20], "weight_decay": wd}, {"params": params[20:], "weight_decay": 0.0}]
    ours = ours_cls(groups(ps), max_grad_norm=max_norm, **kw, **ours_only)
    theirs = theirs_cls(groups(qs), foreach=False, **kw)
    sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5)
    _run_pair(ours, theirs, ps, qs, steps=15, max_norm=max_norm, sched=sched)
    assert ours.param_groups[0]["lr"] == theirs.param_groups[0]["lr"] < kw["lr"]
    # Observed 7.2e-7 (SGD, whose lr is 5x larger), 2.4e-7 (AdamW) after 15 steps on O(1) params:
    # fp32 rounding, about one ulp per step (torch's single-tensor operation order; IEEE div/sqrt).
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-6)
    if max_norm > 0:
        assert ours.clips_grad_norm and ours.last_grad_norm.item() > max_norm  # it did clip


def test_triton_optimizer_survives_storage_replacement_and_grad_none():
    ps = _params([(5, 3), (7,)])
    qs = _clone_params(ps)
    ours, theirs = TritonAdamW(ps, lr=0.01), torch.optim.AdamW(qs, lr=0.01)
    _run_pair(ours, theirs, ps, qs, steps=2)
    ps[0].data = ps[0].data.clone()  # what model.to() does: the flat groups are rebuilt, state kept
    ours.zero_grad()
    assert all(p.grad is not None and p.grad.abs().sum() == 0 for p in ps)
    _run_pair(ours, theirs, ps, qs, steps=2, seed=3)
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-6)  # observed 0; fp32 rounding would give ~1e-7
    assert ours._flats[0][1].owns_params()


def test_grad_norm_before_step_is_reused():
    ps = _params([(5, 3), (7,)])
    opt = TritonAdamW(ps, lr=0.01, max_grad_norm=0.1)
    for p in ps:
        p.grad = torch.randn_like(p)
    norm = opt.grad_norm()
    ref = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ps]))
    torch.testing.assert_close(norm, ref, rtol=1e-6, atol=0)  # observed 0: same fp32 sum here
    opt.step()
    assert opt.last_grad_norm is norm


def test_opcheck():
    dev = DEVICE
    n = 37
    hp_adam = torch.tensor([0.01, 0.9, 0.99, 1e-8, 0.1, 1.0], dtype=torch.float64, device=dev)
    hp_sgd = torch.tensor([0.01, 0.9, 0.0, 0.1, 1.0], dtype=torch.float64, device=dev)
    for dtype in DTYPES:
        p, g = torch.randn(n, device=dev).to(dtype), torch.randn(n, device=dev).to(dtype)
        m, v, buf = torch.randn(n, device=dev), torch.rand(n, device=dev), torch.randn(n, device=dev)
        norm = torch.tensor(2.0, device=dev)
        step = torch.zeros((), device=dev)
        torch.library.opcheck(adamw_step, (p, g, m, v, step, hp_adam, norm, True))
        torch.library.opcheck(adamw_step, (p, g, m, v, step, hp_adam, None, False))
        torch.library.opcheck(sgd_step, (p, g, buf, step, hp_sgd, norm, True))
        torch.library.opcheck(sgd_step, (p, g, None, step, hp_sgd, None, False))
        torch.library.opcheck(grad_norm, ([g, torch.randn(5, device=dev).to(dtype)],))


def test_ops_compose_with_torch_compile_without_recompiling():
    n = 4097
    p, g = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    m, v, step = torch.zeros(n, device=DEVICE), torch.zeros(n, device=DEVICE), torch.zeros((), device=DEVICE)
    hp = torch.tensor([0.01, 0.9, 0.99, 1e-8, 0.1, 0.5], dtype=torch.float64, device=DEVICE)
    p_ref, m_ref, v_ref, step_ref = p.clone(), m.clone(), v.clone(), step.clone()

    def fn(p, g, m, v, step, hp):
        adamw_step(p, g, m, v, step, hp, grad_norm([g]), True)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    for lr in (0.01, 0.02, 0.005):  # a changing LR is a tensor write: no recompile
        hp[0].fill_(lr)
        compiled(p, g, m, v, step, hp)
        fn(p_ref, g, m_ref, v_ref, step_ref, hp)
    assert counter.frame_count == 1
    assert torch.equal(p, p_ref) and torch.equal(m, m_ref) and torch.equal(v, v_ref) and step.item() == 3


def test_build_optimizer_triton_clips_and_reports():
    ps = _params([(5, 3), (7,)])
    groups = [{"params": ps[:1], "weight_decay": 0.1}, {"params": ps[1:], "weight_decay": 0.0}]
    opt = build_optimizer(groups, name="adamw", impl="triton", lr=1e-3, max_grad_norm=1.0, device=DEVICE)
    assert isinstance(opt, TritonAdamW) and opt.clips_grad_norm and opt.impl == "triton"
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    sgd = build_optimizer(ps, name="sgd", impl="triton", lr=1e-3, momentum=0.9, device=DEVICE)
    assert isinstance(sgd, TritonSGD) and not sgd.clips_grad_norm and sgd.param_groups[0]["momentum"] == 0.9
    adam = build_optimizer(ps, name="adam", impl="triton", lr=1e-3, device=DEVICE)
    assert adam.param_groups[0]["decoupled_weight_decay"] is False


# Run without TRITON_INTERPRET (kernels compiled, not interpreted): the error a CPU user gets, and
# the PTX our kernels lower to for an H100 (sm_90; Triton's bundled ptxas needs no GPU).
_NO_INTERPRETER = r"""
import json, torch
out = {}
from trainer.optim import adamw, grad_norm, grad_table, optimizers, sgd
try:
    optimizers.TritonAdamW([torch.nn.Parameter(torch.zeros(3))])
except ValueError as e:
    out["error"] = str(e)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
def vector_accesses(fn, sig, constexprs):
    # Pointers 16-byte aligned and n_elements % 16 == 0: what Triton specialises for flat buffers.
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t != "constexpr"}
    ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                         target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8)).asm["ptx"]
    return [ptx.count("ld.global.v4"), ptx.count("st.global.v4")]
try:
    for dt in ("fp32", "bf16"):
        out["adamw_" + dt] = vector_accesses(adamw._adamw_kernel, {"Param_ptr": "*" + dt, "Grad_ptr": "*" + dt,
            "ExpAvg_ptr": "*fp32", "ExpAvgSq_ptr": "*fp32", "Coefs_ptr": "*fp32", "n_elements": "i32",
            "DECOUPLED": "constexpr", "HAS_CLIP": "constexpr", "BLOCK_SIZE": "constexpr", "STOCHASTIC": "constexpr"},
            {"DECOUPLED": True, "HAS_CLIP": True, "BLOCK_SIZE": adamw.BLOCK_SIZE, "STOCHASTIC": False})
    # bf16 master weights: bf16 parameters and states, stored with stochastic rounding.
    out["adamw_stochastic_bf16"] = vector_accesses(adamw._adamw_kernel, {"Param_ptr": "*bf16", "Grad_ptr": "*bf16",
        "ExpAvg_ptr": "*bf16", "ExpAvgSq_ptr": "*bf16", "Coefs_ptr": "*fp32", "n_elements": "i32",
        "DECOUPLED": "constexpr", "HAS_CLIP": "constexpr", "BLOCK_SIZE": "constexpr", "STOCHASTIC": "constexpr"},
        {"DECOUPLED": True, "HAS_CLIP": True, "BLOCK_SIZE": adamw.BLOCK_SIZE, "STOCHASTIC": True})
    for dt in ("fp32", "bf16"):
        out["sgd_" + dt] = vector_accesses(sgd._sgd_kernel, {"Param_ptr": "*" + dt, "Grad_ptr": "*" + dt,
            "MomentumBuffer_ptr": "*fp32", "Coefs_ptr": "*fp32", "n_elements": "i32", "HAS_MOMENTUM": "constexpr",
            "NESTEROV": "constexpr", "HAS_CLIP": "constexpr", "BLOCK_SIZE": "constexpr"},
            {"HAS_MOMENTUM": True, "NESTEROV": False, "HAS_CLIP": True, "BLOCK_SIZE": sgd.BLOCK_SIZE})
        out["sumsq_" + dt] = vector_accesses(grad_norm._sumsq_partials_kernel, {"X_ptr": "*" + dt,
            "Partials_ptr": "*fp32", "n_elements": "i32", "BLOCK_SIZE": "constexpr"},
            {"BLOCK_SIZE": grad_norm.BLOCK_SIZE})
        # The address-table kernels (ALIGNED: the host checked 16-byte addresses and lengths).
        table = {"GradPtrs_ptr": "*i64", "BlockTensor_ptr": "*i32", "BlockStart_ptr": "*i64", "Numel_ptr": "*i64"}
        tl_dtype = grad_table._TL_DTYPES[{"fp32": torch.float32, "bf16": torch.bfloat16}[dt]]
        out["adamw_table_" + dt] = vector_accesses(grad_table._adamw_blocks_kernel, {"Param_ptr": "*fp32",
            "ExpAvg_ptr": "*fp32", "ExpAvgSq_ptr": "*fp32", **table, "Coefs_ptr": "*fp32", "DECOUPLED": "constexpr",
            "HAS_CLIP": "constexpr", "GRAD_DTYPE": "constexpr", "ALIGNED": "constexpr", "BLOCK_SIZE": "constexpr",
            "STOCHASTIC": "constexpr"},
            {"DECOUPLED": True, "HAS_CLIP": True, "GRAD_DTYPE": tl_dtype, "ALIGNED": True,
             "BLOCK_SIZE": grad_table.BLOCK_SIZE, "STOCHASTIC": False})
        out["sumsq_table_" + dt] = vector_accesses(grad_table._sumsq_blocks_kernel, {**table, "Partials_ptr": "*fp32",
            "GRAD_DTYPE": "constexpr", "ALIGNED": "constexpr", "BLOCK_SIZE": "constexpr"},
            {"GRAD_DTYPE": tl_dtype, "ALIGNED": True, "BLOCK_SIZE": grad_table.BLOCK_SIZE})
except Exception as e:
    out["ptx_error"] = repr(e)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def no_interpreter_run():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _NO_INTERPRETER], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_triton_optimizer_on_cpu_without_interpreter_says_what_to_do(no_interpreter_run):
    msg = no_interpreter_run["error"]
    assert "need a CUDA device" in msg and "impl='foreach'" in msg


def test_kernels_lower_to_16_byte_accesses_on_h100(no_interpreter_run):
    if "ptxas" in no_interpreter_run.get("ptx_error", ""):
        pytest.skip(f"no ptxas: {no_interpreter_run['ptx_error']}")
    assert "ptx_error" not in no_interpreter_run, no_interpreter_run["ptx_error"]
    # (tensors streamed in, tensors streamed out): each must be read/written in 16-byte vectors.
    streams = {"adamw": (4, 3), "sgd": (3, 2), "sumsq": (1, 0), "adamw_table": (4, 3), "sumsq_table": (1, 0)}
    for name, (n_in, n_out) in streams.items():
        for dt in ("fp32", "bf16"):
            loads, stores = no_interpreter_run[f"{name}_{dt}"]
            assert loads >= n_in and stores >= n_out, (name, dt, loads, stores)
    loads, stores = no_interpreter_run["adamw_stochastic_bf16"]  # bf16 master weights: the same four in, three out
    assert loads >= 4 and stores >= 3, (loads, stores)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_adamw_matches_fused_on_gpu(dtype):
    shapes = [(50304, 64), (1024, 64), (64,), (192, 64), (3,)]
    ps = _params(shapes, dtype=dtype)
    qs = _clone_params(ps)
    ours = TritonAdamW(ps, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0)
    theirs = torch.optim.AdamW(qs, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    _run_pair(ours, theirs, ps, qs, steps=10, max_norm=1.0)
    # fp32: fused AdamW's fp32 math in another order, ~1 ulp per step. bf16: both do fp32 math and round
    # once per step, but torch clips with a bf16 grad norm and we with an fp32 one, and a 1-ulp rounding
    # difference at one step carries into the next ones: observed on an H100 (torch 2.11) 1 of 3.2M
    # elements 2.5 bf16 ulps apart after 10 steps (abs 2.4e-3 at 0.12). Allow 4 ulps.
    tol = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2**-5, atol=4e-3)}[dtype]
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, **tol)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_stochastic_rounding_keeps_updates_smaller_than_a_bf16_step(sign):
    """bf16 master weights: 20 AdamW steps of a tenth of a bf16 ulp each on parameters at 1.0. Rounded to nearest,
    every update is lost (1.0 - lr is 1.0 in bf16); stored with stochastic rounding the mean over 4096 parameters
    is where fp32 arithmetic would be, within a quarter of the smaller ulp below 1.0, and the states stay bf16."""
    n, lr, steps = 4096, 0.1 * 2**-7, 20  # 2**-7: bf16's ulp at 1.0
    assert torch.tensor(1.0 - lr).to(torch.bfloat16).item() == 1.0  # round to nearest loses each update
    p = torch.ones(n, dtype=torch.bfloat16, device=DEVICE)
    g = torch.full((n,), sign, dtype=torch.bfloat16, device=DEVICE)
    m, v = (torch.zeros(n, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    step = torch.zeros(1, device=DEVICE)
    hparams = torch.tensor([lr, 0.9, 0.999, 1e-8, 0.0, 0.0], dtype=torch.float64, device=DEVICE)
    for _ in range(steps):
        adamw_step(p, g, m, v, step, hparams, None, True, True)
    # Adam's update with a constant gradient is lr * sign at every step (the bias corrections cancel).
    want = 1.0 - sign * steps * lr
    assert abs(p.float().mean().item() - want) < 0.25 * 2**-8, (p.float().mean().item(), want)
    assert len(set(p.tolist())) > 1  # rounded up and down: not one value
    assert m.dtype == v.dtype == torch.bfloat16
    again = torch.ones(n, dtype=torch.bfloat16, device=DEVICE)  # the same step rounds the same way again
    m2, v2, step2 = torch.zeros_like(m), torch.zeros_like(v), torch.zeros(1, device=DEVICE)
    for _ in range(steps):
        adamw_step(again, g, m2, v2, step2, hparams, None, True, True)
    assert torch.equal(again, p) and torch.equal(m2, m) and torch.equal(v2, v)


def test_stochastic_rounding_is_for_bf16_parameters_and_states():
    p = torch.ones(8, device=DEVICE)
    states = [torch.zeros(8, device=DEVICE) for _ in range(2)]
    step, hparams = torch.zeros(1, device=DEVICE), torch.zeros(6, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match="stochastic rounding stores bf16 parameters"):
        adamw_step(p, p.clone(), *states, step, hparams, None, True, True)
    opt = TritonAdamW(
        [torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16, device=DEVICE))], stochastic_rounding=True
    )
    opt.param_groups[0]["params"][0].grad = torch.ones(8, dtype=torch.bfloat16, device=DEVICE)
    opt.step()
    state = opt.state_dict()["state"][0]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
