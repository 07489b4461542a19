"""The compile report of a run: graphs, graph breaks, recompiles, compile time, caches, generated code.

``CompileWatcher`` observes torch.compile while a run trains, without owning the ``torch.compile`` call::

    watcher = CompileWatcher(max_recompiles=cfg.compile.max_recompiles, on_recompile=lambda r: log(r["message"]))
    with watcher:                               # before the first compiled call
        for step in range(start, steps):
            train_step()                        # every micro-batch's forward and backward, the optimizer step
            if step == start:                   # warm-up: the first full step (also after a resume)
                watcher.mark_warm()
            if evaluating and first_eval:
                with watcher.expect_compiles():  # eval()/no_grad recompile once: expected
                    evaluate()
            watcher.check(step)                 # on_recompile per new recompile; RecompileLimitError past the limit
    watcher.write(run_dir / "compile_report.json")   # also when the run stops on an error
    print(format_text(watcher.report()))

Where the facts come from (checked against torch 2.11 and 2.13; ``tests/test_compile_report.py`` pins them):

- graphs, recompile reasons and compile time by phase: ``torch._dynamo.utils.get_compilation_metrics()``, one
  ``CompilationMetrics`` per Dynamo frame compile (``is_forward=True``; compile ids ``!N/...`` are compiled-autograd
  graphs) and per lazily compiled AOTAutograd backward (``is_forward=False``). It keeps only the last 64, so the watcher
  collects new ones at the start of every compile (``torch._dynamo.callback_handler``) and at every ``check``.
- graph breaks with the user's file and line: the ``graph_breaks`` artifact loggers, which Dynamo writes to whenever
  they are enabled for DEBUG (unlike ``recompiles``, which needs ``TORCH_LOGS``). The watcher enables them with its own
  handler and turns propagation off, so nothing is printed unless the user asked for ``TORCH_LOGS=graph_breaks``.
- caches and compiled autograd: ``torch._dynamo.utils.counters``, as differences from when the watcher started.

``torch._dynamo.reset()`` drops compile callbacks; ``check`` installs the watcher's again.
"""

from __future__ import annotations

import contextlib
import json
import linecache
import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

CACHE_COUNTERS = {
    "inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
    "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass", "autograd_cache_guard_miss"),
}
PHASES = ("dynamo", "aot_autograd", "inductor", "inductor_codegen")


class RecompileLimitError(RuntimeError):
    """More recompiles after warm-up than ``compile.max_recompiles`` allows."""


def _artifact_loggers(artifact: str) -> list[logging.Logger]:
    """The loggers torch registered for ``artifact`` (``<module>.__<artifact>``) in the modules imported so far."""
    from torch._logging._internal import log_registry

    return [logging.getLogger(q) for q in sorted(log_registry.artifact_log_qnames) if q.endswith(f".__{artifact}")]


class _Capture(logging.Handler):
    """Routes the DEBUG records of one torch artifact to ``fn`` without torch printing them (unless TORCH_LOGS asks)."""

    def __init__(self, artifact: str, fn: Callable[[logging.LogRecord], None]):
        super().__init__(level=logging.DEBUG)
        self.artifact, self.fn, self.saved = artifact, fn, {}

    def emit(self, record: logging.LogRecord) -> None:
        self.fn(record)

    def attach(self) -> None:
        from torch._logging._internal import log_state

        user_asked = log_state.is_artifact_enabled(self.artifact)
        for lg in _artifact_loggers(self.artifact):
            self.saved.setdefault(lg.name, (lg.level, lg.propagate))
            lg.setLevel(logging.DEBUG)
            lg.propagate = user_asked
            if self not in lg.handlers:
                lg.addHandler(self)

    def detach(self) -> None:
        for name, (level, propagate) in self.saved.items():
            lg = logging.getLogger(name)
            lg.removeHandler(self)
            lg.setLevel(level)
            lg.propagate = propagate
        self.saved.clear()


_BREAK_AT = re.compile(
    r"Graph break (?:\(user stack suppressed due to duplicate graph break\) )?in user code at (.+):(\d+)\n"
)
_REASON = re.compile(
    r"Graph Break Reason: (.*?)(?:\n\n(?:Stack variable source attribution|User code traceback):|\Z)", re.S
)
_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')
_ENCOUNTERED = re.compile(r"^Encountered graph break when attempting to trace [^\n]*\n+")


