"""A plain PyTorch training loop with ``compile_optimizer`` and an LR scheduler.

    python scripts/example_plain_loop.py                 # CPU: a few seconds (aot_eager backend)
    python scripts/example_plain_loop.py --backend inductor

The drop-in is a ``torch.optim.Optimizer``: the scheduler, ``zero_grad`` and checkpoints work
unchanged, and the LR the scheduler writes every step lands in a device tensor, so the compiled
step is captured once (the script prints the graph count at the end).
"""

import argparse
import math

import torch
from torch._dynamo.utils import counters

from trainer.compile import compile_optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--backend", default="inductor" if torch.cuda.is_available() else "aot_eager")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # Fit y = sin(3x) on [-1, 1] with a small MLP.
    x = torch.linspace(-1, 1, 256, device=device).unsqueeze(1)  # (N, 1)
    y = torch.sin(3 * x)
    model = torch.nn.Sequential(torch.nn.Linear(1, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(device)

    opt = compile_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.01), backend=args.backend)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps, eta_min=1e-3)

    first = last = math.nan
    for step in range(1, args.steps + 1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        last = loss.item()
        first = last if step == 1 else first
        if step % 20 == 0 or step == 1:
            print(f"step {step:3d}  loss {last:.5f}  lr {opt.param_groups[0]['lr']:.2e}")
    print(f"loss {first:.5f} -> {last:.5f}; compiled graphs: {counters['stats']['unique_graphs']}")


if __name__ == "__main__":
    main()
