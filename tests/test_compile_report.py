"""The compile report: graphs, graph breaks with their source line, recompiles and the limit, caches, dumped code.

These tests also pin the torch internals report.py reads (CompilationMetrics fields, the graph_breaks artifact
loggers' message format, Dynamo's compile-start callbacks, counters) so a torch upgrade that moves them fails here.
All use backend="aot_eager" except the one Inductor test (C++ on CPU, ~10 s on a cold cache).
"""

import inspect
import json
import logging
import os

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from trainer.compile.debug import compile_error_hint, dump_code
from trainer.compile.report import CompileWatcher, RecompileLimitError, format_text


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _line_of(obj, marker: str) -> int:
    """The line number of the first source line of ``obj`` containing ``marker``."""
    lines, start = inspect.getsourcelines(obj)
    return start + next(i for i, line in enumerate(lines) if marker in line)


class Broken(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 1)

    def forward(self, x):
        h = self.a(x).relu()
        torch._dynamo.graph_break()  # planted break
        return self.b(h).sum()


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x, scale=1.0):
        return (self.a(x) * scale).sum()


def test_graph_break_has_reason_and_user_source_line(tmp_path, capfd):
    model = Broken()
    compiled = torch.compile(model, backend="aot_eager", dynamic=False)
    breaks_before = sum(counters["graph_break"].values())
    with CompileWatcher() as watcher:
        compiled(torch.randn(4, 8)).backward()
    report = watcher.report()

    (brk,) = report["graph_breaks"]
    assert brk["file"] == __file__
    assert brk["line"] == _line_of(Broken.forward, "# planted break")
    assert brk["code"] == "torch._dynamo.graph_break()  # planted break"
    assert "torch._dynamo.graph_break()" in brk["reason"]
    assert brk["count"] == 1
    # Dynamo's own tally agrees with what the log capture found.
    assert report["graph_break_count"] == sum(counters["graph_break"].values()) - breaks_before == 1

    graphs = report["graphs"]
    assert graphs["forward"] == 2  # one break: the graph before it and the resume function's graph
    assert graphs["aot_backward"] == 2  # each forward graph has a backward, compiled lazily at .backward()
    assert graphs["compiled_autograd"] == 0
    assert graphs["dynamo_graphs"] == 2  # counters["stats"]["unique_graphs"]
    assert graphs["forward_ops"] > 0
    assert report["recompiles"] == [] and report["not_compiled"] == []

    t = report["compile_time_s"]
    assert t["dynamo"] > 0 and t["aot_autograd"] > 0
    assert t["inductor"] == 0 and t["inductor_codegen"] == 0  # aot_eager runs no Inductor
    # The phases split the total (6 decimals each, rounding error < 1e-5).
    assert abs(sum(t[p] for p in ("dynamo", "aot_autograd", "inductor", "inductor_codegen")) - t["total"]) < 1e-5
    assert set(report["cache"]) >= {"fxgraph_cache_hit", "fxgraph_cache_miss", "autograd_cache_hit"}

    # The watcher captured the break without torch printing it (unless TORCH_LOGS asks), and put the loggers back.
    if "TORCH_LOGS" not in os.environ:
        assert "Graph break" not in capfd.readouterr().err
    assert all(not lg.handlers for lg in _graph_break_loggers())

    path = watcher.write(tmp_path / "compile_report.json")
    assert json.loads(path.read_text()) == json.loads(json.dumps(report))
    text = format_text(report)
    assert f"{__file__}:{brk['line']}" in text
    assert "torch._dynamo.graph_break()" in text


def _graph_break_loggers():
    from torch._logging._internal import log_registry

    return [logging.getLogger(q) for q in log_registry.artifact_log_qnames if q.endswith(".__graph_breaks")]


