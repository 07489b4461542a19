"""trainer::add_rms_norm (residual add + RMSNorm) against float64 torch.

On CPU the Triton kernels run under ``TRITON_INTERPRET=1`` (tests/conftest.py sets it); on a GPU machine the
same tests run the compiled kernels on CUDA.
"""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from tests.conftest import forbid_fallbacks
from trainer.ops import add_rms_norm as arn
from trainer.ops import utils
from trainer.ops.add_rms_norm import add_rms_norm, rms_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6  # Llama 3's rms_norm_eps

bf16, fp32 = torch.bfloat16, torch.float32

# (inc dtype or None for rms_norm, out dtype) -> tolerance on y and every gradient, as max|err| / max|ref| against
# float64 over _SHAPES (see _grad_err for one column); x and the weight are fp32. bf16 keeps 8 significant bits:
# rounding to nearest is off by up to 2^-8 relative, and the interpreter truncates fp32 -> bf16 stores instead (triton
# 3.9 cast_impl), up to 2^-7 = 7.8e-3. Observed maxima on the CPU interpreter in the comments.
TOLERANCES = {
    # fp32 throughout: fp32 rounding of sums of up to 4097 terms. Observed 1.7e-7 (2.2e-7 without inc).
    (fp32, fp32): 1e-6,
    (None, fp32): 1e-6,
    # A bf16 branch into an fp32 norm: only the returned inc gradient is bf16, one truncation. Observed 6.7e-3.
    (bf16, fp32): 8e-3,
    # fp32 inputs, bf16 y: y is one truncation (observed 6.2e-3, 6.9e-3 without inc); the gradients are linear in
    # y's incoming gradient, which is bf16 (the cast of y.float()'s gradient): observed 2.5e-3, 5.0e-3 without inc.
    (fp32, bf16): 1e-2,
    (None, bf16): 1e-2,
    # The autocast case: fp32 stream, bf16 branch, bf16 y: the above, and the inc gradient, whose fp32 value is off
    # by up to 1e-3 through the bf16 dy, truncated once more. Observed 6.4e-3.
    (bf16, bf16): 1.2e-2,
}

# (rows..., cols): 1, 7 and 33 rows (33 as (3, 11): a leading shape to flatten); 1 column, a column count that is
# not a power of two, a small power of two, and 4097, one past a power of two (the row loop of the backward then
# runs 8 rows at a time in the interpreter, and 33 rows spread over 3 programs whose partial sums are added).
_SHAPES = [(*rows, c) for rows in [(1,), (7,), (3, 11)] for c in (1, 7, 64, 4097)]


@pytest.fixture(autouse=True)
def _no_silent_fallback(monkeypatch):
    """Where Triton can run, the PyTorch fallback must not: a test of the kernels tests the kernels."""
    if arn._use_triton(torch.device(DEVICE)):
        forbid_fallbacks(monkeypatch, arn, "_forward_torch", "_backward_torch")


def test_triton_runs_on_the_test_device():
    assert arn._use_triton(torch.device(DEVICE)), "TRITON_INTERPRET=1 must be set before triton is imported"


