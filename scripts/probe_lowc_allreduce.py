"""Contention probe, 2+ GPUs under torchrun: how much a gradient all-reduce running beside compute slows it,
NCCL's kernels vs torch's copy-engine ("low-contention") reduce-scatter + all-gather.

    torchrun --nproc-per-node 2 scripts/probe_lowc_allreduce.py [--mb 475] [--matmuls 200] [--out probe.json]

Why: at 2 GPUs the DDP step loses ~1.4 ms of compute to the NCCL kernels that share the SMs with the backward,
more than the 0.4 ms of exposed communication (scripts/results/notes_ddp_tail.md). torch's symmetric memory has
reduce-scatter and all-gather whose transfers are ``copy_`` calls on peer-mapped buffers (copy engines), only the
reduction and the barriers run on SMs (``torch.ops.symm_mem._low_contention_reduce_scatter`` / ``_all_gather``).
This measures, per rank, on separate streams: a loop of bf16 matmuls of gpt2-small's MLP shapes alone, with an
NCCL all-reduce of ``--mb`` MiB of fp32 beside it, and with the low-contention pair beside it; then each reduction
alone; and checks the two reductions give the same sum. It decides whether DataParallel should reduce that way.
Measured in session 8: scripts/results/probe_{475,100}.json, notes_ddp_tail.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=475.0, help="MiB of fp32 gradients reduced (gpt2-small: 475)")
    p.add_argument("--matmuls", type=int, default=200, help="matmul pairs in the compute loop (~0.2 ms each)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out")
    a = p.parse_args()

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    name = dist.group.WORLD.group_name
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.9, a no-op (deprecated) after
        symm_mem.enable_symm_mem_for_group(name)

    n = int(a.mb * 2**20 / 4)
    n -= n % world
    torch.manual_seed(rank)
    grads = symm_mem.empty(n, dtype=torch.float32, device=dev)
    grads.normal_()
    symm_mem.rendezvous(grads, name)
    plain = grads.clone()  # NCCL reduces this one in place
    x = torch.randn(16384, 768, device=dev, dtype=torch.bfloat16)
    w = torch.randn(768, 3072, device=dev, dtype=torch.bfloat16)
    h = torch.empty(16384, 3072, device=dev, dtype=torch.bfloat16)
    y = torch.empty(16384, 768, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    backend = symm_mem._get_backend_stream()

    def compute() -> None:
        for _ in range(a.matmuls):
            torch.mm(x, w, out=h)
            torch.mm(h, w.t(), out=y)

    def nccl() -> torch.Tensor:
        dist.all_reduce(plain)
        return plain

    def lowc() -> torch.Tensor:
        shard = torch.ops.symm_mem._low_contention_reduce_scatter(grads, "sum", name)
        out = torch.ops.symm_mem._low_contention_all_gather(shard, name)
        torch.cuda.current_stream().wait_stream(backend)  # the ops run on torch's backend stream
        return out

    scratch = torch.empty(world - 1, n // world, device=dev, dtype=torch.float32)
    handle = symm_mem.rendezvous(grads, name)

    def ce_inplace() -> torch.Tensor:
        """In-place all-reduce of ``grads`` with copy-engine transfers: pull the peers' copies of this rank's
        chunk, add them on the SMs (the only SM work besides the barriers), then pull the peers' reduced chunks."""
        chunk = n // world
        mine = grads[rank * chunk : (rank + 1) * chunk]
        handle.barrier(channel=0)  # every rank's gradients are complete
        peers = [(rank + s) % world for s in range(1, world)]
        for i, peer in enumerate(peers):
            scratch[i].copy_(handle.get_buffer(peer, (chunk,), torch.float32, rank * chunk))
        mine.add_(scratch.sum(0) if world > 2 else scratch[0])
        handle.barrier(channel=1)  # every rank's chunk is reduced (and the peers are done reading this one)
        for peer in peers:
            grads[peer * chunk : (peer + 1) * chunk].copy_(
                handle.get_buffer(peer, (chunk,), torch.float32, peer * chunk)
            )
        handle.barrier(channel=2)  # the peers have read this rank's chunk: the buffer may be written again
        return grads

    def run(comp, comm) -> tuple[float | None, float | None]:
        """(compute ms, communication ms) from a common start, each on its own stream."""
        cur = torch.cuda.current_stream()
        torch.cuda.synchronize()
        dist.barrier()
        start, comp_end, comm_end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record(cur)
        if comm is not None:
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                comm()
                comm_end.record(side)
        if comp is not None:
            comp()
            comp_end.record(cur)
        cur.wait_stream(side)
        torch.cuda.synchronize()
        return (
            start.elapsed_time(comp_end) if comp is not None else None,
            start.elapsed_time(comm_end) if comm is not None else None,
        )

    # Same sum both ways (fp32, two or more addends in rank order: compare with a tolerance, not bits).
    plain.copy_(grads)
    with torch.cuda.stream(side):
        ref, got = nccl().clone(), lowc()
        got_ce = ce_inplace()
    torch.cuda.synchronize()
    max_diff = (ref - got).abs().max().item()
    max_diff_ce = (ref - got_ce).abs().max().item()
    modes = {
        "compute alone": (compute, None),
        "compute + nccl all-reduce": (compute, nccl),
        "compute + low-contention rs+ag": (compute, lowc),
        "compute + copy-engine in-place all-reduce": (compute, ce_inplace),
        "nccl all-reduce alone": (None, nccl),
        "copy-engine in-place all-reduce alone": (None, ce_inplace),
        "low-contention rs+ag alone": (None, lowc),
    }
    for comp, comm in modes.values():  # warm-up: cuBLAS, NCCL channels, symmetric-memory workspaces
        run(comp, comm)
    rows = {}
    for label, (comp, comm) in modes.items():
        times = [run(comp, comm) for _ in range(a.repeats)]
        rows[label] = {
            "compute_ms": statistics.median(t[0] for t in times) if comp is not None else None,
            "comm_ms": statistics.median(t[1] for t in times) if comm is not None else None,
        }
    if rank == 0:
        base = rows["compute alone"]["compute_ms"]
        print(f"{torch.cuda.get_device_name()} x{world}, torch {torch.__version__}, {a.mb:g} MiB fp32, "
              f"{a.matmuls} matmul pairs; max |nccl - low-contention| {max_diff:.3g}, "
              f"max |nccl - copy-engine in place| {max_diff_ce:.3g}")  # fmt: skip
        print("| mode | compute ms | compute slowed by | communication ms |\n|---|---|---|---|")
        for label, r in rows.items():
            c, m = r["compute_ms"], r["comm_ms"]
            slowed = f"{c - base:+.2f} ms" if c is not None else "-"
            print(f"| {label} | {c if c is None else round(c, 2)} | {slowed} | {m if m is None else round(m, 2)} |")
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "world": world, "torch": torch.__version__,
                           "mb": a.mb, "max_abs_diff": max_diff,
                       "max_abs_diff_ce": max_diff_ce, "rows": rows}, f, indent=1)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
