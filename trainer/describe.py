"""What a run says about itself: the startup lines (what trains on what; which path the step runs and why; what
a CPU run will cost) and ``trainer explain``'s views of the bucket plan and the FSDP units."""

from __future__ import annotations

import torch
import torch.nn as nn

from trainer import plan as plan_rules
from trainer.build import fsdp_units, splits_at_buckets
from trainer.config import Config


def describe_path(plan: plan_rules.Plan, opt) -> str:
    """The startup line that says which path the step runs and why (the plan's choices of the compile switches):
    compiled or eager, graphed or not, the optimizer, kernels."""
    from trainer.step import GRAPH_AFTER_STEPS

    cfg, why = plan.cfg, plan.compile_reasons
    c = cfg.compile
    scope = "whole model" if plan.scope == "model" else "each block"
    path = f"compiled ({c.backend}, {scope})" if plan.compiled else "eager"
    if c.autograd:
        path += " + compiled autograd"
    if plan.graphed:
        path += f", the whole step replayed as one CUDA graph after {GRAPH_AFTER_STEPS} ordinary steps"
    kernels = [f"{opt.impl} {cfg.optim.name}"]
    if plan.strategy.zero:  # distributed.shard_optimizer (trainer.optim.zero)
        kernels.append(f"optimizer state sharded over {plan.strategy.world} ranks")
    if plan.compiled and plan.kernels:
        kernels.append(f"kernels substituted where they match: {' '.join(plan.kernels)}")
    reasons = f" ({'; '.join(why)})" if why else ""
    return f"path: {path}; {', '.join(kernels)}{reasons}"


def describe_run(
    plan: plan_rules.Plan, model: nn.Module, corpus, tokens_per_step: int, threads: str | None = None
) -> str:
    """The startup line that says what trains on what: parameters, data, device and strategy, precision, steps and
    the global batch (micro-batch x grad_accum x data-parallel ranks), run dir (from the plan); ``threads``: how many
    torch's CPU ops run on and why (:func:`trainer.threads.set_threads`), on the CPU."""
    from trainer.models.hf import attention_of

    cfg, device, strategy = plan.cfg, plan.device, plan.strategy
    n_params = sum(p.numel() for p in model.parameters())
    ranks = f" x{strategy.world} ({strategy})" if strategy.world > 1 else ""
    attention = attention_of(model)
    eager = (
        (
            f"; attention: transformers' eager implementation ({type(model.hf).__name__} has no sdpa in this "
            "transformers: slower, and it keeps the attention matrix)"
        )
        if attention == "eager"
        else ""
    )
    cost = cpu_cost(cfg, model) if device.type == "cpu" else None
    fp8 = f"fp8 ({cfg.train.fp8_recipe}) + " if plan.precision == "fp8" else ""
    precision = fp8 + precision_name(plan.autocast)
    if plan.cfg.optim.master_weights == "bf16":
        precision += ", bf16 master weights (stochastic rounding)"
    t, dp = cfg.train, strategy.dp_ranks
    batch = f"global batch {plan.global_batch} = {t.micro_batch_size} x {t.grad_accum} accumulated x {dp} rank"
    batch += "s" if dp > 1 else ""
    return (
        f"trainer {cfg.run.name}: {n_params / 1e6:.2f}M params, {corpus.description}, "
        f"{len(corpus.train) / 1e6:.1f}M train tokens; device {device}{ranks}, {precision}; "
        + (f"{threads}; " if threads else "")
        + f"{cfg.train.steps} steps x {tokens_per_step} tokens ({batch}); run dir {cfg.run.dir}{eager}"
        + (f"\n{cost}" if cost else "")
    )


