"""trainer's kernels compiled in a second process while the model compiles (trainer/ops/warm.py): the calls a compile
traces reach the process, which rebuilds and launches each; a process still starting is stopped, not waited for."""

import os
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.conftest import ROOT
from trainer import build
from trainer.config import load_config
from trainer.ops import warm
from trainer.ops.add_rms_norm import add_rms_norm
from trainer.ops.linear_cross_entropy import linear_cross_entropy


@pytest.fixture(autouse=True)
def _disarmed():
    yield
    warm.finish(wait_s=0)


def _trace_a_step(dtype=torch.float32):
    """The calls of one forward and backward through two of trainer's ops, on fake tensors (as a compile traces)."""
    with FakeTensorMode():
        x = torch.randn(6, 16, dtype=dtype, requires_grad=True)
        inc = torch.randn(6, 16, dtype=dtype, requires_grad=True)
        weight = torch.ones(16, dtype=dtype, requires_grad=True)
        head = torch.randn(10, 16, dtype=dtype, requires_grad=True)
        _s, y = add_rms_norm(x, inc, weight, 1e-5)
        loss = linear_cross_entropy(y, head, torch.zeros(6, dtype=torch.long))
        loss.backward()


def test_the_traced_calls_run_in_the_process():
    warm.enable(torch.device("cpu"))
    _trace_a_step()
    _trace_a_step()  # the same calls again: sent once
    assert warm.running()
    warm._process.ready.wait(120)  # started: finish() waits for it rather than stopping it
    got = warm.finish()
    # add_rms_norm and its backward, linear_cross_entropy (its backward reads what the forward saved)
    assert got["failed"] == [] and got["stopped"] is False
    assert got["sent"] == got["done"] == 3
    assert not warm.running()


def test_a_process_still_starting_is_stopped():
    warm.enable(torch.device("cpu"))
    _trace_a_step()
    got = warm.finish()
    assert got["stopped"] is True and got["sent"] == 3 and got["done"] == 0


def test_nothing_starts_unless_armed_and_nothing_after_finish():
    _trace_a_step()
    assert not warm.running() and warm.finish() is None
    warm.enable(torch.device("cpu"))
    warm.finish()
    _trace_a_step()
    assert not warm.running()


def test_a_real_launch_ends_the_process():
    warm.enable(torch.device("cpu"))
    _trace_a_step()
    assert warm.running()
    x = torch.randn(4, 8)
    add_rms_norm(x, x, torch.ones(8), 1e-5)
    assert not warm.running()


def test_calls_are_rebuilt_with_their_layout():
    with FakeTensorMode():
        base = torch.empty(4, 24, dtype=torch.bfloat16)
        view = base[:, 8:]  # a strided view at an offset
        args = (view, [base], None, 1e-5, torch.float32, True, "mean")
        encoded = [warm._encode(a) for a in args]
    rebuilt = [warm._decode(a, torch.device("cpu")) for a in encoded]
    assert (rebuilt[0].shape, rebuilt[0].stride(), rebuilt[0].storage_offset()) == ((4, 16), (24, 1), 8)
    assert rebuilt[0].dtype == torch.bfloat16 and not rebuilt[0].any()
    assert rebuilt[1][0].shape == (4, 24) and rebuilt[2:] == [None, 1e-5, torch.float32, True, "mean"]


def test_tensor_subclasses_are_not_sent():
    from torch.testing._internal.two_tensor import TwoTensor

    pair = TwoTensor(torch.zeros(4, 8), torch.zeros(4, 8))  # a wrapper like DTensor: its shape is not the kernel's
    assert warm._encode(pair) is warm._SKIP and warm._encode(torch.zeros(4, 8)) is not warm._SKIP


def test_symbolic_shapes_are_not_sent():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv()
    with FakeTensorMode(shape_env=shape_env):
        x = torch.empty(shape_env.create_unbacked_symint(), 16)  # rows of a size the trace does not know
        assert not isinstance(x.shape[0], int)
        assert warm._encode(x) is warm._SKIP and warm._encode([x]) is warm._SKIP
        warm.enable(torch.device("cpu"))
        add_rms_norm(x, x, torch.ones(16), 1e-5)
    assert not warm.running()


