"""trainer's norm kernels as ``triton_op``s (trainer/ops/utils.py ``kernel_op``) where Triton compiles them: a traced
graph sees through them (Inductor then compiles their kernels with its own), unless the memory trace keeps them
opaque (torch's ``decompose_custom_triton_ops``). The suite's own processes run the kernels in Triton's interpreter,
where the ops stay opaque ``custom_op``s; this test runs in a process without it."""

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

CODE = """
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch import config as functorch_config
from torch._library.triton import get_triton_kernels_for_op
from trainer.ops.add_layer_norm import add_layer_norm
from trainer.ops.add_rms_norm import add_rms_norm

assert [k.fn.__name__ for k in get_triton_kernels_for_op("trainer::add_layer_norm")] == ["_add_ln_fwd_kernel"]

def f(x, inc, w, b):
    s, y = add_layer_norm(x, inc, w, b)
    s2, y2 = add_rms_norm(s, y, w, 1e-6)
    return (y2.float() ** 2).sum() + s2.sum()

def trainer_nodes(**patch):
    seen = []
    def keep(g, _):
        seen.extend(str(n.target) for n in g.graph.nodes if str(n.target).startswith("trainer."))
        return g.forward
    torch._dynamo.reset()
    args = [torch.randn(*shape, requires_grad=True) for shape in ((8, 64), (8, 64), (64,), (64,))]
    with functorch_config.patch(**patch):
        out = torch.compile(f, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))(*args)
        out.backward()
    ref = f(*[a.detach().requires_grad_() for a in args])
    assert torch.allclose(out, ref), (out, ref)
    return sorted(set(seen))

print(trainer_nodes())
print(trainer_nodes(decompose_custom_triton_ops=False))
"""


def test_norm_ops_are_traced_through_unless_kept_opaque():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    through, opaque = r.stdout.strip().splitlines()[-2:]
    assert through == "[]"  # the PyTorch path of a CPU tensor, traced into the graph
    assert opaque == str(
        ["trainer.add_layer_norm.default", "trainer.add_layer_norm_backward.default", "trainer.add_rms_norm.default",
         "trainer.add_rms_norm_backward.default"]
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_inductor_compiles_the_norm_kernels_with_its_own(norm):
    """Under Inductor on a GPU the norms' kernels are in the code it generates (compiled in its workers, launched by
    it), and the compiled step gives the eager op's values and gradients."""
    import torch
    from torch._inductor.utils import run_and_get_code

    from trainer.ops.add_layer_norm import add_layer_norm
    from trainer.ops.add_rms_norm import add_rms_norm

    g = torch.Generator().manual_seed(0)
    x, inc = (torch.randn(512, 768, generator=g).cuda().requires_grad_() for _ in range(2))
    w, b = (1 + 0.1 * torch.randn(768, generator=g)).cuda().requires_grad_(), torch.zeros(768, device="cuda")

    def f(x, inc, w):
        s, y = add_layer_norm(x, inc, w, b) if norm == "layer" else add_rms_norm(x, inc, w, 1e-6)
        return (y.float() ** 2).sum() + s.sum()

    def grads(fn):
        for t in (x, inc, w):
            t.grad = None
        out = fn(x, inc, w)
        out.backward()
        return [out.detach(), *(t.grad.clone() for t in (x, inc, w))]

    torch._dynamo.reset()
    compiled, code = run_and_get_code(lambda: grads(torch.compile(f, backend="inductor")))
    kernels = [f"_add_{'ln' if norm == 'layer' else 'rms'}_{way}_kernel" for way in ("fwd", "bwd")]
    text = "\n".join(code)
    assert all(k in text for k in kernels), [k for k in kernels if k not in text]
    for got, want in zip(compiled, grads(f)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
