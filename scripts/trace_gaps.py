"""Where a data-parallel step's time goes, from a GPU timeline (``BENCH_TRACE=dir python scripts/bench_ddp.py``).

    python scripts/trace_gaps.py results/ours-ddp_w2.json.gz [more traces ...]

Steps are delimited by the optimizer kernel (the last kernel whose name matches ``--step-kernel``; matches
closer together than ``--cluster-ms`` are one step's, so raise it for an optimizer whose launches of one step lie
further apart, e.g. ``--cluster-ms 50`` for a 0.5 s step);
over the last ``--steps`` steps it prints: step time, time the compute streams are busy, NCCL
kernel time, NCCL time not overlapped with compute, compute-idle time (nothing running: the host or
an exposed wait), kernel time per category (matmul, attention, Triton kernels: Inductor's and ours,
optimizer with clipping, copies and casts outside compiled code (FSDP's copies in and out among them), NCCL,
other) and the largest kernels. Works as well for one GPU
(``BENCH_TRACE=dir python scripts/bench_step.py``).

With host events in the trace (``BENCH_TRACE_CPU=1``) it also splits the compute-idle time: a gap
between two compute kernels is the host's when the second kernel was launched after the first one
ended (the GPU ran out of work), otherwise a wait on the device (on NCCL, or an event).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict

CATEGORIES = [  # first match wins
    ("nccl", r"nccl"),
    # Copies and casts that are not Inductor's: FSDP's all-gather copy-in (a foreach copy, multi_tensor CopyFunctor),
    # copy-out (split_with_sizes), reduce-scatter copy-in (chunk_cat), dtype casts (direct_copy), torch.cat.
    ("copies", r"^(?!triton_).*(copy|chunk_cat|split_with_sizes)"),
    ("optimizer", r"adam|multi_tensor|foreach|sgd|sumsq"),  # with clipping's norm kernels (multi_tensor LpNorm)
    ("triton", r"^triton_|^_\w*_kernel$"),  # Inductor's (whatever they fused) and ours (_name_kernel)
    ("attention", r"flash|fmha|cudnn|attention|sdpa"),
    ("matmul", r"gemm|cutlass|nvjet|xmma|cublas|wgmma|splitk"),
    ("other", r""),
]


def category(name: str) -> str:
    return next(c for c, rx in CATEGORIES if re.search(rx, name, re.I))


def label(name: str) -> str:
    """A kernel's name for the list of the largest: its first 90 characters, and for torch's foreach kernels
    (``multi_tensor_apply_kernel<..., Functor<...>, ...>``, whose first 90 characters are alike) their functor."""
    functor = re.search(r"\w+Functor<[^<>]*>", name) if "multi_tensor_apply" in name else None
    return f"multi_tensor_apply_kernel {functor.group(0)}"[:90] if functor else name[:90]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(x, y) -> float:
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, b - a)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def analyse(path: str, steps: int, step_kernel: str, top_n: int = 20, cluster_ms: float = 1.0) -> str:
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    kernels.sort(key=lambda e: e["ts"])
    marks = [e["ts"] + e["dur"] for e in kernels if re.search(step_kernel, e["name"], re.I)]
    # One step may launch several optimizer kernels: keep the last of each cluster (gap > cluster_ms).
    ends = [t for i, t in enumerate(marks) if i + 1 == len(marks) or marks[i + 1] - t > cluster_ms * 1000]
    if len(ends) < steps + 1:
        return f"{path}: only {len(ends)} step boundaries found (kernel /{step_kernel}/)"
    lo, hi = ends[-steps - 1], ends[-1]
    window = [e for e in kernels if e["ts"] >= lo and e["ts"] + e["dur"] <= hi]
    compute_kernels = [e for e in window if "nccl" not in e["name"].lower()]
    nccl = _union([(e["ts"], e["ts"] + e["dur"]) for e in window if "nccl" in e["name"].lower()])
    compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in compute_kernels])
    total = hi - lo
    by_name: dict[str, float] = defaultdict(float)
    for e in window:
        by_name[label(e["name"])] += e["dur"]
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:top_n]
    per = 1e3 * steps  # us -> ms per step
    lines = [
        f"{path}: last {steps} steps",
        f"  step {total / per:.2f} ms | compute busy {_length(compute) / per:.2f} ms | compute idle "
        f"{(total - _length(compute)) / per:.2f} ms | nccl {_length(nccl) / per:.2f} ms, of it not under compute "
        f"{(_length(nccl) - _intersect(nccl, compute)) / per:.2f} ms | kernels/step {len(window) / steps:.0f}",
    ]
    by_cat: dict[str, float] = defaultdict(float)
    for e in window:
        by_cat[category(e["name"])] += e["dur"]
    lines.append("  by category: " + " | ".join(f"{c} {by_cat[c] / per:.2f} ms" for c, _ in CATEGORIES if by_cat[c]))
    launches = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver")  # Triton launches through the driver (cuLaunchKernel)
        and "correlation" in e.get("args", {})
        and "Launch" in e.get("name", "")
    }
    if launches and compute_kernels:
        lines.append("  " + _idle_split(compute_kernels, launches, per, lo))
    lines += [f"    {t / per:7.3f} ms  {n}" for n, t in top]
    return "\n".join(lines)


def _idle_split(compute: list[dict], launches: dict[int, float], per: float, start: float) -> str:
    """Compute-idle time from ``start`` on, split into the host's (next kernel launched late) and the device's."""
    host = device = 0.0
    busy_until = start
    for e in compute:
        gap = e["ts"] - busy_until
        if gap > 0:
            launched = launches.get(e["args"].get("correlation"))
            late = 0.0 if launched is None else min(gap, max(0.0, launched - busy_until))
            host += late
            device += gap - late
        busy_until = max(busy_until, e["ts"] + e["dur"])
    return (
        f"idle: host {host / per:.2f} ms (kernel launched after the GPU ran dry) | "
        f"device {device / per:.2f} ms (waits, kernel-to-kernel latency)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--step-kernel", default="adam")
    p.add_argument("--top", type=int, default=20, help="how many of the largest kernels (by name) to list")
    p.add_argument("--cluster-ms", type=float, default=1.0, help="step-kernel matches closer than this are one step's")
    a = p.parse_args()
    for t in a.traces:
        print(analyse(t, a.steps, a.step_kernel, a.top, a.cluster_ms))


if __name__ == "__main__":
    main()
