"""``trainer tune``: the fastest settings, measured in short runs, the memory model pruning them.

Each candidate is a short ``trainer fit`` in a child process (:class:`trainer.tune_runs.Runner`): 6 steps, the
throughput of the last 2 (after the compile and the CUDA graph's capture), the peak memory of all of them. An
out-of-memory run is caught there and recorded. The runs share one compile cache in the work directory
(``<run.dir>.tune``), which also keeps every measurement (``measured.json``) for the memory model
(:mod:`trainer.memory`) of later commands.

Under ``torchrun`` every rank of ``trainer tune`` takes part: rank 0 chooses each candidate, the first rank of
each node launches the candidate's own ``torchrun`` for its node's GPUs, and the tune processes themselves never
touch a GPU.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from trainer import console, memory
from trainer.config import Config, load_config, to_yaml
from trainer.global_batch import derive_grad_accum
from trainer.memory import (
    GB,
    MODES,
    Estimate,
    Point,
    load_points,
    memory_key,
    save_point,
    static_parts,
    step_transient,
    work_dir,
)
from trainer.tune_runs import Runner, World, plan_facts

GRID = [1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def checkpointing(mode: str) -> str:
    return f"train.activation_checkpointing={mode}"


def batch_overrides(micro_batch: int, per_rank: int | None, derived: bool = False) -> list[str]:
    """The micro-batch, with train.grad_accum keeping ``per_rank`` sequences per rank and step (None: one
    micro-batch a step). ``derived``: the config sets train.global_batch_size, from which the run derives
    train.grad_accum itself (for one micro-batch a step, it is unset)."""
    micro = f"train.micro_batch_size={micro_batch}"
    if per_rank is None:
        return [micro, "train.grad_accum=1", *(["train.global_batch_size=null"] if derived else [])]
    return [micro] if derived else [micro, f"train.grad_accum={per_rank // micro_batch}"]


class Session:
    """The estimate and the runner of one ``tune`` or ``explain --memory``: the config as given, the counted parts,
    and the points measured (earlier ones from ``measured.json``, if ``reuse``)."""

    def __init__(self, config: str, overrides: list[str], budget_s: float | None, reuse: bool, say=console.info):
        from trainer.data import load_corpus

        self.config, self.overrides, self.say = config, overrides, say
        self.cfg = cfg = load_config(config, overrides)
        self.world = World.from_env()
        self.work = work_dir(cfg)
        self.started, self.budget_s = time.monotonic(), budget_s
        deadline = None if budget_s is None else self.started + budget_s
        # A spare imports while a candidate runs: on CUDA only, where the candidate's step does not need the cores.
        self.runner = Runner(config, overrides, self.work, self.world, deadline, say, spares=on_cuda(cfg))
        corpus = load_corpus(
            cfg.data.path, cfg.data.vocab_size, cfg.data.val_fraction, cfg.data.seq_len, dtype=cfg.data.dtype
        )
        model = memory.model_on_meta(cfg, corpus.vocab_size)
        self.key = memory_key(cfg, self.world.size)
        parts = static_parts(model, cfg, self.world.size, "cuda")
        self.estimate = Estimate(parts, cfg.data.seq_len, transient=step_transient(model, cfg, self.world.size))
        if reuse:
            self.estimate.points = load_points(self.work / "measured.json", self.key)
        t = cfg.train
        self.derived = t.global_batch_size is not None  # each candidate's run derives train.grad_accum from it
        # The global batch over the ranks as the runs will split it (exit 2 where they cannot).
        self.dp = memory._strategy(cfg, self.world.size).dp_ranks  # the ranks that split the global batch
        accum = derive_grad_accum(t.global_batch_size, t.micro_batch_size, self.dp) if self.derived else None
        self.per_rank = t.micro_batch_size * (accum or t.grad_accum)
        self.measured: list[Point] = []
        self.skipped: list[list[str]] = []  # candidates planned but not measured for lack of budget
        self.capability: str | None = None  # the GPU's, e.g. "9.0", from the first candidate's plan.json

    def trace(self) -> None:
        """Each mode's activations from its traced step (:func:`memory.traced_estimate`, kept in the work dir's
        ``traced.json``): the memory model without probes."""
        started = time.monotonic()
        cache = self.work / "traced.json"
        try:
            traced = memory.traced_estimate(self.cfg, self.world.size, None, cache=cache).traced
        except Exception as e:  # a model Dynamo cannot capture whole, say: the probes measure it instead
            if self.world.rank == 0:
                console.warn(f"tune: the step could not be traced for its memory ({type(e).__name__}: {e}); "
                             "each mode is probed instead")  # fmt: skip
            return
        # Gradients counted as a part throughout: a candidate below the per-rank batch accumulates (they exist
        # from its first micro-batch), and one at it makes them in its backward, a little less at the peak.
        self.estimate.traced, self.estimate.keep_grads = traced, False
        if self.world.rank == 0:
            self.say(f"tune: each mode's step traced for its memory ({time.monotonic() - started:.0f} s)")

    def measure(self, mode: str, micro_batch: int, extra: list[str] = ()) -> Point:
        """Run one candidate, record it (the estimate, ``measured.json``) and say how it went."""
        overrides = [checkpointing(mode), *batch_overrides(micro_batch, self.per_rank, self.derived), *extra]
        predicted = self.estimate.peak(mode, micro_batch)
        n = len(self.measured) + 1
        if self.world.rank == 0:
            self.say(f"[{n}] {' '.join(overrides)}: running ({self.elapsed:.0f} s elapsed)")
        point = self.runner.run(mode, micro_batch, overrides, predicted)
        point = self.world.broadcast(point)
        if self.estimate.capacity is None:  # the device's, from the first candidate that ran on it (rank 0's)
            facts = plan_facts(self.work) if self.world.rank == 0 else {}
            memory_gb = facts.get("device.memory_gb")
            device = (memory.USABLE * memory_gb * GB if memory_gb else None, facts.get("device.capability"))
            self.estimate.capacity, self.capability = self.world.broadcast(device)
        if point.status in ("ok", "out of memory") and not extra:
            self.estimate.points.append(point)
            if self.world.rank == 0:
                save_point(self.work / "measured.json", self.key, point)
        self.measured.append(point)
        if self.world.rank == 0:
            self.say(f"[{n}] {' '.join(overrides)}: {_outcome(point)} ({point.seconds:.0f} s)")
        return point

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def affords(self) -> bool:
        """Whether another candidate is expected to end within the budget (the longest so far as the guess);
        rank 0's answer, on every rank."""
        longest = max((p.seconds for p in self.measured), default=0.0)
        ok = self.budget_s is None or self.elapsed + longest <= self.budget_s
        return self.world.broadcast(ok)