def _user_frame(text: str) -> tuple[str | None, int | None]:
    """The last ``File "...", line N`` in a formatted stack that is not inside torch."""
    import torch

    torch_dir = os.path.dirname(torch.__file__)
    frames = [(f, int(n)) for f, n in _FILE_LINE.findall(text) if not f.startswith(torch_dir)]
    return frames[-1] if frames else (None, None)


def _parse_graph_break(record: logging.LogRecord) -> dict[str, Any]:
    """``{reason, detail, file, line}`` from one ``graph_breaks`` record (formats of torch 2.11 and 2.13)."""
    msg = record.getMessage()
    at, why = _BREAK_AT.search(msg), _REASON.search(msg)
    if at and why:
        file, line = at.group(1), int(at.group(2))
        detail = _ENCOUNTERED.sub("", why.group(1).strip())
    else:
        # A break Dynamo cannot resume from (it skips the whole frame), or a backend failure turned into a break:
        # the reason is the exception, the place the last user frame of the stack in the message.
        file, line = _user_frame(msg)
        exc = record.exc_info[1] if record.exc_info else None
        detail = _ENCOUNTERED.sub("", str(exc).strip()) if exc is not None else msg.strip()
        if "results in a skip" in msg:
            detail = "frame skipped (runs eagerly): " + detail
    return {"reason": _summary(detail), "detail": detail, "file": file, "line": line}


def _summary(text: str) -> str:
    """The first line of a reason, with the next one when the first only leads in ("... encountered:")."""
    lines = [s.strip() for s in text.splitlines() if s.strip()]
    if not lines:
        return "unknown"
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def _parse_recompile(text: str) -> dict[str, Any]:
    """``{reason, guard_of, user_where, user_code, detail}`` from ``CompilationMetrics.recompile_reason``.

    The text is ``"<compile id>: <failed guard>  # <source>  # <file:line> in <fn>"``, then (torch 2.11 and 2.13) a
    ``"User stack trace:"`` block whose last frame is the user line that read the value the failed guard checks.
    """
    guard_of, sep, rest = text.partition(": ")
    if not sep or not re.fullmatch(r"!?[\d/]+(?:_\d+)?", guard_of):
        guard_of, rest = None, text
    first, _, more = rest.strip().partition("\n")
    reason = first.split("  #")[0].strip() or first.strip()
    file, line = _user_frame(more) if "User stack trace" in more else (None, None)
    return {
        "reason": reason,
        "guard_of": guard_of,
        "user_where": f"{file}:{line}" if file else None,
        "user_code": linecache.getline(file, line).strip() if file else "",
        "detail": rest.strip(),
    }


def _us(value: int | None) -> float:
    return (value or 0) / 1e6


