"""The compile layer: capture scopes, compiled autograd with hooks, parity with eager, no recompiles."""

import json
import sys

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from tests.conftest import FAST, ROOT, cli, losses
from trainer.compile.autograd import compiled_autograd
from trainer.compile.capture import apply_compile
from trainer.config import load_config
from trainer.loop import Trainer
from trainer.models import build_model
from trainer.models.blocks import find_blocks


@pytest.fixture(autouse=True)
def _fresh_dynamo(fresh_dynamo):
    yield


class Broken(nn.Module):
    """Three linears with a planted graph break between the first two."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        x = torch.relu(self.a(x))
        torch._dynamo.graph_break()  # the planted break
        x = torch.relu(self.b(x))
        return self.c(x).sum()


class _CountingBackend:
    """aot_eager that counts forward and backward graphs handed to it."""

    def __init__(self):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        self.fw = self.bw = 0

        def fw(gm, _):
            self.fw += 1
            return make_boxed_func(gm.forward)

        def bw(gm, _):
            self.bw += 1
            return make_boxed_func(gm.forward)

        self.backend = aot_autograd(fw_compiler=fw, bw_compiler=bw)


def _train_steps(model, compiled, ca: bool, steps=3):
    x = torch.randn(4, 8)
    for _ in range(steps):
        ctx = compiled_autograd("aot_eager") if ca else torch.enable_grad()
        with ctx:
            compiled(x).backward()
        model.zero_grad(set_to_none=True)


def test_graph_break_splits_the_backward_without_compiled_autograd():
    m = Broken()
    counting = _CountingBackend()
    _train_steps(m, torch.compile(m, backend=counting.backend), ca=False)
    assert counting.fw == 2 and counting.bw == 2  # one AOT backward graph per forward piece
    assert counters["compiled_autograd"]["captures"] == 0


def test_compiled_autograd_captures_one_backward_graph():
    m = Broken()
    counting = _CountingBackend()
    _train_steps(m, torch.compile(m, backend=counting.backend), ca=True)
    assert counting.fw == 2
    assert counting.bw == 0  # the AOT backwards are inlined into compiled autograd's graph instead
    assert counters["compiled_autograd"]["captures"] == 1  # one backward graph, captured once over 3 steps


def test_tensor_and_post_accumulate_hooks_run_under_compiled_autograd():
    torch.manual_seed(0)
    m = Broken()
    ref = Broken()
    ref.load_state_dict(m.state_dict())
    seen = []
    m.b.weight.register_hook(lambda g: g * 3.0)  # a tensor hook that changes the gradient
    m.c.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.sum()))
    x = torch.randn(4, 8)
    with compiled_autograd("aot_eager"):
        torch.compile(m, backend="aot_eager")(x).backward()
    ref(x).backward()
    assert counters["compiled_autograd"]["captures"] == 1
    torch.testing.assert_close(m.b.weight.grad, 3.0 * ref.b.weight.grad)
    torch.testing.assert_close(m.a.weight.grad, ref.a.weight.grad)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], ref.c.weight.grad.sum())


def test_blocks_scope_compiles_one_graph_for_identical_blocks():
    model = build_model(preset=None, vocab_size=64, seq_len=16, n_layer=4, n_head=2, n_embd=16)
    path, blocks = find_blocks(model)
    assert path == "transformer.h" and len(blocks) == 4
    cfg = load_config(None, ["compile.scope=blocks", "compile.backend=aot_eager", "compile.loss=false"]).compile
    out = apply_compile(model, cfg)
    assert out is model
    idx = torch.randint(0, 64, (2, 16))
    out(idx, idx).backward()
    out(idx, idx).backward()
    assert counters["stats"]["unique_graphs"] == 1  # 4 blocks, 2 steps, one graph
    cfg.loss = True  # the head and loss as one more graph
    apply_compile(model, cfg)(idx, idx).backward()
    assert counters["stats"]["unique_graphs"] == 2
    assert set(model.state_dict()) == set(build_model(preset=None, vocab_size=64, seq_len=16, n_layer=4, n_head=2,
                                                      n_embd=16).state_dict())  # fmt: skip


def test_find_blocks_errors():
    with pytest.raises(ValueError, match="no nn.ModuleList"):
        find_blocks(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="no submodule 'nope'"):
        find_blocks(nn.Sequential(nn.Linear(2, 2)), "nope")


def _fit(tmp_path, name, *extra):
    cfg = load_config(
        ROOT / "configs/tiny.yaml",
        [*FAST, f"run.dir={tmp_path / name}", "train.steps=15", "log.every=1", "train.eval_every=5", *extra],
    )
    summary = Trainer(cfg).fit()
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r], summary


def test_compiled_training_matches_eager(tmp_path):
    eager, _ = _fit(tmp_path, "eager")
    torch._dynamo.reset()
    compiled, _ = _fit(tmp_path, "aot", "compile.enabled=true", "compile.backend=aot_eager")
    # train graph + eval graph: the 3 train/eval switches and the LR changing every step compile nothing more
    assert counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()
    counters.clear()
    ca, _ = _fit(tmp_path, "aot_ca", "compile.enabled=true", "compile.backend=aot_eager", "compile.autograd=true")
    assert len(eager) == len(compiled) == len(ca) == 15
    # aot_eager runs the same ATen kernels as eager: observed bitwise-equal losses (torch 2.13, CPU)
    assert compiled == eager
    assert ca == eager
    assert counters["stats"]["unique_graphs"] == 3  # forward (train), forward (eval), compiled-autograd backward
    assert counters["compiled_autograd"]["captures"] == 1


def test_inductor_blocks_training_matches_eager(tmp_path):
    eager, _ = _fit(tmp_path, "eager")
    torch._dynamo.reset()
    compiled, _ = _fit(tmp_path, "inductor", "compile.enabled=true", "compile.scope=blocks")
    # Inductor's C++ kernels fuse and reorder fp32 reductions (layer norm, softmax): observed max |diff|
    # 9.5e-7 over 15 steps (tiny.yaml, FAST shape); 1e-5 leaves 10x headroom and still catches a wrong kernel
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)
    # one block graph (shared by both blocks) and the head+loss graph, each with its eval (no-grad) variant
    assert counters["stats"]["unique_graphs"] == 4


def test_compiled_run_resumes_from_eager_checkpoint_and_back(tmp_path):
    """Checkpoint keys carry no `_orig_mod.`: eager -> compiled -> eager resumes work and agree with a straight run."""
    run, straight = tmp_path / "run", tmp_path / "straight"
    base = [*FAST, "train.steps=10", "log.every=1"]
    aot = ["compile.enabled=true", "compile.backend=aot_eager"]

    def fit(run_dir, *extra, resume=None):
        Trainer(load_config(ROOT / "configs/tiny.yaml", [*base, f"run.dir={run_dir}", *extra]), resume=resume).fit()

    fit(run, "train.stop_at=4")
    keys = set(torch.load(run / "checkpoints/step_000004/model.pt", weights_only=True))
    assert not any("_orig_mod" in k for k in keys)
    fit(run, "train.stop_at=8", *aot, resume="last")
    assert set(torch.load(run / "checkpoints/step_000008/model.pt", weights_only=True)) == keys
    torch._dynamo.reset()
    fit(run, resume="last")
    fit(straight)

    assert losses(run) == losses(straight)  # aot_eager is bitwise-equal to eager on CPU (see above)


PLANTED = """
import torch, torch.nn as nn


