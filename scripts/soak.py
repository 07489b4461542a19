"""A soak: ``trainer fit`` for N minutes under ``torchrun --max-restarts 1``, with a checkpoint every 100 steps,
evaluations and one injected restart, checking step time, memory, host RSS and the compile cache for drift.

    python scripts/soak.py                                  # GPT-2 124M (ddp), 2 GPUs, 5 minutes
    python scripts/soak.py --nproc 8 --minutes 10
    python scripts/soak.py --tiny --minutes 0.5             # configs/tiny.yaml on 2 gloo ranks (CPU), a scratch --out

The run starts with ``resume=auto``. Halfway (``--kill-at``), once a checkpoint exists, one rank is SIGKILLed;
torchrun restarts both and they resume from the last checkpoint. At the end every rank gets SIGTERM (a scheduler's
stop): it finishes its step, saves and exits. Every second the script notes the steps logged so far (which gives
each row of ``metrics.jsonl`` its wall time) and the size of the run's compile cache.

Read from the rows (``log.every`` steps apart): ``step_time``, ``mem_allocated_gb`` and ``mem_reserved_gb`` (CUDA),
``host_rss_gb`` (rank 0). The checks, with W = minutes / 5 (one minute of a 5-minute soak):

- step time: the median over [W, 2W) against the median over the last W, within 2% (``--tiny``, on shared CPU
  cores: 25%);
- allocated memory: flat (the same two windows within 1%);
- reserved memory (less than 2%) and host RSS (less than 1%): growth within each start of the job, a process of its
  own, once it is steady: after its first evaluation (which compiles the evaluation's graphs and takes their
  memory once) and its first checkpoint (a background save allocates the pinned host copy of the state then), from
  the first quarter of the rows after both to the last quarter;
- compile cache: no bigger at the end than when the rank was killed (the restart compiled nothing new);
- the job: exit 0, one restart, resumed from a checkpoint, metrics steps increasing with none repeated.

A check that cannot apply (no CUDA memory on a CPU, nothing compiled) is null. Writes ``result.json`` and
``plot.png`` to ``--out`` (default ``scripts/results/soak/``; a scratch directory with ``--tiny``) and prints a
table; exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LIMITS = {"step_time": 2.0, "mem_allocated": 1.0, "mem_reserved": 2.0, "host_rss": 1.0}  # percent
# --tiny's step time on shared CPU cores: three half-minute soaks on 2 cores read +7.5%, -5.9% and -15.5% with nothing
# drifting, so its check catches a step that slows by a quarter or more (a leak), not the GPU soak's 2%.
TINY_STEP_TIME_LIMIT = 25.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="key=value overrides for trainer fit")
    p.add_argument("--minutes", type=float, default=5.0, help="how long to train (default 5)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (GPUs) under torchrun (default 2)")
    p.add_argument("--config", help="default configs/gpt2-small-ddp.yaml (GPT-2 124M); --tiny: configs/tiny.yaml")
    p.add_argument("--tiny", action="store_true", help="configs/tiny.yaml, ddp, a soak that runs on a CPU")
    p.add_argument("--out", help="where result.json and plot.png go (default scripts/results/soak/; --tiny: scratch)")
    p.add_argument("--run-dir", help="the run directory, new or empty (default: a scratch directory, removed)")
    p.add_argument("--kill-at", type=float, default=0.5, help="when to kill a rank, a fraction of --minutes")
    p.add_argument("--kill-rank", type=int, help="the rank to kill (default the last)")
    p.add_argument("--checkpoint-every", type=int, help="checkpoint.every (default 100; --tiny 20)")
    p.add_argument("--eval-every", type=int, help="train.eval_every (default 500; --tiny 50)")
    p.add_argument("--log-every", type=int, help="log.every (default 10; --tiny 2)")
    return p


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = _parser()
    a = p.parse_args(argv)
    a.config = a.config or ("configs/tiny.yaml" if a.tiny else "configs/gpt2-small-ddp.yaml")
    for key, big, tiny in (("checkpoint_every", 100, 20), ("eval_every", 500, 50), ("log_every", 10, 2)):
        if getattr(a, key) is None:
            setattr(a, key, tiny if a.tiny else big)
    a.kill_rank = a.nproc - 1 if a.kill_rank is None else a.kill_rank
    if a.minutes <= 0:
        p.error(f"--minutes: expected a positive number, got {a.minutes:g}")
    if a.nproc < 1:
        p.error(f"--nproc: expected 1 or more, got {a.nproc}")
    if not 0 < a.kill_at < 1:
        p.error(f"--kill-at: expected a fraction between 0 and 1, got {a.kill_at:g}")
    if not 0 <= a.kill_rank < a.nproc:
        p.error(f"--kill-rank: expected a rank below --nproc {a.nproc}, got {a.kill_rank}")
    if not (ROOT / a.config).is_file() and not Path(a.config).is_file():
        p.error(f"--config: no such file: {a.config}")
    if a.run_dir and Path(a.run_dir).exists() and any(Path(a.run_dir).iterdir()):
        p.error(f"--run-dir: {a.run_dir} is not empty; a soak starts a run of its own")
    if a.out is None:
        a.out = tempfile.mkdtemp(prefix="soak_") if a.tiny else str(ROOT / "scripts/results/soak")
    return a


def _command(a, run_dir: Path) -> list[str]:
    over = [f"run.dir={run_dir}", "train.steps=1000000", f"checkpoint.every={a.checkpoint_every}",
            f"train.eval_every={a.eval_every}", f"log.every={a.log_every}", "log.progress=false"]  # fmt: skip
    if a.tiny:  # a step of ~0.1 s on a CPU core, so that half a minute holds checkpoints, evaluations and a restart
        over += ["train.micro_batch_size=8", *(["distributed.strategy=ddp"] if a.nproc > 1 else [])]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}",
            "--max-restarts=1", "-m", "trainer", "fit", a.config, *over, *a.overrides, "resume=auto"]  # fmt: skip


def _workers(launcher: int) -> dict[int, tuple[int, int]]:
    """``{rank: (pid, restart count)}`` of the ranks torchrun (pid ``launcher``) runs now, from /proc."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if int((d / "stat").read_text().rpartition(")")[2].split()[1]) != launcher:
                continue
            env = dict(kv.split(b"=", 1) for kv in (d / "environ").read_bytes().split(b"\0") if b"=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if b"RANK" in env:
            found[int(env[b"RANK"])] = (int(d.name), int(env.get(b"TORCHELASTIC_RESTART_COUNT", b"0")))
    return found


def _size(path: Path) -> int:
    """Bytes of a file, or of the files under a directory (0 when absent; files that go meanwhile are skipped)."""
    total = 0
    for f in [path, *path.rglob("*")] if path.is_dir() else [path]:
        try:
            total += f.stat().st_size if f.is_file() else 0
        except OSError:
            continue
    return total


def _rows(run_dir: Path) -> list[tuple[str, dict]]:
    """The rows of the run's metrics.jsonl, each with its line."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append((line, json.loads(line)))
        except json.JSONDecodeError:
            continue  # a row being written
    return out


def soak(a, run_dir: Path, logs: Path) -> dict:
    """Run the job (its output to ``logs``), kill a rank once, stop it at the end; the rows with their wall times,
    the samples, the starts."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if a.tiny:
        env.setdefault("OMP_NUM_THREADS", "1")
    cmd = _command(a, run_dir)
    with open(logs / "stdout.log", "w") as out, open(logs / "stderr.log", "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err)
    t0, total = time.monotonic(), a.minutes * 60
    # step -> (its row's line, when it was first seen): a restart's row of a step replaces the earlier start's. The
    # rows that appeared since the last sample are spread evenly over the time between the two samples.
    seen: dict[int, tuple[str, float]] = {}
    samples, kill, stop, before = [], None, None, 0.0
    while True:
        t, done = time.monotonic() - t0, proc.poll() is not None
        rows = _rows(run_dir)
        new = [r["step"] for line, r in rows if seen.get(r["step"], ("",))[0] != line]
        for i, (line, r) in enumerate((line, r) for line, r in rows if r["step"] in set(new)):
            seen[r["step"]] = (line, before + (i + 1) / len(new) * (t - before))
        before, last = t, rows[-1][1]["step"] if rows else 0
        samples.append({"t": t, "step": last, "cache_bytes": _size(run_dir / "compile_cache"),
                        "bundle_bytes": _size(run_dir / "checkpoints" / "compile_cache.bin")})  # fmt: skip
        if done:
            break
        if kill is None and t >= a.kill_at * total and (run_dir / "checkpoints/last").is_file():
            workers = _workers(proc.pid)
            pid, restart = workers.get(a.kill_rank, (None, None))
            if pid is not None and restart == 0:
                os.kill(pid, signal.SIGKILL)
                kill = {"t": t, "at": time.time(), "rank": a.kill_rank, "last_step": last}
        if stop is None and t >= total:
            for pid, _ in _workers(proc.pid).values():
                os.kill(pid, signal.SIGTERM)  # as a scheduler stops a job: each rank finishes its step and saves
            stop = t
        if stop is not None and t > stop + 600:
            proc.kill()
        time.sleep(1.0)
    rows = [{**r, "t": seen[r["step"]][1]} for _, r in _rows(run_dir)]
    starts = [json.loads(line) for line in (run_dir / "starts.jsonl").read_text().splitlines()] \
        if (run_dir / "starts.jsonl").is_file() else []  # fmt: skip
    return {"returncode": proc.returncode, "rows": rows, "samples": samples, "kill": kill, "stop_s": stop,
            "starts": starts, "command": cmd[3:]}  # fmt: skip


def _median(rows: list[dict], key: str, lo: float, hi: float) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None and r["t"] is not None and lo <= r["t"] < hi]
    return statistics.median(vals) if vals else None


def _change(first: float | None, last: float | None, limit: float, growth_only: bool = False) -> dict:
    if not first or last is None:
        return {"first": first, "last": last, "change_pct": None, "limit_pct": limit, "ok": None}
    pct = (last - first) / first * 100
    ok = pct < limit if growth_only else abs(pct) <= limit
    return {"first": first, "last": last, "change_pct": pct, "limit_pct": limit, "ok": ok}


def _steady(rows: list[dict], kill_t: float, eval_every: int, checkpoint_every: int = 0) -> list[list[dict]]:
    """Each start's rows once it is steady: those after its first evaluation (which compiles the evaluation's
    graphs) and its first checkpoint (whose background save allocates the pinned host copy of the state, kept for
    the saves after it); all of them without either."""
    spans = []
    for inside in (lambda t: t < kill_t, lambda t: t >= kill_t):  # each start of the job: its own process
        span = [r for r in rows if r["t"] is not None and inside(r["t"])]
        firsts = [-(-span[0]["step"] // every) * every for every in (eval_every, checkpoint_every) if span and every]
        firsts = [f for f in firsts if f < span[-1]["step"]]  # those that came in this start
        after = [r for r in span if firsts and r["step"] > max(firsts)]
        spans.append(after or span)
    return spans


def _growth(span: list[dict], key: str, limit: float) -> dict | None:
    """The change of ``key`` from the first quarter of ``span`` to its last (medians); None without values."""
    vals = [r[key] for r in span if r.get(key) is not None]
    if len(vals) < 2:
        return None
    quarter = max(1, len(vals) // 4)
    return _change(statistics.median(vals[:quarter]), statistics.median(vals[-quarter:]), limit, True)


def _cache_end(rows: list[dict], kill_t: float) -> float | None:
    """Until when the compile cache must not grow after the kill: the end (None); where the job's first evaluation
    came after the kill, the row before it (an evaluation compiles graphs of its own, new to the cache, where a
    restart that compiles again would add nothing)."""
    evals = [r["t"] for r in rows if r.get("val_loss") is not None and r["t"] is not None]
    if not evals or min(evals) <= kill_t:
        return None
    return max((r["t"] for r in rows if r["t"] is not None and r["t"] < min(evals)), default=None)


def analyse(a, run: dict) -> dict:
    total, w = a.minutes * 60, a.minutes * 60 / 5
    # A start's first step is its compile, and the row after it holds the CUDA graph's capture: neither is steady.
    after_first = {i + 1 for i, r in enumerate(run["rows"]) if r.get("first_step_s") is not None}
    rows = [r for i, r in enumerate(run["rows"]) if r.get("first_step_s") is None and i not in after_first]
    checks = {
        "step_time": _change(_median(rows, "step_time", w, 2 * w), _median(rows, "step_time", total - w, total),
                             TINY_STEP_TIME_LIMIT if a.tiny else LIMITS["step_time"]),
        "mem_allocated": _change(_median(rows, "mem_allocated_gb", w, 2 * w),
                                 _median(rows, "mem_allocated_gb", total - w, total), LIMITS["mem_allocated"]),
    }  # fmt: skip
    kill_t = run["kill"]["t"] if run["kill"] else total
    for name, key in (("mem_reserved", "mem_reserved_gb"), ("host_rss", "host_rss_gb")):
        spans = _steady(rows, kill_t, getattr(a, "eval_every", 0), getattr(a, "checkpoint_every", 0))
        per_start = [_growth(span, key, LIMITS[name]) for span in spans]
        per_start = [c for c in per_start if c is not None]
        checks[name] = {"starts": per_start, "ok": all(c["ok"] for c in per_start) if per_start else None}
    before, end_t = [s for s in run["samples"] if s["t"] <= kill_t], _cache_end(run["rows"], kill_t)
    at_kill = before[-1]["cache_bytes"] if before else 0
    at_end = [s for s in run["samples"] if end_t is None or s["t"] <= end_t][-1]["cache_bytes"]
    checks["compile_cache"] = {"at_kill_bytes": at_kill, "at_end_bytes": at_end, "until_t": end_t,
                               "ok": None if not at_kill else at_end <= at_kill}  # fmt: skip
    steps = [r["step"] for r in run["rows"]]
    resumed = [s for s in run["starts"] if s.get("restart")]
    job_ok = (run["returncode"] == 0 and run["kill"] is not None and len(resumed) == 1
              and resumed[0]["checkpoint"] is not None and steps == sorted(set(steps)))  # fmt: skip
    checks["job"] = {"returncode": run["returncode"], "starts": len(run["starts"]), "ok": job_ok}
    restart = None
    if run["kill"] and resumed:
        back = resumed[0]["step"]
        after = [r["t"] for r in run["rows"] if r["step"] > back and r["t"] is not None and r["t"] > kill_t]
        restart = {**run["kill"], "resumed_from_step": back, "steps_run_again": run["kill"]["last_step"] - back,
                   "first_row_after_s": (min(after) - kill_t) if after else None,
                   "phases_s": restart_phases(run["kill"], run["rows"], back)}  # fmt: skip
    return {"checks": checks, "restart": restart, "steps": steps[-1] if steps else 0,
            "ok": all(c["ok"] is not False for c in checks.values())}  # fmt: skip


def restart_phases(kill: dict, rows: list[dict], back: int) -> dict | None:
    """Where the time from the kill to the restart's first step went: ``launcher`` (torchrun noticing the lost rank,
    stopping the others, its rendezvous and the new processes: the kill to the new rank 0's creation), then the new
    process's phases (``startup_s`` of its first row: trainer/startup.py) and ``first_step`` (the compile and the
    step); None when the row does not say."""
    first = next((r for r in rows if r["step"] == back + 1 and r.get("startup_s")), None)
    if first is None or first.get("process_started_at") is None or kill.get("at") is None:
        return None
    phases = {"launcher": first["process_started_at"] - kill["at"], **first["startup_s"],
              "first_step": first["first_step_s"]}  # fmt: skip
    return {**{k: round(v, 2) for k, v in phases.items()}, "total": round(sum(phases.values()), 2)}


def plot(a, run: dict, result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in run["rows"] if r["t"] is not None and r.get("first_step_s") is None]
    minutes = [r["t"] / 60 for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7), sharex=True)
    panels = [(axes[0, 0], [("step_time", 1e3, "step time")], "ms"),
              (axes[0, 1], [("mem_allocated_gb", 1, "allocated"), ("mem_reserved_gb", 1, "reserved")], "CUDA GB"),
              (axes[1, 0], [("host_rss_gb", 1, "rank 0 RSS")], "host GB")]  # fmt: skip
    for ax, series, unit in panels:
        for key, scale, label in series:
            pts = [(m, r[key] * scale) for m, r in zip(minutes, rows) if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), ".", markersize=3, label=label)
        ax.set_ylabel(unit)
    ax = axes[1, 1]
    ts = [s["t"] / 60 for s in run["samples"]]
    ax.plot(ts, [s["cache_bytes"] / 1e6 for s in run["samples"]], label="compile_cache/")
    ax.plot(ts, [s["bundle_bytes"] / 1e6 for s in run["samples"]], label="compile_cache.bin")
    ax.set_ylabel("MB")
    w = a.minutes / 5
    for ax in axes.flat:
        ax.axvspan(w, 2 * w, color="green", alpha=0.08)
        ax.axvspan(a.minutes - w, a.minutes, color="green", alpha=0.08)
        if run["kill"]:
            ax.axvline(run["kill"]["t"] / 60, color="red", linestyle="--", linewidth=0.8, label="rank killed")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("minutes")
    c = result["checks"]
    fmt = lambda x: "n/a" if x is None else f"{x:+.2f}%"
    fig.suptitle(f"soak: {a.config} x{a.nproc}, {a.minutes:g} min, {result['steps']} steps; step time "
                 f"{fmt(c['step_time']['change_pct'])}, allocated {fmt(c['mem_allocated']['change_pct'])} "
                 "(minute windows shaded)", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _device_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.splitlines()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        out = []
    return out[0].strip() if out else "cpu"


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def table(result: dict) -> str:
    lines = [f"\nsoak: {result['run']['config']} x{result['run']['nproc']} on {result['run']['device']}, "
             f"{result['run']['minutes']:g} min, {result['steps']} steps; git {result['run']['git_sha']}",
             "| check | first | last | change | limit | ok |", "|---|---|---|---|---|---|"]  # fmt: skip
    c = result["checks"]
    for name in ("step_time", "mem_allocated"):
        x = c[name]
        num = lambda v: "-" if v is None else f"{v:.4g}"
        pct = "-" if x["change_pct"] is None else f"{x['change_pct']:+.2f}%"
        lines.append(f"| {name} | {num(x['first'])} | {num(x['last'])} | {pct} | {x['limit_pct']}% | {x['ok']} |")
    for name in ("mem_reserved", "host_rss"):
        for i, x in enumerate(c[name]["starts"]):
            lines.append(f"| {name} (start {i + 1}, steady) | {x['first']:.4g} GB | {x['last']:.4g} GB | "
                         f"{x['change_pct']:+.2f}% | <{x['limit_pct']}% | {x['ok']} |")  # fmt: skip
    cc = c["compile_cache"]
    lines.append(f"| compile_cache | {cc['at_kill_bytes']} B | {cc['at_end_bytes']} B | | no growth | {cc['ok']} |")
    lines.append(f"| job | | | | exit 0, one restart | {c['job']['ok']} |")
    if result["restart"]:
        r = result["restart"]
        again = "-" if r["first_row_after_s"] is None else f"{r['first_row_after_s']:.1f}"
        lines.append(f"restart: rank {r['rank']} killed at {r['t']:.0f} s (step {r['last_step']}), resumed from step "
                     f"{r['resumed_from_step']}, its first row {again} s after the kill")  # fmt: skip
        if r.get("phases_s"):
            lines.append(
                "restart, kill to first step (s): " + ", ".join(f"{k} {v:.2f}" for k, v in r["phases_s"].items())
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    from scripts._meta import git_sha

    scratch = Path(tempfile.mkdtemp(prefix="soak_run_"))
    run_dir = Path(a.run_dir).resolve() if a.run_dir else scratch / "run"
    run = soak(a, run_dir, scratch)
    result = {"run": {"config": a.config, "nproc": a.nproc, "minutes": a.minutes, "tiny": a.tiny,
                      "device": _device_name(), "torch": _version("torch"), "triton": _version("triton"),
                      "git_sha": git_sha(), "command": run["command"]}}  # fmt: skip
    result.update(analyse(a, run))
    result["series"] = {"rows": run["rows"], "samples": run["samples"], "starts": run["starts"]}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    plot(a, run, result, out / "plot.png")
    if run["returncode"] != 0:
        print((scratch / "stderr.log").read_text()[-3000:], file=sys.stderr)
    shutil.rmtree(scratch, ignore_errors=True)
    print(table(result))
    print(f"wrote {out / 'result.json'} and {out / 'plot.png'}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