class CompileWatcher:
    """Records what torch.compile does while active: graphs, breaks, recompiles, compile time by phase, caches.

    Args:
        max_recompiles: recompiles allowed after ``mark_warm``; one more raises ``RecompileLimitError`` from ``check``.
            ``None`` means no limit.
        on_recompile: called by ``check`` with each recompile after warm-up, a dict with ``message`` (one line to log
            as a warning), ``reason`` (the failed guard, e.g. ``"lr == 0.001"`` or ``"tensor 'x' size mismatch at
            index 0. expected 4, actual 5"``), ``function``, ``where`` and ``user_where`` (``file:line`` of the
            compiled function and of the user line that read the value), ``compile_id``, ``step``.

    A recompile is a Dynamo frame compiled again because a guard failed (one per frame: a shape change in a model
    with one graph break recompiles both of its frames), or a new compiled-autograd capture. "forward" graphs are
    all graphs Dynamo captures (the model, the loss, a compiled optimizer step); "aot_backward" the backward graphs
    AOTAutograd compiles at the first ``backward()`` (not those loaded from the AOTAutograd cache with their forward);
    "compiled_autograd" the backward graphs compiled autograd captures.
    """

    def __init__(
        self, *, max_recompiles: int | None = None, on_recompile: Callable[[dict[str, Any]], None] | None = None
    ):
        self.max_recompiles = max_recompiles
        self.on_recompile = on_recompile
        self.warm = False
        self.active = False
        self._expected = 0
        self._expected_once: set[str] = set()
        self._compiles: list[dict[str, Any]] = []
        self._breaks: dict[tuple, dict[str, Any]] = {}
        self._recompiles: list[dict[str, Any]] = []
        self._pending: list[dict[str, Any]] = []  # recompiles after warm-up not yet passed to on_recompile
        self.extra: dict[str, Any] = {}  # more for the report from the run (``fp8``: the linears in float8)
        self._seen: dict[int, Any] = {}
        self._counters0: dict[tuple[str, str], int] = {}
        self._captures_seen = 0
        self._breaks_capture = _Capture("graph_breaks", self._on_graph_break)

    # -- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> CompileWatcher:
        import torch._dynamo  # noqa: F401  (registers the graph_breaks loggers of the modules that use them)
        import torch._dynamo.convert_frame  # noqa: F401
        import torch._dynamo.symbolic_convert  # noqa: F401
        from torch._dynamo.utils import counters, get_compilation_metrics

        assert not self.active, "CompileWatcher.start() called twice"
        self._seen = {id(m): m for m in get_compilation_metrics()}  # older compiles are not this run's
        self._counters0 = {(g, k): counters[g][k] for g, keys in CACHE_COUNTERS.items() for k in keys}
        self._counters0[("stats", "unique_graphs")] = counters["stats"]["unique_graphs"]
        self._counters0[("compiled_autograd", "captures")] = counters["compiled_autograd"]["captures"]
        self._captures_seen = self._counters0[("compiled_autograd", "captures")]
        self._breaks_capture.attach()
        self._install_callback()
        from trainer.compile.passes.substitute import LOG

        LOG.clear()  # this run's substitutions
        self.active = True
        return self

    def stop(self, report: str | os.PathLike | None = None) -> None:
        """Collect what is left and restore the loggers; write the report to ``report`` if given. Raises nothing:
        the limit is ``check``'s job."""
        if self.active:
            import torch._dynamo

            self._collect()
            self._breaks_capture.detach()
            with contextlib.suppress(ValueError):  # already dropped by torch._dynamo.reset()
                torch._dynamo.callback_handler.remove_start_callback(self._on_compile_start)
            self.active = False
        if report is not None:
            self.write(report)

    def __enter__(self) -> CompileWatcher:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _install_callback(self) -> None:
        import torch._dynamo

        if self._on_compile_start not in torch._dynamo.callback_handler.start_callbacks:
            torch._dynamo.callback_handler.register_start_callback(self._on_compile_start)

    def _on_compile_start(self, _args: Any) -> None:
        # Runs inside Dynamo (an exception here would fail the user's compile): only collect, never raise.
        self._collect()

    # -- warm-up and the recompile limit -------------------------------------------------------------------

    def mark_warm(self) -> None:
        """End of warm-up: from now on each recompile goes to ``on_recompile`` and counts toward the limit."""
        self._collect()
        self.warm = True

    @contextlib.contextmanager
    def expect_compiles(self) -> Iterator[None]:
        """Compiles inside are expected after warm-up (the first eval, the first step after resume): reported, not
        counted toward the limit and not passed to ``on_recompile``."""
        self._collect()
        self._expected += 1
        try:
            yield
        finally:
            self._collect()
            self._expected -= 1

    def after_step(self, step: int, first: bool) -> None:
        """Call when a training step is done: the first one ends the warm-up (:meth:`mark_warm`), later ones
        :meth:`check` the recompile limit."""
        if first:
            self.mark_warm()
        else:
            self.check(step)

    def expect_first(self, what: str):
        """:meth:`expect_compiles` the first time for ``what`` (the first evaluation compiles its eval graph), else
        nothing."""
        if what in self._expected_once:
            return contextlib.nullcontext()
        self._expected_once.add(what)
        return self.expect_compiles()

    @property
    def recompiles_after_warmup(self) -> int:
        return sum(1 for r in self._recompiles if r["after_warmup"] and not r["expected"])

    def check(self, step: int | None = None) -> None:
        """Call once per training step: passes new recompiles to ``on_recompile``, then enforces the limit.

        Raises:
            RecompileLimitError: more than ``max_recompiles`` recompiles after warm-up.
        """
        if self.active:
            self._breaks_capture.attach()  # again, in case torch._logging.set_logs() reset the loggers
            self._install_callback()  # again, in case torch._dynamo.reset() dropped it
        self._collect()
        pending, self._pending = self._pending, []
        for rec in pending:
            rec["step"] = step
            if self.on_recompile is not None:
                self.on_recompile(rec)
        n = self.recompiles_after_warmup
        if self.max_recompiles is not None and n > self.max_recompiles:
            last = [r for r in self._recompiles if r["after_warmup"] and not r["expected"]][-1]
            raise RecompileLimitError(
                f"{n} recompiles after warm-up, more than compile.max_recompiles={self.max_recompiles}. "
                f"The last one: {last['message']}. Each recompile costs a full compile; make the input that changes "
                "stay the same (see the reason), or raise compile.max_recompiles if these recompiles are expected."
            )

    # -- collection ----------------------------------------------------------------------------------------

    def _on_graph_break(self, record: logging.LogRecord) -> None:
        brk = _parse_graph_break(record)
        key = (brk["file"], brk["line"], brk["reason"])
        if key in self._breaks:
            self._breaks[key]["count"] += 1
        else:
            code = linecache.getline(brk["file"], brk["line"]).strip() if brk["file"] else ""
            self._breaks[key] = {**brk, "code": code, "count": 1}

    def _collect(self) -> None:
        from torch._dynamo.utils import counters, get_compilation_metrics

        current = get_compilation_metrics()
        new = [m for m in current if id(m) not in self._seen]
        # Holding every object still in torch's deque keeps its id from being reused by a new one.
        self._seen = {id(m): m for m in current}
        for m in new:
            self._add_compile(m)
        captures = counters["compiled_autograd"]["captures"]
        for _ in range(max(0, captures - self._captures_seen)):
            if self.warm:
                self._add_recompile(
                    {
                        "compile_id": None,
                        "function": "backward (compiled autograd)",
                        "where": None,
                        "reason": "compiled autograd captured a new backward graph (a new autograd node or changed "
                        "shapes; TORCH_LOGS=compiled_autograd_verbose says which)",
                    }
                )
        self._captures_seen = max(self._captures_seen, captures)

    def _add_compile(self, m: Any) -> None:
        # getattr: this runs inside Dynamo's compile, where a field a future torch renames must not fail the compile
        # (the tests pin every field read here, so a rename shows up there).
        def get(name: str) -> Any:
            return getattr(m, name, None)

        cid = get("compile_id") or ""
        if get("is_forward") is False:
            kind = "aot_backward"
            total = _us(get("backward_cumulative_compile_time_us"))
            backend = total
        else:
            kind = "compiled_autograd" if cid.startswith("!") else "forward"
            total = _us(get("dynamo_cumulative_compile_time_us"))
            backend = _us(get("aot_autograd_cumulative_compile_time_us"))  # the backend call: AOTAutograd + Inductor
        inductor = _us(get("inductor_cumulative_compile_time_us"))
        codegen = _us(get("inductor_code_gen_cumulative_compile_time_us"))
        where = f"{get('co_filename')}:{get('co_firstlineno')}" if get("co_filename") else None
        fail = get("fail_type")
        self._compiles.append(
            {
                "compile_id": cid,
                "kind": kind,
                "function": get("co_name"),
                "where": where,
                "ops": get("graph_op_count"),
                "compile_time_s": round(total, 6),
                "phases_s": {
                    "dynamo": max(0.0, total - backend),
                    "aot_autograd": max(0.0, backend - inductor),
                    "inductor": max(0.0, inductor - codegen),
                    "inductor_codegen": codegen,
                },
                "failed": f"{fail}: {get('fail_reason')}" if fail else None,
            }
        )
        if get("recompile_reason") and kind != "aot_backward":
            self._add_recompile(
                {"compile_id": cid, "function": get("co_name"), "where": where, **_parse_recompile(m.recompile_reason)}
            )

    def _add_recompile(self, rec: dict[str, Any]) -> None:
        rec.update(after_warmup=self.warm, expected=self._expected > 0, step=None)
        rec["message"] = (
            f"recompiled {rec['function']}"
            + (f" ({rec['where']})" if rec["where"] else "")
            + f": {rec['reason']}"
            + (f", read at {rec['user_where']}" if rec.get("user_where") else "")
        )
        self._recompiles.append(rec)
        if self.warm and not rec["expected"]:
            self._pending.append(rec)

    # -- the report ----------------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """The report as a JSON-serialisable dict (``format_text`` renders it)."""
        import torch
        from torch._dynamo.utils import counters

        if self.active:
            self._collect()

        def delta(group: str, key: str) -> int:
            now, then = counters[group][key], self._counters0.get((group, key), 0)
            return now - then if now >= then else now  # counters were cleared (torch._dynamo.reset())

        graphs = [c for c in self._compiles if c["failed"] is None and (c["kind"] == "aot_backward" or c["ops"])]
        count = {k: sum(1 for c in graphs if c["kind"] == k) for k in ("forward", "aot_backward", "compiled_autograd")}
        phases = {p: round(sum(c["phases_s"][p] for c in self._compiles), 6) for p in PHASES}
        breaks = sorted(self._breaks.values(), key=lambda b: (b["file"] or "", b["line"] or 0))
        from trainer.compile.passes.substitute import LOG
        from trainer.ops import warm

        return {
            "torch_version": torch.__version__,
            "graphs": {
                **count,
                "dynamo_graphs": delta("stats", "unique_graphs"),
                "forward_ops": sum(c["ops"] or 0 for c in graphs if c["kind"] == "forward"),
                "compiles": self._compiles,
            },
            "graph_breaks": breaks,
            "graph_break_count": sum(b["count"] for b in breaks),
            "recompiles": self._recompiles,
            "recompiles_after_warmup": self.recompiles_after_warmup,
            "max_recompiles": self.max_recompiles,
            "compile_time_s": {**phases, "total": round(sum(c["compile_time_s"] for c in self._compiles), 6)},
            "cache": {k: delta(g, k) for g, keys in CACHE_COUNTERS.items() for k in keys},
            "compiled_autograd_captures": delta("compiled_autograd", "captures"),
            # The kernels substituted into the graphs (trainer/compile/passes/), and the near-misses left alone.
            "kernels": LOG.report(),
            "kernel_near_misses": [{"name": n, "source": src, "reason": r} for n, src, r in LOG.near_misses],
            # trainer's kernels compiled in a second process while the model compiled (trainer/ops/warm.py)
            "kernels_compiled_beside": warm.last,
            # Frames Dynamo gave up on (a break it cannot resume from, or an error suppressed): they run eagerly.
            "not_compiled": [
                {k: c[k] for k in ("compile_id", "function", "where")} | {"error": c["failed"]}
                for c in self._compiles
                if c["failed"]
            ],
            **self.extra,
        }

    def write(self, path: str | os.PathLike) -> Path:
        """Write ``report()`` as JSON to ``path`` (the run's ``compile_report.json``); returns the path."""
        from trainer.io import atomic_write_text

        return atomic_write_text(path, json.dumps(self.report(), indent=2, default=str) + "\n")


