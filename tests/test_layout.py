"""The package's shape: folders that are the architecture, imports that point down only, no import cycles, the fit
loop short enough to read top to bottom."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trainer"

LAYERS = (
    ("base", ("trainer.io", "trainer.shipped", "trainer.codec", "trainer.data", "trainer.console", "trainer.threads",
              "trainer.errors", "trainer.faults", "trainer.startup", "trainer.chat", "trainer.packing")),
    ("ops", ("trainer.ops",)),
    ("models", ("trainer.models",)),
    ("precision", ("trainer.precision",)),
    ("distributed", ("trainer.distributed",)),
    ("optim", ("trainer.optim",)),
    ("compile", ("trainer.compile",)),
    ("config", ("trainer.schema", "trainer.config")),
    ("run", ("trainer.plan", "trainer.global_batch", "trainer.step", "trainer.checkpoint", "trainer.metrics")),
    ("assembly", ("trainer.build", "trainer.model_setup", "trainer.describe", "trainer.memory")),
    ("app", ("trainer", "trainer.__main__", "trainer.loop", "trainer.cli", "trainer.tune_runs", "trainer.spare",
             "trainer.tune", "trainer.explain_memory", "trainer.sample", "trainer.prepare", "trainer.instruct",
             "trainer.sources", "trainer.plot")),
)  # fmt: skip
"""The layers, bottom first: a module imports only from its own layer and the layers below it, at module level or
inside a function alike. Why this order (docs/architecture.md has the table):

- ``optim`` sits on ``distributed``: the sharded optimizer (``optim/zero.py``) shards over ddp's bucket plan;
- ``compile`` sits on ``optim``: ``from trainer.compile import compile_optimizer`` is public;
- ``config`` sits on ``compile``: the schema checks ``compile.kernels`` against ``KERNEL_NAMES`` and the compile
  options against what the compile layer accepts, while nothing below it reads a config (plain arguments only);
- ``run`` (the plan, the step, the run directory, the checkpointed states, checkpoints, metrics), then ``assembly``
  (``build.py``, the memory model, which builds the run's pieces), then ``app`` (the fit loop, ``tune`` and the
  commands)."""

MAX_SHARE = 0.30
"""The most of the package's lines (non-empty lines of its .py files) that one subpackage may hold."""

# The Triton optimizer modules, layered within optim/: a module imports only from its own layer and those below.
OPTIM_KERNEL_LAYERS = {
    "grad_norm": 1,
    "adamw": 2,
    "sgd": 2,
    "grad_table": 2,
    "flat_group": 3,
    "flat": 3,
    "optimizers": 3,
}


def _modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package under ``root``: ``trainer.a.b`` -> its file (a package is its ``__init__.py``)."""
    out = {}
    for f in sorted((root / "trainer").rglob("*.py")):
        name = ".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        out[name] = f
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The package module that the dotted ``name`` is or lies in (``trainer.compile.passes.KERNEL_NAMES`` ->
    ``trainer.compile.passes``); None outside the package."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in known:
            return ".".join(parts[:i])
    return None


def _imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """``(target module, line)`` for each import of the package in ``path``, anywhere in it (inside functions too),
    relative imports resolved."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                package = ".".join(package.split(".")[: len(package.split(".")) - (node.level - 1)])
                base = f"{package}.{base}" if base else package
            names = [f"{base}.{a.name}" for a in node.names]  # a submodule, or a name in the module ``base``
        else:
            continue
        for name in names:
            if (target := _resolve(name, known)) is not None:
                found.append((target, node.lineno))
    return found


def _graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = _modules(root)
    return {m: {t for t, _ in _imports(m, f, mods) if t != m and not m.startswith(t + ".")} for m, f in mods.items()}


def _layer_of(module: str, layers=LAYERS) -> int | None:
    """The index in ``layers`` of the longest name that ``module`` is or lies under (``trainer`` itself: exactly)."""
    best = None
    for i, (_, names) in enumerate(layers):
        for n in names:
            if module == n or (n != "trainer" and module.startswith(n + ".")):
                if best is None or len(n) > best[1]:
                    best = (i, len(n))
    return None if best is None else best[0]


