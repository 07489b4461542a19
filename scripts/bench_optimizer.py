"""AdamW step on GPT-2 124M's 148 parameter tensors: torch foreach, fused, torch.compile, and ours.

    python scripts/bench_optimizer.py                         # CUDA: the full comparison (~3 min)
    python scripts/bench_optimizer.py --rows triton,fused     # a subset
    python scripts/bench_optimizer.py --cpu-smoke             # CPU, tiny shapes: checks the script runs

One process, one set of shapes (GPT-2 small: wte 50304x768, wpe 1024x768, 12 blocks, ln_f; 124.5M
parameters), random gradients, two param groups (weight decay on matrices, none on vectors and
biases, as the fit loop builds them). Rows:

- ``foreach``, ``fused``: torch.optim.AdamW as is.
- ``torch.compile``: ``torch.compile(opt.step)`` as a user writes it (Python-float LR).
- ``compile_optimizer``: our drop-in (LR on the device, capturable step, Inductor).
- ``triton``, ``triton+clip``: TritonAdamW over flat gradient buffers, without and with fused global-norm
  clipping.
- ``triton-table``, ``triton-table+clip``: TritonAdamW reading the gradients where autograd left them through
  an address table (``flat_grads=False``, what ``optim.impl=triton`` builds).
- ``fused+clip``: what the fit loop does with torch's fused AdamW: ``get_total_norm`` of the gradients, then
  the step divides them by ``grad_scale`` (the clip) inside its kernel and writes them back (36 bytes per
  parameter); ``-capturable``: the same as the graphed step runs it (``capturable=True``, lr on the device).
- ``*-bf16``: bf16 parameters and gradients (torch's AdamW, also under compile_optimizer, keeps bf16
  states; TritonAdamW keeps fp32 states).

For each row: median step time (``triton.testing.do_bench``, CUDA events), the memory-traffic floor
(bytes per parameter x parameters / device-to-device copy bandwidth measured in this run, the copy
counted as read + write), the ratio to it, and the first call (compile and Triton JIT included;
compile caches start empty unless --warm-caches). Also a sweep of our kernel's BLOCK_SIZE and
num_warps over one flat fp32 buffer. Writes JSON (--out) and prints a table last.

Bytes per parameter (read + write): fp32 AdamW 28 (p, g, m, v read; p, m, v written); clipping
reads g once more (+4); bf16 params and grads with fp32 states 22 (+2 with clipping); torch's bf16
AdamW keeps bf16 states: 14.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Before torch/triton are imported: cold compile caches (honest first-call times), and the Triton
# interpreter for the CPU smoke run (it is chosen when kernels are decorated).
if "--warm-caches" not in sys.argv:
    _cache = tempfile.mkdtemp(prefix="bench_optimizer_cache_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_cache, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(_cache, "triton")
if "--cpu-smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from scripts import _meta  # noqa: E402

LR, BETAS, WD, EPS = 6e-4, (0.9, 0.95), 0.1, 1e-8
ROWS = [
    "foreach",
    "fused",
    "torch.compile",
    "compile_optimizer",
    "triton",
    "triton+clip",
    "fused+clip",
    "fused+clip-capturable",
    "triton-table",
    "triton-table+clip",
    "fused-bf16",
    "compile_optimizer-bf16",
    "triton-bf16",
    "triton+clip-bf16",
]
BYTES = {  # bytes per parameter moved by one step at the floor
    "foreach": 28,
    "fused": 28,
    "torch.compile": 28,
    "compile_optimizer": 28,
    "triton": 28,
    "triton+clip": 32,
    "fused+clip": 36,
    "fused+clip-capturable": 36,
    "triton-table": 28,
    "triton-table+clip": 32,
    "fused-bf16": 14,
    "compile_optimizer-bf16": 14,
    "triton-bf16": 22,
    "triton+clip-bf16": 24,
}


def gpt2_shapes(vocab=50304, ctx=1024, d=768, layers=12) -> list[tuple[int, ...]]:
    """GPT-2 small's parameter shapes in nanoGPT order (148 tensors at the defaults)."""
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,)]


