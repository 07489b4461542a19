"""Why is compiled autograd slower and hungrier than plain torch.compile upstream? One variant per process.

    python scripts/exp_compiled_autograd.py            # all variants, gpt2-small B=16 T=1024 bf16

Variants (all: torch.compile(model), fused AdamW, bf16 autocast):
  plain           no compiled autograd
  ca-dyn          compiled autograd as upstream defaults it (dynamic=True)
  ca-static       compiled autograd with dynamic=False (static shapes, as the forward)
  ca-static-div   ca-static with the loss divided by a Python int (gradient accumulation's `loss / accum`)
Reports tokens/s, peak memory, first-step time, and whether the variant ran at all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VARIANTS = ["plain", "ca-dyn", "ca-static", "ca-static-div"]


def run(variant: str, steps: int, batch: int, seq: int) -> dict:
    import contextlib

    import torch

    from trainer.compile.autograd import compiled_autograd
    from trainer.models import build_model

    torch.manual_seed(0)
    model = build_model(preset="gpt2-small", vocab_size=50304, seq_len=seq).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=True)
    cm = torch.compile(model)
    x = torch.randint(0, 50304, (batch, seq), device="cuda")
    y = torch.randint(0, 50304, (batch, seq), device="cuda")
    if variant == "plain":
        ctx = contextlib.nullcontext
    else:
        dyn = variant == "ca-dyn"
        ctx = lambda: compiled_autograd("inductor", dynamic=dyn)  # noqa: E731
    times = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with ctx():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = cm(x, y)
            (loss / 1 if variant.endswith("-div") else loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    med = sorted(times[3:])[len(times[3:]) // 2]
    return {"tokens_per_s": batch * seq / med, "first_step_s": times[0],
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variant")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--out", default=str(ROOT / "scripts/results/exp_compiled_autograd.json"))
    a = p.parse_args()
    if a.variant:
        print("RESULT " + json.dumps(run(a.variant, a.steps, a.batch, a.seq)), flush=True)
        return
    results = {}
    for v in VARIANTS:
        r = subprocess.run([sys.executable, __file__, "--variant", v, "--steps", str(a.steps), "--batch",
                            str(a.batch), "--seq", str(a.seq)], capture_output=True, text=True,
                           env={**os.environ})  # fmt: skip
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        results[v] = json.loads(line[-1][7:]) if line else {"error": r.stderr[-800:]}
        print(v, results[v], flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1))
    print("| variant | tokens/s | peak GB | first step s |\n|---|---|---|---|")
    for v, r in results.items():
        if "error" in r:
            print(f"| {v} | failed: {r['error'].strip().splitlines()[-1][:80]} | | |")
        else:
            print(f"| {v} | {r['tokens_per_s'] / 1e3:.0f}K | {r['peak_mem_gb']:.1f} | {r['first_step_s']:.1f} |")


if __name__ == "__main__":
    main()