def _plan(device: str, compiled: bool):
    cfg = load_config(ROOT / "configs/tiny.yaml", [])
    return SimpleNamespace(cfg=cfg, compiled=compiled, device=torch.device(device))


@pytest.mark.parametrize(("device", "compiled", "env", "backend", "armed"),
                         [("cuda", True, "1", "inductor", True), ("cuda", True, "0", "inductor", False),
                          ("cpu", True, "1", "inductor", False), ("cuda", False, "1", "inductor", False),
                          ("cuda", True, "1", "aot_eager", False)])  # fmt: skip
def test_the_run_arms_it_where_inductor_compiles_for_cuda(monkeypatch, tmp_path, device, compiled, env, backend, armed):
    from trainer.compile import cache

    monkeypatch.setattr(cache, "start_workers", lambda: True)
    monkeypatch.setenv("TRAINER_WARM_KERNELS", env)
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.setenv(name, os.environ.get(name, "before"))
    warm.last = {"sent": 1}  # a run before this one's
    plan = _plan(device, compiled)
    plan.cfg.compile.backend = backend
    build.compile_caches(plan, tmp_path)
    assert (warm._device is not None) is armed
    assert warm.last is None  # the compile report says nothing of another run's process


def test_a_process_that_cannot_start_disarms_and_the_compile_goes_on(monkeypatch):
    def cannot_start(device):
        raise OSError("too many processes")

    monkeypatch.setattr(warm, "_Process", cannot_start)
    warm.enable(torch.device("cpu"))
    _trace_a_step()  # raises nothing
    assert warm._device is None and not warm.running()


def test_a_calls_input_bytes():
    with FakeTensorMode():
        args = (torch.empty(4, 24, dtype=torch.bfloat16)[:, 8:], [torch.empty(10)], None, 1e-5)
        spec = {"args": [warm._encode(a) for a in args]}
    assert warm._input_bytes(spec) == (8 + 3 * 24 + 16) * 2 + 10 * 4


_LOADS_WHAT_IT_COMPILED = """
import sys
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from trainer.ops import warm
from trainer.ops.add_rms_norm import add_rms_norm
from trainer.ops.linear_cross_entropy import linear_cross_entropy


def step():
    x = torch.randn(512, 768, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    weight = torch.ones(768, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    head = torch.randn(1000, 768, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    _s, y = add_rms_norm(x, x, weight, 1e-5)
    linear_cross_entropy(y, head, torch.zeros(512, dtype=torch.long, device="cuda")).backward()


if sys.argv[1] == "warm":
    warm.enable(torch.device("cuda"))
    with FakeTensorMode():
        step()
    assert warm._process.ready.wait(120)
    got = warm.finish()
    assert got["failed"] == [] and got["done"] == got["sent"] == 3, got
cache = Path(sys.argv[2])
before = {p for p in cache.rglob("*") if p.is_file()}
step()
torch.cuda.synchronize()
print(len(before), sorted(p.name for p in cache.rglob("*") if p.is_file() and p not in before))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_main_process_loads_the_kernels_the_process_compiled(tmp_path):
    """Triton's cache: after the process compiled the calls, the same launches in the main process write nothing
    (no kernel or launcher compiled there); without it, they write their kernels."""
    import subprocess
    import sys

    out = {}
    for mode in ("warm", "cold"):
        cache = tmp_path / mode
        path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "PYTHONPATH": path}
        run = subprocess.run([sys.executable, "-c", _LOADS_WHAT_IT_COMPILED, mode, str(cache)], env=env,
                             capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        out[mode] = run.stdout.strip().splitlines()[-1]
    n_warm, new_warm = out["warm"].split(" ", 1)
    assert int(n_warm) > 0 and new_warm == "[]", out
    assert out["cold"].split(" ", 1)[1] != "[]", out
