"""Loss-curve parity: the trainer against the loop a user writes, step by step, same seed, data and model.

    python scripts/parity.py                       # gpt2-small on the GPU: the shipped path against the user loop
    python scripts/parity.py --device cpu --preset tiny --batch 4 --seq 128 --steps 12
    python scripts/parity.py --variants "default;compile.enabled=false"

The user loop is the benchmarks' (``scripts/_user_loop.py``). Each trainer variant is a space-separated list
of overrides on top of the same settings (``default``: none, the path a run takes as shipped); its per-step
losses come from its metrics.jsonl. Prints both curves and the largest gap over the steps; exits 1 when a gap
exceeds ``--tol`` (bf16 runs drift by rounding; a systematic gap is a bug, not rounding).

Both sides train at a constant learning rate, by default without warm-up. Without warm-up AdamW can spike at one
step, on one side and not the other (docs/troubleshooting.md): a gap at a single step that the next step closes.
``--warmup N`` gives both sides the same linear warm-up over N steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def user_losses(a) -> list[float]:
    import torch

    from scripts._user_loop import user_model_and_data, user_step

    dev = torch.device(a.device)
    model, batches = user_model_and_data(a.preset, 50304, a.seq, a.batch, dev, seed=a.seed)
    step = user_step(model, torch.compile(model) if a.user_compile else model, batches, dev, warmup=a.warmup)
    return [step(i).item() for i in range(a.steps)]


def trainer_losses(a, overrides: list[str]) -> list[float]:
    from trainer.config import load_config
    from trainer.loop import Trainer

    run_dir = Path(tempfile.mkdtemp(prefix="parity_"))
    common = [
        f"model.preset={a.preset}", f"train.micro_batch_size={a.batch}", f"data.seq_len={a.seq}",
        "data.vocab_size=50304", f"train.steps={a.steps}", "train.eval_every=0", "train.eval_batches=1",
        "checkpoint.enabled=false", "log.progress=false", "log.every=1", f"seed={a.seed}",
        f"schedule.warmup_steps={a.warmup}", "schedule.decay=constant", f"train.device={a.device}",
        "train.precision=" + ("bf16" if a.device == "cuda" else "fp32"), f"run.dir={run_dir}",
    ]  # fmt: skip
    Trainer(load_config(ROOT / "configs/gpt2-small.yaml", [*common, *overrides])).fit()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r["loss"] for r in records if "loss" in r}
    return [by_step[s] for s in range(1, a.steps + 1)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=0, help="linear learning-rate warm-up steps, on both sides")
    p.add_argument("--user-compile", action="store_true", help="torch.compile the user's model")
    p.add_argument("--variants", default="default", help="';'-separated override lists ('default': none)")
    p.add_argument("--tol", type=float, default=0.1, help="largest allowed per-step loss gap")
    p.add_argument("--out", default=str(ROOT / "scripts/results/parity/result.json"), help="the curves (JSON)")
    a = p.parse_args()

    ref = user_losses(a)
    result = {"user": ref, "variants": {}}
    worst = 0.0
    for variant in [v.strip() for v in a.variants.split(";") if v.strip()]:
        got = trainer_losses(a, [] if variant == "default" else variant.split())
        gaps = [abs(g - r) for g, r in zip(got, ref, strict=True)]
        result["variants"][variant] = got
        worst = max(worst, max(gaps))
        print(f"\n[{variant}] largest gap {max(gaps):.4f} at step {gaps.index(max(gaps)) + 1}")
        print("step  user      trainer   gap")
        for i, (r, g) in enumerate(zip(ref, got, strict=True)):
            print(f"{i + 1:4d}  {r:8.4f}  {g:8.4f}  {g - r:+.4f}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    sys.exit(1 if worst > a.tol else 0)


if __name__ == "__main__":
    main()
