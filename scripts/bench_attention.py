"""Causal attention kernels on one GPU: torch's SDPA backends at the built-in GPT's shapes (``model.attention``).

    python scripts/bench_attention.py                       # gpt2-small and gpt2-medium shapes, bf16
    python scripts/bench_attention.py --backends flash,cudnn --out /tmp/attn.json

For each shape and backend: forward and forward+backward time (CUDA events, median of --iters), the
achieved TFLOP/s and its ratio to the bf16 matmul peak measured in the same run (the floor: causal
attention does 2·B·H·T²·D FLOPs forward, 2.5x that backward), and the largest difference of the output
and the input gradients from the flash backend's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {  # name: (batch, heads, seq, head_dim) of the built-in GPT presets at B=16, T=1024
    "gpt2-small": (16, 12, 1024, 64),
    "gpt2-medium": (16, 16, 1024, 64),
}


def _time(fn, iters: int) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def bench(shape, backend: str, iters: int, ref=None) -> dict | tuple[dict, dict]:
    """``{"error": ...}`` where the backend cannot run; else (timings, outputs and gradients)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from trainer.models.gpt import sdpa_backend

    B, H, T, D = shape
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand():
        return torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g)

    q, k, v = (rand().requires_grad_() for _ in range(3))
    dy = rand()

    def fwd():
        with sdpa_kernel(sdpa_backend(backend)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        fwd().backward(dy)

    try:
        y = fwd()
        fwd_bwd()
    except RuntimeError as e:  # the backend cannot run this shape, dtype or device
        return {"error": str(e).splitlines()[0]}
    out = {"y": y.detach(), "dq": q.grad.clone(), "dk": k.grad.clone(), "dv": v.grad.clone()}
    flops_fwd = 2 * B * H * T * T * D  # 4·B·H·T²·D halved by the causal mask
    t_fwd, t_all = _time(fwd, iters), _time(fwd_bwd, iters)
    row = {
        "fwd_ms": t_fwd,
        "fwd_bwd_ms": t_all,
        "fwd_tflops": flops_fwd / t_fwd / 1e9,
        "fwd_bwd_tflops": 3.5 * flops_fwd / t_all / 1e9,
    }
    if ref is not None:
        row["max_abs_diff_vs_flash"] = max((out[n].float() - ref[n].float()).abs().max().item() for n in out)
    return row, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="flash,cudnn,efficient")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=str(ROOT / "scripts/results/bench_attention/result.json"))
    a = p.parse_args()

    import torch

    from scripts.bench_step import matmul_peak

    peak = matmul_peak()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "matmul_peak_tflops": peak / 1e12, "rows": {}}  # fmt: skip
    lines = [f"{result['gpu']}, torch {torch.__version__}, cuDNN {result['cudnn']}; bf16 matmul peak measured "
             f"{peak / 1e12:.0f} TFLOP/s; causal, bf16",
             "| shape (B,H,T,D) | backend | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s | of matmul peak | "
             "max |diff| vs flash |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for shape_name in a.shapes.split(","):
        shape = SHAPES[shape_name]
        ref = None
        for backend in a.backends.split(","):
            got = bench(shape, backend, a.iters, ref)
            if isinstance(got, dict):  # not available here
                result["rows"][f"{shape_name}/{backend}"] = got
                lines.append(f"| {shape_name} {shape} | {backend} | {got['error'][:60]} | | | | | |")
                continue
            row, out = got
            if backend == "flash":
                ref = out
            result["rows"][f"{shape_name}/{backend}"] = row
            diff = row.get("max_abs_diff_vs_flash")
            lines.append(
                f"| {shape_name} {shape} | {backend} | {row['fwd_ms']:.3f} | {row['fwd_bwd_ms']:.3f} | "
                f"{row['fwd_tflops']:.0f} | {row['fwd_bwd_tflops']:.0f} | {row['fwd_bwd_tflops'] * 1e12 / peak:.1%} | "
                f"{'' if diff is None else f'{diff:.2e}'} |"
            )
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(result, indent=1))
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