def _outcome(p: Point) -> str:
    if p.status != "ok":
        return p.status
    return f"{p.tokens_per_s / 1e3:.1f}K tok/s, peak {p.peak / GB:.1f} GB" if p.peak else f"{p.tokens_per_s:.0f} tok/s"


def on_cuda(cfg: Config) -> bool:
    """Whether the candidates run on CUDA (asked without creating a CUDA context in this process)."""
    return cfg.train.device.startswith("cuda") or (cfg.train.device == "auto" and torch.cuda.is_available())


def search(s: Session) -> None:
    """Measure the candidates in order of promise until the budget ends (rank 0 decides; every rank follows).

    On CUDA, for each checkpointing mode in order of cost (none, selective, full): a probe at the config's
    micro-batch (unless one was measured before), then the largest micro-batch the estimate says fits; a mode is
    tried only where it fits a larger micro-batch than the cheaper modes did. Then, on the fastest: fp8 where the
    GPU has float8 tensor cores and torchao is installed; under fsdp, every unit kept gathered into the backward
    (one micro-batch smaller if it runs out of memory), then gradients reduced in bf16; half and twice the bucket
    (ddp) or unit (fsdp) size.
    On CPU: the micro-batches, largest first (checkpointing only slows a step there), then half the threads."""
    cfg, est = s.cfg, s.estimate
    sizes = divisors(s.per_rank)
    b0 = cfg.train.micro_batch_size
    if not on_cuda(cfg):
        for b in sorted(sizes, reverse=True)[:4]:
            if s.affords():
                s.measure(cfg.train.activation_checkpointing, b)
        best, cores = fastest(s.measured), cfg.train.threads or torch.get_num_threads()
        if best is not None and cores > 1 and s.affords():  # torch's default is not always the fastest: measured
            s.measure(best.mode, best.micro_batch, [f"train.threads={cores // 2}"])
        return
    if s.estimate.traced:
        return planned_search(s, sizes)
    reached = 0  # the largest micro-batch a cheaper mode ran at
    for mode in MODES:
        if reached == max(sizes) or not s.affords():
            break
        probe = b0
        while est.fit(mode) is None and probe and s.affords():  # a probe; out of memory: the next smaller size
            if s.measure(mode, probe).status != "out of memory":
                break
            probe = max((b for b in sizes if b < probe), default=None)
        tried = {p.micro_batch for p in s.measured if p.mode == mode}
        while s.affords():  # each run refits the line: after one that fits, a larger size may be predicted to fit
            ok = [p.micro_batch for p in s.measured if p.mode == mode and p.status == "ok"]
            b = est.largest(mode, [b for b in sizes if b > max([reached, *ok]) and b not in tried])
            if b is None:
                break
            tried.add(b)
            s.measure(mode, b)
        ok = [p.micro_batch for p in s.measured if p.mode == mode and p.status == "ok"]
        reached = max([reached, *ok])
    best = fastest(s.measured)
    if best is None:
        return
    if cfg.train.precision != "fp8" and fp8_possible(s) and s.affords():
        s.measure(best.mode, best.micro_batch, ["train.precision=fp8"])
    layouts(s, sizes)


