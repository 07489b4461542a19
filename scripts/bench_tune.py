"""``trainer tune`` against a hand grid, on one machine in one run: is tune's winner the grid's best?

1. ``trainer tune CONFIG *overrides --budget-s N`` in a child process, in a work directory of its own with an empty
   compile cache: its table, its fastest candidate, the seconds of each candidate (the first pays the compile
   cache's and the imports' cold start).
2. The grid: every ``--precisions`` x ``--grid`` point (``mode:micro-batch``), the per-rank batch of the config kept
   through ``train.grad_accum`` as tune keeps it, each run exactly as tune runs a candidate
   (:class:`trainer.tune_runs.Runner`: the same steps, timed on the GPU, the same peak), sharing tune's compile cache.

Reported: both tables, the grid's best, and tune's fastest over it (the goal: within 2%).

    python scripts/bench_tune.py                                 # llama-1b train.grad_accum=16, 300 s, on a GPU
    python scripts/bench_tune.py --config tiny --overrides train.device=cpu --budget-s 40 \\
        --precisions fp32 --grid none:2,none:4 --out /tmp/tune.json                # the script itself, on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts._meta import ROOT, git_sha  # noqa: E402

RESULT = ROOT / "scripts/results/bench_tune/result.json"
DONE = re.compile(r"^\[(\d+)\] (.*): (.+) \((\d+) s\)$")  # tune's line for a candidate that ended


def parse_tune(out: str) -> dict:
    """tune's table (rows: candidate, tok/s, peak GB, predicted GB, status) and each candidate's seconds, from its
    output."""
    rows, seconds = [], {}
    for line in out.splitlines():
        if m := DONE.match(line.strip()):
            if m.group(3) != "running":
                seconds[int(m.group(1))] = float(m.group(4))
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].isdigit():
            rows.append({"n": int(cells[0]), "candidate": cells[1], "tokens_per_s": _rate(cells[2]),
                         "peak_gb": _number(cells[3]), "predicted_gb": _number(cells[4]),
                         "status": cells[5].strip("*")})  # fmt: skip
    for row in rows:
        row["seconds"] = seconds.get(row["n"])
    return {"rows": rows, "fastest": next((r for r in rows if r["status"] == "fastest"), None)}


def _rate(cell: str) -> float | None:
    if cell in ("-", ""):
        return None
    scale = {"K": 1e3, "M": 1e6}.get(cell[-1], 1.0)
    return float(cell.rstrip("KM")) * scale


def _number(cell: str) -> float | None:
    return None if cell in ("-", "") else float(cell)


def best(points: list[dict]) -> dict | None:
    ok = [p for p in points if p.get("status") == "ok" and p.get("tokens_per_s")]
    return max(ok, key=lambda p: p["tokens_per_s"]) if ok else None


def run_tune(config: str, overrides: list[str], budget: float, work: Path) -> tuple[dict, float, str]:
    """``trainer tune`` in a child process, its work directory ``work`` (``run.dir`` beside it)."""
    cmd = [sys.executable, "-m", "trainer", "tune", config, *overrides, f"run.dir={work.with_suffix('')}",
           "--budget-s", f"{budget:g}"]  # fmt: skip
    started = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.monotonic() - started
    print(r.stdout[-4000:], r.stderr[-2000:] if r.returncode else "", sep="\n", flush=True)
    if m := re.search(r"; wrote (\S+) \(", r.stdout):  # CONFIG.tuned.yaml: kept with the runs, not beside the config
        tuned = ROOT / m.group(1)
        if tuned.is_file():
            tuned.replace(work.parent / tuned.name)
    return parse_tune(r.stdout), wall, r.stdout


def run_grid(config: str, overrides: list[str], precisions: list[str], grid: list[tuple[str, int]], work: Path,
             cache: Path) -> list[dict]:  # fmt: skip
    """Each grid point as tune runs a candidate (the config's per-rank batch kept), sharing ``cache``."""
    from trainer import tune
    from trainer.config import load_config
    from trainer.tune_runs import Runner

    cfg = load_config(config, overrides)
    if cfg.train.global_batch_size is not None:
        raise SystemExit("--overrides: set train.grad_accum, not train.global_batch_size (the grid keeps the former)")
    per_rank = cfg.train.micro_batch_size * cfg.train.grad_accum
    work.mkdir(parents=True, exist_ok=True)
    if cache.is_dir() and not (work / "compile_cache").exists():
        (work / "compile_cache").symlink_to(cache.resolve())
    runner = Runner(config, overrides, work, spares=tune.on_cuda(cfg))
    points = []
    try:
        for precision in precisions:
            for mode, b in grid:
                if per_rank % b:
                    points.append({"precision": precision, "mode": mode, "micro_batch": b,
                                   "status": f"skipped: {b} does not divide {per_rank}"})  # fmt: skip
                    continue
                extra = [tune.checkpointing(mode), *tune.batch_overrides(b, per_rank), f"train.precision={precision}"]
                p = runner.run(mode, b, extra)
                points.append({"precision": precision, "mode": mode, "micro_batch": b, "overrides": extra,
                               "tokens_per_s": p.tokens_per_s, "peak_gb": p.peak and p.peak / 1e9,
                               "status": p.status, "seconds": p.seconds})  # fmt: skip
                print(f"grid {precision} {mode} B={b}: {p.status} {p.tokens_per_s} tok/s ({p.seconds} s)", flush=True)
    finally:
        runner.close()
    return points


def seconds_of(run_dir: Path) -> dict | None:
    """Where a candidate's run spent its time: its start's phases (``startup_s``), the first step (compile included),
    the steps after it, and the compile by phase (``compile_report.json``); None where the run logged no row."""
    from trainer.plot import read_metrics

    rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    first = next((r for r in rows if r.get("first_step_s") is not None), None)
    if first is None:
        return None
    later, prev = 0.0, first["step"]
    for r in rows:
        if r["step"] > prev and r.get("step_time"):
            later, prev = later + r["step_time"] * (r["step"] - prev), r["step"]
    report = run_dir / "compile_report.json"
    compiled = json.loads(report.read_text()).get("compile_time_s") if report.is_file() else None
    return {"startup_s": first.get("startup_s"), "first_step_s": round(first["first_step_s"], 2),
            "later_steps_s": round(later, 2), "compile_time_s": compiled}  # fmt: skip


def table(points: list[dict]) -> str:
    lines = ["| precision | checkpointing | micro-batch | tok/s | peak GB | status | seconds |", "|" + "---|" * 7]
    top = best(points)
    for p in points:
        tps = f"{p['tokens_per_s'] / 1e3:.1f}K" if p.get("tokens_per_s") else "-"
        peak = f"{p['peak_gb']:.1f}" if p.get("peak_gb") else "-"
        status = "**best**" if p is top else p["status"]
        lines.append(f"| {p['precision']} | {p['mode']} | {p['micro_batch']} | {tps} | {peak} | {status} | "
                     f"{p.get('seconds', '-')} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="llama-1b")
    ap.add_argument("--overrides", nargs="*", default=["train.grad_accum=16"])
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--precisions", default="bf16,fp8", help="comma-separated train.precision values")
    ap.add_argument("--grid", default="none:4,none:8,none:16,selective:8,selective:32",
                    help="comma-separated mode:micro-batch points")  # fmt: skip
    ap.add_argument("--work", default=None, help="where the runs go (default: a new directory under /tmp)")
    ap.add_argument("--out", default=str(RESULT))
    args = ap.parse_args()
    grid = [(m, int(b)) for m, b in (p.split(":") for p in args.grid.split(","))]
    root = Path(args.work or f"/tmp/bench_tune_{os.getpid()}")
    if root.exists():  # tune would reuse the measurements it finds there: its table would not be this run's
        raise SystemExit(f"--work: {root} exists; name a new directory")
    started = time.monotonic()
    tuned, tune_wall, _ = run_tune(args.config, args.overrides, args.budget_s, root / "tune.tune")
    points = run_grid(args.config, args.overrides, args.precisions.split(","), grid, root / "grid",
                      root / "tune.tune" / "compile_cache")  # fmt: skip
    top, fastest = best(points), tuned["fastest"]
    ratio = fastest["tokens_per_s"] / top["tokens_per_s"] if top and fastest and fastest["tokens_per_s"] else None
    from trainer.tune_runs import plan_facts

    facts = plan_facts(root / "grid") or plan_facts(root / "tune.tune")
    spent = {str(d.relative_to(root)): seconds_of(d) for d in sorted(root.glob("*/runs/*")) if d.is_dir()}
    for name, where in spent.items():
        print(f"{name}: {where}")
    result = {
        "config": args.config, "overrides": args.overrides, "budget_s": args.budget_s, "git_sha": git_sha(),
        "device": facts.get("train.device"), "device_memory_gb": facts.get("device.memory_gb"),
        "tune": {**tuned, "wall_s": round(tune_wall, 1)}, "grid": points, "grid_best": top,
        "tune_over_grid_best": ratio, "seconds_of_runs": spent, "wall_s": round(time.monotonic() - started, 1),
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(points))
    if ratio is not None:
        print(f"tune's fastest ({fastest['candidate']}): {fastest['tokens_per_s'] / 1e3:.1f}K tok/s, "
              f"{ratio:.3f}x the grid's best ({top['precision']} {top['mode']} B={top['micro_batch']})")  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
