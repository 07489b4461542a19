"""trainer::add_layer_norm (residual add + LayerNorm) against float64 torch.

On CPU the Triton kernels run under ``TRITON_INTERPRET=1`` (tests/conftest.py sets it); on a GPU machine the
same tests run the compiled kernels on CUDA.
"""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from tests.conftest import forbid_fallbacks
from trainer.ops import add_layer_norm as aln
from trainer.ops import utils
from trainer.ops.add_layer_norm import add_layer_norm, layer_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _no_silent_fallback(monkeypatch):
    """Where Triton can run, the PyTorch fallback must not: a test of the kernels tests the kernels."""
    if aln._use_triton(torch.device(DEVICE)):
        forbid_fallbacks(monkeypatch, aln, "_forward_torch", "_backward_torch")


def test_triton_runs_on_the_test_device():
    assert aln._use_triton(torch.device(DEVICE)), "TRITON_INTERPRET=1 must be set before triton is imported"


def _inputs(shape, x_dtype, inc_dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = shape[-1]
    x = (torch.randn(shape, generator=g) * 3 + 1).to(DEVICE, x_dtype).requires_grad_()
    inc = torch.randn(shape, generator=g).to(DEVICE, inc_dtype).requires_grad_() if inc_dtype else None
    w = (1 + 0.1 * torch.randn(c, generator=g)).to(DEVICE).requires_grad_()
    b = (0.1 * torch.randn(c, generator=g)).to(DEVICE).requires_grad_() if bias else None
    # Upstream gradients for both outputs: y's (as the next matmul would send) and s's (the residual stream's).
    gy = torch.randn(shape, generator=g).to(DEVICE)
    gs = torch.randn(shape, generator=g).to(DEVICE)
    return x, inc, w, b, gy, gs


def _leaves(*ts):
    return [t for t in ts if t is not None]


def _reference(x, inc, w, b, gy, gs, eps=1e-5, ib=None):
    """float64: s = x + (inc + ib), y = layer_norm(s); the loss <y, gy> + <s, gs>, its gradients
    (x, inc, w, b, ib: those given)."""
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ir = inc.detach().double().requires_grad_() if inc is not None else None
    br = b.detach().double().requires_grad_() if b is not None else None
    ibr = ib.detach().double().requires_grad_() if ib is not None else None
    s = xr + (ir if ibr is None else ir + ibr) if ir is not None else xr
    y = F.layer_norm(s, s.shape[-1:], wr, br, eps)
    loss = (y * gy.double()).sum() + ((s * gs.double()).sum() if ir is not None else 0)
    loss.backward()
    return s.detach(), y.detach(), [t.grad for t in _leaves(xr, ir, wr, br, ibr)]


def _err(a, ref):
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


# (rows, cols): one row, a ragged row block, a gpt2 width over several backward programs, a width that is
# not a power of two.
_SHAPES = [(1, 16), (7, 64), (2, 37, 768), (40, 1000)]


@pytest.mark.parametrize("shape", _SHAPES, ids=str)
@pytest.mark.parametrize(
    "x_dtype,inc_dtype,autocast,tol",
    [
        # fp32 throughout: fp32 rounding of 1000-term sums. Observed <= 2.6e-7 on the interpreter.
        (torch.float32, torch.float32, False, 1e-6),
        # The autocast case: fp32 stream, bf16 branch; y, its incoming gradient and the inc gradient are bf16
        # (2^-9 relative rounding each; the interpreter truncates instead of rounding). Observed <= 6.4e-3.
        (torch.float32, torch.bfloat16, True, 1.6e-2),
    ],
    ids=["fp32", "fp32+bf16-autocast"],
)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_add_layer_norm_matches_float64(shape, x_dtype, inc_dtype, autocast, tol, bias):
    x, inc, w, b, gy, gs = _inputs(shape, x_dtype, inc_dtype, bias, seed=shape[-1])
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        s, y = add_layer_norm(x, inc, w, b)
    assert s.dtype == x_dtype and y.dtype == (torch.bfloat16 if autocast else x_dtype) and y.shape == x.shape
    ((y.float() * gy).sum() + (s.float() * gs).sum()).backward()
    s_ref, y_ref, grads_ref = _reference(x, inc, w, b, gy, gs)
    assert _err(s, s_ref) <= 1e-6  # x + inc, rounded once to fp32
    assert _err(y, y_ref) <= tol
    for got, want in zip([t.grad for t in _leaves(x, inc, w, b)], grads_ref):
        assert _err(got, want) <= tol
    assert x.grad.dtype == x_dtype and inc.grad.dtype == inc_dtype and w.grad.dtype == w.dtype


@pytest.mark.parametrize("shape", [(7, 64), (2, 37, 768), (40, 1000)], ids=str)
@pytest.mark.parametrize(
    "inc_dtype,autocast,tol",
    # tolerances as in the test above; the inc bias gradient is a column sum of the fp32 dx (observed <= 4e-7 in
    # fp32; with autocast the bf16 dy's rounding, as for the weight gradient).
    [(torch.float32, False, 1e-6), (torch.bfloat16, True, 1.6e-2)],
    ids=["fp32", "fp32+bf16-autocast"],
)
def test_inc_bias_is_added_and_gets_the_column_sums(shape, inc_dtype, autocast, tol):
    """s = x + (inc + inc_bias): the bias of the matmul that made inc, added in fp32; its gradient is the column
    sums of the gradient into s, from the backward's partial sums."""
    x, inc, w, b, gy, gs = _inputs(shape, torch.float32, inc_dtype, seed=shape[-1] + 1)
    ib = (0.5 * torch.randn(shape[-1], generator=torch.Generator().manual_seed(3))).to(DEVICE).requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        s, y = add_layer_norm(x, inc, w, b, inc_bias=ib)
    ((y.float() * gy).sum() + (s.float() * gs).sum()).backward()
    s_ref, y_ref, grads_ref = _reference(x, inc, w, b, gy, gs, ib=ib)
    assert _err(s, s_ref) <= 1e-6
    assert _err(y, y_ref) <= tol
    for got, want in zip([x.grad, inc.grad, w.grad, b.grad, ib.grad], grads_ref):
        assert _err(got, want) <= tol
    assert ib.grad.dtype == ib.dtype and ib.grad.shape == ib.shape


def test_partial_sums_finish_over_many_parts_and_ragged_columns():
    # The finishing kernel: fp32 column sums of (k, parts, cols) partials in order, more parts than one step
    # takes and a width that is not a multiple of its column block; each sum cast to its output's dtype.
    g = torch.Generator().manual_seed(0)
    parts = torch.randn((3, 150, 77), generator=g).to(DEVICE)
    outs = [torch.empty(77, device=DEVICE), torch.empty(77, device=DEVICE), torch.empty(77, device=DEVICE).bfloat16()]
    utils.sum_parts_kernel[(3, -(-77 // utils.SUM_COLS))](
        parts, *outs, 150, 77, BLOCK_PARTS=utils.SUM_PARTS, BLOCK_COLS=utils.SUM_COLS
    )
    want = parts.double().sum(1)
    for k in range(3):
        torch.testing.assert_close(outs[k].double(), want[k], rtol=1e-5 if k < 2 else 8e-3, atol=1e-5)


@pytest.mark.parametrize("shape", [(7, 64), (2, 37, 768)], ids=str)
def test_layer_norm_without_inc_matches_float64(shape):
    x, _, w, b, gy, _ = _inputs(shape, torch.float32, None)
    y = layer_norm(x, w, b)
    (y * gy).sum().backward()
    _, y_ref, grads_ref = _reference(x, None, w, b, gy, None)
    assert _err(y, y_ref) <= 1e-5
    for got, want in zip([x.grad, w.grad, b.grad], grads_ref):
        assert _err(got, want) <= 1e-5


def test_s_unused_downstream_gets_no_gradient_from_it():
    # The last norm of a model (ln_f): only y is used; the residual gradient is then LN'(dy) alone.
    x, inc, w, b, gy, _ = _inputs((5, 64), torch.float32, torch.float32)
    _, y = add_layer_norm(x, inc, w, b)
    (y * gy).sum().backward()
    xr, ir = x.detach().double().requires_grad_(), inc.detach().double().requires_grad_()
    (F.layer_norm(xr + ir, (64,), w.detach().double(), b.detach().double()) * gy.double()).sum().backward()
    assert _err(x.grad, xr.grad) <= 1e-5 and _err(inc.grad, ir.grad) <= 1e-5


def test_torch_fallback_matches_the_kernels(monkeypatch):
    # The PyTorch path (CPU without the interpreter) computes what the kernels compute.
    x, inc, w, b, gy, gs = _inputs((9, 100), torch.float32, torch.float32)
    ib = torch.randn(100, device=DEVICE).requires_grad_()
    s, y = add_layer_norm(x, inc, w, b, inc_bias=ib)
    ((y * gy).sum() + (s * gs).sum()).backward()
    kernel = [t.detach().clone() for t in (s, y, x.grad, inc.grad, w.grad, b.grad, ib.grad)]
    for t in (x, inc, w, b, ib):
        t.grad = None
    monkeypatch.undo()  # the autouse fixture's replacements: the fallback must run now
    monkeypatch.setattr(aln, "_use_triton", lambda device: False)
    s, y = add_layer_norm(x, inc, w, b, inc_bias=ib)
    ((y * gy).sum() + (s * gs).sum()).backward()
    for got, want in zip((s, y, x.grad, inc.grad, w.grad, b.grad, ib.grad), kernel):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_compiles_fullgraph_without_breaks():
    x, inc, w, b, gy, gs = _inputs((2, 5, 64), torch.float32, torch.float32)

    def f(x, inc):
        s, y = add_layer_norm(x, inc, w, b)
        return (y * gy).sum() + (s * gs).sum()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    compiled(x, inc).backward()
    got = [t.grad.clone() for t in (x, inc, w, b)]
    for t in (x, inc, w, b):
        t.grad = None
    f(x, inc).backward()
    assert counter.frame_count == 1
    for g, t in zip(got, (x, inc, w, b)):
        torch.testing.assert_close(g, t.grad, rtol=1e-6, atol=0)


def test_any_view_as_incoming_gradient_or_vector():
    # A .sum() loss sends expanded (stride-0) gradients; a strided bias vector is read as given, not at stride 1.
    x, inc, w, b, *_ = _inputs((6, 40), torch.float32, torch.float32)
    ib = torch.randn(80, device=DEVICE)[::2].requires_grad_()
    s, y = add_layer_norm(x, inc, w, b, inc_bias=ib)
    (y.sum() + 2 * s.sum()).backward()
    ones = torch.ones(6, 40, device=DEVICE)
    s_ref, y_ref, grads_ref = _reference(x, inc, w, b, ones, 2 * ones, ib=ib)
    assert _err(s, s_ref) <= 1e-6 and _err(y, y_ref) <= 1e-5
    for got, want in zip([x.grad, inc.grad, w.grad, b.grad, ib.grad], grads_ref):
        assert _err(got, want) <= 1e-5


def test_inc_bias_without_inc_is_refused():
    x, _, w, b, *_ = _inputs((3, 16), torch.float32, None)
    with pytest.raises(ValueError, match="inc_bias without inc"):
        torch.ops.trainer.add_layer_norm(x, None, b.detach(), w, b, 1e-5, torch.float32)


def test_no_rows_give_zero_weight_gradients():
    x, inc, w, b, *_ = _inputs((0, 16), torch.float32, torch.float32)
    ib = torch.randn(16, device=DEVICE).requires_grad_()
    s, y = add_layer_norm(x, inc, w, b, inc_bias=ib)
    (y.sum() + s.sum()).backward()
    assert s.shape == y.shape == (0, 16)
    for t in (w, b, ib):
        assert torch.equal(t.grad, torch.zeros_like(t))


def test_bad_shapes_are_rejected():
    x, inc, w, b, *_ = _inputs((3, 16), torch.float32, torch.float32)
    with pytest.raises(ValueError, match="one shape"):
        add_layer_norm(x, inc[:, :8], w, b)
    with pytest.raises(ValueError, match="weight and bias of shape"):
        layer_norm(x, w[:8], b[:8])
    with pytest.raises(ValueError, match="inc_bias of shape"):
        add_layer_norm(x, inc, w, b, inc_bias=b[:8])
