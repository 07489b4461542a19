"""The package's shape: no import cycles, the kernels layered, the fit loop short enough to read top to bottom."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trainer"

# trainer/compile/kernels/runtime.py's docstring: a module imports only from the layers above its own.
KERNEL_LAYERS = {
    "runtime": 1,
    "grad_norm": 1,
    "rows": 1,
    "adamw": 2,
    "sgd": 2,
    "grad_table": 2,
    "add_layer_norm": 2,
    "add_rms_norm": 2,
    "linear_cross_entropy": 2,
    "flat_group": 3,
    "flat": 3,
    "optimizers": 3,
}


def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        name = ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        out[name] = f
    return out


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``path`` imports anywhere in it (function-level imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        found.update(n for n in names if n in known)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: {t for t in _imports(f, mods) if t != m and not m.startswith(t + ".")} for m, f in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the list of modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return path[path.index(t) :] + [t]
            if t not in state and (found := visit(t)):
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycles():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_kernels_import_only_from_the_layers_above():
    prefix = "trainer.compile.kernels."
    graph = _graph()
    names = {m.removeprefix(prefix) for m in graph if m.startswith(prefix)}
    assert names == set(KERNEL_LAYERS), "a kernel module without a layer: add it to runtime.py's docstring and here"
    for name in names:
        for target in graph[prefix + name]:
            if target.startswith(prefix):
                other = target.removeprefix(prefix)
                layer = KERNEL_LAYERS[name]
                assert KERNEL_LAYERS[other] <= layer, f"{name} (layer {layer}) imports {other}"


def test_the_fit_loop_reads_top_to_bottom():
    """loop.py fits on a few screens, and no function nested in it or in step.py runs past ~20 lines."""
    loop = PACKAGE / "loop.py"
    assert len(loop.read_text().splitlines()) <= 150
    for path in (loop, PACKAGE / "step.py"):
        for outer in ast.walk(ast.parse(path.read_text())):
            if not isinstance(outer, ast.FunctionDef):
                continue
            for inner in ast.walk(outer):
                if inner is not outer and isinstance(inner, ast.FunctionDef):
                    length = inner.end_lineno - inner.lineno + 1
                    assert length <= 22, f"{path.name}: {outer.name}.{inner.name} is {length} lines"


def test_models_import_nothing_above_them():
    """trainer/models/ (the models, their blocks, checkpointing's wrapper, the meta-device check) is the bottom of
    the package: it imports nothing of compile/, distributed/ or the run's modules, only the shipped files' lookup."""
    allowed = {"trainer.shipped"}
    for module, targets in _graph().items():
        if module == "trainer.models" or module.startswith("trainer.models."):
            above = {t for t in targets if not t.startswith("trainer.models")} - allowed
            assert not above, f"{module} imports {sorted(above)}"