def _upward_imports(root: Path = ROOT, layers=LAYERS) -> list[str]:
    """Each import of a layer above the importing module's own, as ``file:line: module (layer) imports target
    (layer)``; and each module no layer names."""
    problems = []
    mods = _modules(root)
    for module, path in mods.items():
        own = _layer_of(module, layers)
        where = path.relative_to(root)
        if own is None:
            problems.append(f"{where}: {module} is in no layer: add it to LAYERS")
            continue
        for target, line in _imports(module, path, mods):
            up = _layer_of(target, layers)
            if up is not None and up > own:
                problems.append(
                    f"{where}:{line}: {module} ({layers[own][0]}) imports {target} ({layers[up][0]}), a layer above"
                )
    return problems


def _shares(root: Path = ROOT) -> dict[str, float]:
    """Each subpackage's (direct subdirectory of ``trainer/``) share of the package's non-empty lines of Python."""
    lines = {}
    for f in (root / "trainer").rglob("*.py"):
        parts = f.relative_to(root / "trainer").parts
        key = parts[0] if len(parts) > 1 else ""  # "": the top-level modules, not a subpackage
        lines[key] = lines.get(key, 0) + sum(1 for line in f.read_text().splitlines() if line.strip())
    total = sum(lines.values())
    return {k: n / total for k, n in lines.items() if k}


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


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_no_subpackage_holds_more_than_its_share():
    shares = _shares()
    assert {"ops", "optim", "compile", "distributed", "models"} <= set(shares)
    too_big = {k: f"{v:.0%}" for k, v in shares.items() if v > MAX_SHARE}
    assert not too_big, f"subpackages over {MAX_SHARE:.0%} of trainer/'s lines: {too_big}"


def test_the_share_check_counts_non_empty_lines(tmp_path):
    _write(tmp_path, {"trainer/__init__.py": "x = 1\n\n\n", "trainer/big/__init__.py": "a = 1\nb = 2\n\nc = 3\n"})
    assert _shares(tmp_path) == {"big": 0.75}


def test_no_module_imports_a_layer_above_its_own():
    problems = _upward_imports()
    assert not problems, "\n".join(problems)


def test_the_layer_check_finds_an_upward_import(tmp_path):
    _write(
        tmp_path,
        {
            "trainer/__init__.py": "",
            "trainer/io.py": "",
            "trainer/ops/__init__.py": "",
            "trainer/ops/kernel.py": "import torch\n\n\ndef f():\n    from trainer.compile import passes\n",
            "trainer/ops/fine.py": "from trainer import io\nfrom . import kernel\n",
            "trainer/compile/__init__.py": "",
            "trainer/compile/passes.py": "from ..ops.kernel import f\n",
            "trainer/compile/stray.py": "from ..cli import main\n",
            "trainer/cli.py": "",
        },
    )
    layers = (("base", ("trainer.io",)), ("ops", ("trainer.ops",)), ("compile", ("trainer.compile",)),
              ("app", ("trainer", "trainer.cli")))  # fmt: skip
    assert _upward_imports(tmp_path, layers) == [
        "trainer/compile/stray.py:1: trainer.compile.stray (compile) imports trainer.cli (app), a layer above",
        "trainer/ops/kernel.py:5: trainer.ops.kernel (ops) imports trainer.compile.passes (compile), a layer above",
    ]
    assert "trainer/io.py: trainer.io is in no layer: add it to LAYERS" in _upward_imports(tmp_path, layers[1:])


def test_no_import_cycles():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_optimizer_kernels_import_only_from_their_layer_and_below():
    prefix = "trainer.optim."
    graph = _graph()
    for name, layer in OPTIM_KERNEL_LAYERS.items():
        assert prefix + name in graph, f"{prefix}{name} is gone: update OPTIM_KERNEL_LAYERS"
        for target in graph[prefix + name]:
            other = target.removeprefix(prefix)
            if target.startswith(prefix):
                assert other in OPTIM_KERNEL_LAYERS, f"{name} imports {other}, which is not an optimizer kernel"
                assert OPTIM_KERNEL_LAYERS[other] <= layer, f"{name} (layer {layer}) imports {other}"


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
    """trainer/models/ (the models, their blocks, checkpointing's wrapper, the meta-device check) imports nothing of
    ops/, compile/, distributed/ or the run's modules, only the shipped files' lookup."""
    allowed = {"trainer.shipped"}
    for module, targets in _graph().items():
        if module == "trainer.models" or module.startswith("trainer.models."):
            above = {t for t in targets if not t.startswith("trainer.models")} - allowed
            assert not above, f"{module} imports {sorted(above)}"
