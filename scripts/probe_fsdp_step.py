"""What one FSDP2 training step does on the host: ours (the Trainer, compiled blocks) against a hand-written eager
FSDP2 loop, counted per step with torch.profiler (CPU activities) on rank 0.

    torchrun --nproc-per-node 2 scripts/probe_fsdp_step.py --variant ours-fsdp
    torchrun --nproc-per-node 2 scripts/probe_fsdp_step.py --variant fsdp-eager
    python scripts/probe_fsdp_step.py --variant ours-fsdp --fake-world 2     # one process, a fake process group
    torchrun --nproc-per-node 2 scripts/probe_fsdp_step.py --variant ours-fsdp --device cuda --n-head 12 \
        --n-embd 768 --vocab 50304 --seq 1024 --batch 16 --timed 10        # gpt2-small on 2 GPUs

``--fake-world N`` runs rank 0 of N alone on torch's fake process group (collectives do nothing), so the step's host
work is timed without communication or a second process competing for the CPU. The eager loop mirrors the GPU
baseline (bf16 parameters and autocast, fused AdamW, ``clip_grad_norm_``) unless ``--cpu-baseline``.

Prints the host time per step and, per step, how often the ops that matter for host overhead ran: collectives, host
syncs (``aten::item``/``_local_scalar_dense``), DTensor redistributions, compiled regions, FSDP hooks.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WATCH = ("item", "_local_scalar_dense", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
         "_reduce_scatter", "wait_tensor", "full_tensor", "redistribute", "Torch-Compiled Region", "CompiledFunction",
         "FSDP::", "Optimizer.step", "synchronize", "record_stream", "cudaStreamSynchronize", "cudaDeviceSynchronize",
         "cudaEventSynchronize", "cudaMemcpy", "_foreach_norm", "linalg_vector_norm")  # fmt: skip


def eager_loop(a, on_step) -> None:
    """The hand-written FSDP2 loop (scripts/bench_ddp.py's fsdp-eager), GPU settings unless --cpu-baseline."""
    import torch

    from scripts._user_loop import user_fsdp, user_model_and_data, user_step

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    cuda = a.device == "cuda"
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    like_gpu = cuda or not a.cpu_baseline
    shape = {"n_layer": a.n_layer, "n_head": a.n_head, "n_embd": a.n_embd}
    model, batches = user_model_and_data(a.preset, a.vocab, a.seq, a.batch, dev, rank=rank, world_size=world, **shape)
    step = user_step(model, user_fsdp(model, bf16=like_gpu), batches, dev, like_gpu=like_gpu)
    for i in range(a.steps):
        loss = step(i)
        on_step()
    float(loss)


def ours(a, on_step) -> None:
    from torch.optim.lr_scheduler import LambdaLR

    from scripts import bench_ddp

    orig = LambdaLR.step

    def step(self, *args, **kw):  # called once per training step by the loop (and once by LambdaLR.__init__)
        orig(self, *args, **kw)
        if getattr(self, "_probe_started", False):
            on_step()
        self._probe_started = True

    LambdaLR.step = step
    a.warmup, a.bucket_mb, a.ours_bucket_mb = 0, 25.0, 100.0
    like_gpu = [] if a.cpu_baseline else ["train.precision=bf16", "optim.impl=fused"]
    bench_ddp.run_ours(a, [*bench_ddp.VARIANTS["ours-fsdp"]["overrides"], *like_gpu])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", default="ours-fsdp", choices=["ours-fsdp", "fsdp-eager"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=32)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--skip", type=int, default=3, help="steps before the profiled ones")
    p.add_argument("--profiled", type=int, default=4, help="profiled steps")
    p.add_argument("--timed", type=int, default=0, help="after the profiled steps, this many steps timed alone")
    p.add_argument("--extra", action="append", default=[], help="trainer overrides (ours)")
    p.add_argument("--top", type=int, default=0)
    p.add_argument("--stacks", default="", help="comma-separated op names whose callers to print")
    p.add_argument("--fake-world", type=int, default=0)
    p.add_argument("--cpu-baseline", action="store_true", help="the loops as bench_ddp runs them on the CPU")
    a = p.parse_args()
    import torch
    import torch.distributed as dist

    if a.fake_world:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        os.environ.update(WORLD_SIZE=str(a.fake_world), RANK="0", LOCAL_RANK="0")
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=a.fake_world)
        init = dist.init_process_group
        dist.init_process_group = lambda *args, **kw: None if dist.is_initialized() else init(*args, **kw)
    elif a.variant == "fsdp-eager" and "WORLD_SIZE" in os.environ:  # ours: the Trainer creates its own group
        if a.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
    torch.set_num_threads(1)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    acts = [torch.profiler.ProfilerActivity.CPU]
    if a.device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    sched = torch.profiler.schedule(wait=a.skip, warmup=1, active=a.profiled, repeat=1)
    prof = torch.profiler.profile(activities=acts, schedule=sched, with_stack=bool(a.stacks))
    a.steps = a.skip + 1 + a.profiled + a.timed + 1
    stamps: list[float] = []

    def on_step():  # no device sync: on a GPU the interval is the host's issue time per step (the loop paces it)
        stamps.append((time.perf_counter(), time.process_time()))
        prof.step()

    with prof:
        (ours if a.variant == "ours-fsdp" else eager_loop)(a, on_step)
    if not rank0:
        return
    n = a.profiled
    world = os.environ.get("WORLD_SIZE", 1)
    steps = [e for e in prof.events() if e.name.startswith("ProfilerStep")]
    times = sorted(e.cpu_time_total / 1e3 for e in steps) or [float("nan")]
    pairs = list(zip(stamps, stamps[1:]))[a.skip + 1 + a.profiled :]
    wall = [(t1[0] - t0[0]) * 1e3 for t0, t1 in pairs]
    cpu = [(t1[1] - t0[1]) * 1e3 for t0, t1 in pairs]  # this process's CPU time: robust to other load
    print(f"\n== {a.variant} world {world}{' (fake pg)' if a.fake_world else ''}: profiled wall ms/step "
          f"{[round(t, 1) for t in times]}"
          + (f"; unprofiled: wall ms/step median {statistics.median(wall):.1f}, process CPU ms/step median "
             f"{statistics.median(cpu):.1f} (min {min(cpu):.1f})" if pairs else ""))  # fmt: skip
    print("-- watched ops (block numbers as N): calls per step, cpu total ms per step")
    grouped = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.key_averages():
        if any(w.lower() in e.key.lower() for w in WATCH):
            g = grouped[re.sub(r"\d+", "N", e.key)]
            g[0] += e.count
            g[1] += e.cpu_time_total
    for key, (count, total) in sorted(grouped.items()):
        print(f"  {count / n:8.1f}  {total / 1e3 / n:8.2f} ms  {key[:110]}")
    # Where the step's host time goes: top-level phases (FSDP hooks are nested in forward/backward).
    phases = collections.defaultdict(float)
    for e in prof.events():
        k = e.name
        if k.startswith("FSDP::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("FSDP::")):
            phases["FSDP hooks (all)"] += e.cpu_time_total
        elif k.startswith("Optimizer.step"):
            phases["optimizer step"] += e.cpu_time_total
        elif "clip_grad" in k or "_get_total_norm" in k:
            phases.setdefault("_clip_marker", 0)
        elif k.startswith("Torch-Compiled Region") and (e.cpu_parent is None or "Compiled" not in e.cpu_parent.name):
            phases["compiled regions (forward, incl. guards)"] += e.cpu_time_total
        elif k == "autograd::engine::evaluate_function: CompiledFunctionBackward":
            phases["compiled backward nodes"] += e.cpu_time_total
    phases.pop("_clip_marker", None)
    print("-- host ms per step by phase: " + ", ".join(f"{k} {v / 1e3 / n:.1f}" for k, v in phases.items()))
    if a.top:
        print(f"-- top {a.top} by self cpu ms per step")
        for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[: a.top]:
            print(f"  {e.count / n:8.1f}  {e.self_cpu_time_total / 1e3 / n:8.2f} ms  {e.key[:110]}")
    for name in filter(None, a.stacks.split(",")):
        print(f"-- callers of {name} (calls per step)")
        chains = collections.Counter()
        for e in prof.events():
            if e.name != name:
                continue
            chain, q = [], e.cpu_parent
            while q is not None and len(chain) < 14:
                if not q.name.startswith(("aten::", "torch/_ops", "<built-in")):
                    chain.append(q.name[:100])
                q = q.cpu_parent
            chains[tuple(chain)] += 1
        for chain, count in chains.most_common(8):
            print(f"  {count / n:8.1f}")
            for fr in chain:
                print(f"            {fr}")
    from torch._dynamo.utils import counters

    print("-- dynamo counters:", {f"{k}.{kk}": vv for k, v in counters.items() for kk, vv in v.items()})


if __name__ == "__main__":
    main()