def mesh_report(doc: dict) -> str:
    """``trainer explain``'s view of the mesh from ``plan.json``'s ``mesh``: each dimension's size, rank 0's
    coordinates, and the groups of ranks along each dimension larger than 1 (each a process group)."""
    from trainer.distributed.mesh import DIMS, Mesh

    mesh = Mesh(**doc["sizes"])
    at = ", ".join(f"{d} {doc['coordinate'][d]}" for d in DIMS)
    lines = [f"mesh: {mesh} = {mesh.world} rank(s); rank 0 at ({at})"]
    for name in DIMS:
        if getattr(mesh, name) > 1:
            groups = mesh.groups(name)
            shown = " ".join(str(g) for g in groups[:4]) + (f" ... ({len(groups)} groups)" if len(groups) > 4 else "")
            lines.append(f"  {name:<9} groups: {shown}")
    if mesh.world > 1:
        lines.append(
            f"  the global batch is split over replicate x shard = {mesh.dp} data-parallel rank(s); FSDP shards over "
            f"shard x cp = {mesh.fsdp_ranks}" + (f", replicated {mesh.replicate}x (HSDP)" if mesh.replicate > 1 else "")
        )
    return "\n".join(lines)


def say_startup(plan: plan_rules.Plan, model: nn.Module, corpus, tokens_per_step: int, opt, threads: str | None):
    """Say what the run trains and how (:func:`describe_run`, :func:`describe_path`), how a resume kept or changed
    the global batch, a warm-up longer than the run, and imports compiled from source at every start (rank 0)."""
    from trainer import console, startup

    console.info(describe_run(plan, model, corpus, tokens_per_step, threads=threads))
    console.info(describe_path(plan, opt))
    plan.batch.say()
    if warmup := warmup_note(plan.cfg):
        console.warn(warmup)
    if uncached := startup.uncached_imports():
        console.warn(startup.bytecode_note(uncached))


def warmup_note(cfg: Config) -> str | None:
    """The warning for a warm-up longer than the run (``schedule.warmup_steps`` > ``train.steps``): the learning
    rate rises through every step, reaches only a fraction of ``optim.lr`` (:func:`trainer.build.lr_lambda`'s at the
    last step) and never decays. None for a warm-up that fits."""
    from trainer.build import lr_lambda

    warmup, steps = cfg.schedule.warmup_steps, cfg.train.steps
    if warmup <= steps:
        return None
    peak = 100 * lr_lambda(cfg)(steps - 1)  # the last step's multiplier (step k runs at lr_lambda(k - 1)), in percent
    shown = f"{peak:.2g}%" if peak < 10 else f"{min(peak, 99):.0f}%"  # 3.99 -> 4%; 99.8 is not 100%
    return (
        f"schedule.warmup_steps={warmup} is longer than train.steps={steps}: the learning rate reaches only {shown} "
        f"of optim.lr, and no decay follows; set schedule.warmup_steps below train.steps (e.g. {steps // 10}, a "
        "tenth of the run) or raise train.steps"
    )