def planned_search(s: Session, sizes: list[int]) -> None:
    """The search with each mode's traced memory: the config as given (which tells the device), then fp8 where the
    GPU and torchao allow it, then in each mode the largest micro-batch predicted to fit where it is larger than
    the cheaper modes' (recomputation pays only for a larger micro-batch), each one size smaller if it runs out of
    memory; then the layouts (:func:`layouts`). What the budget leaves out is listed (``s.skipped``)."""
    cfg, est = s.cfg, s.estimate
    given = cfg.train.activation_checkpointing, cfg.train.micro_batch_size
    s.measure(*given)
    plan: list[tuple[str, int, list[str]]] = []
    reached = 0
    for mode in MODES:
        b = est.largest(mode, [b for b in sizes if b > reached])
        if b is not None:
            plan.append((mode, b, []))
            reached = b
    if plan and cfg.train.precision != "fp8" and fp8_possible(s):
        plan.insert(0, (*plan[0][:2], ["train.precision=fp8"]))
    for i, (mode, b, extra) in enumerate(plan):
        if not s.affords():
            s.skipped += [[checkpointing(m), f"micro-batch {x}", *e] for m, x, e in plan[i:]]
            break
        if (mode, b) == given and not extra:
            continue
        while b is not None and s.measure(mode, b, extra).status == "out of memory":
            b = max((x for x in sizes if x < b), default=None) if s.affords() else None
    best = fastest(s.measured)
    fp8 = next((p for p in s.measured if "train.precision=fp8" in p.overrides and p.status == "ok"), None)
    if best is not None and fp8 is not None and best is not fp8 and s.affords():  # fp8 on the fastest in bf16
        twin = next((p for p in s.measured if (p.mode, p.micro_batch) == (fp8.mode, fp8.micro_batch) and p is not fp8
                     and p.status == "ok"), None)  # fmt: skip
        if twin is None or fp8.tokens_per_s > twin.tokens_per_s:
            s.measure(best.mode, best.micro_batch, ["train.precision=fp8"])
    layouts(s, sizes)


def layouts(s: Session, sizes: list[int]) -> None:
    """On the fastest so far, under fsdp: every unit kept gathered into the backward, gradients reduced in bf16,
    the mesh's other layouts; under ddp or fsdp, half and twice the bucket or unit size."""
    d = s.cfg.distributed
    if fastest(s.measured) is None:
        return
    if s.world.size > 1 and d.strategy == "fsdp":
        if d.reshard_after_forward and s.affords():  # every unit kept gathered from its forward into its backward
            best = fastest(s.measured)
            smaller = max((b for b in sizes if b < best.micro_batch), default=None)
            for b in (best.micro_batch, smaller):  # it holds more: where the fastest size does not fit, one smaller
                if b and s.affords():
                    run = s.measure(best.mode, b, [*carried(best), "distributed.reshard_after_forward=false"])
                    if run.status != "out of memory":
                        break
        if d.reduce_dtype != "bf16" and s.affords():
            best = fastest(s.measured)
            s.measure(best.mode, best.micro_batch, [*carried(best), "distributed.reduce_dtype=bf16"])
    if s.world.size > 1 and d.strategy == "fsdp":  # other layouts of the mesh, the global batch kept
        for layout in mesh_candidates(s):
            best = fastest(s.measured)
            if s.affords():
                s.measure(best.mode, best.micro_batch, [*carried(best), *layout,
                                                        f"train.global_batch_size={s.per_rank * s.dp}"])  # fmt: skip
    if s.world.size > 1 and d.strategy in ("ddp", "fsdp"):
        key, value = (
            ("distributed.bucket_mb", d.bucket_mb)
            if d.strategy == "ddp"
            else ("distributed.fsdp_unit_mb", d.fsdp_unit_mb)
        )
        best = fastest(s.measured)
        for v in (value / 2, value * 2):
            if value and s.affords():
                s.measure(best.mode, best.micro_batch, [*carried(best), f"{key}={v:g}"])