def make_groups(shapes, dtype, device, seed=0):
    """Parameters with random gradients in two groups (decay on >= 2-D tensors)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(0.02 * torch.randn(s, generator=gen, device=device, dtype=torch.float32).to(dtype))
        p.grad = (0.01 * torch.randn(s, generator=gen, device=device, dtype=torch.float32)).to(dtype)
        params.append(p)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return params, [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]


def build_row(row, groups, backend):
    """Return a zero-argument step function for one row."""
    from trainer.optim.compiled import compile_optimizer
    from trainer.optim.optimizers import TritonAdamW  # imported in main(), outside the timing

    kw = dict(lr=LR, betas=BETAS, eps=EPS)
    name = row.removesuffix("-bf16")
    if name == "foreach":
        return torch.optim.AdamW(groups, foreach=True, **kw).step
    if name == "fused":
        return torch.optim.AdamW(groups, fused=True, **kw).step
    if name == "torch.compile":
        return torch.compile(torch.optim.AdamW(groups, foreach=True, **kw).step, backend=backend)
    if name == "compile_optimizer":
        return compile_optimizer(torch.optim.AdamW(groups, foreach=True, **kw), backend=backend).step
    if name in ("triton", "triton+clip", "triton-table", "triton-table+clip"):
        clip = 1.0 if name.endswith("+clip") else 0.0
        return TritonAdamW(groups, max_grad_norm=clip, flat_grads=not name.startswith("triton-table"), **kw).step
    if name in ("fused+clip", "fused+clip-capturable"):
        params = [p for g in groups for p in g["params"]]
        if name.endswith("capturable"):
            kw = dict(kw, lr=torch.tensor(LR, device=params[0].device), capturable=True)
        opt = torch.optim.AdamW(groups, fused=True, **kw)

        def step():
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            opt.grad_scale = torch.clamp((norm.float() + 1e-6) / 1.0, min=1.0)
            opt.step()

        return step
    raise ValueError(f"unknown row {row!r}; rows: {', '.join(ROWS)}")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, smoke: bool) -> tuple[float, float, float]:
    """(median, p20, p80) milliseconds per call: do_bench's CUDA events on GPU, 3 wall-clock calls on CPU."""
    if not smoke:
        from triton.testing import do_bench

        p20, p50, p80 = do_bench(fn, warmup=100, rep=500, quantiles=[0.2, 0.5, 0.8])
        return p50, p20, p80
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[1], times[0], times[2]


