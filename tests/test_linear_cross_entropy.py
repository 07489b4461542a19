"""trainer::linear_cross_entropy against float64 ``F.cross_entropy(x @ W.T, t)``.

On CPU the Triton kernel runs under ``TRITON_INTERPRET=1``; on a GPU machine the same tests
run on CUDA with the compiled kernel, plus the ``gpu`` tests at gpt2-small head size.
"""

import os

import torch

# Triton reads TRITON_INTERPRET when @triton.jit decorates a function, and it decorates its own
# tl.max / tl.sum when `triton` is first imported: so the variable must be set before anything
# in the process imports triton (torch does not on import; test modules collected before this
# one may). Set too late, the kernel cannot run on CPU: the op takes its PyTorch path and
# test_triton_runs_on_the_test_device fails. Not set on a GPU machine, where the tests run the
# compiled kernel on CUDA tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

from tests.conftest import forbid_fallbacks  # noqa: E402
from trainer.ops import linear_cross_entropy as lce  # noqa: E402
from trainer.ops.linear_cross_entropy import linear_cross_entropy  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ROWS_TORCH = lce._cross_entropy_rows_torch  # kept before the autouse fixture below replaces it

# dtype -> (loss relative error, gradient error as max|err| / max|ref|) against float64, over
# the shapes of test_matches_float64_reference (observed maxima in the comments, CPU interpreter).
TOLERANCES = {
    # Observed 1.2e-7 and 2.1e-5. The gradient error is torch's own fp32 CPU matmul ``dlogits @ W`` summing
    # V = 50304 terms: 1.3e-5 with the kernel's dlogits, which are within 8e-8 of float64's (torch 2.13, AVX-512).
    torch.float32: (1e-6, 5e-5),
    # Observed 1.7e-3 and 1.1e-2. Logits, dlogits and the returned gradients are bf16 (8-bit
    # mantissa, 2^-9 relative rounding): eager bf16 F.cross_entropy is off by as much (1.7e-3,
    # 6.9e-3). The interpreter truncates fp32 -> bf16 stores instead of rounding to nearest
    # (triton 3.9 cast_impl), a bias that doubles the gradient error; the CPU fallback, which
    # rounds like the GPU, gives 8.3e-3.
    torch.bfloat16: (5e-3, 2.5e-2),
    # Observed 1.1e-4 and 1.0e-3: the bf16 causes with an 11-bit mantissa; no underflow, since
    # the 1 / n_valid scale is applied in fp32 in the backward.
    torch.float16: (5e-4, 3e-3),
}


@pytest.fixture(autouse=True)
def _no_silent_fallback(monkeypatch):
    """Where Triton can run, the PyTorch fallback must not: a test of the kernel tests the kernel."""
    if lce._use_triton(torch.device(DEVICE)):
        forbid_fallbacks(monkeypatch, lce, "_cross_entropy_rows_torch")


def _reference(x, w, t, ignore_index=-100, reduction="mean"):
    xr = x.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    loss = F.cross_entropy(xr @ wr.T, t, ignore_index=ignore_index, reduction=reduction)
    loss.backward()
    return loss.detach(), xr.grad, wr.grad


def _rel_err(actual, ref):
    return ((actual.double() - ref).abs().max() / ref.abs().max()).item()


