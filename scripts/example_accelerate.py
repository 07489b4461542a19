"""Hugging Face Accelerate with ``compile_optimizer``: ``prepare()`` takes the drop-in like any optimizer.

    python scripts/example_accelerate.py                 # CPU: a few seconds (aot_eager backend)
    accelerate launch scripts/example_accelerate.py --backend inductor

``prepare`` wraps the drop-in in an ``AcceleratedOptimizer`` (which round-trips its state_dict to
place it on the device) and the scheduler in an ``AcceleratedScheduler``; both only use the
``torch.optim.Optimizer`` API, which the drop-in implements.
"""

import argparse
import math

import torch
from accelerate import Accelerator
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

from trainer.compile import compile_optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--backend", default="inductor" if torch.cuda.is_available() else "aot_eager")
    args = parser.parse_args()

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    # Learn a noisy linear map R^8 -> R^2 with a small MLP.
    w_true = torch.randn(8, 2)
    xs = torch.randn(512, 8)
    ys = xs @ w_true + 0.01 * torch.randn(512, 2)
    loader = DataLoader(TensorDataset(xs, ys), batch_size=64, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 2))

    opt = compile_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), backend=args.backend)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=len(loader) * 2, gamma=0.5)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)

    first = last = math.nan
    for epoch in range(1, args.epochs + 1):
        total = 0.0
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            accelerator.backward(loss)
            opt.step()
            sched.step()
            total += loss.item()
        last = total / len(loader)
        first = last if epoch == 1 else first
        accelerator.print(f"epoch {epoch}  loss {last:.5f}  lr {opt.param_groups[0]['lr']:.2e}")
    accelerator.print(f"loss {first:.5f} -> {last:.5f}; compiled graphs: {counters['stats']['unique_graphs']}")


if __name__ == "__main__":
    main()
