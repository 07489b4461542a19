"""The memory model against measured peaks: ``trainer explain --memory``'s probes, then the runs it predicts.

Usage (one GPU):
    python scripts/check_memory.py configs/llama-1b.yaml \\
        --points none:16,none:20,selective:24,full:32 --boundary
    python scripts/check_memory.py configs/tiny.yaml --probe 8 --points none:16 --device cpu   # smoke, seconds

Each mode is probed at ``--probe`` (one short run), as ``trainer explain --memory`` does; every prediction is made
from these probes alone, before the other runs. Then each of ``--points`` runs, and with ``--boundary`` also the
largest micro-batch of ``trainer.tune.GRID`` predicted to fit each mode and the next one (predicted not to). Each
run is a 6-step ``trainer fit`` (one micro-batch a step: train.grad_accum=1); its peak is the log's
``torch.cuda.max_memory_allocated``. Writes ``scripts/results/check_memory/result.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts import _meta  # noqa: E402
from trainer.memory import GB, MODES  # noqa: E402
from trainer.tune import GRID, Session  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--probe", type=int, default=4, help="the probes' micro-batch (default 4)")
    p.add_argument("--points", default="", help="mode:micro-batch,... to measure against the prediction")
    p.add_argument("--boundary", action="store_true", help="also each mode's largest predicted fit and the next")
    p.add_argument("--device", default="auto", help="train.device (cpu: a smoke run)")
    p.add_argument("--probes-from", metavar="JSON", help="the probes of an earlier result file of this script, for "
                   "the same config on the same device, instead of running them again")  # fmt: skip
    p.add_argument("--out", default=str(ROOT / "scripts/results/check_memory/result.json"))
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="check_memory_")
    s = Session(a.config, [*a.overrides, f"run.dir={work}/run", f"train.device={a.device}"], None, reuse=False)
    s.per_rank = None  # one micro-batch a step
    s.runner.steps, s.runner.log_every = 6, 3
    started = time.monotonic()
    if a.probes_from:
        from trainer.memory import Point

        earlier = json.loads(Path(a.probes_from).read_text())
        assert earlier["config"] == a.config and earlier["overrides"] == a.overrides, "another config's probes"
        for r in earlier["rows"][: len(MODES)]:
            s.estimate.points.append(Point(r["mode"], r["micro_batch"], r["measured_gb"] * GB, r["tokens_per_s"]))
            s.measured.append(s.estimate.points[-1])
        s.estimate.capacity = earlier["capacity_gb"] * GB
    else:
        for mode in MODES:
            s.measure(mode, a.probe)
    est = s.estimate
    wanted = [(m, int(b)) for m, b in (x.split(":") for x in a.points.split(",") if x)]
    largest = {m: est.largest(m, GRID) for m in MODES}
    if a.boundary:
        for m, b in largest.items():
            above = next((g for g in GRID if b is not None and g > b), None)
            wanted += [(m, x) for x in (b, above) if x is not None]
    predicted = {(m, b): est.peak(m, b) for m, b in wanted}  # before any of them runs
    fits = {(m, b): est.fits(m, b) for m, b in wanted}
    rows = [_row(pt, pt.peak, True) for pt in s.measured]  # the probes: measured by definition
    for m, b in dict.fromkeys(wanted):
        if b == a.probe:
            continue
        pt = s.measure(m, b)
        rows.append(_row(pt, predicted[(m, b)], fits[(m, b)]))
    report = {"device": _meta_device(s), "git_sha": _meta.git_sha(), "config": a.config, "overrides": a.overrides,
              "probe": a.probe, "capacity_gb": est.capacity and est.capacity / GB,
              "parts_gb": {k: v[0] / GB for k, v in est.parts.items()},
              "per_sequence_gb": {m: est.fit(m)[0] / GB for m in MODES if est.fit(m)},
              "largest_predicted": largest, "rows": rows, "seconds": round(time.monotonic() - started)}  # fmt: skip
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(est.describe(GRID, "memory, predicted from the probes:"))
    print(table(rows))
    print(f"wrote {out}")


def _row(pt, predicted, predicted_fits) -> dict:
    measured = pt.peak / GB if pt.peak else None
    pred = predicted / GB if predicted else None
    err = (pred - measured) / measured if measured and pred else None
    return {"mode": pt.mode, "micro_batch": pt.micro_batch, "predicted_gb": pred, "measured_gb": measured,
            "error": err, "predicted_fits": predicted_fits, "status": pt.status,
            "tokens_per_s": pt.tokens_per_s, "seconds": pt.seconds}  # fmt: skip


def table(rows: list[dict]) -> str:
    lines = ["| mode | B | predicted | measured | error | predicted to fit | outcome |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        pred = f"{r['predicted_gb']:.1f} GB" if r["predicted_gb"] else "-"
        meas = f"{r['measured_gb']:.1f} GB" if r["measured_gb"] else "-"
        err = f"{r['error']:+.1%}" if r["error"] is not None else "-"
        fit = {True: "yes", False: "no", None: "-"}[r["predicted_fits"]]
        what = "probe" if r["predicted_gb"] == r["measured_gb"] and r["measured_gb"] else r["status"]
        lines.append(f"| {r['mode']} | {r['micro_batch']} | {pred} | {meas} | {err} | {fit} | {what} |")
    return "\n".join(lines)


def _meta_device(s) -> str:
    from trainer.tune import _plan_facts

    facts = _plan_facts(s.work)
    return f"{facts.get('train.device')}, {facts.get('device.memory_gb')} GB"


if __name__ == "__main__":
    main()