def cpu_cost(cfg: Config, model: nn.Module, quiet_below_s: float = 600) -> str | None:
    """What a run on the CPU will cost, when that is more than ``quiet_below_s`` seconds: the FLOPs of one step and
    of one evaluation on this process (the model's ``flops_per_token``, 6 x parameters otherwise; an evaluation is
    forward only, a third) over the rate a 1024 x 1024 fp32 matmul reaches on this CPU, measured here in a tenth of
    a second. An estimate: larger matmuls run faster than that, the rest of a step slower."""
    import time

    from trainer.models import flops_per_token

    t, seq = cfg.train, cfg.data.seq_len
    per_token = flops_per_token(model, seq)
    step_flops = per_token * t.micro_batch_size * t.grad_accum * seq
    eval_flops = per_token / 3 * t.micro_batch_size * t.eval_batches * seq
    evals = (t.steps // t.eval_every if t.eval_every else 0) + 1  # and one at the end
    if (step_flops * t.steps + eval_flops * evals) / 1e10 < quiet_below_s:  # short even at 10 GFLOP/s: no need to time
        return None
    # fp32 whatever the precision: a CPU's bf16 matmul (AMX) can run several times faster than fp32 (852 against
    # about 220 GFLOP/s on the 2-core CI machine), but the rest of a step under CPU autocast does not keep pace.
    n = 1024
    a = torch.full((n, n), 0.5)  # not random: the run's random stream is not to be touched
    best = float("inf")
    for _ in range(5):  # the first wakes the thread pool
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    rate = 2 * n**3 / best
    step_s, eval_s = step_flops / rate, eval_flops / rate
    total = step_s * t.steps + eval_s * evals
    if total < quiet_below_s:
        return None
    took = f"{total / 3600:.1f} h" if total >= 3600 else f"{total / 60:.0f} min"
    return (
        f"on the CPU one step is {step_flops / 1e12:.2f} TFLOP: about {step_s:.0f} s at the {rate / 1e9:.0f} "
        f"GFLOP/s a matmul reaches here, and one evaluation ({t.eval_batches} batches) about {eval_s:.0f} s; "
        f"{t.steps} steps and {evals} evaluations take about {took}. This config is sized for a GPU; "
        "configs/tiny.yaml trains on a CPU in about a minute"
    )


def precision_name(dtype) -> str:
    return {None: "fp32", torch.bfloat16: "bf16 autocast", torch.float16: "fp16 autocast + grad scaler"}[dtype]


def fsdp_units_report(model: nn.Module, cfg: Config) -> str:
    """``trainer explain``'s view of the FSDP units (as :func:`shard` builds them)."""
    from trainer.distributed.fsdp import describe_units, kept_units

    units, d = fsdp_units(model, cfg), cfg.distributed
    kept = kept_units(len(units), d.reshard_after_forward, d.keep_gathered)
    return describe_units(model, units, d.fsdp_unit_mb, kept)


def ddp_plan_report(model: nn.Module, run_plan: plan_rules.Plan, splitter=None) -> str:
    """``trainer explain``'s view of the bucket plan of ``run_plan``'s config: bucket -> units -> parameters -> bytes
    -> graph piece.

    ``splitter`` is the one a run used (under torchrun); without one, the forward is traced once with
    a splitter over the eager backend (no code generation) to find where the pieces end.
    """
    from trainer.compile.capture import inner_backend
    from trainer.distributed import ddp
    from trainer.distributed.buckets import plan_buckets

    cfg, compiled = run_plan.cfg, run_plan.compiled
    c = cfg.compile
    d = cfg.distributed
    plan = splitter.plan if splitter is not None else plan_buckets(model, d.bucket_mb, c.blocks, d.split_tail)
    lines = []
    if splits_at_buckets(compiled, run_plan.scope, c.autograd):
        if splitter is None:
            splitter = ddp.PlanSplitter(plan, inner_backend("eager"))
            idx = torch.zeros(1, cfg.data.seq_len, dtype=torch.long, device=next(model.parameters()).device)
            with torch.no_grad():
                torch.compile(model, backend=splitter)(idx, idx)
        pieces = {b: i for i, piece in enumerate(splitter.pieces[0]) for b in piece} if splitter.pieces else {}
        lines.append(plan.describe(pieces))
        n = len(splitter.pieces[0]) if splitter.pieces else 1
        state = "misaligned with the plan: overlap may suffer" if splitter.misaligned else "one per bucket"
        lines.append(f"forward graph split into {n} pieces ({state}); each piece's backward completes its bucket")
    else:
        lines.append(plan.describe())
        if compiled and c.autograd:
            lines.append("compiled autograd: one backward graph; each bucket's all-reduce is a node inside it")
        elif compiled:
            lines.append("compile.scope=blocks: one graph per block; buckets hold whole blocks")
        else:
            lines.append("eager: each bucket's all-reduce starts when its last gradient is accumulated")
    lines.append("parameters per bucket:")
    lines.append(plan.describe_params())
    return "\n".join(lines)