def _inputs(n, v, c, dtype, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g).to(device, dtype).requires_grad_()
    # Logits of std ~2, so the softmax is neither flat nor one-hot.
    w = (torch.randn(v, c, generator=g) * 2 / c**0.5).to(device, dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    t[1::3] = -100  # rows 1, 4, 7, ... ignored; N = 1 keeps its only row
    return x, w, t.to(device)


def _check(loss, x, w, ref, dtype):
    loss_tol, grad_tol = TOLERANCES[dtype]
    ref_loss, ref_gx, ref_gw = ref
    assert loss.dtype == torch.float32 and x.grad.dtype == x.dtype and w.grad.dtype == w.dtype
    assert abs(loss.item() - ref_loss.item()) <= loss_tol * abs(ref_loss.item())
    assert _rel_err(x.grad, ref_gx) <= grad_tol
    assert _rel_err(w.grad, ref_gw) <= grad_tol


def test_triton_runs_on_the_test_device():
    # Every other test here passes on the PyTorch fallback when this one fails.
    assert lce._use_triton(torch.device(DEVICE)), (
        "triton was imported before TRITON_INTERPRET=1 was set (by a test module collected earlier?), "
        "so the kernel cannot run on CPU tensors: set the variable in tests/conftest.py, before any import"
    )


# N = 4097 runs 5 uneven chunks (4 x 820 + 817), N = 7 three (3, 3, 1), N = 1 one.
_CHUNK = {1: None, 7: 3, 4097: 1024}
_SHAPES = [(n, v, c) for n in (1, 7, 4097) for v in (256, 1000) for c in (16, 64)] + [(7, 50304, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n,v,c", _SHAPES)
def test_matches_float64_reference(n, v, c, dtype):
    x, w, t = _inputs(n, v, c, dtype, seed=n + v + c)
    loss = linear_cross_entropy(x, w, t, chunk_size=_CHUNK[n])
    loss.backward()
    _check(loss, x, w, _reference(x, w, t), dtype)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_rows_ignored_matches_f_cross_entropy(reduction):
    # F.cross_entropy: mean over zero rows is 0 / 0 = nan, sum is 0; the gradients are zero.
    x, w, t = _inputs(7, 256, 16, torch.float32)
    t.fill_(-100)
    loss = linear_cross_entropy(x, w, t, reduction=reduction)
    loss.backward()
    ref_loss, ref_gx, ref_gw = _reference(x, w, t, reduction=reduction)
    assert torch.equal(loss.isnan(), ref_loss.isnan()) and (reduction == "mean" or loss.item() == 0.0)
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(ref_gx, torch.zeros_like(ref_gx))
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(ref_gw, torch.zeros_like(ref_gw))


def test_sum_reduction_and_grad_output_scaling():
    # grad_output 3.5 (as in loss / grad_accum) must multiply the gradients computed in the forward.
    x, w, t = _inputs(7, 1000, 16, torch.float32)
    loss = linear_cross_entropy(x, w, t, reduction="sum")
    (loss * 3.5).backward()
    ref_loss, ref_gx, ref_gw = _reference(x, w, t, reduction="sum")
    _check(loss, x, w, (ref_loss, ref_gx * 3.5, ref_gw * 3.5), torch.float32)


def test_ignore_index_that_is_a_class():
    # ignore_index = 0 is also a vocabulary entry: its rows are ignored, column 0 still counts.
    x, w, t = _inputs(7, 256, 16, torch.float32)
    t = torch.where(t < 0, 0, t)
    t[0] = 0
    loss = linear_cross_entropy(x, w, t, ignore_index=0)
    loss.backward()
    _check(loss, x, w, _reference(x, w, t, ignore_index=0), torch.float32)


def test_autocast_computes_in_bf16_and_returns_fp32():
    # The GPT under autocast: fp32 hidden states (ln_f runs in fp32) and an fp32 master weight.
    x, w, t = _inputs(300, 1000, 64, torch.float32)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss = linear_cross_entropy(x, w, t, chunk_size=128)
        eager = F.cross_entropy(F.linear(x, w), t)
    loss.backward()
    # Same bf16 logits as autocast's F.linear, logsumexp in fp32 both: observed equal on CPU. Not
    # yet observed on CUDA, where cuBLAS may sum 128-row chunks in another order than the
    # 300-row product and move some logits by one bf16 ulp.
    assert abs(loss.item() - eager.item()) <= (1e-6 if DEVICE == "cpu" else 2e-5) * abs(eager.item())
    # The matmul really ran in bf16: bitwise the bf16-input result, 1e-4 away from fp32's.
    bf16_loss = linear_cross_entropy(x.detach().bfloat16(), w.detach().bfloat16(), t, chunk_size=128)
    assert torch.equal(loss, bf16_loss)
    assert loss.item() != linear_cross_entropy(x.detach(), w.detach(), t).item()
    _check(loss, x, w, _reference(x, w, t), torch.bfloat16)


def test_bf16_input_with_fp32_weight_outside_autocast():
    x, w, t = _inputs(7, 1000, 64, torch.bfloat16)
    w = w.detach().float().requires_grad_()
    loss = linear_cross_entropy(x, w, t)
    loss.backward()
    _check(loss, x, w, _reference(x, w, t), torch.bfloat16)


def test_no_grad_computes_the_loss_only():
    # One chunk size (4 rows: chunks of 4 and 3) for the three losses compared bit for bit. The logits are torch's
    # matmul of each chunk, and on the CPU a 4-row and a 7-row matmul can round a logit differently (observed 1.9e-6
    # with one thread, none with two; with two, 3-row chunks differ): chunking is not bitwise invariant, and not the
    # point here.
    x, w, t = _inputs(7, 1000, 16, torch.float32)
    with torch.no_grad():
        loss = linear_cross_entropy(x, w, t, chunk_size=4)
    assert not loss.requires_grad
    assert torch.equal(loss, linear_cross_entropy(x, w, t, chunk_size=4).detach())
    out = lce._linear_cross_entropy_op(x.detach(), w.detach(), t, -100, "mean", torch.float32, 4, False, False)
    assert torch.equal(out[0], loss) and out[1].shape == (0,) and out[2].shape == (0,)


def test_backward_refuses_gradients_not_computed_in_forward():
    x, w, t = _inputs(7, 256, 16, torch.float32)
    loss, _, _ = lce._linear_cross_entropy_op(x, w, t, -100, "mean", torch.float32, 4, False, True)
    with pytest.raises(RuntimeError, match="grad_x=False"):
        loss.backward()


def test_double_backward_is_refused():
    x, w, t = _inputs(7, 256, 16, torch.float32)
    (gx,) = torch.autograd.grad(linear_cross_entropy(x, w, t), x)  # plain backward works
    assert gx.shape == x.shape
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(linear_cross_entropy(x, w, t), x, create_graph=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_column_and_row_blocks(dtype):
    # Forced small blocks: 8 column blocks (the last 104 wide) and 2 row blocks (the last one
    # half empty), against the PyTorch rows function on the same logits.
    logits = (torch.randn(7, 1000) * 3).to(DEVICE, dtype)
    t = torch.randint(0, 1000, (7,), device=DEVICE)
    t[2] = -100
    got, want = logits.clone(), logits.clone()
    loss_got, loss_want = torch.empty(7, device=DEVICE), torch.empty(7, device=DEVICE)
    lce._cross_entropy_rows_triton(got, t, loss_got, -100, True, block_size=128, block_rows=4)
    _ROWS_TORCH(want, t, loss_want, -100, True)
    # fp32: observed 4.8e-7 (exp/log rounding, another summation order). bf16: the stored
    # gradient may differ by one bf16 ulp (2^-8 in [0.5, 1)): truncation in the interpreter.
    atol = 2e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(loss_got, loss_want, rtol=0, atol=2e-6)
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=atol)
    assert torch.equal(got[2], torch.zeros_like(got[2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_pytorch_fallback(dtype, monkeypatch):
    # What CPU tensors run when Triton is not interpreted (a plain `import triton`).
    monkeypatch.setattr(lce, "_use_triton", lambda device: False)
    monkeypatch.setattr(lce, "_cross_entropy_rows_torch", _ROWS_TORCH)
    x, w, t = _inputs(4097, 1000, 16, dtype, device="cpu")
    loss = linear_cross_entropy(x, w, t, chunk_size=1024)
    loss.backward()
    _check(loss, x, w, _reference(x, w, t), dtype)


def test_rejects_bad_arguments():
    x, w, t = _inputs(7, 256, 16, torch.float32)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(x, w, t, reduction="none")
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(x, w[:, :8], t)
    with pytest.raises(ValueError, match="int64"):
        linear_cross_entropy(x, w, t.int())
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(x, w, t, chunk_size=0)
    with pytest.raises(ValueError, match="float64"):
        linear_cross_entropy(x.double(), w, t)


@pytest.mark.skipif(DEVICE != "cpu", reason="on CUDA the device-side assert poisons the context")
def test_rejects_out_of_range_target():
    x, w, t = _inputs(7, 256, 16, torch.float32)
    t[0] = 256
    with pytest.raises(RuntimeError, match="outside"):
        linear_cross_entropy(x, w, t)


def _opcheck_samples():
    x, w, t = _inputs(33, 300, 16, torch.float32)
    xd, wd = x.detach(), w.detach()
    return [
        (x, w, t, -100, "mean", torch.float32, 8, True, True),
        (xd, wd, t, -100, "sum", torch.bfloat16, 100, False, False),
        (xd.bfloat16().requires_grad_(), wd, torch.where(t < 0, 3, t), 3, "mean", torch.bfloat16, 16, True, False),
    ]


@pytest.mark.parametrize("i", range(3))
def test_opcheck(i):
    torch.library.opcheck(lce._linear_cross_entropy_op, _opcheck_samples()[i])


def _loss_fn(x, w, t):
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        return linear_cross_entropy(x, w, t, chunk_size=128) / 2


def _grads(fn, x, w, t):
    x.grad = w.grad = None
    loss = fn(x, w, t)
    loss.backward()
    return loss.detach(), x.grad, w.grad


def test_compile_fullgraph_aot_eager():
    x, w, t = _inputs(300, 1000, 64, torch.float32)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_loss_fn, backend=counter, fullgraph=True)
    for got, want in zip(_grads(compiled, x, w, t), _grads(_loss_fn, x, w, t)):
        assert torch.equal(got, want)  # the same kernel on the same inputs
    t2 = torch.randint(0, 1000, t.shape, device=DEVICE)
    compiled(x, w, t2).backward()
    assert counter.frame_count == 1  # one graph, no recompile for new targets


@pytest.mark.slow  # ~25 s cold (Inductor's C++ compile on 2 cores), ~6 s with its cache warm
def test_compile_fullgraph_inductor():
    x, w, t = _inputs(300, 1000, 64, torch.float32)
    compiled = torch.compile(_loss_fn, fullgraph=True)
    for got, want in zip(_grads(compiled, x, w, t), _grads(_loss_fn, x, w, t)):
        # Observed equal; Inductor only generates the backward's fp32 scaling around our op.
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_gpt2_head_bf16_autocast_accuracy_and_memory():
    assert not lce._INTERPRETED, "run the gpu tests without TRITON_INTERPRET"
    n, c, v = 16 * 1024, 768, 50304
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, c, device="cuda", generator=g).requires_grad_()
    w = (torch.randn(v, c, device="cuda", generator=g) * 0.02).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[::7] = -100

    def run(fn, autocast=True):
        x.grad = w.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = fn(x, w, t)
        loss.backward()
        torch.cuda.synchronize()
        return loss.detach(), x.grad, w.grad, torch.cuda.max_memory_allocated() - base

    ours = run(linear_cross_entropy)
    eager = run(lambda x, w, t: F.cross_entropy(F.linear(x, w), t))
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = run(lambda x, w, t: F.cross_entropy(F.linear(x, w), t), autocast=False)  # fp32: ~1e-6, as on CPU
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32

    def errors(r):
        return abs(r[0].item() - ref[0].item()) / abs(ref[0].item()), _rel_err(r[1], ref[1]), _rel_err(r[2], ref[2])

    ours_err, eager_err = errors(ours), errors(eager)
    print(f"errors vs fp32: ours {ours_err}, eager autocast {eager_err}; peak bytes ours {ours[3]}, eager {eager[3]}")
    # Not yet observed on a GPU. Expected: ours within 1.6x of eager autocast, as the CPU
    # fallback (which rounds to nearest like the GPU) is; the bf16 table bounds it as on CPU.
    loss_tol, grad_tol = TOLERANCES[torch.bfloat16]
    assert ours_err[0] <= loss_tol and ours_err[1] <= grad_tol and ours_err[2] <= grad_tol
    assert all(o <= 2 * e + 1e-4 for o, e in zip(ours_err, eager_err))
    # Expected ~0.9 GB (412 MB logits chunk + weight copies + grads) against ~10 GB materialised.
    assert ours[3] < 0.25 * eager[3] and ours[3] < 1.5 * 2**30


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_weight_gradient_accumulates_in_fp32_inside_cublas(monkeypatch):
    """Under bf16 autocast, each chunk's ``dlogits.T @ x`` product goes into the fp32 accumulator through
    ``mm``/``addmm`` with ``out_dtype=float32`` (cuBLAS adds it in fp32; no bf16 product, no separate add), and the
    gradients are those of the path that adds bf16 products: the loss and input gradient bit for bit, the weight
    gradient as close to float64's."""
    assert lce._fp32_out_mm(torch.device("cuda")), "this torch has no addmm(out_dtype=) on CUDA"
    n, v, c = 4097, 1000, 64
    x, w, t = _inputs(n, v, c, torch.float32)  # an fp32 weight: its gradient stays fp32, no rounding at the end
    ref = _reference(x, w, t)
    calls = []

    def spy(fn):
        def wrapped(*args, **kwargs):
            calls.append((fn.__name__, kwargs.get("out_dtype")))
            return fn(*args, **kwargs)

        return wrapped

    def run():
        x.grad = w.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = linear_cross_entropy(x, w, t, chunk_size=1024)  # 5 chunks
        loss.backward()
        return loss.detach(), x.grad.clone(), w.grad.clone()

    with monkeypatch.context() as m:
        m.setattr(torch, "mm", spy(torch.mm))
        m.setattr(torch, "addmm", spy(torch.addmm))
        fp32_out = run()
    assert [call for call in calls if call[1] is not None] == [("mm", torch.float32)] + [("addmm", torch.float32)] * 4
    monkeypatch.setattr(lce, "_fp32_out_mm", lambda device: False)
    bf16_products = run()
    assert fp32_out[2].dtype == torch.float32
    torch.testing.assert_close(fp32_out[0], bf16_products[0], rtol=0, atol=0)
    torch.testing.assert_close(fp32_out[1], bf16_products[1], rtol=0, atol=0)
    errors = _rel_err(fp32_out[2], ref[2]), _rel_err(bf16_products[2], ref[2])
    # Observed 3.65e-3 and 3.62e-3 on an H100: the bf16 operands (dlogits, x), not the products, set the error.
    print(f"weight gradient error against float64: fp32 accumulation {errors[0]:.2e}, bf16 products {errors[1]:.2e}")
    assert errors[0] <= TOLERANCES[torch.bfloat16][1] and errors[0] <= 1.1 * errors[1]


# --- save_logit_grads=True: one (N, V) buffer, gradient matmuls in the backward (compile.kernels: cross_entropy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n,v,c", [(1, 256, 16), (7, 1000, 64), (4097, 1000, 16), (7, 50304, 16)])
def test_saved_logit_grads_match_float64_reference(n, v, c, dtype):
    # Same tolerances as the chunked op: the same kernel on the same logits; the gradient
    # matmuls run on the unscaled bf16/fp16 dlogits and are scaled by 1 / n_valid in fp32 after.
    x, w, t = _inputs(n, v, c, dtype, seed=n + v + c)
    loss = linear_cross_entropy(x, w, t, save_logit_grads=True)
    loss.backward()
    _check(loss, x, w, _reference(x, w, t), dtype)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_saved_logit_grads_reductions_grad_output_and_all_ignored(reduction):
    x, w, t = _inputs(7, 1000, 16, torch.float32)
    loss = linear_cross_entropy(x, w, t, reduction=reduction, save_logit_grads=True)
    (loss * 3.5).backward()  # grad_output 3.5, as in loss / grad_accum
    ref_loss, ref_gx, ref_gw = _reference(x, w, t, reduction=reduction)
    _check(loss, x, w, (ref_loss, ref_gx * 3.5, ref_gw * 3.5), torch.float32)
    x.grad = w.grad = None
    t.fill_(-100)
    loss = linear_cross_entropy(x, w, t, reduction=reduction, save_logit_grads=True)
    loss.backward()
    assert loss.isnan().item() == (reduction == "mean") and (reduction == "mean" or loss.item() == 0.0)
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(w.grad, torch.zeros_like(w))
    with pytest.raises(ValueError, match="chunk_size does not apply"):
        linear_cross_entropy(x, w, t, chunk_size=4, save_logit_grads=True)


def test_saved_logit_grads_under_autocast_equal_the_chunked_op():
    # The GPT's case: fp32 hidden states and master weight, bf16 autocast. Both ops run the same
    # bf16 logits through the same kernel: equal losses; gradients within a bf16 ulp of each other.
    x, w, t = _inputs(300, 1000, 64, torch.float32)
    grads = []
    for kw in ({"chunk_size": 300}, {"save_logit_grads": True}):
        x.grad = w.grad = None
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = linear_cross_entropy(x, w, t, **kw)
        loss.backward()
        grads.append((loss.detach(), x.grad, w.grad))
    assert torch.equal(grads[0][0], grads[1][0])
    assert grads[1][1].dtype == torch.float32 and grads[1][2].dtype == torch.float32
    for a, b in zip(grads[0][1:], grads[1][1:]):
        assert _rel_err(b, a.double()) <= 2**-7
    _check(grads[1][0], x, w, _reference(x, w, t), torch.bfloat16)


def test_saved_logit_grads_backward_refuses_a_forward_without_gradients():
    x, w, t = _inputs(7, 256, 16, torch.float32)
    loss, _ = lce._saved_op(x, w, t, -100, "mean", False)  # the buffer still holds logits
    with pytest.raises(RuntimeError, match="compute_grad=False"):
        loss.backward()


def test_saved_logit_grads_opcheck_and_compile_fullgraph():
    x, w, t = _inputs(33, 300, 16, torch.float32)
    torch.library.opcheck(lce._saved_op, (x, w, t, -100, "mean", True))
    torch.library.opcheck(lce._saved_op, (x.detach(), w.detach(), torch.where(t < 0, 3, t), 3, "sum", False))

    def fn(x, w, t):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            return linear_cross_entropy(x, w, t, save_logit_grads=True) / 2

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    for got, want in zip(_grads(compiled, x, w, t), _grads(fn, x, w, t)):
        assert torch.equal(got, want)  # the same kernel and matmuls on the same inputs
    assert counter.frame_count == 1
