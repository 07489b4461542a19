"""Benchmark the matmuls with the MLP's GELU in their epilogue (trainer/compile/kernels/gelu_mlp.py).

gpt2-small's MLP at B=16, T=1024 (M = 16384 tokens, C = 768, 4C = 3072), bf16, CUDA-graph timed:

- forward: ``h = x @ W1.T + b1; g = gelu(h)``: Inductor (cuBLAS addmm, then its GELU kernel) against
  ours (one kernel storing h and g);
- backward: ``dh = (dy @ W2) * gelu'(h); g = gelu(h); db = dh.sum(0)``: Inductor (cuBLAS mm, then its
  fused GELU-backward and bias-sum kernels) against ours (one kernel, a small sum);
- the matmul alone: cuBLAS against our kernel without an epilogue.

With ``--max-autotune``, also Inductor's max-autotune (Triton templates with the pointwise work fused
into their epilogues). Floors: 2*M*N*K FLOPs at the bf16 matmul rate measured here, and the
epilogue's bytes at the copy bandwidth measured here. Then a sweep of our tile configurations.

    python scripts/bench_gelu_mlp.py --out scripts/results/bench_gelu_mlp_h100.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.compile.kernels import gelu_mlp as gm  # noqa: E402


def copy_bandwidth(n_bytes: int = 2**30) -> float:
    a = torch.empty(n_bytes // 4, device="cuda", dtype=torch.float32)
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=5, rep=50)
    return 2 * n_bytes / (ms / 1e3)


def matmul_peak() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench_cudagraph(lambda: a @ b)
    return 2 * 8192**3 / (ms / 1e3)


def bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=200)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=16 * 1024)
    p.add_argument("--c", type=int, default=768)
    p.add_argument("--max-autotune", action="store_true")
    p.add_argument("--sweep", action="store_true", help="sweep our Triton kernel's tiles")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    M, C, N = a.m, a.c, 4 * a.c
    bf = torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(M, C, device="cuda", dtype=bf)
    w1 = (0.02 * torch.randn(N, C, device="cuda")).to(bf)
    b1 = (0.02 * torch.randn(N, device="cuda")).to(bf)
    w2 = (0.02 * torch.randn(C, N, device="cuda")).to(bf)
    dy = torch.randn(M, C, device="cuda", dtype=bf)
    h = F.linear(x, w1, b1)

    bw, peak = copy_bandwidth(), matmul_peak()
    mm_floor = 2 * M * N * C / peak * 1e3
    rows: list[dict] = []

    def row(name: str, ms: float, floor_bytes: int, err: float | None = None) -> None:
        floor = max(mm_floor, floor_bytes / bw * 1e3)
        rows.append(dict(name=name, ms=ms, floor_ms=floor, vs_floor=ms / floor, max_err=err))
        print(f"{name:40s} {ms:8.4f} ms  {ms / floor:5.2f}x floor" + (f"  err {err:.3g}" if err is not None else ""))

    def fwd_ref(x, w1, b1):
        h = F.linear(x, w1, b1)
        return h, F.gelu(h, approximate="tanh")

    def bwd_ref(dy, w2, h):
        hf = h.float()
        t = torch.tanh(0.7978845608028654 * (hf + 0.044715 * hf * hf * hf))
        dg = (dy @ w2).float()
        dh = dg * (0.5 * (1 + t) + 0.5 * hf * (1 - t * t) * 0.7978845608028654 * (1 + 3 * 0.044715 * hf * hf))
        return dh.to(h.dtype), (0.5 * hf * (1 + t)).to(h.dtype), dh.sum(0)

    fwd_c = torch.compile(fwd_ref)
    bwd_c = torch.compile(bwd_ref)
    h_ref, g_ref = fwd_c(x, w1, b1)
    dh_ref, g2_ref, db_ref = bwd_c(dy, w2, h)

    def err(out, ref) -> float:
        return (out.float() - ref.float()).abs().max().item()

    # Bytes beyond the matmul's operands: forward writes h and g; backward reads h, writes dh and g.
    eb = 2 * M * N * 2
    bb = 3 * M * N * 2
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, M={M} C={C} 4C={N} bf16; copy "
        f"{bw / 1e9:.0f} GB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s, matmul floor {mm_floor:.4f} ms"
    )
    row("cublas mm (x @ W1.T + b1)", bench(lambda: F.linear(x, w1, b1)), M * N * 2)
    row("ours mm (no epilogue)", bench(lambda: gm.mm_gelu(x, w1.t(), gm.EPILOGUE_NONE, bias=b1)), M * N * 2,
        err(gm.mm_gelu(x, w1.t(), gm.EPILOGUE_NONE, bias=b1)[0], h_ref))  # fmt: skip
    row("fwd inductor (addmm + gelu)", bench(lambda: fwd_c(x, w1, b1)), eb)
    out = gm.mm_gelu(x, w1.t(), gm.EPILOGUE_GELU, bias=b1)
    row("fwd ours (mm + gelu epilogue)", bench(lambda: gm.mm_gelu(x, w1.t(), gm.EPILOGUE_GELU, bias=b1)), eb,
        max(err(out[0], h_ref), err(out[1], g_ref)))  # fmt: skip
    row("cublas mm (dy @ W2)", bench(lambda: dy @ w2), M * N * 2)
    row("bwd inductor (mm + gelu bwd + sum)", bench(lambda: bwd_c(dy, w2, h)), bb)
    out = gm.mm_gelu(dy, w2, gm.EPILOGUE_DGELU, bias=b1, h=h)
    row("bwd ours (mm + dgelu epilogue)", bench(lambda: gm.mm_gelu(dy, w2, gm.EPILOGUE_DGELU, bias=b1, h=h)), bb,
        max(err(out[0], dh_ref), err(out[1], g2_ref)))  # fmt: skip
    print(f"  db max err {err(out[2], db_ref):.3g} (|db| max {db_ref.abs().max().item():.3g})")
    # cuBLASLt epilogues (trainer/compile/kernels/cublaslt.py).
    from trainer.compile.kernels import cublaslt as lt

    def addmm_gelu():
        return torch._addmm_activation(b1, x, w1.t(), use_gelu=True)

    row("fwd torch._addmm_activation (gelu, no h)", bench(addmm_gelu), M * N * 2, err(addmm_gelu(), g_ref))
    h_buf = torch.empty_like(h)
    try:
        g_lt = lt.matmul(x, w1.t(), lt.EPILOGUE_GELU_AUX_BIAS, bias=b1, aux=h_buf)
        row("fwd cublaslt GELU_AUX_BIAS", bench(lambda: lt.matmul(x, w1.t(), lt.EPILOGUE_GELU_AUX_BIAS, bias=b1,
            aux=h_buf)), eb, max(err(g_lt, g_ref), err(h_buf, h_ref)))  # fmt: skip
        db_lt = torch.empty(N, device="cuda", dtype=bf)
        dh_lt = lt.matmul(dy, w2, lt.EPILOGUE_DGELU_BGRAD, bias=db_lt, aux=h)
        row("bwd cublaslt DGELU_BGRAD (no g)", bench(lambda: lt.matmul(dy, w2, lt.EPILOGUE_DGELU_BGRAD, bias=db_lt,
            aux=h)), 2 * M * N * 2, err(dh_lt, dh_ref))  # fmt: skip
        print(f"  db max err {err(db_lt, db_ref):.3g}")
        gelu_c = torch.compile(lambda h: F.gelu(h, approximate="tanh"))

        def bwd_lt():
            dh = lt.matmul(dy, w2, lt.EPILOGUE_DGELU_BGRAD, bias=db_lt, aux=h)
            return dh, gelu_c(h)

        row("bwd cublaslt DGELU_BGRAD + g kernel", bench(bwd_lt), bb)
        row("fwd+bwd inductor", bench(lambda: (fwd_c(x, w1, b1), bwd_c(dy, w2, h))), eb + bb)
        row("fwd+bwd cublaslt", bench(lambda: (lt.matmul(x, w1.t(), lt.EPILOGUE_GELU_AUX_BIAS, bias=b1, aux=h_buf),
            bwd_lt())), eb + bb)  # fmt: skip
    except lt.CublasLtError as e:
        print(f"cublaslt: {e}")
    if a.max_autotune:
        opts = dict(mode="max-autotune-no-cudagraphs")
        fwd_m, bwd_m = torch.compile(fwd_ref, **opts), torch.compile(bwd_ref, **opts)
        row("fwd inductor max-autotune", bench(lambda: fwd_m(x, w1, b1)), eb)
        row("bwd inductor max-autotune", bench(lambda: bwd_m(dy, w2, h)), bb)

    sweep: list[dict] = []
    if a.sweep:
        print("sweep (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages): fwd ms, bwd ms")
        for bm, bn, bk, warps, stages in itertools.product((64, 128, 256), (128, 256), (64,), (4, 8), (3, 4, 5)):
            if bm * bn > 128 * 256 or (bm * bn >= 128 * 256 and warps == 4):
                continue
            tile = (bm, bn, bk, 8, warps, stages)
            res = {"tile": tile}
            for name, fn in (
                ("fwd", lambda tile=tile: gm.mm_gelu(x, w1.t(), gm.EPILOGUE_GELU, bias=b1, tile=tile)),
                ("bwd", lambda tile=tile: gm.mm_gelu(dy, w2, gm.EPILOGUE_DGELU, bias=b1, h=h, tile=tile)),
            ):
                try:
                    res[name] = bench(fn)
                except Exception as e:  # out of shared memory or registers for this tile
                    res[name] = None
                    res[name + "_error"] = type(e).__name__
            sweep.append(res)
            f = f"{res['fwd']:.4f}" if res["fwd"] else res.get("fwd_error")
            b = f"{res['bwd']:.4f}" if res["bwd"] else res.get("bwd_error")
            print(f"  {tile}: {f}, {b}")
        for name in ("fwd", "bwd"):
            ok = [r for r in sweep if r[name]]
            if ok:
                best = min(ok, key=lambda r: r[name])
                print(f"best {name}: {best['tile']} {best[name]:.4f} ms")
    if a.out:
        info = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw=bw, matmul_peak=peak)
        Path(a.out).write_text(json.dumps(dict(**info, rows=rows, sweep=sweep), indent=1))


if __name__ == "__main__":
    main()
