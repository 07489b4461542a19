"""Host time FSDP2 adds to a training step, measured without communication: one process, a world of one.

FSDP on two H200s ran GPT-2 124M at 55% (ours) and 67% (torch's eager FSDP2) of its one-GPU speed
(``scripts/results/bench_ddp_inplace_h200x2.log``), while DDP kept 95%. This probe separates FSDP2's
per-step Python and dispatch work from communication: the same GPT (default: 12 blocks, tiny width, so the
kernels cost next to nothing) in one gloo process, unsharded and with ``fully_shard`` per block and root, on
the CPU. It prints the median time of forward, forward + backward, ``clip_grad_norm_`` and ``AdamW.step``
(foreach) for each. The numbers are host time on this machine's CPU; a GPU host runs the same Python, faster.

    python scripts/probe_fsdp_host.py                      # 12 blocks
    python scripts/probe_fsdp_host.py --n-layer 24
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _median_ms(fn, n: int, skip: int = 5) -> float:
    times = []
    for _ in range(n + skip):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times[skip:]) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    from torch.distributed.fsdp import fully_shard

    from trainer.models import build_model

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no port, no peers
    torch.set_num_threads(1)
    x = torch.randint(0, 256, (1, 16))
    rows = {}
    try:
        for mode in ("unsharded", "fully_shard"):
            torch.manual_seed(0)
            model = build_model(preset=None, vocab_size=256, seq_len=16, n_layer=a.n_layer, n_head=2, n_embd=16)
            if mode == "fully_shard":
                for block in model.transformer.h:
                    fully_shard(block)
                fully_shard(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
            model(x, x).backward()

            def fwd_bwd(model=model):
                model(x, x).backward()

            rows[mode] = {
                "forward": _median_ms(lambda model=model: model(x, x), a.steps),
                "forward + backward": _median_ms(fwd_bwd, a.steps),
                "clip_grad_norm_": _median_ms(
                    lambda m=model: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0), a.steps
                ),  # fmt: skip
                "AdamW.step (foreach)": _median_ms(opt.step, a.steps),
            }
    finally:
        dist.destroy_process_group()
    print(f"torch {torch.__version__}, GPT with {a.n_layer} blocks (width 16), one gloo process on the CPU; "
          f"median host ms per call")  # fmt: skip
    print("| | unsharded | fully_shard | added |\n|---|---|---|---|")
    for key in rows["unsharded"]:
        u, f = rows["unsharded"][key], rows["fully_shard"][key]
        print(f"| {key} | {u:.1f} | {f:.1f} | +{f - u:.1f} |")


if __name__ == "__main__":
    main()
