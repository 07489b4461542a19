"""Benchmark the MLP's GELU backward with the bias gradient (trainer.compile.kernels.linear_gelu) on GPT-2 shapes.

Times, on one GPU, the memory-bound part of ``h = gelu_tanh(x @ W.T + b)``'s backward at N tokens and
4C columns (gpt2-small: N = 16384, 4C = 3072, bf16):

- ``inductor``: ``torch.compile`` of ``dpre = gelu_backward(dh, pre); db = dpre.sum(0)``, what the compiled
  model runs (Inductor emits a pointwise kernel for dpre and a column reduction for db);
- ``ours``: ``gelu_tanh_backward_bias``, one pass writing dpre and partial column sums, then their sum.

The floor is the bytes that must move (read dh and pre, write dpre) over the copy bandwidth measured in the same
run (``torch.Tensor.copy_`` of 1 GiB). Prints a table and writes JSON.

    python scripts/bench_linear_gelu.py                    # on a GPU
    python scripts/bench_linear_gelu.py --n 16384 --h 4096 # gpt2-medium's 4C
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=16 * 1024, help="tokens (B * T)")
    p.add_argument("--h", type=int, default=3072, help="columns (the MLP's 4C)")
    p.add_argument("--out", type=Path, default=ROOT / "scripts/results/bench_linear_gelu.json")
    a = p.parse_args()
    import triton.testing

    from trainer.compile.kernels.linear_gelu import gelu_tanh_backward_bias

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    pre = torch.randn(a.n, a.h, device=dev, generator=g).to(torch.bfloat16)
    dh = torch.randn(a.n, a.h, device=dev, generator=g).to(torch.bfloat16)

    def reference(dh, pre):
        dpre = torch.ops.aten.gelu_backward(dh, pre, approximate="tanh")
        return dpre, dpre.sum(0)

    inductor = torch.compile(reference)
    inductor(dh, pre)
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=dev)  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), rep=200)
    bandwidth = 2 * src.nbytes / (copy_ms * 1e-3)  # read + write
    floor_ms = 3 * pre.nbytes / bandwidth * 1e3
    rows = {}
    for name, fn in (("inductor", lambda: inductor(dh, pre)), ("ours", lambda: gelu_tanh_backward_bias(dh, pre))):
        ms = triton.testing.do_bench(fn, rep=300)
        rows[name] = {"ms": ms, "vs_floor": ms / floor_ms}
    want, got = inductor(dh, pre), gelu_tanh_backward_bias(dh, pre)
    rows["ours"]["max_dpre_diff"] = (want[0].float() - got[0].float()).abs().max().item()
    db_err = (want[1].float() - got[1].float()).abs().max() / want[1].float().abs().max()
    rows["ours"]["max_dbias_rel_diff"] = db_err.item()
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": [a.n, a.h],
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "floor_ms": floor_ms,
        "rows": rows,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"{result['gpu']}, torch {torch.__version__}, ({a.n}, {a.h}) bf16; copy bandwidth {bandwidth / 1e9:.0f} GB/s,"
          f" floor (read dh, pre; write dpre) {floor_ms:.3f} ms")  # fmt: skip
    print("| | ms | vs floor |\n|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['ms']:.3f} | {r['vs_floor']:.2f}x |")
    print("ours vs inductor: max |dpre diff|", rows["ours"]["max_dpre_diff"], "db rel diff",
          rows["ours"]["max_dbias_rel_diff"])  # fmt: skip


if __name__ == "__main__":
    main()