_ADVICE = (
    (
        "size mismatch",
        "a tensor's shape changed: keep shapes fixed (full batches, fixed seq_len) or compile.dynamic=true",
    ),
    (" == ", "a Python value the graph specialised on changed: pass it as a tensor (e.g. the learning rate)"),
    ("training", "a module switched between train() and eval(): expected once, at the first evaluation"),
    ("grad_mode", "grad mode changed (torch.no_grad): expected once, at the first evaluation"),
)


def _advice(reason: str) -> str | None:
    return next((text for needle, text in _ADVICE if needle in reason), None)


def format_text(report: dict[str, Any], verbose: bool = False) -> str:
    """A summary of ``report`` a user can act on: each graph break with its reason and source line, each recompile,
    each kernel substituted (``verbose``: also each near-miss left alone, and why)."""
    g, t, c = report["graphs"], report["compile_time_s"], report["cache"]
    lines = [
        f"Compile report (torch {report['torch_version']})",
        f"Graphs: {g['forward']} forward ({g['forward_ops']} ops), {g['aot_backward']} AOTAutograd backward, "
        f"{g['compiled_autograd']} compiled-autograd backward; compiled autograd captures: "
        f"{report['compiled_autograd_captures']}",
        f"Compile time: {t['total']:.1f} s (Dynamo {t['dynamo']:.1f} s, AOTAutograd {t['aot_autograd']:.1f} s, "
        f"Inductor {t['inductor']:.1f} s + codegen {t['inductor_codegen']:.1f} s)",
        f"Caches: FX graph {c['fxgraph_cache_hit']} hit / {c['fxgraph_cache_miss']} miss, "
        f"AOTAutograd {c['autograd_cache_hit']} hit / {c['autograd_cache_miss']} miss",
    ]
    breaks = report["graph_breaks"]
    lines.append(
        f"Graph breaks: {len(breaks)}" + (" (each one splits a graph; remove them for one graph)" if breaks else "")
    )
    for i, b in enumerate(breaks, 1):
        where = f"{b['file']}:{b['line']}" if b["file"] else "(source line unknown)"
        lines.append(f"  {i}. {where}" + (f"  ({b['count']} compiles)" if b["count"] > 1 else ""))
        if b.get("code"):
            lines.append(f"       {b['code']}")
        lines.append(f"     {b['reason']}")
        lines += [
            f"     {s.strip()}" for s in b["detail"].splitlines()[1:] if s.strip().startswith(("Explanation", "Hint"))
        ]
    recs = report["recompiles"]
    limit = report["max_recompiles"]
    expected = sum(1 for r in recs if r["after_warmup"] and r["expected"])
    counts = [f"{len(recs) - expected - report['recompiles_after_warmup']} in warm-up"]
    counts += [f"{expected} expected after it (a first evaluation, a resume)"] if expected else []
    counts += [f"{report['recompiles_after_warmup']} unexpected after it"]
    counts += [f"limit compile.max_recompiles={limit}"] if limit is not None else []
    lines.append(f"Recompiles: {len(recs)} ({', '.join(counts)})")
    for r in recs:
        when = (" after warm-up" + (", expected" if r["expected"] else "")) if r["after_warmup"] else " in warm-up"
        step = f", step {r['step']}" if r.get("step") is not None else ""
        lines.append(f"  - {r['function']}" + (f" ({r['where']})" if r["where"] else "") + f"{when}{step}")
        lines.append(f"      failed guard: {r['reason'].splitlines()[0]}")
        if r.get("user_where"):
            lines.append(f"      read at {r['user_where']}" + (f": {r['user_code']}" if r.get("user_code") else ""))
        if advice := _advice(r["reason"]):
            lines.append(f"      -> {advice}")
    for f in report["not_compiled"]:
        where = f" ({f['where']})" if f["where"] else ""
        lines.append(f"Not compiled, runs eagerly: {f['function']}{where} [{f['compile_id']}]: {_summary(f['error'])}")
    lines += _kernel_lines(report.get("kernels", []), report.get("kernel_near_misses", []), verbose)
    if fp8 := report.get("fp8"):
        lines.append(
            f"fp8 ({fp8['recipe']}): {len(fp8['converted'])} linears in float8, {len(fp8['left_out'])} in bf16"
        )
        if verbose:
            lines += [f"  float8: {name}" for name in fp8["converted"]]
            lines += [f"  bf16: {x['name']} ({x['why']})" for x in fp8["left_out"]]
        else:  # one line per reason, with its first layer
            firsts: dict[str, list] = {}
            for x in fp8["left_out"]:
                firsts.setdefault(x["why"], []).append(x["name"])
            lines += [
                f"  bf16, {why}: {len(names)} ({names[0]}{', ...' if len(names) > 1 else ''})"
                for why, names in firsts.items()
            ]
    return "\n".join(lines)


def _kernel_lines(kernels: list[dict], misses: list[dict], verbose: bool) -> list[str]:
    total = sum(k["count"] for k in kernels)
    lines = [f"Kernels substituted: {total}" + ("" if total else " (compile.kernels, or no pattern matched)")]
    for k in kernels:
        lines.append(f"  {k['name']} x{k['count']}: {', '.join(k['sources']) or '(source line unknown)'}")
    if verbose:
        lines.append(f"Near-misses left alone: {len(misses)}")
        lines += [f"  {m['name']} at {m['source']}: {m['reason']}" for m in misses]
    elif misses:
        lines.append(f"Near-misses left alone: {len(misses)} (trainer explain --verbose lists them)")
    return lines
