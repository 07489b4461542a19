"""What a checkpoint costs the steps: synchronous against ``checkpoint.async_save``, one GPU.

    python scripts/bench_checkpoint.py                                   # gpt2-small and the Llama-3.2-1B shape
    python scripts/bench_checkpoint.py --models tiny --saves 3             # a quick check on a CPU

Each (model, mode) is one ``trainer fit`` in a process of its own, ``log.every=1``, a checkpoint every ``--every``
steps (by default each model's ``EVERY``: saves far enough apart that a background write is done before the next
save, so that the wait measured is the save's own). A save's cost is the time the loop waits for it
(``checkpoint_s`` in metrics.jsonl: the whole write when synchronous; the copy to host memory with ``async_save``,
and any wait for the previous write, ``checkpoint_wait_s``, also given apart) plus what the steps after it lose (the
background writer shares the host: the excess over the median step of the ``AFTER`` steps that follow). The wait is
in the next step's row (a row is written before its step's checkpoint). The first save is left out (its pinned
buffers are allocated then). Models:

- ``gpt2-small``: configs/gpt2-small.yaml (GPT-2 124M, 1.5 GB of state);
- ``llama-1b``: configs/llama-1b.yaml on the embedded bytes (a 256-token vocabulary: about 15 GB of state);
- ``tiny``: configs/tiny.yaml, for a CPU.

Writes ``scripts/results/bench_checkpoint/result.json`` (``--out``) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

AFTER = 5  # steps after a save whose excess time is the save's
MODELS = {
    "gpt2-small": ["configs/gpt2-small.yaml"],
    "llama-1b": [
        "configs/llama-1b.yaml",
        "data.path=null",
        "data.vocab_size=null",
        "model.hf_overrides={vocab_size: 256}",
    ],
    "tiny": ["configs/tiny.yaml"],
}
# steps between saves: ~3 s and ~16 s on an H200, so that a background write (1B: about 12.6 s) ends before the next
EVERY = {"gpt2-small": 100, "llama-1b": 150, "tiny": 4}


def analyse(rows: list[dict], every: int) -> dict:
    """The saves' costs from one run's metrics rows (``log.every=1``): per save its held and after seconds."""
    times = {r["step"]: r["step_time"] for r in rows if r.get("step_time") is not None and "first_step_s" not in r}
    # A row's checkpoint_s is the wait for the save after the row before it: with log.every=1, the previous step's.
    held = {r["step"] - 1: r["checkpoint_s"] for r in rows if r.get("checkpoint_s") is not None}
    previous = {r["step"] - 1: r.get("checkpoint_wait_s", 0.0) for r in rows if r.get("checkpoint_s") is not None}
    saves = sorted(held)
    near = {s + i for s in saves for i in range(0, AFTER + 1)}
    median = statistics.median(t for step, t in times.items() if step not in near)
    costs = []
    for s in saves[1:]:  # the first save allocates the pinned buffers
        after = sum(times[s + i] - median for i in range(1, AFTER + 1) if s + i in times)
        costs.append({"step": s, "held_s": held[s], "previous_s": previous[s], "after_s": after,
                      "stall_s": held[s] + after})  # fmt: skip
    return {
        "median_step_s": median,
        "saves": costs,
        "stall_s": statistics.median(c["stall_s"] for c in costs) if costs else None,
        "held_s": statistics.median(c["held_s"] for c in costs) if costs else None,
        "previous_s": statistics.median(c["previous_s"] for c in costs) if costs else None,
    }


def run(model: str, mode: str, a: argparse.Namespace) -> dict:
    every = a.every or EVERY[model]
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as tmp:
        cmd = [sys.executable, "-m", "trainer", "fit", *MODELS[model], f"train.steps={every * a.saves + AFTER + 1}",
               f"checkpoint.every={every}", "checkpoint.keep=2", "log.every=1", "train.eval_every=0",
               "log.progress=false", f"checkpoint.async_save={mode == 'async'}", f"run.dir={tmp}/run",
               *a.overrides]  # fmt: skip
        start = time.monotonic()
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wall = time.monotonic() - start
        if r.returncode != 0:
            return {"error": (r.stderr or r.stdout)[-2000:], "wall_s": wall}
        rows = [json.loads(line) for line in Path(tmp, "run/metrics.jsonl").read_text().splitlines()]
        last = Path(tmp, "run/checkpoints", Path(tmp, "run/checkpoints/last").read_text().strip())
        state = sum(p.stat().st_size for p in last.rglob("*") if p.is_file())
        return {**analyse(rows, every), "state_gb": state / 1e9, "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    p.add_argument("--models", default="gpt2-small,llama-1b", help="of: " + ", ".join(MODELS))
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--saves", type=int, default=4, help="saves per run (the first is left out; default 4)")
    p.add_argument("--every", type=int, help="checkpoint.every (default: each model's EVERY)")
    p.add_argument("--out", type=Path, default=ROOT / "scripts/results/bench_checkpoint/result.json")
    a = p.parse_args(argv)
    unknown = [m for m in a.models.split(",") if m not in MODELS]
    if unknown:
        p.error(f"--models: unknown {', '.join(unknown)}; known: {', '.join(MODELS)}")
    from scripts._meta import git_sha

    result = {"git_sha": git_sha(), "saves": a.saves, "every": a.every or EVERY, "after": AFTER, "runs": {}}
    print("| model | mode | state GB | held s | of which the previous write | after s | stall s | step s |\n"
          "|---|---|---|---|---|---|---|---|")  # fmt: skip
    for model in a.models.split(","):
        for mode in a.modes.split(","):
            out = result["runs"].setdefault(model, {})[mode] = run(model, mode, a)
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(result, indent=1) + "\n")  # after every run: a cut-off one keeps what finished
            if "error" in out:
                print(f"| {model} | {mode} | failed: {out['error'].strip().splitlines()[-1]} |")
                continue
            held, stall = out["held_s"], out["stall_s"]
            cells = [f"{out['state_gb']:.2f}", f"{held:.3f}", f"{out['previous_s']:.3f}", f"{stall - held:.3f}",
                     f"{stall:.3f}", f"{out['median_step_s']:.4f}"]  # fmt: skip
            print(f"| {model} | {mode} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