def test_recompile_after_warmup_warns_then_exceeding_the_limit_raises():
    compiled = torch.compile(Small(), backend="aot_eager", dynamic=False)  # dynamic=False: every new shape recompiles
    warned = []
    with CompileWatcher(max_recompiles=1, on_recompile=warned.append) as watcher:
        compiled(torch.randn(2, 4)).backward()
        watcher.check(0)
        compiled(torch.randn(3, 4)).backward()  # a recompile during warm-up: reported, not warned
        watcher.check(1)
        watcher.mark_warm()
        compiled(torch.randn(3, 4)).backward()  # cached: nothing new
        watcher.check(2)
        assert warned == []
        compiled(torch.randn(4, 4)).backward()  # 1st after warm-up: allowed, warned
        watcher.check(3)
        assert len(warned) == 1
        assert "size mismatch at index 0" in warned[0]["reason"]
        assert warned[0]["step"] == 3 and warned[0]["function"] == "forward"
        compiled(torch.randn(5, 4)).backward()  # 2nd: over the limit
        with pytest.raises(RecompileLimitError, match=r"compile\.max_recompiles=1") as err:
            watcher.check(4)
    assert "size mismatch" in str(err.value)
    assert isinstance(err.value, RuntimeError)
    report = watcher.report()
    assert [r["after_warmup"] for r in report["recompiles"]] == [False, True, True]
    assert report["recompiles_after_warmup"] == 2
    assert "expected 4, actual 5" in format_text(report)


def test_python_float_recompiles_but_tensor_lr_does_not():
    def scaled(x, lr):
        return (x * lr).sum()

    warned = []
    f = torch.compile(scaled, backend="aot_eager", dynamic=False)
    x = torch.randn(4)
    with CompileWatcher(max_recompiles=10, on_recompile=warned.append) as watcher:
        lr = torch.tensor(1e-3)
        f(x, lr)
        watcher.mark_warm()
        for value in (2e-3, 3e-3):  # an LR scheduler writing into a tensor LR
            lr.fill_(value)
            f(x, lr)
            watcher.check()
        f(x, torch.tensor(5e-3))  # a new tensor of the same shape, dtype and device
        watcher.check()
        assert warned == [] and watcher.report()["recompiles"] == []

        f(x, 0.1)  # a Python float: Dynamo specialises on its value
        f(x, 0.2)
        watcher.check()
    assert len(warned) == 2
    tensor_to_float, float_changed = warned
    assert "tensor" in tensor_to_float["reason"]  # "expected type of 'lr' to be a tensor type, ..."
    assert float_changed["reason"] == "lr == 0.1"  # the guard that failed: the value compiled for
    assert float_changed["user_where"] == f"{__file__}:{_line_of(scaled, 'x * lr')}"  # the line that read lr
    assert "pass it as a tensor" in format_text(watcher.report())


def test_expected_compiles_after_warmup_are_reported_not_counted():
    model = Small()
    compiled = torch.compile(model, backend="aot_eager", dynamic=False)
    warned = []
    with CompileWatcher(max_recompiles=0, on_recompile=warned.append) as watcher:
        compiled(torch.randn(2, 4)).backward()
        watcher.mark_warm()
        with watcher.expect_compiles(), torch.no_grad():  # the first evaluation
            model.eval()
            compiled(torch.randn(2, 4))
            model.train()
        watcher.check()  # max_recompiles=0, yet no error
    (rec,) = watcher.report()["recompiles"]
    assert rec["after_warmup"] and rec["expected"]
    assert warned == [] and watcher.recompiles_after_warmup == 0


def test_collects_every_compile_past_torchs_metrics_limit():
    # get_compilation_metrics() keeps only the last 64 (here 2); the watcher collects at each compile's start.
    from torch._dynamo.utils import set_compilation_metrics_limit

    # One code object, five values of i: with dynamic=False each is a compile of its own.
    fns = [torch.compile(lambda x, i=i: x + i, backend="eager", dynamic=False) for i in range(5)]
    set_compilation_metrics_limit(2)
    try:
        with CompileWatcher() as watcher:
            for fn in fns:
                fn(torch.ones(2))
        assert watcher.report()["graphs"]["forward"] == 5
    finally:
        set_compilation_metrics_limit(64)


