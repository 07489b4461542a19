"""The memory model against measured peaks: ``trainer explain --memory``'s probes, then the runs it predicts.

Usage (one GPU):
    python scripts/check_memory.py configs/llama-1b.yaml \\
        --points none:16,none:20,selective:24,selective:28,full:32,full:64 --boundary
    python scripts/check_memory.py configs/tiny.yaml --probe 8 --points none:16 --device cpu   # smoke, seconds
    python scripts/check_memory.py configs/llama-1b.yaml --boundary --reuse result.json   # its runs reused
    python scripts/check_memory.py configs/llama-1b.yaml --measure full:96,full:112 --out b.json   # runs alone

``--measure`` runs the points and writes each as it ends, without probes or predictions: runs split across
GPUs this way are joined by ``--reuse a.json b.json`` (then only what no file holds runs).

Each mode is probed as ``trainer explain --memory`` probes it (``trainer.tune.probe_modes``: at ``--probe``, then
near the limit the first predicts); every prediction is made from these probes alone, before the other runs. Then
each of ``--points`` runs, and with ``--boundary`` also the largest micro-batch of ``trainer.tune.GRID`` predicted
to fit each mode and the next one (predicted not to). Each run is a 6-step ``trainer fit`` (one micro-batch a step:
train.grad_accum=1); its peak is the log's ``torch.cuda.max_memory_allocated``. Writes
``scripts/results/check_memory/result.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import atexit
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts import _meta  # noqa: E402
from trainer.io import atomic_write_text  # noqa: E402
from trainer.memory import GB, MODES, Point  # noqa: E402
from trainer.tune import GRID, Session, probe_modes  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument(
        "--probe",
        type=int,
        default=4,
        help="the first probe's micro-batch (default 4); the second is chosen as explain --memory chooses it",
    )
    p.add_argument("--points", default="", help="mode:micro-batch,... to measure against the prediction")
    p.add_argument(
        "--boundary",
        nargs="?",
        const=",".join(MODES),
        default="",
        metavar="MODES",
        help="also each mode's (or these modes') largest predicted fit and the next micro-batch",
    )
    p.add_argument("--device", default="auto", help="train.device (cpu: a smoke run)")
    p.add_argument(
        "--reuse",
        nargs="*",
        default=[],
        metavar="JSON",
        help="earlier result files of this script, for the same config on the same device: their runs are not "
        "run again (a later file's run of the same point, and its device capacity, win)",
    )
    p.add_argument(
        "--per-rank",
        type=int,
        help="sequences per rank and step, kept through train.grad_accum, in 8-step runs as tune makes "
        "(default: one micro-batch a step, 6 steps)",
    )
    p.add_argument(
        "--measure", default="", help="mode:micro-batch,... to run alone (no probes), each written as it ends"
    )
    p.add_argument("--out", default=str(ROOT / "scripts/results/check_memory/result.json"))
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="check_memory_")
    s = Session(a.config, [*a.overrides, f"run.dir={work}/run", f"train.device={a.device}"], None, reuse=False)
    atexit.register(s.runner.close)  # the spare waiting for a next run, if one is
    s.per_rank = a.per_rank
    if a.per_rank is None:  # one micro-batch a step
        s.runner.steps, s.runner.log_every = 6, 3
    started = time.monotonic()
    earlier, seconds, device = {}, 0, None
    for f in a.reuse:
        doc = json.loads(Path(f).read_text())
        assert doc["config"] == a.config and doc["overrides"] == a.overrides, f"{f}: another config's runs"
        earlier.update(
            {(r["mode"], r["micro_batch"]): {**r, "git_sha": r.get("git_sha", doc["git_sha"])} for r in doc["rows"]}
        )
        s.estimate.capacity = (doc["capacity_gb"] and doc["capacity_gb"] * GB) or s.estimate.capacity  # the last file's
        seconds += doc["seconds"]
        device = doc.get("device") or device

    run = s.measure
    if a.measure:
        _measure_alone(a, s, _points(a.measure), started)
        return

    def measured(mode: str, b: int) -> Point:
        if (mode, b) not in earlier:
            return run(mode, b)
        r = earlier[(mode, b)]
        status = r["status"] if r["status"] != "probe" else ("ok" if r["measured_gb"] else "out of memory")
        peak = r["measured_gb"] and r["measured_gb"] * GB
        return Point(mode, b, peak, r["tokens_per_s"], status, seconds=r["seconds"])

    s.measure = lambda mode, b: _probe(s, measured, mode, b)
    probe_modes(s, a.probe)  # as explain --memory
    probes = {(p.mode, p.micro_batch) for p in s.estimate.points}
    rows = [_row(p, None, None, probe=True) for p in s.estimate.points]
    est = s.estimate
    wanted = _points(a.points)
    largest = {m: est.largest(m, GRID) for m in MODES}
    for m, b in largest.items():
        if m in a.boundary.split(","):
            above = next((g for g in GRID if b is not None and g > b), None)
            wanted += [(m, x) for x in (b, above) if x is not None]
    predicted = {(m, b): est.peak(m, b) for m, b in wanted}  # from the probes alone, before any of these runs
    fits = {(m, b): est.fits(m, b) for m, b in wanted}
    described = est.describe(GRID, "memory, predicted from the probes:")
    for m, b in dict.fromkeys(wanted):
        if (m, b) not in probes:
            rows.append(_row(measured(m, b), predicted[(m, b)], fits[(m, b)]))
    sha = _meta.git_sha()
    for r in rows:  # the commit each row was measured at
        r["git_sha"] = earlier.get((r["mode"], r["micro_batch"]), {}).get("git_sha", sha)
    _write(
        a,
        s,
        rows,
        seconds + round(time.monotonic() - started),
        device=_meta_device(s) if len(s.measured) or device is None else device,
        probes=sorted(probes),
        parts_gb={k: v[0] / GB for k, v in est.parts.items()},
        per_sequence_gb={m: est.fit(m)[0] / GB for m in MODES if est.fit(m)},
        constant_gb={m: est.fit(m)[1] / GB for m in MODES if est.fit(m)},
        largest_predicted=largest,
    )
    print(described)
    print(table(rows))
    print(f"wrote {a.out}")


def _points(spec: str) -> list[tuple[str, int]]:
    """``mode:micro-batch,...`` as pairs."""
    return [(m, int(b)) for m, b in (x.split(":") for x in spec.split(",") if x)]


def _write(a, s, rows: list[dict], seconds: int, device: str | None = None, **extra) -> None:
    """The result file: the config, the device, the rows (and ``extra``), written atomically."""
    report = {
        "device": device or _meta_device(s),
        "git_sha": _meta.git_sha(),
        "config": a.config,
        "overrides": a.overrides,
        "capacity_gb": s.estimate.capacity and s.estimate.capacity / GB,
        **extra,
        "rows": rows,
        "seconds": seconds,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(a.out), json.dumps(report, indent=1) + "\n")


def _measure_alone(a, s, points: list[tuple[str, int]], started: float) -> None:
    rows = []
    for mode, b in points:
        rows.append(_row(s.measure(mode, b), None, None))
        _write(a, s, rows, round(time.monotonic() - started))  # each run kept as it ends
    print(table(rows))


def _probe(s, measured, mode: str, b: int) -> Point:
    pt = measured(mode, b)
    if pt not in s.estimate.points:
        s.estimate.points.append(pt)
    return pt


def _row(pt, predicted, predicted_fits, probe: bool = False) -> dict:
    measured = pt.peak / GB if pt.peak else None
    pred = predicted / GB if predicted else None
    err = (pred - measured) / measured if measured and pred else None
    return {
        "mode": pt.mode,
        "micro_batch": pt.micro_batch,
        "predicted_gb": pred,
        "measured_gb": measured,
        "error": err,
        "predicted_fits": predicted_fits,
        "status": "probe" if probe else pt.status,
        "tokens_per_s": pt.tokens_per_s,
        "seconds": pt.seconds,
    }


def table(rows: list[dict]) -> str:
    lines = ["| mode | B | predicted | measured | error | predicted to fit | outcome |", "|---" * 7 + "|"]
    for r in rows:
        pred = f"{r['predicted_gb']:.1f} GB" if r["predicted_gb"] else "-"
        meas = f"{r['measured_gb']:.1f} GB" if r["measured_gb"] else "-"
        err = f"{r['error']:+.1%}" if r["error"] is not None else "-"
        fit = {True: "yes", False: "no", None: "-"}[r["predicted_fits"]]
        lines.append(f"| {r['mode']} | {r['micro_batch']} | {pred} | {meas} | {err} | {fit} | {r['status']} |")
    return "\n".join(lines)


def _meta_device(s) -> str:
    from trainer.tune import plan_facts

    facts = plan_facts(s.work)
    return f"{facts.get('train.device')}, {facts.get('device.memory_gb')} GB"


if __name__ == "__main__":
    main()