def mesh_candidates(s: Session) -> list[list[str]]:
    """The mesh layouts worth measuring beside the config's under fsdp: HSDP with a replica per node where the job
    spans nodes (FSDP's collectives then stay within a node), and tensor parallel over 2 ranks of a node where the
    config has none (the model's heads permitting; a layout the model refuses exits 2 in its run and is skipped)."""
    d, w = s.cfg.distributed, s.world
    out = []
    nodes = w.size // max(w.local_size, 1)
    if nodes > 1 and d.replicate == 1:
        out.append([f"distributed.replicate={nodes}", "distributed.shard=-1"])
    if d.tp == 1 and w.local_size % 2 == 0 and (w.size // 2) % max(d.replicate, 1) == 0:
        out.append(["distributed.tp=2", "distributed.shard=-1"])
    return out


CARRIED = (
    "train.precision=",
    "distributed.reshard_after_forward=",
    "distributed.reduce_dtype=",
    "distributed.replicate=",
    "distributed.tp=",
    "distributed.shard=",
    "train.global_batch_size=",
)


def carried(p: Point) -> list[str]:
    """The settings a later candidate keeps from ``p`` (fp8, fsdp's gathering and reduction), beside its own."""
    return [o for o in p.overrides if o.startswith(CARRIED)]


def fp8_possible(s: Session) -> bool:
    """Float8 tensor cores (compute capability 8.9 or later) and torchao."""
    cap = s.capability
    return bool(cap) and tuple(map(int, cap.split("."))) >= (8, 9) and installed("torchao")


def installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def fastest(points: list[Point]) -> Point | None:
    ok = [p for p in points if p.status == "ok" and p.tokens_per_s]
    return max(ok, key=lambda p: p.tokens_per_s) if ok else None


def table(points: list[Point], world: int = 1, skipped: list[list[str]] = ()) -> str:
    """The candidates as a Markdown table: tok/s (of all ``world`` ranks), peak and predicted memory per rank,
    status; then those ``skipped`` for lack of budget."""
    speed = "tok/s" if world == 1 else f"tok/s ({world} ranks)"
    lines = [f"| # | candidate | {speed} | peak GB | predicted GB | status |", "|---|---|---|---|---|---|"]
    best = fastest(points)
    for i, p in enumerate(points, 1):
        tps = f"{p.tokens_per_s / 1e3:.1f}K" if p.tokens_per_s else "-"
        peak = f"{p.peak / GB:.1f}" if p.peak else "-"
        pred = f"{p.predicted / GB:.1f}" if p.predicted else "-"
        status = "**fastest**" if p is best else p.status
        lines.append(f"| {i} | {' '.join(p.overrides)} | {tps} | {peak} | {pred} | {status} |")
    for o in skipped:
        lines.append(f"| - | {' '.join(o)} | - | - | - | skipped: no budget left |")
    return "\n".join(lines)


def tuned_path(config: str, shipped: bool) -> Path:
    """``CONFIG.tuned.yaml`` beside the config; in the working directory for a shipped one."""
    p = Path(config)
    name = p.name.removesuffix(".yaml").removesuffix(".yml") + ".tuned.yaml"
    return Path(name) if shipped else p.with_name(name)


def write_tuned(s: Session, best: Point, path: Path, command: str) -> None:
    """The config with the fastest candidate's overrides, and a comment giving the measurement."""
    from trainer.io import atomic_write_text

    given = next((p for p in s.measured if p.status == "ok" and _as_given(p, s)), None)
    vs = f"; the config as given: {_speed(given)}" if given else ""
    cfg = _own_run(load_config(s.config, [*s.overrides, *best.overrides]))
    head = [
        f"# {command}",
        f"# The fastest of {len(s.measured)} settings measured in {s.elapsed:.0f} s: {_speed(best)}{vs}.",
        f"# Overrides over {s.config}: {' '.join(best.overrides)}; run.name and run.dir with -tuned added, so that "
        "this config's run has a directory of its own",
        "",
    ]
    atomic_write_text(path, "\n".join(head) + to_yaml(cfg))
    # The measurements travel with it: `trainer fit` predicts its peak from <run.dir>.tune/measured.json.
    measured, beside = s.work / "measured.json", work_dir(cfg) / "measured.json"
    if measured.is_file() and not beside.exists():
        beside.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(measured, beside)


def _own_run(cfg: Config) -> Config:
    """``cfg`` with ``-tuned`` added to ``run.name`` and to the last part of ``run.dir``: the tuned config's run
    starts in a directory of its own, not in the one that holds a run of the config as given."""
    run_dir = Path(cfg.run.dir)
    run_dir = run_dir if run_dir.name else run_dir.resolve()  # `.` has no last part to add to
    cfg.run.name = f"{cfg.run.name}-tuned"
    cfg.run.dir = str(run_dir.with_name(f"{run_dir.name}-tuned"))
    return cfg


def _speed(p: Point) -> str:
    return f"{p.tokens_per_s / 1e3:.1f}K tok/s" + (f", peak {p.peak / GB:.1f} GB" if p.peak else "")


def _as_given(p: Point, s: Session) -> bool:
    t = s.cfg.train
    return (
        p.mode == t.activation_checkpointing
        and p.micro_batch == t.micro_batch_size
        and len(p.overrides) == 1 + len(batch_overrides(p.micro_batch, s.per_rank, s.derived))
    )


def tune(config: str, overrides: list[str], budget_s: float, shipped: bool = False, say=console.info) -> int:
    """``trainer tune``: measure, print the table, write ``CONFIG.tuned.yaml``. Returns the exit code."""
    world = World.from_env()
    world.join()
    quiet = (lambda *_: None) if world.rank else say
    s = Session(config, overrides, budget_s, reuse=True, say=quiet)
    kept = "train.global_batch_size (train.grad_accum derived)" if s.derived else "train.grad_accum"
    quiet(
        f"tune: {config} on {world.size} rank{'s' if world.size > 1 else ''}, budget {budget_s:.0f} s; "
        f"{s.per_rank} sequences per rank and step, kept through {kept} (micro-batches: "
        f"{', '.join(map(str, divisors(s.per_rank)))}); runs and measurements in {s.work}"
    )
    if s.per_rank == 1:
        quiet(
            "tune: the global batch is one sequence per rank: only the checkpointing mode is searched "
            f"(raise {_batch_key(s)} to search larger micro-batches)"
        )
    try:
        if on_cuda(s.cfg):
            s.trace()
        search(s)
    finally:
        s.runner.close()
    if world.size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    if world.rank:
        return 0
    say(table(s.measured, world.size, s.skipped))
    best = fastest(s.measured)
    if best is None:
        say("tune: no candidate ran; the log of each is in " + str(s.work / "runs"))
        return 1
    path = tuned_path(config, shipped)
    argv = " ".join(["trainer tune", config, *overrides, f"--budget-s {budget_s:g}"])
    write_tuned(s, best, path, argv)
    say(f"tune: fastest {' '.join(best.overrides)}: {_speed(best)}; wrote {path} ({s.elapsed:.0f} s)")
    say(f"  trainer fit {path}")
    if hint := larger_batch_hint(s, best):
        say(hint)
    return 0


def larger_batch_hint(s: Session, best: Point) -> str | None:
    """A line when the fastest mode is predicted to fit a micro-batch larger than the global batch allows."""
    fits = s.estimate.largest(best.mode, [b for b in GRID if b > s.per_rank])
    if fits is None:
        return None
    return (
        f"tune: micro-batches up to {fits} are predicted to fit with train.activation_checkpointing={best.mode}, "
        f"but the global batch holds {s.per_rank} sequences per rank and step; raise {_batch_key(s)} to let tune "
        "try them (a larger global batch changes the training, not only its speed)"
    )


def _batch_key(s: Session) -> str:
    """The key that sets the global batch of the session's config."""
    return "train.global_batch_size" if s.derived else "train.grad_accum"


def probe_modes(s: Session, b0: int) -> None:
    """Two probes per mode: at ``b0``, then at the largest micro-batch of :data:`GRID` at most half the largest
    the first predicts to fit (a size near the limit, where the line must hold; a smaller one if it runs out of
    memory). On CPU, at ``b0`` and twice it."""
    for mode in MODES:
        s.measure(mode, b0)
        limit = s.estimate.largest(mode, GRID) or 2 * b0
        b1 = max((g for g in GRID if b0 < g <= max(limit // 2, 2 * b0)), default=2 * b0)
        while s.measure(mode, b1).status == "out of memory":
            b1 = max((g for g in GRID if b0 < g < b1), default=None)
            if b1 is None:
                break