def test_compiled_autograd_backward_graphs_and_captures():
    from torch._dynamo import compiled_autograd

    model = Small()
    compiled = torch.compile(model, backend="aot_eager", dynamic=False)
    with CompileWatcher() as watcher:
        for _ in range(2):
            with compiled_autograd._enable(torch.compile(backend="aot_eager", dynamic=False)):
                compiled(torch.randn(2, 4)).backward()
            model.zero_grad(set_to_none=True)
    report = watcher.report()
    assert report["compiled_autograd_captures"] == 1  # the second backward reuses the captured graph
    assert report["graphs"]["compiled_autograd"] == 1
    assert report["graphs"]["aot_backward"] == 0  # compiled autograd traces the AOT backward into its own graph
    assert report["graphs"]["forward"] == 1


def test_dump_code_writes_inductor_code_per_graph_and_cache_counters(tmp_path):
    def fn(x):
        return (x.sin() * 2).sum()

    x = torch.randn(8, requires_grad=True)
    with CompileWatcher() as watcher, dump_code(tmp_path / "first") as files:
        torch.compile(fn, backend="inductor")(x).backward()
    names = sorted(p.name for p in files)
    assert names == ["graph_000_0-0_forward.py", "graph_001_0-0_backward.py"]
    forward = (tmp_path / "first" / names[0]).read_text()
    assert "def call(" in forward and "cpp_fused" in forward  # Inductor's wrapper with its C++ kernel (CPU)
    report = watcher.report()
    assert report["graphs"]["forward"] == 1
    cache = report["cache"]
    assert cache["fxgraph_cache_hit"] + cache["fxgraph_cache_miss"] == 2  # forward and backward looked up

    # Compiled again from scratch: now both come from the caches, and are still dumped.
    torch._dynamo.reset()
    with CompileWatcher() as watcher, dump_code(tmp_path / "again") as files:
        torch.compile(fn, backend="inductor")(x).backward()
    cache = watcher.report()["cache"]
    assert cache["fxgraph_cache_hit"] == 2 and cache["autograd_cache_hit"] == 1
    assert sorted(p.name for p in files) == names


def test_compile_error_hint_names_the_minifier_and_logs(monkeypatch):
    def broken_backend(gm, example_inputs):
        raise RuntimeError("backend exploded")

    with pytest.raises(Exception) as err:
        torch.compile(lambda x: x.sin(), backend=broken_backend)(torch.randn(2))
    hint = compile_error_hint(err.value)
    assert type(err.value).__name__ == "BackendCompilerFailed"
    assert "backend exploded" in hint
    assert "TORCHDYNAMO_REPRO_AFTER=dynamo" in hint and "minifier_launcher.py" in hint  # not Inductor: "dynamo"
    assert "TORCH_TRACE" in hint and "tlparse" in hint

    with pytest.raises(Exception) as err:  # a graph break under fullgraph=True: Dynamo fails, no graph to minify
        torch.compile(Broken(), backend="aot_eager", fullgraph=True)(torch.randn(2, 8))
    hint = compile_error_hint(err.value)
    assert type(err.value).__name__ == "Unsupported"
    assert "compile.fullgraph=false" in hint and "TORCH_LOGS" in hint
    assert "REPRO_AFTER" not in hint

    # Inductor failing on a graph (here its code generation): minify after AOTAutograd.
    from torch._inductor.graph import GraphLowering

    def fail_codegen(self):
        raise RuntimeError("codegen exploded")

    monkeypatch.setattr(GraphLowering, "compile_to_module", fail_codegen)
    with pytest.raises(Exception) as err:
        torch.compile(lambda x: x.cos() + 3, backend="inductor")(torch.randn(4))
    assert type(err.value).__name__ == "InductorError"
    assert "TORCHDYNAMO_REPRO_AFTER=aot" in compile_error_hint(err.value)
