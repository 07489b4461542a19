"""trainer.compile.kernels.linear_gelu: forward and gradients against float64 ``gelu_tanh(F.linear(x, W, b))``.

On CPU the Triton kernel runs under ``TRITON_INTERPRET=1`` (see tests/test_linear_cross_entropy.py for why
the variable is set before anything imports triton); on a GPU machine the same tests run it on CUDA.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

from trainer.compile.kernels import linear_gelu as lg  # noqa: E402
from trainer.compile.kernels.flat import triton_can_run  # noqa: E402
from trainer.compile.kernels.linear_gelu import gelu_tanh_backward_bias, linear_gelu  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Error as max|err| / max|ref| against float64, for the output and each gradient, over the shapes below (CPU
# interpreter). fp32: observed 5.5e-7, torch's module 5.1e-7. bf16 under autocast: the output, dpre and the
# matmuls are bf16 (2^-9 relative rounding); observed 9.3e-3, torch's module under the same autocast 6.4e-3 (the
# interpreter truncates fp32 -> bf16 stores instead of rounding, see tests/test_linear_cross_entropy.py).
TOLERANCES = {torch.float32: 2e-6, torch.bfloat16: 1.5e-2}


def test_triton_runs_on_the_test_device():
    assert triton_can_run(torch.device(DEVICE), lg._gelu_tanh_backward_bias_kernel), (
        "triton was imported before TRITON_INTERPRET=1 was set: the op would test its PyTorch fallback"
    )


@pytest.fixture(autouse=True)
def _no_silent_fallback(monkeypatch):
    """Where Triton can run, the PyTorch fallback must not."""
    if triton_can_run(torch.device(DEVICE), lg._gelu_tanh_backward_bias_kernel):

        def fail(*args, **kwargs):
            raise AssertionError("the PyTorch fallback ran where the Triton kernel should have")

        monkeypatch.setattr(lg, "_backward_torch", fail)


def _inputs(m, k, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * (2 / k**0.5)  # pre-activations of std ~2: both GELU tails
    b = torch.randn(n, generator=g)
    dout = torch.randn(m, n, generator=g)
    return [t.to(DEVICE) for t in (x, w, b, dout)]


def _grads(fn, x, w, b, dout, autocast: bool):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        out = fn(*leaves)
    out.backward(dout.to(out.dtype))
    return out.detach(), *(t.grad for t in leaves)


def _module(x, w, b):
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def _rel_err(actual, ref):
    return ((actual.double() - ref).abs().max() / ref.abs().max()).item()


# Rows: fewer than one 32-row block, not a multiple of it, and more than MAX_GROUPS * 4 blocks (several
# blocks per row group, a short last group); columns: fewer than one 128-column block and not a multiple.
SHAPES = [(1, 8, 5), (37, 16, 200), (300, 24, 130), (lg.MAX_GROUPS * 128 + 45, 8, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_matches_float64_reference(m, k, n, dtype):
    x, w, b, dout = _inputs(m, k, n, seed=m + k + n)
    autocast = dtype == torch.bfloat16
    ref = _grads(_module, x.double(), w.double(), b.double(), dout.double(), autocast=False)
    ours = _grads(linear_gelu, x, w, b, dout, autocast)
    assert ours[0].dtype == dtype and [g.dtype for g in ours[1:]] == [torch.float32] * 3
    for a, r in zip(ours, ref):
        assert _rel_err(a, r) <= TOLERANCES[dtype]
    if autocast:  # torch's module under the same autocast is within the same bound of float64
        theirs = _grads(_module, x, w, b, dout, autocast)
        for a, r in zip(theirs, ref):
            assert _rel_err(a, r) <= TOLERANCES[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward_op_against_aten_gelu_backward(dtype):
    """The kernel's dpre is aten's gelu_backward (tanh) and dbias the fp32 sum of the stored dpre."""
    g = torch.Generator().manual_seed(3)
    pre = (torch.randn(300, 130, generator=g) * 3).to(DEVICE, dtype)
    pre[0, :4] = torch.tensor([-30.0, 30.0, 0.0, -1e-3])  # saturated tails, zero
    dout = torch.randn(300, 130, generator=g).to(DEVICE, dtype)
    dpre, dbias = gelu_tanh_backward_bias(dout, pre)
    want = torch.ops.aten.gelu_backward(dout.double(), pre.double(), approximate="tanh")
    tol = 1e-6 if dtype == torch.float32 else 2**-7  # bf16: one rounding of the stored value (truncated)
    assert dpre.dtype == dbias.dtype == dtype and dbias.shape == (130,)
    torch.testing.assert_close(dpre.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    torch.testing.assert_close(dbias.double(), dpre.double().sum(0), rtol=tol, atol=tol * 300)


def test_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="two equal 2-D shapes"):
        gelu_tanh_backward_bias(torch.zeros(3, 4, device=DEVICE), torch.zeros(3, 5, device=DEVICE))


def test_opcheck():
    pre = torch.randn(37, 200, device=DEVICE)
    torch.library.opcheck(gelu_tanh_backward_bias, (torch.randn(37, 200, device=DEVICE), pre))


def test_compile_fullgraph_aot_eager_equals_eager():
    x, w, b, dout = _inputs(37, 16, 200)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(linear_gelu, backend=counter, fullgraph=True)
    eager = _grads(linear_gelu, x, w, b, dout, autocast=False)
    got = _grads(compiled, x, w, b, dout, autocast=False)
    assert counter.frame_count == 1
    for a, r in zip(got, eager):
        torch.testing.assert_close(a, r, rtol=0, atol=0)


def test_kernel_compiles_for_hopper_without_a_gpu():
    """The interpreter runs what compiled Triton refuses (a plain-float global read in the kernel: the first H100 run
    failed to compile): compile the kernel to a cubin for sm_90 here, in a process without TRITON_INTERPRET."""
    import subprocess
    import sys
    from pathlib import Path

    script = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from trainer.compile.kernels.linear_gelu import _gelu_tanh_backward_bias_kernel as k
sig = {"DOut": "*bf16", "Pre": "*bf16", "DPre": "*bf16", "Partials": "*fp32", "n_rows": "i32", "n_cols": "i32",
       "rows_per_group": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
src = ASTSource(fn=k, signature=sig, constexprs={"BLOCK_M": 32, "BLOCK_N": 128})
print(sorted(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cubin" in r.stdout


def test_compiled_under_autocast_equals_eager():
    """Inside a compiled model under bf16 autocast (the trainer's case): Dynamo traces the autocast state queries and
    the casts; the result and gradients equal the eager call's."""
    x, w, b, dout = _inputs(37, 16, 200)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(linear_gelu, backend=counter, fullgraph=True)
    eager = _grads(linear_gelu, x, w, b, dout, autocast=True)
    got = _grads(compiled, x, w, b, dout, autocast=True)
    assert counter.frame_count == 1 and got[0].dtype == torch.bfloat16
    for a, r in zip(got, eager):
        torch.testing.assert_close(a, r, rtol=0, atol=0)


def test_compiled_autograd_equals_eager(monkeypatch):
    """Under compiled autograd (the backward traced as one graph) the autograd.Function's backward, our op
    included, gives the eager gradients; the op's body ran at runtime (not only its fake at trace time)."""
    from trainer.compile.autograd import compiled_autograd

    x, w, b, dout = _inputs(37, 16, 200)
    eager = _grads(linear_gelu, x, w, b, dout, autocast=False)
    calls = []
    can_run = lg.triton_can_run  # called by the op's body when it runs
    monkeypatch.setattr(lg, "triton_can_run", lambda *a: calls.append(1) or can_run(*a))
    with compiled_autograd("aot_eager"):
        got = _grads(torch.compile(linear_gelu, backend="aot_eager", fullgraph=True), x, w, b, dout, autocast=False)
    assert calls
    for a, r in zip(got, eager):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-7)