def copy_bandwidth(device, smoke: bool) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write."""
    n = (1 << 16) if smoke else (1 << 28)  # 1 GiB of fp32 on the GPU
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, smoke)[0]
    return 2 * n * 4 / (ms / 1e3)


def sweep_adamw_kernel(n, device, smoke):
    """Our AdamW kernel alone on one flat fp32 buffer, for BLOCK_SIZE x num_warps."""
    from trainer.optim.adamw import launch_adamw

    p, g = torch.randn(n, device=device), torch.randn(n, device=device)
    m, v, step = torch.zeros(n, device=device), torch.zeros(n, device=device), torch.zeros((), device=device)
    hp = torch.tensor([LR, *BETAS, EPS, WD, 0.0], dtype=torch.float64, device=device)
    out = []
    for block in (1024, 2048, 4096):
        for warps in (4, 8):
            fn = lambda: launch_adamw(p, g, m, v, step, hp, None, True, block_size=block, num_warps=warps)  # noqa: B023
            fn()
            out.append({"BLOCK_SIZE": block, "num_warps": warps, "ms": time_ms(fn, device, smoke)[0]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of: " + ", ".join(ROWS))
    parser.add_argument("--backend", default=None, help="torch.compile backend (inductor; aot_eager for --cpu-smoke)")
    parser.add_argument("--out", default=str(ROOT / "scripts/results/bench_optimizer/result.json"))
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU; checks the script, times nothing")
    parser.add_argument("--warm-caches", action="store_true", help="keep the default compile caches (warm first calls)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the BLOCK_SIZE x num_warps sweep")
    args = parser.parse_args()

    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (use --cpu-smoke to check the script on CPU)")
    device = torch.device("cpu" if smoke else "cuda")
    backend = args.backend or ("aot_eager" if smoke else "inductor")
    rows = [r for r in args.rows.split(",") if r]
    for r in rows:
        if r not in ROWS:
            parser.error(f"unknown row {r!r}; rows: {', '.join(ROWS)}")
    if smoke:  # torch's fused AdamW has no bf16 CPU kernel in every version; the rest run
        rows = [r for r in rows if r != "fused-bf16"]
    shapes = gpt2_shapes(vocab=64, ctx=16, d=8, layers=2) if smoke else gpt2_shapes()
    n_params = sum(torch.Size(s).numel() for s in shapes)

    import trainer.optim.adamw  # noqa: F401  (import and kernel decoration outside the first-call times)
    import trainer.optim.compiled  # noqa: F401

    bandwidth = copy_bandwidth(device, smoke)
    results = []
    for row in rows:
        dtype = torch.bfloat16 if row.endswith("-bf16") else torch.float32
        _, groups = make_groups(shapes, dtype, device)
        _sync(device)
        t0 = time.perf_counter()
        step = build_row(row, groups, backend)
        step()
        _sync(device)
        first_s = time.perf_counter() - t0
        ms, p20, p80 = time_ms(step, device, smoke)
        floor_ms = BYTES[row] * n_params / bandwidth * 1e3
        results.append(
            {
                "row": row,
                "dtype": str(dtype).removeprefix("torch."),
                "bytes_per_param": BYTES[row],
                "median_ms": ms,
                "p20_ms": p20,
                "p80_ms": p80,
                "floor_ms": floor_ms,
                "ratio_to_floor": ms / floor_ms,
                "first_call_s": first_s,
            }
        )
        print(f"{row}: {ms:.3f} ms (x{ms / floor_ms:.2f} of floor), first call {first_s:.1f} s", flush=True)
        del step, groups
        if device.type == "cuda":
            torch.cuda.empty_cache()
    sweep = [] if args.no_sweep else sweep_adamw_kernel(sum(torch.Size(s).numel() for s in shapes), device, smoke)

    import triton

    report = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else "cpu (smoke run: times mean nothing)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "git_sha": _meta.git_sha(),
        "n_tensors": len(shapes),
        "n_params": n_params,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "compile_backend": backend,
        "cold_compile_caches": not args.warm_caches,
        "rows": results,
        "adamw_kernel_sweep": sweep,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")

    print(f"\n{report['device']} | torch {report['torch']} | triton {report['triton']} | {report['git_sha']}")
    print(
        f"{n_params / 1e6:.1f}M params in {len(shapes)} tensors; copy bandwidth {bandwidth / 1e9:.0f} GB/s (read+write)"
    )
    if sweep:
        best = min(sweep, key=lambda s: s["ms"])
        print(
            "kernel sweep (fp32, one buffer): "
            + ", ".join(f"{s['BLOCK_SIZE']}/{s['num_warps']}w {s['ms']:.3f}" for s in sweep)
        )
        print(f"  best BLOCK_SIZE={best['BLOCK_SIZE']} num_warps={best['num_warps']}")
    print(
        f"\n{'row':<24}{'dtype':>10}{'B/param':>9}{'median ms':>11}{'p20-p80 ms':>16}{'floor ms':>10}{'x floor':>9}"
        f"{'first call s':>14}"
    )
    for r in results:
        print(
            f"{r['row']:<24}{r['dtype']:>10}{r['bytes_per_param']:>9}{r['median_ms']:>11.3f}"
            f"{r['p20_ms']:>8.3f}-{r['p80_ms']:<7.3f}{r['floor_ms']:>10.3f}"
            f"{r['ratio_to_floor']:>9.2f}{r['first_call_s']:>14.1f}"
        )


if __name__ == "__main__":
    main()