def _inputs(shape, inc_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = shape[-1]
    x = (torch.randn(shape, generator=g) * 3 + 1).to(DEVICE).requires_grad_()
    inc = torch.randn(shape, generator=g).to(DEVICE, inc_dtype).requires_grad_() if inc_dtype else None
    w = (1 + 0.1 * torch.randn(c, generator=g)).to(DEVICE).requires_grad_()
    # Upstream gradients for both outputs: y's (as the next matmul would send) and s's (the residual stream's).
    gy = torch.randn(shape, generator=g).to(DEVICE)
    gs = torch.randn(shape, generator=g).to(DEVICE)
    return x, inc, w, gy, gs


def _reference(x, inc, w, gy, gs, eps=EPS):
    """float64: s = x + inc, y = rms_norm(s) * w; the loss <y, gy> + <s, gs> and its gradients (x, inc, w)."""
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ir = inc.detach().double().requires_grad_() if inc is not None else None
    s = xr + ir if ir is not None else xr
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * wr
    loss = (y * gy.double()).sum() + ((s * gs.double()).sum() if ir is not None else 0)
    loss.backward()
    return s.detach(), y.detach(), [t.grad for t in (xr, ir, wr) if t is not None]


def _err(a, ref):
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


def _grad_err(got, want, s, w, gy):
    """``_err`` of a gradient into s (x's, inc's), except at one column. There y = w * s / sqrt(s^2 + eps) is flat
    in s: the gradient rstd * w * dy * (1 - xhat^2) is what is left of two terms of size rstd * w * dy that agree to
    ~7 digits (eps / s^2), in fp32 as in torch's own fp32 ``F.rms_norm`` (observed 9.6e-2 relative to the gradient
    here, 0.51 for torch's), so the error is taken relative to the size of those terms (observed 2.2e-7)."""
    if s.shape[-1] > 1:
        return _err(got, want)
    terms = (torch.rsqrt(s.pow(2) + EPS) * w.double() * gy.double()).abs().max()
    return ((got.double() - want).abs().max() / torch.maximum(want.abs().max(), terms)).item()


@pytest.mark.parametrize("shape", _SHAPES, ids=str)
@pytest.mark.parametrize("inc_dtype,out_dtype", [k for k in TOLERANCES if k[0] is not None], ids=str)
def test_add_rms_norm_matches_float64(shape, inc_dtype, out_dtype):
    tol = TOLERANCES[inc_dtype, out_dtype]
    x, inc, w, gy, gs = _inputs(shape, inc_dtype, seed=shape[-1])
    s, y = add_rms_norm(x, inc, w, EPS, out_dtype)
    assert s.dtype == fp32 and y.dtype == out_dtype and s.shape == y.shape == x.shape
    ((y.float() * gy).sum() + (s * gs).sum()).backward()
    s_ref, y_ref, grads_ref = _reference(x, inc, w, gy, gs)
    assert _err(s, s_ref) <= 1e-7  # x + inc, rounded once to fp32 (2^-24 relative)
    assert _err(y, y_ref) <= tol
    assert _grad_err(x.grad, grads_ref[0], s_ref, w, gy) <= tol
    assert _grad_err(inc.grad, grads_ref[1], s_ref, w, gy) <= tol
    assert _err(w.grad, grads_ref[2]) <= tol
    assert x.grad.dtype == fp32 and inc.grad.dtype == inc_dtype and w.grad.dtype == w.dtype


@pytest.mark.parametrize("shape", _SHAPES, ids=str)
@pytest.mark.parametrize("out_dtype", [fp32, bf16], ids=str)
def test_rms_norm_without_inc_matches_float64(shape, out_dtype):
    tol = TOLERANCES[None, out_dtype]
    x, _, w, gy, _ = _inputs(shape, None, seed=shape[-1] + 1)
    y = rms_norm(x, w, EPS, out_dtype)
    assert y.dtype == out_dtype and y.shape == x.shape
    (y.float() * gy).sum().backward()
    _, y_ref, grads_ref = _reference(x, None, w, gy, None)
    assert _err(y, y_ref) <= tol
    assert _grad_err(x.grad, grads_ref[0], x.detach().double(), w, gy) <= tol
    assert _err(w.grad, grads_ref[1]) <= tol


def test_the_norm_reads_the_sum_rounded_to_xs_dtype():
    # A bf16 residual stream: s = x + inc is rounded to bf16 and the norm reads that, as the module after the add
    # would read s. An fp32 y then matches the float64 norm of the returned s to fp32 precision (observed 8.8e-8),
    # where the norm of the unrounded sum is 3.4e-3 away; s and the gradients into x and inc are bf16, one
    # truncation each (observed 5.8e-3 and 5.0e-3; see TOLERANCES).
    x, inc, w, gy, gs = _inputs((7, 64), bf16, seed=4)
    xb = x.detach().bfloat16().requires_grad_()
    s, y = add_rms_norm(xb, inc, w, EPS, fp32)
    assert s.dtype == bf16 and y.dtype == fp32
    assert _err(s, xb.double() + inc.double()) <= 8e-3
    ((y * gy).sum() + (s.float() * gs).sum()).backward()
    sr, wr = s.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y_ref = sr * torch.rsqrt(sr.pow(2).mean(-1, keepdim=True) + EPS) * wr
    # s's incoming gradient is the bf16 cast of s.float()'s.
    ((y_ref * gy.double()).sum() + (sr * gs.bfloat16().double()).sum()).backward()
    assert _err(y, y_ref.detach()) <= 1e-6 and _err(w.grad, wr.grad) <= 1e-6
    assert xb.grad.dtype == inc.grad.dtype == bf16
    assert _err(xb.grad, sr.grad) <= 8e-3 and _err(inc.grad, sr.grad) <= 8e-3


def test_is_torchs_rms_norm_and_the_hugging_face_form_in_fp32():
    # The forms a graph rewriter replaces, computed by torch in fp32: the same math, summed in another order.
    x, inc, w, *_ = _inputs((2, 9, 300), fp32)
    s, y = add_rms_norm(x, inc, w, EPS)
    h = x + inc
    hf = w * (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype)
    torch.testing.assert_close(s, h, rtol=0, atol=0)
    torch.testing.assert_close(y, hf, rtol=1e-6, atol=1e-6)  # a few fp32 ulps: 300-term sums in another order
    torch.testing.assert_close(y, F.rms_norm(h, (300,), w, EPS), rtol=1e-6, atol=1e-6)


def test_out_dtype_defaults_to_the_autocast_dtype():
    x, inc, w, *_ = _inputs((3, 16), bf16)
    assert add_rms_norm(x, inc, w, EPS)[1].dtype == fp32 and rms_norm(x, w, EPS).dtype == fp32
    with torch.autocast(DEVICE, dtype=bf16):
        s, y = add_rms_norm(x, inc, w, EPS)
        assert s.dtype == fp32 and y.dtype == bf16 and rms_norm(x, w, EPS).dtype == bf16
        assert add_rms_norm(x, inc, w, EPS, fp32)[1].dtype == fp32  # an explicit dtype wins


def test_partial_sums_over_many_programs_and_row_blocks(monkeypatch):
    # Small tiles: 4 rows a block at 64 columns, so 33 rows take 9 forward programs and, in the interpreter, 3
    # backward programs of 3 blocks each (the last ragged).
    monkeypatch.setattr(arn, "INTERPRETER_TILE", 256)
    monkeypatch.setitem(arn.TILE, "fwd", 256)
    monkeypatch.setitem(arn.TILE, "bwd", 256)
    x, inc, w, gy, gs = _inputs((3, 11, 64), fp32, seed=5)
    s, y = add_rms_norm(x, inc, w, EPS)
    ((y * gy).sum() + (s * gs).sum()).backward()
    s_ref, y_ref, grads_ref = _reference(x, inc, w, gy, gs)
    assert _err(s, s_ref) <= 1e-7 and _err(y, y_ref) <= 1e-6
    for got, want in zip([x.grad, inc.grad, w.grad], grads_ref):
        assert _err(got, want) <= 1e-6


def test_partial_sums_finish_over_many_parts_and_ragged_columns():
    # The finishing kernel: fp32 column sums of (parts, cols) partials in order, more parts than one step takes
    # and a width that is not a multiple of its column block, cast to the output's dtype (bf16: 2^-9 rounding,
    # truncated in the interpreter).
    parts = torch.randn((150, 77), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    want = parts.double().sum(0)
    for dtype, rtol in [(fp32, 1e-5), (bf16, 8e-3)]:
        out = torch.empty(77, device=DEVICE, dtype=dtype)
        utils.sum_parts(parts[None], [out])  # one output, as this op's backward launches it
        torch.testing.assert_close(out.double(), want, rtol=rtol, atol=1e-5)


def test_weight_gradient_in_the_weights_dtype():
    # A bf16 weight (a model cast to bf16): its gradient is the fp32 column sum rounded once to bf16.
    x, inc, w, gy, gs = _inputs((7, 64), fp32)
    wb = w.detach().bfloat16().requires_grad_()
    s, y = add_rms_norm(x, inc, wb, EPS)
    ((y * gy).sum() + (s * gs).sum()).backward()
    _, y_ref, grads_ref = _reference(x, inc, wb, gy, gs)
    assert wb.grad.dtype == bf16
    assert _err(y, y_ref) <= 1e-6 and _err(wb.grad, grads_ref[2]) <= 8e-3  # bf16 rounding, truncated: 2^-8


def test_s_unused_downstream_gets_no_gradient_from_it():
    # The last norm of a model: only y is used; the residual gradient is then RMSNorm'(dy) alone.
    x, inc, w, gy, _ = _inputs((5, 64), fp32)
    _, y = add_rms_norm(x, inc, w, EPS)
    (y * gy).sum().backward()
    _, _, grads_ref = _reference(x, inc, w, gy, torch.zeros_like(gy))
    for got, want in zip([x.grad, inc.grad, w.grad], grads_ref):
        assert _err(got, want) <= 1e-6


def test_any_view_as_incoming_gradient():
    # A .sum() loss sends expanded (stride-0) gradients; a strided weight is read as given, not at stride 1.
    x, inc, _, *_ = _inputs((6, 40), fp32)
    w = (1 + torch.randn(80, device=DEVICE))[::2].detach().requires_grad_()
    s, y = add_rms_norm(x, inc, w, EPS)
    (y.sum() + 2 * s.sum()).backward()
    ones = torch.ones(6, 40, device=DEVICE)
    s_ref, y_ref, grads_ref = _reference(x, inc, w, ones, 2 * ones)
    assert _err(s, s_ref) <= 1e-7 and _err(y, y_ref) <= 1e-6
    for got, want in zip([x.grad, inc.grad, w.grad], grads_ref):
        assert _err(got, want) <= 1e-6


def test_torch_fallback_matches_the_kernels(monkeypatch):
    # The PyTorch path (CPU without the interpreter) computes what the kernels compute.
    def run():
        x, inc, w, gy, gs = _inputs((9, 100), bf16, seed=3)
        s, y = add_rms_norm(x, inc, w, EPS, bf16)
        ((y.float() * gy).sum() + (s * gs).sum()).backward()
        y2 = rms_norm(x.detach().requires_grad_(), w, EPS)
        return [s, y, x.grad, inc.grad, w.grad, y2]

    kernel = run()
    monkeypatch.undo()  # the autouse fixture's replacements: the fallback must run now
    monkeypatch.setattr(arn, "_use_triton", lambda device: False)
    for got, want in zip(run(), kernel):
        assert got.dtype == want.dtype
        # bf16 outputs may differ by one bf16 ulp: the interpreter truncates where torch rounds to nearest.
        tol = 8e-3 if got.dtype == bf16 else 1e-5
        torch.testing.assert_close(got.detach().float(), want.detach().float(), rtol=tol, atol=tol)


def _opcheck_samples():
    x, inc, w, *_ = _inputs((33, 70), bf16)
    xd, wd = x.detach(), w.detach()
    return [
        (x, inc, w, EPS, fp32),
        (x, inc.detach().float().requires_grad_(), w, EPS, bf16),
        (x, None, w, EPS, fp32),
        (xd, inc.detach(), wd, 1e-5, bf16),
    ]


@pytest.mark.parametrize("i", range(4))
def test_opcheck(i):
    torch.library.opcheck(arn._fwd_op, _opcheck_samples()[i])


def test_opcheck_backward():
    x, inc, w, gy, gs = _inputs((33, 70), bf16)
    s, _, rstd = arn._fwd_op(x.detach(), inc.detach(), w.detach(), EPS, fp32)
    torch.library.opcheck(arn._bwd_op, (gy, gs, s, w.detach(), rstd, bf16))
    torch.library.opcheck(arn._bwd_op, (gy.bfloat16(), None, x.detach(), w.detach(), rstd, None))


def test_compiles_fullgraph_once_and_matches_eager():
    x, inc, w, gy, gs = _inputs((2, 5, 64), bf16)

    def f(x, inc):
        s, y = add_rms_norm(x, inc, w, EPS, bf16)
        y2 = rms_norm(s, w, EPS, fp32)
        return (y.float() * gy).sum() + (s * gs).sum() + (y2 * gs).sum(), y

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    for _ in range(2):  # the second call reuses the graph: one frame, no recompile
        for t in (x, inc, w):
            t.grad = None
        loss, y = compiled(x, inc)
        loss.backward()
    got = [loss.detach(), y.detach()] + [t.grad.clone() for t in (x, inc, w)]
    for t in (x, inc, w):
        t.grad = None
    loss, y = f(x, inc)
    loss.backward()
    assert counter.frame_count == 1
    for g, want in zip(got, [loss.detach(), y.detach()] + [t.grad for t in (x, inc, w)]):
        torch.testing.assert_close(g, want, rtol=0, atol=0)  # the same kernels in the same order


def test_no_rows_give_zero_weight_gradients():
    x, inc, w, *_ = _inputs((0, 16), fp32)
    s, y = add_rms_norm(x, inc, w, EPS)
    (y.sum() + s.sum()).backward()
    assert s.shape == y.shape == (0, 16)
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_bad_shapes_are_rejected():
    x, inc, w, *_ = _inputs((3, 16), fp32)
    with pytest.raises(ValueError, match="one shape"):
        add_rms_norm(x, inc[:, :8], w, EPS)
    with pytest.raises(ValueError, match="weight of shape"):
        rms_norm(x, w[:8], EPS)
    with pytest.raises(ValueError, match="weight of shape"):
        rms_norm(x, w[None], EPS)
    with pytest.raises(ValueError, match="1 to 16384"):
        rms_norm(x.new_zeros(2, 16385), x.new_ones(16385), EPS)
