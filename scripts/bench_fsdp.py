"""Sharded-training (FSDP2) benchmark: tokens/s per GPU, MFU, peak memory and scaling of Llama-shaped Hugging Face
models, a hand-written torchtitan-style loop against ours.

    python scripts/bench_fsdp.py --plan hf-llama-1b:1:4:loop:none,hf-llama-1b:2:4:loop:none,hf-llama-1b:2:4:ours:none
    python scripts/bench_fsdp.py --models hf-llama-1b --worlds 1,2 --batch 4,8 --rows loop,ours --ac none
    python scripts/bench_fsdp.py --plan hf-llama-8b:2:2:loop:full,hf-llama-8b:2:2:ours:full,hf-llama-8b:2:4:ours:full
    python scripts/bench_fsdp.py --plan hf-llama-1b:2:8:ours:none,hf-llama-1b:2:8:ours@distributed.fsdp_unit_mb=0:none
    python scripts/bench_fsdp.py --device cpu --tiny --compile-backend aot_eager --steps 3 --warmup 1 \\
        --plan hf-llama-1b:2:2:loop:none hf-llama-1b:2:2:ours:none          # seconds, 2 gloo processes

A job is ``model:world:batch:row:ac``: a model of ``scripts/_models.py`` (``hf-llama-1b``: Llama-3.2-1B's shape,
``hf-llama-8b``: Llama-3-8B's), trained from a random initialisation at T=2048 in bf16 on ``world`` GPUs with
``batch`` sequences per GPU, activation checkpointing ``ac`` (none, full or selective) on every decoder layer.
``--plan`` lists jobs (run in that order); without it ``--models x --worlds x --batch x --rows x --ac`` make the
grid. Every job runs under ``torch.distributed.run --standalone`` in fresh processes. Rows:

- ``loop``: FSDP2 as torchtitan writes it, by hand: the transformers ``LlamaForCausalLM`` (sdpa attention) built
  from its config on the meta device; per decoder layer ``checkpoint_wrapper`` (non-reentrant; ``selective``
  with :func:`trainer.models.recompute.policy`), ``layer.compile()``, ``fully_shard`` (bf16 parameters, fp32
  gradient reduction); ``fully_shard`` on the root; ``to_empty`` on the GPU and Hugging Face's own initialisation
  of the shards; fused AdamW, ``clip_grad_norm_`` (1.0); random tokens drawn on the GPU each step. The loss is
  the trainer's (:class:`trainer.models.hf.HFCausalLM`: the LM head, logits upcast to fp32, cross-entropy), so
  both rows compute the same thing. Timed over the whole window of timed steps, one synchronisation at each end.
- ``loop-fp8``: the loop with torchtitan's float8 (``convert_to_float8_training`` before compile and
  ``fully_shard``: every linear but the LM head, tensorwise scales, the weights all-gathered in float8, their
  scales precomputed after each optimizer step). Ours in fp8 is ``ours@train.precision=fp8``.
- layouts (either row): ``@distributed.replicate=N``, ``@distributed.tp=N``, ``@distributed.cp=N`` and
  ``@data.seq_len=T`` (:data:`LAYOUT_KEYS`). The loop (scripts/_fsdp_loop.py) lays its ranks out as torchtitan's
  ``parallel_dims.py`` does: HSDP, tensor parallel with transformers' plan (``config.base_model_tp_plan``) and the
  clipping norm per mesh, torch's ``context_parallel`` around the forward and backward; each row is compared with the
  loop of its own layout. ``B`` is sequences per data-parallel rank: a TP x CP group shares them.
- ``ours``: ``trainer fit`` with ``distributed.strategy=fsdp`` and ``compile.enabled=true`` (blocks compiled,
  our kernels substituted, ``distributed.fsdp_unit_mb`` units, fused AdamW), on the embedded corpus (bytes, which
  fit any vocabulary). Its median step time. At world 1 the Trainer runs its single-GPU path (no sharding,
  whole-model compile, fp32 parameters under bf16 autocast), as for any one-process run; the loop shards over a
  world of one. ``ours@key=value`` adds trainer overrides to that job (``--extra`` to every ours job), so one
  call can A/B a setting; ``row@env:NAME=value`` sets an environment variable for the job (either row).

Each job reports tokens/s per GPU, step time, MFU against the 989 TFLOP/s spec and against the bf16 matmul peak
measured at the start of the job, FLOPs per token with attention counted (6N + 12·L·A·T,
:meth:`~trainer.models.hf.HFCausalLM.flops_per_token`), peak memory (allocated, from the first step on),
first-step seconds (compile included; the jobs of one call share one compile cache, so a later job with the same
graphs, e.g. the loop at another world size, compiles warm), the final loss and the job's wall time. The loop's
loss on random tokens stays near ln V (11.76 for Llama-3's 128256 tokens): a check of its initialisation; ours
learns the bytes. A job that fails keeps the end of its stderr under ``error``; one that runs out of memory reads
``OOM`` in the table, so the largest micro-batch that fits a (model, world, ac) is the largest ``batch`` whose row
has a number; within a call, the larger micro-batches of a (model, world, row, ac) that ran out of memory are
skipped. A second table gives each row at its best: the fastest AC mode and micro-batch that ran, against the
loop's and loop-fp8's best, and the largest micro-batch that fit per AC mode. World 2 rows show their scaling
efficiency against the same (model, batch, row, ac) at world 1 when that ran; ours rows their ratio to the
loop's. The JSON (``--out``) is rewritten after every job (a cut-off run
keeps what finished) and keeps the entries of earlier calls under other keys, so several calls fill one file;
each entry names its GPU. The Markdown table comes last.

On 2 GPUs (80 GB each), the jobs that matter most first (a cut-off run keeps them): 1B at world 2, both rows,
micro-batch 8; 8B at world 2 with full checkpointing (its fp32 parameters, gradients and AdamW states sharded over
two GPUs take 64 GB per GPU before any activation, so only checkpointed rows at small micro-batches fit); 1B at
world 1 for the scaling; then micro-batch 4. Most of a job's time is the compile:

    python scripts/bench_fsdp.py --steps 10 --warmup 2 --timeout 300 --plan \\
        hf-llama-1b:2:8:loop:none hf-llama-1b:2:8:ours:none hf-llama-8b:2:2:loop:full hf-llama-8b:2:2:ours:full \\
        hf-llama-1b:1:8:loop:none hf-llama-1b:1:8:ours:none \\
        hf-llama-1b:2:4:loop:none hf-llama-1b:2:4:ours:none hf-llama-1b:1:4:loop:none hf-llama-1b:1:4:ours:none

``--device cpu --tiny`` (gloo; a 2-layer Llama 64 wide with a 256-token vocabulary at T=64) checks the script in
seconds; such runs write to a temporary file unless ``--out`` says where.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts._fsdp_loop import run_loop  # noqa: E402
from scripts._models import hf_dir, spec  # noqa: E402
from scripts.bench_ddp import SAME_AS_USER, SPEC_PEAK  # noqa: E402

ROWS = {"loop": {"kind": "user"}, "loop-fp8": {"kind": "user", "fp8": True}, "ours": {"kind": "ours", "overrides": []}}
LAYOUT_KEYS = ("distributed.replicate", "distributed.tp", "distributed.cp", "data.seq_len")
"""What a row of either kind may set (``loop@distributed.tp=2``, ``ours@data.seq_len=32768``): the mesh's layout and
the sequence length. Ours takes them as its config keys; the loop builds the same layout (``_fsdp_loop.loop_mesh``)."""
AC_MODES = ("none", "full", "selective")
# --tiny: the model's config with these fields changed (a 2-layer Llama, 64 wide; bytes fill its vocabulary).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=256)  # fmt: skip
TINY_SEQ = 64


def parse_job(job: str) -> dict:
    """The parts of ``model:world:batch:row:ac``; ``row`` may carry ``@key=value`` and ``@env:NAME=value``.

    Raises:
        SystemExit: a malformed job, naming what to change.
    """
    from scripts._variants import parse_variant

    model, world, batch, rest = (job.split(":", 3) + ["", "", ""])[:4]
    row, _, ac = rest.rpartition(":")  # the row's own parts may hold ':' (env:NAME=value); ac is last
    if not (world.isdigit() and batch.isdigit() and int(world) > 0 and int(batch) > 0 and row and ac in AC_MODES):
        raise SystemExit(f"--plan: '{job}': expected model:world:batch:row:ac, e.g. hf-llama-1b:2:4:ours:none "
                         f"(row: {' or '.join(ROWS)}, perhaps with @key=value; ac: {', '.join(AC_MODES)})")  # fmt: skip
    if spec(model)["kind"] != "hf":
        raise SystemExit(f"--plan: '{job}': {model} is not a Hugging Face model; this benchmark trains those")
    rest, parts = split_row(row)
    layout = {}
    for key, value in parts:
        if not (value.isdigit() and int(value) > 0):
            raise SystemExit(f"--plan: '{job}': {key} takes a positive integer, got '{value}'")
        layout[key] = int(value)
    try:
        row_spec = parse_variant(rest, ROWS)
    except SystemExit as e:
        raise SystemExit(f"--plan: '{job}': {str(e).removeprefix('--variants: ')}") from None
    if row_spec["kind"] == "ours":
        row_spec["overrides"] = [*row_spec["overrides"], *(f"{k}={v}" for k, v in layout.items())]
    group = math.prod(layout.get(f"distributed.{k}", 1) for k in ("replicate", "tp", "cp"))
    if int(world) % group:
        raise SystemExit(f"--plan: '{job}': world {world} does not divide by replicate x tp x cp = {group}")
    if row_spec.get("fp8") and layout.get("distributed.tp", 1) > 1:
        raise SystemExit(f"--plan: '{job}': the loop's float8 with tensor parallel is not written; use loop")
    return {"model": model, "world": int(world), "batch": int(batch), "row": row, "ac": ac, "spec": row_spec,
            "layout": layout}  # fmt: skip


def _plan(a) -> list[str]:
    """The jobs of this call: ``--plan``, or the grid of the other options; ``--extra`` joins every ours row."""
    if a.plan:
        jobs = [j for arg in a.plan for j in arg.split(",") if j]
    else:
        jobs = [f"{m}:{w}:{b}:{r}:{ac}" for m in a.models.split(",") for w in a.worlds.split(",")
                for b in (a.batch.split(",") if a.batch else [str(spec(m)["batch"])])
                for ac in a.ac.split(",") for r in a.rows.split(",")]  # fmt: skip
    extra = "".join(f"@{e}" for e in a.extra)
    out = []
    for job in jobs:
        j = parse_job(job)
        if extra and j["spec"]["kind"] == "ours":
            job = f"{j['model']}:{j['world']}:{j['batch']}:{j['row']}{extra}:{j['ac']}"
        out.append(job)
    return out


def _seq(a, job: dict) -> int:
    """The job's sequence length: its ``data.seq_len``, else the model's (``--tiny``: TINY_SEQ)."""
    return job.get("layout", {}).get("data.seq_len") or (TINY_SEQ if a.tiny else spec(job["model"])["seq"])


def _group(job: dict) -> int:
    """The GPUs that share one batch: a tensor- and context-parallel group (``batch`` is sequences per data-parallel
    rank, as ``train.micro_batch_size``)."""
    return job["layout"].get("distributed.tp", 1) * job["layout"].get("distributed.cp", 1)


def run_ours(a, job: dict) -> dict:
    """``trainer fit``: the same model through ``model.hf``, sharded by ``distributed.strategy=fsdp``."""
    from scripts._models import overrides
    from trainer.config import load_config
    from trainer.loop import Trainer

    run_dir = tempfile.mkdtemp(prefix="bench_fsdp_")
    n = a.warmup + a.steps
    tiny = "{" + ", ".join(f"{k}: {v}" for k, v in TINY.items()) + "}"
    compiled = (["compile.enabled=false"] if a.compile_backend == "none"
                else ["compile.enabled=true", f"compile.backend={a.compile_backend}"])  # fmt: skip
    cfg = load_config(None, [
        *overrides(job["model"], tempfile.mkdtemp()), *([f"model.hf_overrides={tiny}"] if a.tiny else []),
        f"train.device={a.device}", *(["train.precision=bf16"] if a.device == "cuda" else []),
        "distributed.strategy=fsdp", *compiled, f"train.activation_checkpointing={job['ac']}",
        f"train.micro_batch_size={job['batch']}", f"data.seq_len={_seq(a, job)}",
        # train.stop_at one short of train.steps: the run stops before the final evaluation (which would compile
        # its own no-grad graphs); the schedule is constant, so the extra step changes nothing else.
        f"train.steps={n + 1}", f"train.stop_at={n}", f"log.every={n}", "train.eval_batches=1",
        "checkpoint.enabled=false", "log.progress=false", f"run.dir={run_dir}",
        f"compile.cache_dir={os.environ.get('TORCHINDUCTOR_CACHE_DIR', run_dir)}", *SAME_AS_USER,
        *job["spec"]["overrides"],
    ])  # fmt: skip
    s = Trainer(cfg).fit()
    per_gpu = job["batch"] * cfg.data.seq_len / _group(job)
    return {
        "tokens_per_s_per_gpu": per_gpu / s["median_step_s"],
        "step_ms": s["median_step_s"] * 1e3,
        "first_step_s": s["first_step_s"],
        "peak_mem_gb": s.get("peak_mem_gb"),
        "final_loss": s["loss"],
    }


def _worker(a) -> None:
    import torch

    job = parse_job(a.worker)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    head = {}
    if a.device == "cuda" and rank0:  # before the model exists: its memory is free again when training starts
        from scripts.bench_step import matmul_peak

        head = {"gpu": torch.cuda.get_device_name(), "matmul_peak_tflops": matmul_peak() / 1e12}
        torch.cuda.empty_cache()
    from scripts._meta import gpu_timeline

    with gpu_timeline(a.worker):  # BENCH_TRACE=dir: rank 0's GPU timeline, for scripts/trace_gaps.py
        if job["spec"]["kind"] == "user":
            out = run_loop(a, job, _seq(a, job), _group(job), TINY if a.tiny else None)
        else:
            out = run_ours(a, job)
    if rank0:
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        print("RESULT " + json.dumps({**head, **out, "dynamo_graphs": graphs}), flush=True)
    if a.device != "cuda":  # gloo: exit without finalizing the interpreter, as trainer.distributed.env.exit_code says
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _spawn(a, job: str) -> dict:
    """Run one job in fresh processes; its result, or ``{"error": ...}`` (``"oom": true`` when out of memory)."""
    j = parse_job(job)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={j['world']}", __file__,
           "--worker", job, "--steps", str(a.steps), "--warmup", str(a.warmup), "--device", a.device,
           "--compile-backend", a.compile_backend, *(["--tiny"] if a.tiny else [])]  # fmt: skip
    threads = max(1, (os.cpu_count() or 2) // j["world"])  # the cores shared out (torchrun would give each 1)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": a.cache_dir, "PYTHONUNBUFFERED": "1",
           "TRITON_CACHE_DIR": os.path.join(a.cache_dir, "triton"), "OMP_NUM_THREADS": str(threads),
           **j["spec"]["env"]}  # fmt: skip
    t0 = time.perf_counter()
    # Its own session, so that a job past --timeout can be stopped with everything it started.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = _stop(proc)
        print(f"[{job}] timed out after {a.timeout} s", file=sys.stderr, flush=True)
        return {"error": f"timed out after {a.timeout} s\n{_last_lines(stderr)}", "timed_out": True}
    wall = time.perf_counter() - t0
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        oom = "OutOfMemoryError" in stderr or "CUDA out of memory" in stderr
        print(f"[{job}] failed (exit {proc.returncode}{', out of memory' if oom else ''}):\n{stderr[-4000:]}",
              file=sys.stderr, flush=True)  # fmt: skip
        return {"error": _last_lines(stderr), "oom": oom, "process_wall_s": wall}
    return {**json.loads(lines[-1][len("RESULT ") :]), "process_wall_s": wall}


def _last_lines(stderr: str, chars: int = 2000) -> str:
    """The end of a job's stderr before torchrun's own failure report (which names no cause)."""
    cut = stderr.find("torch.distributed.elastic.multiprocessing.errors.ChildFailedError")
    return (stderr[:cut] if cut > 0 else stderr)[-chars:]


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    """Stop a job: SIGTERM to torchrun, which stops its workers (SIGKILL after 30 s, in their own sessions); then
    SIGKILL to whatever of its session is left."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()


