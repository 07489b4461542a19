"""Benchmark the fused residual add + LayerNorm (trainer::add_layer_norm) at gpt2-small's shape.

``s = x + inc`` (x the fp32 residual stream, inc a bf16 branch output), ``y = LayerNorm(s)`` in bf16, and the
backward with incoming gradients for both (dy bf16 from the next matmul, ds fp32 from later layers), timed
forward and backward separately:

- inductor: ``torch.compile`` of ``s = x + inc; y = F.layer_norm(s).to(bf16)`` (forward and its AOTAutograd
  backward), the pattern Inductor fuses in the model;
- ours: the Triton kernels, at the default tile sizes and over a sweep of them.

Floor: bytes over the copy bandwidth measured in the same run (forward: read x and inc, write s and y, 12 bytes an
element; backward: read dy, s and ds, write dx and dinc, 16 bytes an element).

    python scripts/bench_layer_norm.py            # writes scripts/results/bench_layer_norm/result.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts import _meta  # noqa: E402
from trainer.ops import add_layer_norm as aln  # noqa: E402


def copy_bandwidth(n_bytes: int = 2**30) -> float:
    a = torch.empty(n_bytes // 4, device="cuda", dtype=torch.float32)
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=5, rep=50)
    return 2 * n_bytes / (ms / 1e3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16 * 1024)
    p.add_argument("--cols", type=int, default=768)
    p.add_argument("--out", default=str(ROOT / "scripts/results/bench_layer_norm/result.json"))
    a = p.parse_args()
    n, c = a.rows, a.cols
    torch.manual_seed(0)
    x = torch.randn(n, c, device="cuda")
    inc = torch.randn(n, c, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(c, device="cuda") + 0.1 * torch.randn(c, device="cuda")
    b = 0.1 * torch.randn(c, device="cuda")
    dy = torch.randn(n, c, device="cuda", dtype=torch.bfloat16)
    ds = torch.randn(n, c, device="cuda")
    bw = copy_bandwidth()
    floor_fwd = 12 * n * c / bw * 1e3
    floor_bwd = 16 * n * c / bw * 1e3

    def torch_fn(x, inc, w, b):
        s = x + inc
        return s, F.layer_norm(s, (c,), w, b).to(torch.bfloat16)

    compiled = torch.compile(torch_fn, fullgraph=True)
    leaves = [t.requires_grad_() for t in (x, inc, w, b)]

    def timed(fn) -> tuple[float, float]:
        """(forward ms, backward ms), GPU time: each replayed from a CUDA graph (the custom op's Python dispatch
        costs more host time than its kernels take, as the model's graphed step hides)."""
        s, y = fn(*leaves)  # compile and warm
        torch.autograd.backward((s, y), (ds, dy))

        def step():  # fresh leaves and autograd.grad: no AccumulateGrad node from outside the captured graph
            fresh = [t.detach().requires_grad_() for t in leaves]
            s, y = fn(*fresh)
            torch.autograd.grad((s, y), fresh, (ds, dy))

        fwd = do_bench_cudagraph(lambda: fn(*leaves), rep=100)  # with grad: the training forward, stats saved
        both = do_bench_cudagraph(step, rep=100)
        return fwd, both - fwd

    def ours(x, inc, w, b):
        return aln.add_layer_norm(x, inc, w, b)

    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "git_sha": _meta.git_sha(), "rows": n, "cols": c, "copy_bandwidth_gbs": bw / 1e9,
               "floor_fwd_ms": floor_fwd, "floor_bwd_ms": floor_bwd, "variants": {}}  # fmt: skip
    with torch.autocast("cuda", dtype=torch.bfloat16):
        results["variants"]["inductor"] = timed(compiled)
        results["variants"]["ours"] = timed(ours)
        # Agreement with Inductor's (both fp32 math): y in bf16, the gradients.
        for t in leaves:
            t.grad = None
        s1, y1 = compiled(*leaves)
        torch.autograd.backward((s1, y1), (ds, dy))
        ref = [t.grad.clone() for t in leaves]
        for t in leaves:
            t.grad = None
        s2, y2 = ours(*leaves)
        torch.autograd.backward((s2, y2), (ds, dy))
        results["max_abs_diff"] = {
            "s": (s1 - s2).abs().max().item(),
            "y": (y1.float() - y2.float()).abs().max().item(),
            **{k: (r.float() - t.grad.float()).abs().max().item() for k, r, t in zip("x inc w b".split(), ref, leaves)},
        }
        default = (dict(aln.TILE), dict(aln.ELEMENTS_PER_WARP), aln.PROGRAMS_PER_SM)
        for tile, epw, per_sm in itertools.product((2048, 4096, 8192), (256, 512, 1024), (2, 4)):
            aln.TILE.update(fwd=tile, bwd=tile)
            aln.ELEMENTS_PER_WARP.update(fwd=epw, bwd=epw)
            aln.PROGRAMS_PER_SM = per_sm
            results["variants"][f"ours tile={tile} per_warp={epw} programs/SM={per_sm}"] = timed(ours)
        aln.TILE.update(default[0])
        aln.ELEMENTS_PER_WARP.update(default[1])
        aln.PROGRAMS_PER_SM = default[2]

    print(f"{n} x {c}, copy bandwidth {bw / 1e9:.0f} GB/s; floor forward {floor_fwd * 1e3:.1f} us, "
          f"backward {floor_bwd * 1e3:.1f} us; max |diff| vs inductor {results['max_abs_diff']}")  # fmt: skip
    print("| variant | forward us | x floor | backward us | x floor |\n|---|---|---|---|---|")
    for name, (f_ms, b_ms) in results["variants"].items():
        print(f"| {name} | {f_ms * 1e3:.1f} | {f_ms / floor_fwd:.2f} | {b_ms * 1e3:.1f} | {b_ms / floor_bwd:.2f} |")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
