"""Probe: does an L2 eviction hint make the cross-entropy row kernel's second read of each row hit L2?

The row kernel (``_linear_cross_entropy_kernel``) reads each row of the (N, V) logits twice (online max and
sum, then the gradient written in place). At gpt2-small's head (16384 x 50304 bf16, 1.65 GB) one read and one
write at ~3 TB/s is 1.1 ms. Sweep: block size, warps, rows per program, the kernel's L2 hints (pass-1 loads
``evict_last``, pass-2 loads and stores ``evict_first``) on and off. L2 flushed before each call (a 256 MB
write); CUDA events, median of 20.

    python scripts/probe_ce_evict.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.compile.kernels.linear_cross_entropy import _cross_entropy_rows_triton  # noqa: E402


def _median_ms(fn, flush: torch.Tensor, reps: int = 20) -> float:
    fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[reps // 2]


def main() -> None:
    n, v = 16384, 50304
    x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, v, (n,), device="cuda")
    loss = torch.empty(n, device="cuda")
    flush = torch.empty(2**28, device="cuda", dtype=torch.int8)
    gb = n * v * 2 / 1e9
    print(f"{torch.cuda.get_device_name()}, ({n}, {v}) bf16 logits, {gb:.2f} GB; floor = one read + one write")
    print("block  warps  rows  hints     ms   GB/s (read + write)")
    for block in (4096, 8192, 16384):
        for warps in (4, 8, 16):
            for rows in (1, 2):
                for hints in (False, True):

                    def run(block=block, warps=warps, rows=rows, hints=hints):
                        _cross_entropy_rows_triton(x, t, loss, -100, True, block, rows, warps, l2_hints=hints)

                    ms = _median_ms(run, flush)
                    bw = 2 * gb / ms * 1e3
                    print(f"{block:5d}  {warps:5d}  {rows:4d}  {hints!s:5}  {ms:6.3f}  {bw:5.0f}", flush=True)
    default = _median_ms(lambda: _cross_entropy_rows_triton(x, t, loss, -100, True), flush)
    print(f"default launch (hints on): {default:.3f} ms")


if __name__ == "__main__":
    main()