def model_flops(a, model: str, seq: int) -> float:
    """Training FLOPs per token of ``model`` at ``seq`` tokens a sequence, attention counted (built without
    storage)."""
    import torch

    from trainer.models.hf import build_hf_model

    with torch.device("meta"):
        m = build_hf_model(str(hf_dir(model, tempfile.mkdtemp())), overrides=TINY if a.tiny else None)
    return m.flops_per_token(seq)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--plan",
        nargs="+",
        help="jobs model:world:batch:row:ac, separated by commas or spaces, run in this order "
        "(e.g. hf-llama-1b:2:8:ours:none hf-llama-8b:2:2:loop:full); replaces the grid options",
    )
    p.add_argument("--models", default="hf-llama-1b", help="grid: comma-separated, of hf-llama-1b, hf-llama-8b")
    p.add_argument("--worlds", default="1,2", help="grid: processes (GPUs) per job")
    p.add_argument("--batch", help="grid: micro-batches per GPU (default: each model's, scripts/_models.py)")
    p.add_argument("--rows", default="loop,ours", help="grid: loop, ours, ours@key=value, row@env:NAME=value")
    p.add_argument("--ac", default="none", help="grid: activation checkpointing, of none, full, selective")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compile happens in step 1)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="a 2-layer Llama 64 wide, vocabulary 256, T=64 (CPU checks)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of both rows (aot_eager on CPU; none: eager)")  # fmt: skip
    p.add_argument("--extra", action="append", default=[], help="trainer override for every ours job (repeatable)")
    p.add_argument("--timeout", type=int, default=420, help="seconds per job")
    p.add_argument("--out", help="JSON, rewritten after every job (default: scripts/results/bench_fsdp/result.json; "
                   "a temporary file for --tiny or --device cpu)")  # fmt: skip
    p.add_argument("--cache-dir", help="compile cache shared by the jobs (default: a new temporary directory)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return _worker(a)
    a.cache_dir = a.cache_dir or tempfile.mkdtemp(prefix="bench_fsdp_cache_")
    jobs = _plan(a)

    import torch

    n_gpus = torch.cuda.device_count() if a.device == "cuda" else 0
    most = max(parse_job(j)["world"] for j in jobs)
    if a.device == "cuda" and most > n_gpus:
        raise SystemExit(f"--plan: a job of world {most} needs {most} GPUs; this machine has {n_gpus}")
    if a.out is None:
        scratch = a.tiny or a.device == "cpu"
        a.out = (os.path.join(tempfile.mkdtemp(prefix="bench_fsdp_"), "result.json") if scratch
                 else str(ROOT / "scripts/results/bench_fsdp/result.json"))  # fmt: skip
    from scripts._meta import git_sha

    out = Path(a.out)
    old = json.loads(out.read_text()) if out.exists() else {}
    run = {"gpu": None if a.device == "cuda" else "cpu", "gpus": n_gpus, "torch": torch.__version__,
           "triton": _triton_version(), "git_sha": git_sha(), "device": a.device, "tiny": a.tiny,
           "compile_backend": a.compile_backend, "steps": a.steps, "warmup": a.warmup,
           "matmul_peak_tflops": None}  # fmt: skip
    doc = {"run": run, "results": dict(old.get("results", {}))}  # this call's jobs replace those of the same key
    shapes = dict.fromkeys((j["model"], _seq(a, j)) for j in map(parse_job, jobs))
    flops = {shape: model_flops(a, *shape) for shape in shapes}
    ooms: dict[tuple, int] = {}  # (model, world, row, ac) -> the micro-batch that ran out of memory in this call
    for job in jobs:
        j = parse_job(job)
        key = (j["model"], j["world"], j["row"], j["ac"])
        if key in ooms and j["batch"] > ooms[key]:  # a larger micro-batch needs more memory still
            print(f"{job}: skipped (out of memory at micro-batch {ooms[key]} in this call)", flush=True)
            continue
        res = _spawn(a, job)
        if res.get("oom"):
            ooms[key] = min(ooms.get(key, j["batch"]), j["batch"])
        run["gpu"] = run["gpu"] or res.get("gpu")
        run["matmul_peak_tflops"] = run["matmul_peak_tflops"] or res.get("matmul_peak_tflops")
        doc["results"][job] = entry = _entry(a, parse_job(job), res, flops, run)
        shown = {k: v for k, v in entry.items() if k != "error"}
        print(f"{job}: {shown}" + (" (failed)" if "error" in entry else ""), flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    print(table(doc))
    print(best_table(doc))


def _entry(a, job: dict, res: dict, flops: dict, run: dict) -> dict:
    """A job's JSON entry: what ran, on what, its result and its MFU."""
    entry = {k: job[k] for k in ("model", "world", "batch", "row", "ac")}
    seq = _seq(a, job)
    entry.update(seq=seq, tiny=a.tiny, device=a.device, flops_per_token=flops[job["model"], seq],
                 git_sha=run["git_sha"], torch=run["torch"], **res)  # fmt: skip
    entry.setdefault("gpu", run["gpu"])
    if "tokens_per_s_per_gpu" in res and a.device == "cuda":
        achieved = flops[job["model"], seq] * res["tokens_per_s_per_gpu"]
        entry["mfu_spec"] = achieved / SPEC_PEAK
        peak = res.get("matmul_peak_tflops")
        entry["mfu_measured_peak"] = achieved / (peak * 1e12) if peak else None
    return entry


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def table(doc: dict) -> str:
    """The results as a Markdown table, one row per job: scaling against world 1, ours against the loop."""
    run, results = doc["run"], doc["results"]
    peak = f"{run['matmul_peak_tflops']:.0f}" if run.get("matmul_peak_tflops") else "-"
    lines = [f"\n{run['gpu'] or run['device']} x{run['gpus']}, torch {run['torch']}, triton {run['triton']}, "
             f"bf16 matmul peak measured {peak} TFLOP/s; git {run['git_sha']}",
             "| model | world | B x T | row | AC | tok/s/GPU | vs loop | scaling | step ms | MFU (989 spec) "
             "| MFU (measured peak) | peak mem GB | first step s | job s | final loss |",
             "|---" * 15 + "|"]  # fmt: skip

    index = {_shape(e) + (split_row(e["row"])[0],): e.get("tokens_per_s_per_gpu") for e in results.values()}

    def tps(e, row, world=None):  # the same shape and layout, another row (and world)
        model, w, batch, ac, layout = _shape(e)
        return index.get((model, world or w, batch, ac, layout, row))

    def order(item):
        e = item[1]
        return e["model"], e["ac"], e["batch"], e["world"], e["row"] != "loop", e["row"]

    for _, e in sorted(results.items(), key=order):
        name = e["model"] + (" (tiny)" if e.get("tiny") else "") + ("" if e.get("gpu") == run["gpu"] else
                                                                    f" [{e.get('gpu')}]")  # fmt: skip
        head = f"| {name} | {e['world']} | {e['batch']} x {e['seq']} | {e['row']} | {e['ac']} |"
        if "tokens_per_s_per_gpu" not in e:
            why = "OOM" if e.get("oom") else "timed out" if e.get("timed_out") else "failed"
            lines.append(f"{head} {why} |" + " |" * 9)
            continue
        t = e["tokens_per_s_per_gpu"]
        row = split_row(e["row"])[0]
        loop = tps(e, "loop")
        vs = f"{t / loop:.3f}x" if loop and row != "loop" else "-"
        loop8 = tps(e, "loop-fp8")
        if loop8 and "precision=fp8" in e["row"]:  # ours in fp8: against torchtitan's float8 too
            vs += f" ({t / loop8:.3f}x loop-fp8)"
        one = tps(e, row, world=1) if e["world"] > 1 else None
        scaling = f"{t / one * 100:.1f}%" if one else "-"
        mfu = f"{e['mfu_spec'] * 100:.1f}%" if e.get("mfu_spec") else "-"
        mfu_peak = f"{e['mfu_measured_peak'] * 100:.1f}%" if e.get("mfu_measured_peak") else "-"
        mem = f"{e['peak_mem_gb']:.1f}" if e.get("peak_mem_gb") else "-"
        lines.append(f"{head} {_si(t)} | {vs} | {scaling} | {e['step_ms']:.1f} | {mfu} | {mfu_peak} | {mem} | "
                     f"{e['first_step_s']:.1f} | {e['process_wall_s']:.0f} | {e['final_loss']:.3f} |")  # fmt: skip
    return "\n".join(lines)


def best_table(doc: dict) -> str:
    """Each row at its best, as a Markdown table: per (model, world, row) the fastest (AC, micro-batch) that ran,
    against the fastest of the loop and of loop-fp8 at the same model and world, and the largest micro-batch that
    fit for each AC mode tried."""
    groups: dict[tuple, list[dict]] = {}
    for e in doc["results"].values():
        groups.setdefault((e["model"], e["world"], e["row"]), []).append(e)

    def peers(e: dict) -> tuple:  # the loop rows a row compares with: same model, world and layout
        return e["model"], e["world"], _shape(e)[4]

    def fastest(model, world, row) -> dict | None:
        ran = [e for e in groups.get((model, world, row), []) if "tokens_per_s_per_gpu" in e]
        return max(ran, key=lambda e: e["tokens_per_s_per_gpu"]) if ran else None

    def fastest_peer(e: dict, base: str) -> dict | None:
        ran = [o for o in doc["results"].values() if peers(o) == peers(e) and split_row(o["row"])[0] == base
               and "tokens_per_s_per_gpu" in o]  # fmt: skip
        return max(ran, key=lambda o: o["tokens_per_s_per_gpu"]) if ran else None

    lines = ["\nEach row at its best (the fastest AC and micro-batch that ran):",
             "| model | world | row | AC, B | tok/s/GPU | peak mem GB | vs loop's best | vs loop-fp8's best "
             "| largest B that fit, per AC |", "|---" * 9 + "|"]  # fmt: skip
    for model, world, row in sorted(groups, key=lambda k: (k[0], k[1], k[2] != "loop", k[2])):
        best = fastest(model, world, row)
        if best is None:
            continue
        t = best["tokens_per_s_per_gpu"]
        vs = []
        for base in ("loop", "loop-fp8"):
            other = fastest_peer(best, base) if split_row(row)[0] != base else None
            vs.append(f"{t / other['tokens_per_s_per_gpu']:.3f}x" if other else "-")
        fits = []
        for ac in AC_MODES:
            ran = [e["batch"] for e in groups[model, world, row] if e["ac"] == ac and "tokens_per_s_per_gpu" in e]
            oom = [e["batch"] for e in groups[model, world, row] if e["ac"] == ac and e.get("oom")]
            if ran or oom:
                fits.append(f"{ac} {max(ran) if ran else '-'}" + (f" (OOM at {min(oom)})" if oom else ""))
        mem = f"{best['peak_mem_gb']:.1f}" if best.get("peak_mem_gb") else "-"
        lines.append(f"| {model} | {world} | {row} | {best['ac']}, {best['batch']} | {_si(t)} | {mem} | {vs[0]} | "
                     f"{vs[1]} | {'; '.join(fits)} |")  # fmt: skip
    return "\n".join(lines)


def split_row(row: str) -> tuple[str, list[tuple[str, str]]]:
    """``row`` without its :data:`LAYOUT_KEYS` parts, and those parts as ``(key, value)``
    (``ours@distributed.tp=2@train.precision=fp8`` -> ``ours@train.precision=fp8``, ``[("distributed.tp", "2")]``)."""
    base, *parts = row.split("@")
    layout = [(k, v) for k, _, v in (p.partition("=") for p in parts) if k in LAYOUT_KEYS]
    return "@".join([base, *(p for p in parts if p.partition("=")[0] not in LAYOUT_KEYS)]), layout


def _shape(e: dict) -> tuple:
    """``(model, world, batch, ac, layout)`` of a result, its layout's parts sorted."""
    return e["model"], e["world"], e["batch"], e["ac"], tuple(sorted(split_row(e["row"])[1]))


def _si(x: float) -> str:
    return f"{x / 1e3:.1f}K" if x >= 1e3 else f"{x:.0f}"


if __name__ == "__main__":
    main()
