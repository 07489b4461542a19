"""Benchmark the fused linear + cross-entropy loss on the gpt2-small LM head.

Forward + backward of ``loss(x @ W.T, targets)`` under bf16 autocast, x fp32 (ln_f's output)
and W an fp32 master weight, in one process:

- eager:          F.cross_entropy(F.linear(x, W), t), the GPT's head today;
- compile:        torch.compile of the same function;
- fused:          trainer.ops.linear_cross_entropy;
- fused+compile:  torch.compile of a function calling it (as inside a compiled model).

Reports the median step time (triton.testing.do_bench), first-call (compile) time, peak
memory above the inputs, and the ratio to the matmul floor: 3 matmuls of 2*N*C*V FLOPs at the
bf16 matmul rate measured in the same run. Then sweeps the chunk size and the row kernel's
block size and warps, for tuning. Writes JSON to --out and prints a table last.

    python scripts/bench_fused_loss.py                 # on a GPU
    python scripts/bench_fused_loss.py --cpu-smoke     # tiny shapes on CPU, Triton interpreted
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=16 * 1024, help="tokens (B * T)")
    p.add_argument("--c", type=int, default=768, help="hidden size")
    p.add_argument("--v", type=int, default=50304, help="vocabulary size")
    p.add_argument("--chunk-size", type=int, default=None, help="rows per chunk for 'fused' (default: the op's)")
    p.add_argument("--no-sweep", action="store_true", help="skip the chunk-size and kernel-config sweeps")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    p.add_argument(
        "--out", type=Path, default=None, help="JSON output (default scripts/results/bench_fused_loss/result.json)"
    )
    args = p.parse_args()
    if args.cpu_smoke:
        args.n, args.c, args.v = 512, 32, 1000
    if args.out is None:  # a smoke run times nothing worth keeping
        smoke = Path(tempfile.gettempdir()) / "bench_fused_loss_cpu_smoke.json"
        args.out = smoke if args.cpu_smoke else REPO / "scripts" / "results" / "bench_fused_loss" / "result.json"
    return args


ARGS = _parse_args()
if ARGS.cpu_smoke:
    # Before anything imports triton: it reads the variable when it decorates its kernels.
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(REPO))
from scripts import _meta  # noqa: E402
from trainer.ops import linear_cross_entropy as lce  # noqa: E402

DEVICE = "cpu" if ARGS.cpu_smoke else "cuda"


def _bench(fn, grad_to_none) -> float:
    """Median milliseconds of ``fn``."""
    if DEVICE == "cuda":
        return triton.testing.do_bench(fn, warmup=25, rep=200, grad_to_none=grad_to_none, return_mode="median")
    times = []
    for _ in range(5):
        for t in grad_to_none:
            t.grad = None
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _peak_bytes(fn, grad_to_none) -> int | None:
    """Peak memory of one call of ``fn`` above what was allocated before it."""
    if DEVICE != "cuda":
        return None
    for t in grad_to_none:
        t.grad = None
    _sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    _sync()
    return torch.cuda.max_memory_allocated() - base


def _matmul_tflops() -> float:
    """Measured bf16 matmul rate, the denominator of the floor."""
    size = 256 if DEVICE == "cpu" else 8192
    a = torch.randn(size, size, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=DEVICE, dtype=torch.bfloat16)
    ms = _bench(lambda: a @ b, [])
    return 2 * size**3 / (ms * 1e-3) / 1e12


def _eager_loss(x, w, t):
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        return F.cross_entropy(F.linear(x, w), t)


def _fused_loss(x, w, t, chunk_size=None):
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        return lce.linear_cross_entropy(x, w, t, chunk_size=chunk_size)


def _saved_loss(x, w, t):
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        return lce.linear_cross_entropy(x, w, t, save_logit_grads=True)


def _measure(loss_fn, x, w, t) -> dict:
    def step():
        loss = loss_fn(x, w, t)
        loss.backward()
        return loss

    x.grad = w.grad = None
    _sync()
    start = time.perf_counter()
    loss = step()  # compiles, for the compiled variants
    _sync()
    first_s = time.perf_counter() - start
    step()  # allocator and autotuning caches warm
    return {
        "loss": loss.item(),
        "first_call_s": first_s,
        "ms": _bench(step, [x, w]),
        "peak_bytes": _peak_bytes(step, [x, w]),
    }


def _kernel_sweep(n_cols: int, rows: int) -> list[dict]:
    """The row kernel alone on one (rows, V) bf16 chunk: 2 reads + 1 write of the chunk."""
    logits = torch.randn(rows, n_cols, device=DEVICE, dtype=torch.bfloat16)
    targets = torch.randint(0, n_cols, (rows,), device=DEVICE)
    loss = torch.empty(rows, device=DEVICE)
    results = []
    # A 65536-wide single tile that read the row once measured 4.4 ms against 1.5 ms (register spills)
    # and was removed.
    configs = ((8192, 16384, 32768), (8, 16, 32)) if DEVICE == "cuda" else ((256, 1024), (4,))
    for block_size in configs[0]:
        for num_warps in configs[1]:
            config = (block_size, 1 if DEVICE == "cuda" else None, num_warps)  # (BLOCK_SIZE, BLOCK_ROWS, warps)
            # In place, so repeated calls see gradients in [-1, 1] instead of logits: same traffic.
            ms = _bench(
                lambda config=config: lce._cross_entropy_rows_triton(logits, targets, loss, -100, True, *config), []
            )
            gbps = 3 * logits.numel() * logits.element_size() / (ms * 1e-3) / 1e9
            results.append({"block_size": block_size, "num_warps": num_warps, "ms": ms, "GB/s": gbps})
    return results


def main() -> None:
    n, c, v = ARGS.n, ARGS.c, ARGS.v
    torch.manual_seed(0)
    x = torch.randn(n, c, device=DEVICE, requires_grad=True)
    w = (torch.randn(v, c, device=DEVICE) * 0.02).requires_grad_()
    t = torch.randint(0, v, (n,), device=DEVICE)

    tflops = _matmul_tflops()
    floor_ms = 6 * n * c * v / (tflops * 1e12) * 1e3
    chunk = ARGS.chunk_size or lce._default_chunk_size(v, torch.bfloat16)
    variants = {
        "eager": _eager_loss,
        "compile": torch.compile(_eager_loss),
        "fused": lambda x, w, t: _fused_loss(x, w, t, ARGS.chunk_size),
        "fused+compile": torch.compile(lambda x, w, t: _fused_loss(x, w, t, ARGS.chunk_size), fullgraph=True),
        "saved": _saved_loss,  # save_logit_grads=True: the cross_entropy kernel of compile.kernels
        "saved+compile": torch.compile(_saved_loss, fullgraph=True),
    }
    results = {}
    for name, fn in variants.items():
        results[name] = _measure(fn, x, w, t)
        print(f"{name}: {results[name]}", flush=True)
        torch._dynamo.reset()
    eager = results["eager"]
    for r in results.values():
        r["floor/ms"] = floor_ms / r["ms"]
        r["speedup_vs_eager"] = eager["ms"] / r["ms"]
        r["loss_rel_diff_vs_eager"] = abs(r["loss"] - eager["loss"]) / abs(eager["loss"])

    chunk_sweep, kernel_sweep = [], []
    if not ARGS.no_sweep:
        for rows in (1024, 2048, 4096, 8192, 16384):
            if rows > n:
                break
            r = _measure(lambda x, w, t, rows=rows: _fused_loss(x, w, t, rows), x, w, t)
            chunk_sweep.append({"chunk_size": rows, "ms": r["ms"], "peak_bytes": r["peak_bytes"]})
            print(f"chunk {rows}: {chunk_sweep[-1]}", flush=True)
        kernel_sweep = _kernel_sweep(v, n)  # all N rows: the save_logit_grads case

    report = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke, Triton interpreted)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "git_sha": _meta.git_sha(),
        "shape": {"N": n, "C": c, "V": v, "default_chunk_size": chunk},
        "dtype": "bf16 autocast, fp32 x and weight",
        "matmul_bf16_tflops": tflops,
        "floor_ms": floor_ms,
        "results": results,
        "chunk_sweep": chunk_sweep,
        "kernel_sweep": kernel_sweep,
    }
    ARGS.out.parent.mkdir(parents=True, exist_ok=True)
    ARGS.out.write_text(json.dumps(report, indent=2) + "\n")

    def gib(b):
        return "-" if b is None else f"{b / 2**30:.2f}"

    if kernel_sweep:
        print("\nrow kernel alone, one chunk (block_size, num_warps): ms, GB/s")
        for k in kernel_sweep:
            print(f"  {k['block_size']:6d} {k['num_warps']:3d}  {k['ms']:8.3f}  {k['GB/s']:8.1f}")
    if chunk_sweep:
        print("\nfused, chunk size sweep: rows, ms, peak GiB")
        for k in chunk_sweep:
            print(f"  {k['chunk_size']:6d}  {k['ms']:8.3f}  {gib(k['peak_bytes'])}")
    print(f"\n{report['device']}, torch {torch.__version__}, triton {triton.__version__}, {report['git_sha']}")
    print(f"N={n} C={c} V={v}, bf16 matmul {tflops:.1f} TFLOP/s, floor (6NCV) {floor_ms:.3f} ms -> {ARGS.out}")
    header = ("variant", "ms", "floor/ms", "vs eager", "peak GiB", "first s", "loss diff")
    print("{:15s} {:>9s} {:>9s} {:>9s} {:>9s} {:>8s} {:>10s}".format(*header))
    for name, r in results.items():
        print(
            f"{name:15s} {r['ms']:9.3f} {r['floor/ms']:9.2f} {r['speedup_vs_eager']:8.2f}x "
            f"{gib(r['peak_bytes']):>9s} {r['first_call_s']:8.1f} {r['loss_rel_diff_vs_eager']:10.1e}"
        )


if __name__ == "__main__":
    main()
