"""Loss-curve parity: the trainer against the loop a user writes, step by step, same seed, data and model.

    python scripts/parity.py --device cpu --preset tiny --batch 4 --seq 128 --steps 12
    python scripts/parity.py --variants "compile.enabled=false;compile.enabled=true compile.cudagraphs=true"

The user loop is the benchmarks' (``scripts/bench_step.py``): ``build_model`` on the CPU after
``torch.manual_seed(seed)``, moved to the device, fused AdamW (lr 6e-4, betas 0.9/0.95, weight decay 0.1
on matrices), ``clip_grad_norm_(1.0)``, bf16 autocast on CUDA, constant lr. Each trainer variant is a
space-separated list of overrides on top of the same settings; its per-step losses come from its
metrics.jsonl. Prints both curves and the largest gap over the steps; exits 1 when a gap exceeds
``--tol`` (bf16 runs drift by rounding; a systematic gap is a bug, not rounding).
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

    from trainer.build import param_groups
    from trainer.data import Batches, load_corpus
    from trainer.models import build_model

    dev = torch.device(a.device)
    torch.manual_seed(a.seed)
    corpus = load_corpus(None, 50304, 0.05, a.seq)
    batches = Batches(corpus, seq_len=a.seq, micro_batch_size=a.batch, grad_accum=1, rank=0, world_size=1,
                      seed=a.seed, device=dev)  # fmt: skip
    model = build_model(preset=a.preset, vocab_size=50304, seq_len=a.seq).to(dev)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=6e-4, betas=(0.9, 0.95), fused=True)
    step_model = torch.compile(model) if a.user_compile else model
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    losses = []
    for step in range(a.steps):
        x, y = batches.train_batch(step, 0)
        with amp:
            loss = step_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def trainer_losses(a, overrides: list[str]) -> list[float]:
    from trainer.config import load_config
    from trainer.loop import Trainer

    run_dir = Path(tempfile.mkdtemp(prefix="parity_"))
    common = [
        f"model.preset={a.preset}", f"train.micro_batch_size={a.batch}", f"data.seq_len={a.seq}",
        "data.vocab_size=50304", f"train.steps={a.steps}", "train.eval_every=0", "train.eval_batches=1",
        "checkpoint.enabled=false", "log.progress=false", "log.every=1", f"seed={a.seed}",
        "schedule.warmup_steps=0", "schedule.decay=constant", f"train.device={a.device}",
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
    p.add_argument("--user-compile", action="store_true", help="torch.compile the user's model")
    p.add_argument("--variants", default="compile.enabled=false", help="';'-separated override lists")
    p.add_argument("--tol", type=float, default=0.1, help="largest allowed per-step loss gap")
    p.add_argument("--out", help="write the curves here (JSON)")
    a = p.parse_args()

    ref = user_losses(a)
    result = {"user": ref, "variants": {}}
    worst = 0.0
    for variant in [v.strip() for v in a.variants.split(";") if v.strip()]:
        got = trainer_losses(a, variant.split())
        gaps = [abs(g - r) for g, r in zip(got, ref, strict=True)]
        result["variants"][variant] = got
        worst = max(worst, max(gaps))
        print(f"\n[{variant}] largest gap {max(gaps):.4f} at step {gaps.index(max(gaps)) + 1}")
        print("step  user      trainer   gap")
        for i, (r, g) in enumerate(zip(ref, got, strict=True)):
            print(f"{i + 1:4d}  {r:8.4f}  {g:8.4f}  {g - r:+.4f}")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    sys.exit(1 if worst > a.tol else 0)


if __name__ == "__main__":
    main()
