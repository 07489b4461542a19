"""Data-parallel benchmark: tokens/s per GPU and scaling efficiency, torch's ways against ours.

    python scripts/bench_ddp.py --worlds 1,2                       # gpt2-small, B=16 per GPU, T=1024, bf16
    python scripts/bench_ddp.py --worlds 1,2,4,8 --preset gpt2-small,gpt2-medium --parallel 8
    python scripts/bench_ddp.py --worlds 2 --variants ours-ddp --steps 5   # a quick check

Every (variant, world) runs under ``torch.distributed.run`` in fresh processes. Variants:

- ``eager-ddp``: torch DDP (25 MB buckets), eager.
- ``ddpoptimizer``: ``model.compile()`` then torch DDP: Dynamo's DDPOptimizer splits the graph at
  its own byte-counted buckets (torch's default for compiled DDP).
- ``nosplit``: the same with ``torch._dynamo.config.optimize_ddp = False`` (one graph; all
  all-reduces after the whole backward).
- ``fsdp-eager``: FSDP2 ``fully_shard`` per block and root, bf16 parameters, fp32 reduction, eager.
- ``ours-ddp`` / ``ours-ddp-ca`` / ``ours-ddp-graphed`` / ``ours-fsdp``: ``trainer fit`` with strategy ddp
  (compiled, graph split at our bucket plan), the same with compiled autograd, the same with the whole
  step (all-reduces included) replayed as one CUDA graph (``compile.cudagraphs``; at world 1 the
  single-GPU graphed step), and fsdp (compiled blocks).

The baselines are loops a user writes: bf16 autocast, fused AdamW, ``clip_grad_norm_`` (1.0), the
same batches. They are timed over the whole window of timed steps with one synchronisation at each
end (no per-step sync, which would cost them a few percent). Ours reports the Trainer's median step
time. At world 1 every variant runs its own code path in one process (torch DDP and FSDP wrap a
world of one; the Trainer runs without a wrapper, as for any single-GPU run).

``--parallel N`` runs up to N (variant, world) jobs at once on disjoint GPUs of the machine, largest
worlds first, each job starting in turn when enough GPUs are free: NVLink pairs do not share links
on an NVSwitch machine, but say so when you report it. Several presets (``--preset a,b``) share one
queue; each gets its own JSON, rewritten after every job (a cut-off run keeps what finished).
Measured on 8 H200s: host-bound variants (DDPOptimizer's many graph pieces, eager FSDP) read up to
25% low while other jobs compile beside them (GPT-2 124M, DDPOptimizer, 1 GPU: 356K with five other
jobs vs 480K alone); the compiled, GPU-bound ones did not move. So the ``--solo`` variants (those
three by default) wait for the machine to be theirs alone, and every result says whether it ran
``alone``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPEC_PEAK = 989e12  # H100/H200 SXM dense bf16
# The hand-written loops' seed and constant learning rate (no warm-up, no decay), so that the final losses
# compare: every variant trains the same model on the same batches with the same hyperparameters.
SAME_AS_USER = ["seed=0", "schedule.warmup_steps=0", "schedule.decay=constant"]

_COMPILED = ["compile.enabled=true"]
VARIANTS = {
    "eager-ddp": {"kind": "user", "wrap": "ddp", "compile": False},
    "ddpoptimizer": {"kind": "user", "wrap": "ddp", "compile": True},
    "nosplit": {"kind": "user", "wrap": "ddp", "compile": True, "optimize_ddp": False},
    "fsdp-eager": {"kind": "user", "wrap": "fsdp", "compile": False},
    "ours-ddp": {"kind": "ours", "overrides": ["distributed.strategy=ddp", *_COMPILED, "compile.cudagraphs=false"]},
    "ours-ddp-ca": {"kind": "ours", "overrides": ["distributed.strategy=ddp", *_COMPILED, "compile.autograd=true"]},
    "ours-ddp-graphed": {"kind": "ours",
                         "overrides": ["distributed.strategy=ddp", *_COMPILED, "compile.cudagraphs=true"]},
    "ours-fsdp": {"kind": "ours", "overrides": ["distributed.strategy=fsdp", "compile.enabled=true"]},
}  # fmt: skip


def run_user(a, spec: dict) -> dict:
    """A hand-written data-parallel loop around torch DDP or FSDP2."""
    import torch
    import torch.distributed as dist

    from scripts._user_loop import user_fsdp, user_model_and_data, user_step

    world, rank, local = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    cuda = a.device == "cuda"
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo")
    if spec.get("optimize_ddp") is False:
        torch._dynamo.config.optimize_ddp = False
    model, batches = user_model_and_data(a.preset, a.vocab, a.seq, a.batch, dev, rank=rank, world_size=world,
                                         **_shape(a))  # fmt: skip
    if spec["wrap"] == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        if spec["compile"]:
            model.compile()  # then DDP: no graph breaks in DDP.forward (PYTORCH_NOTES)
        step_model = DDP(model, device_ids=[local] if cuda else None, bucket_cap_mb=a.bucket_mb)
    else:
        step_model = user_fsdp(model, bf16=cuda)
    step = user_step(model, step_model, batches, dev)

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    for i in range(a.warmup):
        loss = step(i)
    float(loss.detach().float().mean())
    sync()
    first = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(a.warmup, a.warmup + a.steps):
        loss = step(i)
    sync()
    per_step = (time.perf_counter() - t0) / a.steps
    out = {
        "tokens_per_s_per_gpu": a.batch * a.seq / per_step,
        "step_ms": per_step * 1e3,
        "warmup_s": first,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        "final_loss": float(loss.detach().float().mean()),
    }
    dist.destroy_process_group()
    return out


def run_ours(a, overrides: list[str]) -> dict:
    from trainer.config import load_config
    from trainer.loop import Trainer

    run_dir = tempfile.mkdtemp(prefix="bench_ddp_")
    common = [
        f"model.preset={a.preset}", f"train.micro_batch_size={a.batch}", f"data.seq_len={a.seq}",
        f"data.vocab_size={a.vocab}", f"train.steps={a.warmup + a.steps}", "train.eval_every=0",
        "train.eval_batches=1", "checkpoint.enabled=false", "log.progress=false", f"log.every={a.warmup + a.steps}",
        f"distributed.bucket_mb={a.ours_bucket_mb}", f"train.device={a.device}", f"run.dir={run_dir}",
        *SAME_AS_USER,
        f"compile.cache_dir={os.environ.get('TORCHINDUCTOR_CACHE_DIR', run_dir)}",
        *(["train.precision=bf16"] if a.device == "cuda" else []), *[f"model.{k}={v}" for k, v in _shape(a).items()],
    ]  # fmt: skip
    cfg = load_config(ROOT / "configs/gpt2-small.yaml", [*common, *overrides, *a.extra])
    s = Trainer(cfg).fit()
    return {
        "tokens_per_s_per_gpu": a.batch * a.seq / s["median_step_s"],
        "step_ms": s["median_step_s"] * 1e3,
        "warmup_s": s["first_step_s"],
        "peak_mem_gb": s.get("peak_mem_gb"),
        "final_loss": s["loss"],
    }


def _shape(a) -> dict:
    return {k: v for k, v in (("n_layer", a.n_layer), ("n_head", a.n_head), ("n_embd", a.n_embd)) if v}


def _worker(a) -> None:
    spec = _spec(a.worker)
    from scripts._meta import gpu_timeline

    with gpu_timeline(f"{a.worker}_w{os.environ.get('WORLD_SIZE', '1')}"):  # BENCH_TRACE: rank 0's timeline
        out = run_user(a, spec) if spec["kind"] == "user" else run_ours(a, spec["overrides"])
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(out), flush=True)


def visible_devices(gpus: list[int]) -> str:
    """A job's ``CUDA_VISIBLE_DEVICES`` for ``gpus``, indices into the GPUs this process sees: through its own
    ``CUDA_VISIBLE_DEVICES`` when it has one."""
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    return ",".join(seen.split(",")[g] if seen else str(g) for g in gpus)


def _spawn(a, preset: str, variant: str, world: int, gpus: list[int] | None, port: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", "--master-addr=127.0.0.1",
           f"--master-port={port}", __file__, "--worker", variant, *_pass_through(a, preset)]  # fmt: skip
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": a.cache_dir, "OMP_NUM_THREADS": "1",
           "TRITON_CACHE_DIR": os.path.join(a.cache_dir, "triton"), "PYTHONUNBUFFERED": "1",
           **_spec(variant)["env"]}  # fmt: skip
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(gpus)
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        print(f"[{preset} {variant} x{world}] timed out after {a.timeout} s", file=sys.stderr, flush=True)
        return {"error": f"timed out after {a.timeout} s"}
    wall = time.perf_counter() - t0
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        print(f"[{preset} {variant} x{world}] failed (exit {r.returncode}):\n{r.stderr[-4000:]}", file=sys.stderr,
              flush=True)  # fmt: skip
        return {"error": r.stderr[-2000:]}
    out = json.loads(lines[-1][len("RESULT ") :])
    out["process_wall_s"] = wall
    out["gpus"] = gpus
    return out


def _pass_through(a, preset: str) -> list[str]:
    args = ["--preset", preset, "--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps),
            "--warmup", str(a.warmup), "--vocab", str(a.vocab), "--device", a.device, "--bucket-mb", str(a.bucket_mb),
            "--ours-bucket-mb", str(a.ours_bucket_mb),
            *[f"--extra={e}" for e in a.extra]]  # fmt: skip
    for k in ("n_layer", "n_head", "n_embd"):
        if getattr(a, k):
            args += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    return args


def _spec(variant: str) -> dict:
    from scripts._variants import parse_variant

    return parse_variant(variant, VARIANTS)


class GpuPool:
    """Disjoint sets of GPUs for at most ``max_jobs`` jobs at once, in ticket order (no job overtakes another)."""

    def __init__(self, n: int, max_jobs: int):
        self.n = n
        self.free = set(range(n))
        self.max_jobs = max_jobs
        self.running = 0
        self.started = 0
        self.cond = threading.Condition()
        self.turn = 0  # the ticket allowed to start next

    def take(self, ticket: int, k: int) -> tuple[list[int], tuple[int, int]]:
        """``k`` free GPUs (``k = n``: the machine to itself) and a token for :meth:`give`."""
        with self.cond:
            self.cond.wait_for(lambda: self.turn == ticket and len(self.free) >= k and self.running < self.max_jobs)
            got = sorted(self.free)[:k]
            self.free -= set(got)
            self.running += 1
            self.started += 1
            self.turn += 1
            self.cond.notify_all()
            return got, (self.started, self.running)

    def give(self, gpus: list[int], token: tuple[int, int]) -> bool:
        """Return the GPUs; true when no other job ran at any time during this one."""
        with self.cond:
            started, running = token
            alone = running == 1 and self.started == started  # none beside it at the start, none started since
            self.free |= set(gpus)
            self.running -= 1
            self.cond.notify_all()
            return alone


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt2-small", help="model preset; several: comma-separated")
    p.add_argument("--n-layer", type=int)
    p.add_argument("--n-head", type=int)
    p.add_argument("--n-embd", type=int)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch", type=int, default=16, help="sequences per GPU")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compile happens in step 1)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="torch DDP's bucket_cap_mb (baselines)")
    p.add_argument("--ours-bucket-mb", type=float, default=100.0, help="distributed.bucket_mb for ours")
    p.add_argument("--worlds", default="1,2")
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated; 'ours-ddp@distributed.split_tail=false' adds trainer overrides, "
        "'eager-ddp@env:NCCL_MAX_CTAS=8' environment variables",
    )
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="jobs at once on disjoint GPUs (largest worlds first; each waits for the jobs before it)",
    )
    p.add_argument("--timeout", type=int, default=900, help="seconds per job")
    p.add_argument(
        "--solo",
        default="ddpoptimizer,fsdp-eager,ours-fsdp",
        help="with --parallel > 1, these variants get the machine to themselves (host-bound: they read "
        "low beside other jobs)",
    )
    p.add_argument("--extra", action="append", default=[], help="extra trainer overrides for 'ours' variants")
    p.add_argument(
        "--out",
        default=str(ROOT / "scripts/results/bench_ddp/{preset}.json"),
        help="JSON per preset ('{preset}' is replaced), rewritten after every job",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help="compile cache shared by all jobs (default: a new temporary directory)")
    a = p.parse_args()
    if a.worker:
        return _worker(a)
    a.cache_dir = a.cache_dir or tempfile.mkdtemp(prefix="bench_ddp_cache_")

    import torch

    presets = a.preset.split(",")
    worlds = sorted((int(w) for w in a.worlds.split(",")), reverse=True)
    variants = a.variants.split(",")
    for v in variants:
        _spec(v)
    n_gpus = torch.cuda.device_count() if a.device == "cuda" else 0
    if n_gpus and max(worlds) > n_gpus:
        raise SystemExit(f"--worlds: {max(worlds)} processes need {max(worlds)} GPUs; this machine has {n_gpus}")
    from scripts._meta import git_sha

    docs = {
        preset: {
            "gpu": torch.cuda.get_device_name() if n_gpus else "cpu",
            "gpus": n_gpus,
            "torch": torch.__version__,
            "git_sha": git_sha(),
            "preset": preset,
            "batch_per_gpu": a.batch,
            "seq_len": a.seq,
            "bucket_mb": a.bucket_mb,
            "ours_bucket_mb": a.ours_bucket_mb,
            "steps": a.steps,
            "warmup": a.warmup,
            "parallel": a.parallel,
            "results": {v: {} for v in variants},
        }  # fmt: skip
        for preset in presets
    }
    jobs = [(preset, v, w) for preset in presets for w in worlds for v in variants]
    pool = GpuPool(n_gpus or 1, max(1, a.parallel))
    lock = threading.Lock()

    solo = set(a.solo.split(",")) if a.parallel > 1 else set()

    def run(ticket: int, preset: str, v: str, w: int) -> None:
        k = (n_gpus if v.split("@")[0] in solo else w) if n_gpus else 1
        gpus, token = pool.take(ticket, k)
        try:
            res = _spawn(a, preset, v, w, gpus[:w] if n_gpus else None, 29500 + ticket % 500)
        finally:
            res_alone = pool.give(gpus, token)
        res["alone"] = res_alone  # false: other jobs ran beside it (host-bound variants read low then)
        with lock:
            docs[preset]["results"][v][str(w)] = res
            print(f"{preset} {v} x{w}: {res}", flush=True)
            out = Path(a.out.format(preset=preset))
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(docs[preset], indent=1))

    with ThreadPoolExecutor(len(jobs)) as ex:
        for f in [ex.submit(run, i, *job) for i, job in enumerate(jobs)]:
            f.result()
    for preset in presets:
        print(table(docs[preset]))
        for line in loss_outliers(docs[preset]):
            print(line, file=sys.stderr)


def loss_outliers(doc: dict, ratio: float = 1.25) -> list[str]:
    """A warning for each run whose final loss is over ``ratio`` times the median of the call's runs: a speed is
    worth nothing if the training it timed went wrong (a diverged run still runs at full speed)."""
    runs = [(v, w, r["final_loss"]) for v, by in doc["results"].items() for w, r in by.items() if "final_loss" in r]
    if len(runs) < 2:
        return []
    median = sorted(loss for *_, loss in runs)[(len(runs) - 1) // 2]  # the lower median: of two, the smaller
    return [
        f"{doc['preset']} {v} x{w}: final loss {loss:.3f}, over {ratio}x the (lower) median of this call's runs "
        f"({median:.3f}): check that run's training before using its speed (AdamW without warm-up can spike at "
        "one step, on some paths and not others: docs/troubleshooting.md)"
        for v, w, loss in runs
        if loss > ratio * median
    ]


def table(doc: dict) -> str:
    worlds = sorted({int(w) for r in doc["results"].values() for w in r})
    head = f"{doc['gpu']} x{doc['gpus']}, torch {doc['torch']}, {doc['preset']} B={doc['batch_per_gpu']}/GPU "
    ours = f", ours {doc['ours_bucket_mb']:g}" if "ours_bucket_mb" in doc else ""
    head += f"T={doc['seq_len']} bf16, buckets: torch {doc['bucket_mb']:g} MB{ours}; git {doc['git_sha'] or '-'}"
    cols = " | ".join(f"world {w} tok/s/GPU" for w in worlds)
    eff = " | ".join(f"scaling x{w}" for w in worlds if w > 1)
    lines = [head, f"| variant | {' | '.join(filter(None, [cols, eff]))} | peak mem GB (largest world) |",
             "|---" * (2 + len(worlds) + len([w for w in worlds if w > 1])) + "|"]  # fmt: skip
    for v, r in doc["results"].items():
        tps = {w: r.get(str(w), {}).get("tokens_per_s_per_gpu") for w in worlds}
        cells = [f"{tps[w] / 1e3:.0f}K" if tps[w] else "failed" if str(w) in r else "not run" for w in worlds]
        effs = [f"{tps[w] / tps[1] * 100:.1f}%" if tps.get(1) and tps[w] else "-" for w in worlds if w > 1]
        mem = r.get(str(worlds[-1]), {}).get("peak_mem_gb")
        lines.append(f"| {v} | {' | '.join(cells + effs)} | {f'{mem:.1f}' if mem else '-'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
