"""Training-step benchmark on one GPU: eager, plain torch.compile, and ours, same model, batch and dtype.

    python scripts/bench_step.py                      # gpt2-small and gpt2-medium, B=16, T=1024, bf16
    python scripts/bench_step.py --models nanogpt-124m,hf-gpt2-124m,hf-llama-1b --variants torch.compile,ours
    python scripts/bench_step.py --models hf-llama-1b --batch 8
    python scripts/bench_step.py --models gpt2-small --variants eager,torch.compile,ours,ours-model
    python scripts/bench_step.py --variants torch.compile,ours,ours@compile.mode=max-autotune-no-cudagraphs
    python scripts/bench_step.py --variants ours,ours@env:TORCHINDUCTOR_MIX_ORDER_REDUCTION=0

Each variant runs in its own process (so compile caches, Dynamo state and the CUDA allocator
start clean) and reports tokens/s (over the timed steps; see Timing), MFU against the 989 TFLOP/s
spec and against the bf16 matmul peak measured in this run, peak memory and first-step time
(compile included). Cold vs warm compile cache: "ours" variants run once with an empty
cache directory and once more with the one the first run filled. ``BENCH_TRACE=dir`` also writes each
variant's GPU timeline there (timings then include the profiler); ``scripts/trace_gaps.py`` reads it.

Models (``scripts/_models.py``): the built-in GPT-2 124M and 350M, a user's nanoGPT-shaped GPT-2 124M
(``scripts/nanogpt_model.py``, through ``model.target``) and Hugging Face GPT-2 124M and Llama-3.2-1B shapes from
their configs (``model.hf``), each at its own batch and length unless ``--batch``/``--seq`` say otherwise.
Baselines are written as a user writes them: ``torch.compile(model)`` (or not), fused AdamW,
``clip_grad_norm_``, bf16 autocast, batches from the same data loader. "ours" is ``trainer fit`` (the Trainer)
as shipped for the GPU (``compile.enabled``, ``compile.cudagraphs`` and ``compile.kernels`` left at ``auto``:
compiled with our kernels substituted, the whole step one CUDA graph); ``ours-*`` variants name other settings.
Several models share one JSON (``--out``). MFU counts attention (6N + 12·L·C·T, or the model's own count).

Timing: the baselines' timed steps run back to back with one wait at the end (the GPU's step time, no
host sync between steps); ``torch.compile-synced`` times each step to a ``torch.cuda.synchronize()`` as
nanoGPT's loop does, which leaves the GPU idle while the next step launches. Ours reports the Trainer's
median step time, on the GPU between the events recorded after each step (its loss read one step late).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts._models import MODELS, spec  # noqa: E402

SPEC_PEAK = 989e12  # H100/H200 SXM dense bf16

_ON = ["compile.enabled=true", "compile.cudagraphs=false"]  # compiled, not graphed
VARIANTS = {
    "eager": {"kind": "user", "compile": False},
    "torch.compile": {"kind": "user", "compile": True},
    "torch.compile-synced": {"kind": "user", "compile": True, "synced": True},
    # torchao's float8 loop: convert_to_float8_training (tensorwise; every linear but the LM head, as the torchao
    # README writes it), then torch.compile(model). Against ours@train.precision=fp8.
    "torch.compile-fp8": {"kind": "user", "compile": True, "fp8": True},
    "ours": {"kind": "ours", "overrides": []},  # as shipped: the defaults' fast path
    "ours-model": {"kind": "ours", "overrides": [*_ON, "compile.scope=model"]},
    "ours-model-fused": {"kind": "ours", "overrides": [*_ON, "compile.scope=model", "optim.impl=fused"]},
    "ours-model-ca": {"kind": "ours", "overrides": [*_ON, "compile.scope=model", "compile.autograd=true"]},
    "ours-blocks": {"kind": "ours", "overrides": [*_ON, "compile.scope=blocks"]},
    "ours-blocks-ca": {"kind": "ours", "overrides": [*_ON, "compile.scope=blocks", "compile.autograd=true"]},
    "ours-eager": {"kind": "ours", "overrides": ["compile.enabled=false"]},
}


def _common_overrides(a) -> list[str]:
    return [
        f"train.micro_batch_size={a.batch}",
        f"data.seq_len={a.seq}",
        "train.precision=bf16",
        f"train.steps={a.warmup + a.steps}",
        "train.eval_every=0",
        "train.eval_batches=1",
        "checkpoint.enabled=false",
        "log.progress=false",
        f"log.every={a.warmup + a.steps}",
        # The hand-written loop's seed and constant learning rate, so that the final losses compare.
        "seed=0",
        "schedule.warmup_steps=0",
        "schedule.decay=constant",
        *a.extra,
    ]


def run_user(a, compile_model: bool, synced: bool = False, fp8: bool = False) -> dict:
    """The loop a user writes around torch.compile(model) with fused AdamW; ``synced``: timed as nanoGPT does,
    waiting for each step (else the timed steps run back to back and the window is timed once); ``fp8``: torchao's
    float8 training on every linear but the LM head (and those with a dimension not a multiple of 16)."""
    import torch

    from scripts import _models
    from scripts._user_loop import user_data, user_step

    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = _models.build(a.model, a.cache_dir, a.seq).to(dev)
    if fp8:
        from torchao.float8 import convert_to_float8_training

        from scripts._user_loop import float8_linear

        convert_to_float8_training(model, module_filter_fn=float8_linear)
    batches = user_data(a.seq, a.batch, dev)
    step_fn = user_step(model, torch.compile(model) if compile_model else model, batches, dev)
    torch.cuda.reset_peak_memory_stats()
    from trainer.compile.report import CompileWatcher

    watcher = CompileWatcher().start()  # the compile's phases, as ours' compile report counts them
    t0 = time.perf_counter()
    loss = step_fn(0)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    watcher.stop()
    for step in range(1, a.warmup):
        loss = step_fn(step)
    torch.cuda.synchronize()
    if synced:  # nanoGPT's timing: the host waits for every step, so the GPU idles while the next one launches
        times = []
        for step in range(a.warmup, a.warmup + a.steps):
            t0 = time.perf_counter()
            loss = step_fn(step)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        per_step = sorted(times)[len(times) // 2]
    else:  # the steps queued back to back, one wait at the end: the GPU's own step time
        t0 = time.perf_counter()
        for step in range(a.warmup, a.warmup + a.steps):
            loss = step_fn(step)
        torch.cuda.synchronize()
        per_step = (time.perf_counter() - t0) / a.steps
    return {
        "tokens_per_s": a.batch * a.seq / per_step,
        "step_ms": per_step * 1e3,
        "first_step_s": first,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9,
        "final_loss": loss.item(),
        "compile_time_s": watcher.report()["compile_time_s"] if compile_model else None,
    }


def run_ours(a, overrides: list[str], cache_dir: str) -> dict:
    from scripts import _models
    from trainer.config import load_config
    from trainer.loop import Trainer

    run_dir = tempfile.mkdtemp(prefix="bench_step_")
    cfg = load_config(
        ROOT / "configs/gpt2-small.yaml",
        [*_models.overrides(a.model, cache_dir), *_common_overrides(a), *overrides, f"run.dir={run_dir}",
         f"compile.cache_dir={cache_dir}"],
    )  # fmt: skip
    s = Trainer(cfg).fit()
    median = s["median_step_s"]
    report = Path(run_dir) / "compile_report.json"
    facts = json.loads(report.read_text()) if report.exists() else {}
    kernels = facts.get("kernels", [])
    return {
        "tokens_per_s": a.batch * a.seq / median,
        "step_ms": median * 1e3,
        "first_step_s": s["first_step_s"],
        "peak_mem_gb": s["peak_mem_gb"],
        "final_loss": s["loss"],
        "kernels": {k["name"]: k["count"] for k in kernels},  # what the compile layer substituted
        "compile_time_s": facts.get("compile_time_s"),  # by phase (Dynamo, AOTAutograd, Inductor, ...)
        "kernels_compiled_beside": facts.get("kernels_compiled_beside"),  # trainer/ops/warm.py's process
    }


def model_flops(a) -> float:
    """Training FLOPs per token of ``a.model`` at ``a.seq`` (counted on a model without storage)."""
    import torch

    from scripts import _models

    with torch.device("meta"):
        return _models.flops_per_token(a.model, _models.build(a.model, tempfile.mkdtemp(), a.seq), a.seq)


def matmul_peak() -> float:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * 8192**3 * 20 / (start.elapsed_time(end) / 1e3)


def _spec(variant: str) -> dict:
    from scripts._variants import parse_variant

    return parse_variant(variant, VARIANTS)


def _worker(a) -> None:
    spec = _spec(a.worker)

    def run() -> dict:
        if spec["kind"] == "user":
            return run_user(a, spec["compile"], spec.get("synced", False), spec.get("fp8", False))
        return run_ours(a, spec["overrides"], a.cache_dir)

    from scripts._meta import gpu_timeline

    with gpu_timeline(a.worker):  # BENCH_TRACE=dir: the GPU timeline, for scripts/trace_gaps.py
        out = run()
    if os.environ.get("BENCH_COMPILE_TIMES"):  # torch's seconds per compile function, for where the first step goes
        from torch._dynamo.utils import compile_times

        print(compile_times(repr="str", aggregate=True), flush=True)
    print("RESULT " + json.dumps(out), flush=True)


def _spawn(a, variant: str, cache_dir: str, trace_dir: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, "--cache-dir", cache_dir, "--models", a.model,
           "--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps), "--warmup", str(a.warmup),
           *[f"--extra={e}" for e in a.extra]]  # fmt: skip
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "TRITON_CACHE_DIR": os.path.join(cache_dir, "triton"),
           **_spec(variant)["env"]}  # fmt: skip
    if trace_dir:
        env["BENCH_TRACE"] = trace_dir
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        print(f"[{variant}] failed (exit {r.returncode}):\n{r.stderr[-3000:]}", file=sys.stderr)
        return {"error": r.stderr[-1500:]}
    out = json.loads(lines[-1][len("RESULT ") :])
    out["process_wall_s"] = wall
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt2-small,gpt2-medium", help="comma-separated, of: " + ", ".join(MODELS))
    p.add_argument("--batch", type=int, help="micro-batch (default: each model's, scripts/_models.py)")
    p.add_argument("--seq", type=int, help="sequence length (default: each model's)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compile happens in step 1)")
    p.add_argument("--variants", default="eager,torch.compile,ours", help="known: " + ", ".join(VARIANTS))
    p.add_argument("--warm-cache", default="", help="variants to rerun with a warm compile cache, e.g. ours")
    p.add_argument("--extra", action="append", default=[], help="extra trainer overrides for 'ours' variants")
    p.add_argument("--out", default=str(ROOT / "scripts/results/bench_step/result.json"))
    p.add_argument("--trace", metavar="DIR", help="then rerun every variant (warm cache) with its GPU timeline "
                   "written to DIR and print scripts/trace_gaps.py's breakdown (not in the table)")  # fmt: skip
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        a.model = a.models
        return _worker(a)

    import torch
    import triton

    variants = a.variants.split(",")
    for v in variants:
        _spec(v)
    peak = matmul_peak()
    from scripts._meta import git_sha

    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "git_sha": git_sha(), "steps": a.steps, "warmup": a.warmup, "matmul_peak_tflops": peak / 1e12,
           "models": {}}  # fmt: skip
    names = a.models.split(",")
    for name in names:
        spec(name)
    batch, seq = a.batch, a.seq

    def record(results: dict, name: str, r: dict) -> None:
        """Keep a result and rewrite the JSON: a run cut short keeps what finished."""
        if "tokens_per_s" in r:
            flops = doc["models"][a.model]["flops_per_token"] * r["tokens_per_s"]
            r["mfu_spec"] = flops / SPEC_PEAK
            r["mfu_measured_peak"] = flops / peak
        results[name] = r
        print(f"{a.model} {name}: {r}", flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc, indent=1))

    for name in names:
        a.model, a.batch, a.seq = name, batch or spec(name)["batch"], seq or spec(name)["seq"]
        results, caches = {}, {}
        doc["models"][name] = {"batch": a.batch, "seq_len": a.seq, "flops_per_token": model_flops(a),
                               "results": results}  # fmt: skip
        for v in variants:
            caches[v] = tempfile.mkdtemp(prefix="cache_")
            record(results, v, _spawn(a, v, caches[v]))
        for v in filter(None, a.warm_cache.split(",")):
            if v in caches:
                record(results, v + " (warm cache)", _spawn(a, v, caches[v]))
        if a.trace:
            _trace(a, variants, caches)
    print(table(doc))


def _trace(a, variants: list[str], caches: dict) -> None:
    from scripts._meta import trace_file
    from scripts.trace_gaps import analyse

    os.makedirs(a.trace, exist_ok=True)
    for v in variants:
        r = _spawn(a, v, caches[v], trace_dir=a.trace)
        path = trace_file(a.trace, v)
        print(f"[traced] {v}: {r.get('tokens_per_s', 0) / 1e3:.0f}K tok/s under the profiler", flush=True)
        if os.path.exists(path):
            print(analyse(path, steps=3, step_kernel="adam"), flush=True)


def table(doc: dict) -> str:
    """The results as a Markdown table, one row per model and variant, ratios against torch.compile."""
    lines = [f"\n{doc['gpu']}, torch {doc['torch']}, bf16; bf16 matmul peak measured "
             f"{doc['matmul_peak_tflops']:.0f} TFLOP/s; git {doc['git_sha']}",
             "| model | B x T | variant | tokens/s | vs torch.compile | MFU (989 spec) | MFU (measured peak) "
             "| peak mem GB | first step s |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for preset, m in doc["models"].items():
        bt = f"{m['batch']} x {m['seq_len']}"
        base = m["results"].get("torch.compile", {}).get("tokens_per_s")
        for v, r in m["results"].items():
            if "tokens_per_s" not in r:
                lines.append(f"| {preset} | {bt} | {v} | failed | | | | | |")
                continue
            ratio = f"{r['tokens_per_s'] / base:.3f}x" if base else "-"
            mfu = f"{r['mfu_spec'] * 100:.1f}% | {r['mfu_measured_peak'] * 100:.1f}%"
            lines.append(f"| {preset} | {bt} | {v} | {r['tokens_per_s'] / 1e3:.1f}K | {ratio} | {mfu} | "
                         f"{r['peak_mem_gb']:.1f} | {r['first_step_s']:.1f} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
