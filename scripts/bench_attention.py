"""Causal attention kernels on one GPU: torch's SDPA backends and FlexAttention at the models' shapes.

    python scripts/bench_attention.py                       # every shape, every backend, bf16
    python scripts/bench_attention.py --shapes llama-1b --backends flash,cudnn,flex --out /tmp/attn.json

Backends: torch's SDPA kernels (flash, cudnn, efficient; ``model.attention`` picks one for the built-in GPT) and
``flex`` (FlexAttention, compiled, with a causal block mask). A shape with fewer key/value heads than query heads
(grouped-query attention, as Llama's) runs each backend twice: with ``enable_gqa=True`` on the grouped keys and
values, and on keys and values repeated to every query head (``/repeat``, what a model without GQA support does).
Queries, keys and values are laid out as a model makes them, ``(B, T, H, D)`` transposed to ``(B, H, T, D)``.

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

SHAPES = {  # name: (batch, heads, seq, head_dim, key/value heads), at the step benchmark's batch and length
    "gpt2-small": (16, 12, 1024, 64, 12),
    "gpt2-medium": (16, 16, 1024, 64, 16),
    "llama-1b": (4, 32, 2048, 64, 8),
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


def _attention(backend: str, gqa: bool):
    """``attend(q, k, v) -> y`` for one backend; ``gqa``: k and v hold fewer heads than q."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from trainer.models.gpt import sdpa_backend

    if backend == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        masks = {}

        def attend(q, k, v):
            T = q.shape[2]
            if T not in masks:
                masks[T] = create_block_mask(lambda b, h, i, j: i >= j, None, None, T, T, device=q.device)
            return flex(q, k, v, block_mask=masks[T], enable_gqa=gqa)

        return attend

    def attend(q, k, v):
        with sdpa_kernel(sdpa_backend(backend)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    return attend


def bench(shape, backend: str, iters: int, ref=None) -> dict | tuple[dict, dict]:
    """``{"error": ...}`` where the backend cannot run; else (timings, outputs and gradients). ``backend`` may end in
    ``/repeat``: keys and values repeated to every query head before the call."""
    import torch

    B, H, T, D, KV = shape
    name, _, repeat = backend.partition("/")
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(heads):  # (B, T, heads, D) transposed, as a model's projection makes it
        return torch.randn(B, T, heads, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)

    q = rand(H).requires_grad_()
    k, v = (rand(KV).requires_grad_() for _ in range(2))
    dy = rand(H)
    attend = _attention(name, gqa=KV != H and not repeat)

    def fwd():
        if repeat:
            return attend(q, k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1))
        return attend(q, k, v)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        fwd().backward(dy)

    try:
        y = fwd()
        fwd_bwd()
    except Exception as e:  # the backend cannot run this shape, dtype or device
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
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
        row["max_abs_diff_vs_first"] = max((out[n].float() - ref[n].float()).abs().max().item() for n in out)
    return row, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="flash,cudnn,efficient,flex", help="each may end in /repeat (GQA shapes)")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=str(ROOT / "scripts/results/bench_attention/result.json"))
    a = p.parse_args()

    import torch

    from scripts._meta import git_sha
    from scripts.bench_step import matmul_peak

    peak = matmul_peak()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "git_sha": git_sha(),
              "cudnn": torch.backends.cudnn.version(), "matmul_peak_tflops": peak / 1e12, "rows": {}}  # fmt: skip
    lines = [f"{result['gpu']}, torch {torch.__version__}, cuDNN {result['cudnn']}; bf16 matmul peak measured "
             f"{peak / 1e12:.0f} TFLOP/s; causal, bf16",
             "| shape (B,H,T,D) | backend | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s | of matmul peak | "
             "max |diff| vs the first |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for shape_name in a.shapes.split(","):
        shape = SHAPES[shape_name]
        ref = None
        backends = a.backends.split(",")
        if shape[1] != shape[4]:  # grouped-query attention: also each backend on repeated keys and values
            backends = [b for name in backends for b in (name, name + "/repeat")]
        for backend in backends:
            got = bench(shape, backend, a.iters, ref)
            if isinstance(got, dict):  # not available here
                result["rows"][f"{shape_name}/{backend}"] = got
                lines.append(f"| {shape_name} {shape} | {backend} | {got['error'][:60]} | | | | | |")
                continue
            row, out = got
            if ref is None:
                ref = out
            result["rows"][f"{shape_name}/{backend}"] = row
            diff = row.get("max_abs_diff_vs_first")
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