class M(nn.Module):
    def __init__(self, vocab=256):
        super().__init__()
        self.emb, self.a, self.out = nn.Embedding(vocab, 16), nn.Linear(16, 16), nn.Linear(16, vocab)

    def forward(self, idx, targets):
        h = torch.relu(self.a(self.emb(idx)))
        print("planted graph break")
        return nn.functional.cross_entropy(self.out(h).flatten(0, 1), targets.flatten())


def make():
    return M()
"""


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """PLANTED as the module ``planted_model`` in ``tmp_path``, importable by model.target in this process."""
    (tmp_path / "planted_model.py").write_text(PLANTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "planted_model", raising=False)  # another test's, from its own directory
    yield tmp_path / "planted_model.py"
    sys.modules.pop("planted_model", None)


def test_explain_names_the_planted_break_and_writes_the_report(tmp_path, planted, capsys):
    line = PLANTED.splitlines().index('        print("planted graph break")') + 1
    r = cli(capsys, "explain", "configs/tiny.yaml", "model.preset=null", "model.target=planted_model:make",
            "compile.backend=aot_eager", "data.seq_len=16", "train.micro_batch_size=2", "--steps", "2")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"{planted}:{line}" in r.stdout, r.stdout
    assert "Graph breaks: 1" in r.stdout and "print" in r.stdout
    assert "plan: what each auto became" in r.stdout and "  optim.impl=auto: foreach" in r.stdout, r.stdout
    # `fit` writes the same report into the run directory
    run = tmp_path / "run"
    torch._dynamo.reset()
    r = cli(capsys, "fit", "configs/tiny.yaml", *FAST, "model.preset=null", "model.target=planted_model:make",
            "compile.enabled=true", "compile.backend=aot_eager", "train.steps=3", f"run.dir={run}")  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads((run / "compile_report.json").read_text())
    assert report["graph_breaks"][0]["line"] == line
    assert report["recompiles_after_warmup"] == 0


def test_compile_failure_stops_or_falls_back(tmp_path, planted, capsys):
    base = ["fit", "configs/tiny.yaml", *FAST, "train.steps=3", "compile.enabled=true", "compile.backend=aot_eager",
            "compile.fullgraph=true", "model.preset=null", "model.target=planted_model:make"]  # fmt: skip
    r = cli(capsys, *base, f"run.dir={tmp_path / 'a'}")  # fullgraph + a graph break: a compile failure
    assert r.returncode == 1 and "compile.fallback=eager" in r.stderr and "Traceback" not in r.stderr, r.stderr
    torch._dynamo.reset()
    r = cli(capsys, *base, f"run.dir={tmp_path / 'b'}", "compile.fallback=eager")
    assert r.returncode == 0, r.stderr
    assert "compile failed; compile.fallback=eager" in r.stderr and "running this run eagerly" in r.stderr
    assert "done: 3 steps" in r.stdout


def test_inductor_options_combine_mode_defaults_and_the_users(monkeypatch):
    """compile.inductor_options reach torch.compile (as options=, with compile.mode's options and the trainer's
    measured defaults under them), also through the DDP splitter's inner compiler; bad keys are config errors."""
    import dataclasses
    import functools

    from trainer.compile.capture import (
        DEFAULT_INDUCTOR_OPTIONS,
        compile_kwargs,
        flat_options,
        inductor_option_names,
        inner_backend,
    )
    from trainer.config import ConfigError

    assert set(DEFAULT_INDUCTOR_OPTIONS) <= inductor_option_names()  # pinned: a torch that renames them fails here
    kw = compile_kwargs("inductor", "default", False, False)
    assert kw["options"] == DEFAULT_INDUCTOR_OPTIONS and "mode" not in kw
    kw = compile_kwargs("inductor", "max-autotune-no-cudagraphs", False, False, {"triton.mix_order_reduction": True})
    assert kw["options"]["max_autotune"] is True and kw["options"]["triton.mix_order_reduction"] is True
    assert "options" not in compile_kwargs("aot_eager", "default", False, False)
    with pytest.raises(ValueError, match="inductor_options"):
        compile_kwargs("aot_eager", "default", False, False, {"max_autotune": True})
    patched = inner_backend("inductor", "default", {"triton": {"cudagraphs": False}})  # nested, as a CLI key gives
    assert isinstance(patched, functools.partial)
    assert patched.keywords["config_patches"] == {**DEFAULT_INDUCTOR_OPTIONS, "triton.cudagraphs": False}

    overrides = ["compile.enabled=true", "compile.inductor_options.max_autotune=true"]
    cfg = load_config(ROOT / "configs/tiny.yaml", overrides)
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda model, **kw: seen.update(kw) or model)
    scoped = dataclasses.replace(cfg.compile, scope="model")  # as the plan resolves auto on the CPU
    apply_compile(build_model(preset="tiny", vocab_size=64, seq_len=16), scoped, say=lambda m: None)
    assert seen["options"] == {**DEFAULT_INDUCTOR_OPTIONS, "max_autotune": True}
    # The error names the override that set an option (a key below compile.inductor_options), not the YAML.
    with pytest.raises(ConfigError, match=r"\(got 'aot_eager'\) \(from override 'compile.inductor_options.max_aut"):
        load_config(ROOT / "configs/tiny.yaml", ["compile.backend=aot_eager", *overrides[1:]])
    with pytest.raises(ConfigError, match="did you mean 'max_autotune'"):
        load_config(ROOT / "configs/tiny.yaml", ["compile.inductor_options.max_autotun=true"])
    # A wrong type is refused here, not only by torch.compile (the splitter's compile_fx would take it silently).
    with pytest.raises(ConfigError, match="max_autotune: expected a bool, got 1"):
        load_config(ROOT / "configs/tiny.yaml", ["compile.inductor_options.max_autotune=1"])
    # Our CUDA graph cannot hold Inductor's, whether compile.mode or an option asks for them.
    graphed = ["compile.enabled=true", "compile.cudagraphs=true"]
    with pytest.raises(ConfigError, match="cannot nest"):
        load_config(ROOT / "configs/tiny.yaml", [*graphed, "compile.inductor_options.triton.cudagraphs=true"])
    load_config(ROOT / "configs/tiny.yaml", [*graphed, "compile.mode=reduce-overhead",
                                             "compile.inductor_options.triton.cudagraphs=false"])  # fmt: skip
    if "aot_inductor.metadata" in inductor_option_names():  # an option whose value is a dict, below a prefix
        assert flat_options({"aot_inductor": {"metadata": {"a": "1"}}}) == {"aot_inductor.metadata": {"a": "1"}}


def test_kernel_ops_are_registered_as_inductor_fallbacks_up_front():
    """Pins the Inductor internals register_kernel_fallbacks uses (torch 2.11 hangs compiling gpt2-small with
    our add_layer_norm in every block without it); where they move, it registers nothing and this fails."""
    from torch._inductor.lowering import lowerings

    from trainer.compile.capture import KERNEL_OPS, compile_kwargs, register_kernel_fallbacks

    compile_kwargs("inductor", "default", True, None)  # every Inductor compile registers them
    assert all(getattr(torch.ops.trainer, name).default in lowerings for name in KERNEL_OPS)
    assert register_kernel_fallbacks() == []  # once
