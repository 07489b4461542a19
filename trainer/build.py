"""Building a run's pieces from the config: model precision, optimizer, schedule, compile and parallel wrapping.

:class:`trainer.loop.Trainer` calls these in order; ``trainer explain`` and the benchmarks reuse them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random

import numpy as np
import torch
import torch.nn as nn

from trainer import console
from trainer import plan as plan_rules
from trainer.config import Config, ConfigError
from trainer.distributed.fsdp import is_sharded
from trainer.model_setup import (
    build_model_of,
    check_attention,
    check_fits_data,
    check_trainable,
    fp8_all_gather,
    master_weights,
    maybe_fp8,
)


def make_model(plan: plan_rules.Plan, vocab_size: int, env=None, resume: bool = False) -> nn.Module:
    """The model the plan's config describes (the built-in GPT, ``model.target``'s, or the
    Hugging Face causal LM of ``model.hf``, whose vocabulary must hold ``vocab_size``: the data's), on the plan's
    device.

    A model trained from scratch on a CUDA device is built on it, where its random initialization takes
    milliseconds (an 8B model's takes about a minute on the host's single random-number stream); one that does
    not fit there is built on the host. A pretrained model is loaded on the host and moved. On a ``resume``, whose
    checkpoint overwrites every parameter, the parameters are left uninitialised and no pretrained weights are read
    (:func:`trainer.models.no_init.build_without_init`; a model that cannot be built so is built as usual, and says
    why).
    Under fsdp on several ranks (``env``) rank 0 builds it so and every other rank with its parameters on the meta
    device; :func:`shard` moves the shards to the device and fills them from rank 0's values.

    Before it reaches the device, the model is checked for parameters to train (:func:`check_trainable`) and against
    the data (:func:`check_fits_data`), which warns of a vocabulary far larger than the data's.

    Raises:
        ValueError: the model cannot be built, has no trainable parameters, or cannot take the data's sequences or
            token ids.
    """
    from trainer.models.no_init import build_without_init, parameters_on_meta

    cfg, device = plan.cfg, plan.device
    m = cfg.model
    check_attention(cfg, device, plan.autocast)
    fsdp = plan.strategy.fsdp
    pretrained = m.pretrained and not resume  # a resume's checkpoint holds every weight
    if plan.precision == "fp8":
        from trainer.precision import fp8

        fp8.check_available(device)  # before anything is built: exit 2 where float8 cannot run

    def build(pretrained: bool) -> nn.Module:
        if resume:
            model, why = build_without_init(lambda: build_model_of(cfg, vocab_size, False))
            if model is not None:
                return model
        model = build_model_of(cfg, vocab_size, pretrained)
        if resume:
            console.info(f"resume: the model's parameters were initialised before the checkpoint's load: {why}")
        return model

    def whole() -> nn.Module:  # one process's model, or rank 0's
        if pretrained or device.type != "cuda":
            return build(pretrained)
        try:
            with torch.device(device):
                return build(False)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            console.warn(f"the model does not fit {device} whole to be initialized there; building it on the host")
            return build(False)

    def ready(model: nn.Module) -> nn.Module:  # something to train, checked against the data, then fp8's layers
        model = master_weights(maybe_fp8(check_fits_data(check_trainable(model, cfg), cfg, vocab_size), plan), cfg)
        if plan.documents is not None:  # packed instruction data: each document attends to itself only
            from trainer.models.hf import use_document_mask

            if why := use_document_mask(model, plan.documents, cfg.data.seq_len):
                console.warn(why)
        return model

    if not fsdp:
        return ready(whole()).to(device)
    if env.rank == 0:
        return ready(whole())
    try:
        with parameters_on_meta():
            model = build_model_of(cfg, vocab_size, False)  # the weights are rank 0's to read
    except Exception as e:  # a model whose __init__ computes with its parameters' values; a config error fails again
        console.warn(
            f"fsdp: rank {env.rank} could not build the model with its parameters on the meta device "
            f"({type(e).__name__}: {e}); building it whole",
            every_rank=True,
        )
        model = build_model_of(cfg, vocab_size, False)
    with console.quiet():  # rank 0 says it for all
        return ready(model)


def batches(plan: plan_rules.Plan, corpus, env):
    """The sampler: this rank's slice of each step's global batch (the plan's), drawn from ``(seed, step)``: its
    data-parallel index's (the ranks of one tensor- or context-parallel group read the same sequences)."""
    from trainer.data import Batches
    from trainer.distributed.cp import context_positions
    from trainer.packing import PackedBatches

    cfg = plan.cfg
    common = dict(
        seq_len=cfg.data.seq_len,
        micro_batch_size=cfg.train.micro_batch_size,
        grad_accum=cfg.train.grad_accum,
        rank=plan.strategy.mesh.dp_rank(env.rank) if plan.strategy.world > 1 else 0,
        world_size=plan.strategy.dp_ranks,
        seed=cfg.seed,
        device=env.device,
        global_batch=plan.global_batch,
        skip=cfg.train.skip_batches,
    )
    if corpus.documents is not None:  # instruction data: whole documents packed, a document mask, a loss mask
        packed = PackedBatches(
            *corpus.documents, filler=corpus.eos_id or 0, eval_batches=cfg.train.eval_batches, **common
        )
        docs, T = corpus.documents[0], cfg.data.seq_len
        split = f"; {n:,} longer than data.seq_len are cut into pieces of {T}" if (n := docs.split_documents(T)) else ""
        console.info(
            f"data: {len(docs.starts) - 1:,} documents packed into {packed.train.sequences_per_epoch():,} sequences "
            f"an epoch, {packed.train.fill():.1%} of their tokens documents'{split}"
        )
        return packed
    return Batches(corpus, positions=context_positions(plan.strategy.mesh, env.rank, cfg.data.seq_len), **common)


def backward_context(cfg: Config):
    """A factory of the context each micro-step's forward and backward run in: compiled autograd, or None."""
    if not cfg.compile.autograd:
        return None
    from trainer.compile.autograd import compiled_autograd

    c = cfg.compile
    mode = c.mode if c.backend == "inductor" else None
    options = dict(c.inductor_options) or None
    return lambda: compiled_autograd(
        c.backend, mode=mode, dynamic=bool(c.dynamic), fullgraph=c.fullgraph, options=options
    )


def eager_fallback(raw_model: nn.Module, plan: plan_rules.Plan, env, opt=None):
    """``compile.fallback``: None (a compile failure stops the run), or for ``eager`` what replaces a model whose
    compile failed: the same parameters, uncompiled, wrapped again for data parallelism (``opt``: as :func:`wrap`)."""
    if plan.cfg.compile.fallback != "eager":
        return None

    def fallback(model: nn.Module, sync) -> tuple[nn.Module, object]:
        from trainer.distributed import sync as grad_sync

        sync.detach()  # the new wrapper registers its own hooks on the same parameters
        model = wrap(uncompiled(raw_model), plan, env, compile=False, opt=opt)[0]
        return model, grad_sync.of(model, plan)

    return fallback


def set_up_process(cfg: Config, device: torch.device) -> str | None:
    """What a run sets for its whole process: the seeds, and torch's threads (``train.threads``; on the CPU without
    it, the cores other work leaves idle: :func:`trainer.threads.set_threads`). Returns the startup line's part that
    says how many threads and why (None off the CPU)."""
    from trainer.threads import set_threads

    seed_everything(cfg.seed)
    return set_threads(cfg.train.threads, device)


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (the model's initialisation; data order has its own)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train_step(model: nn.Module, raw_model: nn.Module, opt, scaler, plan: plan_rules.Plan, env, spikes=None):
    """The :class:`trainer.step.TrainStep` the plan describes (``model``: what :func:`wrap` returned; ``spikes``: the
    run's :class:`trainer.step.SpikeWatch`, whose limit a step compares its loss with under train.on_spike=skip)."""
    from trainer.distributed import sync
    from trainer.step import TrainStep

    cfg = plan.cfg
    return TrainStep(
        model,
        raw_model,
        opt,
        grad_accum=cfg.train.grad_accum,
        grad_clip=cfg.optim.grad_clip,
        scaler=scaler,
        amp_dtype=plan.autocast,
        env=env,
        graphed=plan.graphed,
        skip_non_finite=cfg.train.on_nan == "skip",
        spike_limit=spikes.limit if spikes is not None and cfg.train.on_spike == "skip" else None,
        backward_ctx=backward_context(cfg),
        fallback=eager_fallback(raw_model, plan, env, opt=opt),
        sync=sync.of(model, plan),
        weighted=plan.documents is not None,
        eval_context=_eval_context(raw_model, plan),
    )


def _eval_context(raw_model: nn.Module, plan: plan_rules.Plan):
    """The context the evaluation runs in (None: none): under FlexAttention's document mask, every compiled graph
    set aside (``torch.compiler.set_stance("force_eager")``, whatever the compile scope) and the model on SDPA with
    the dense mask (:func:`trainer.models.hf.dense_documents`). torch 2.11's compiled inference graph of a model with
    FlexAttention inside (the evaluation's, under no_grad) stops on an H200 with an illegal memory access in the
    attention kernel, with or without Inductor's prologue fusion."""
    if plan.documents != "flex":
        return None
    from trainer.models.hf import dense_documents

    console.info("evaluation: eager, SDPA with the dense document mask (compiled FlexAttention fails in torch 2.11's "
                 "inference graphs)")  # fmt: skip

    def context():
        stack = contextlib.ExitStack()
        stack.enter_context(torch.compiler.set_stance("force_eager"))
        stack.enter_context(dense_documents(raw_model))
        return stack

    return context


def compile_caches(plan: plan_rules.Plan, run_dir) -> bool:
    """Point the compile caches at ``compile.cache_dir`` (default ``<run_dir>/compile_cache``) where anything is
    compiled, and start Triton's compile workers where Inductor compiles for CUDA (while the model is built: see
    :func:`trainer.compile.cache.start_workers`); there trainer's own kernels are also compiled in a second
    process as the compile finds them (:mod:`trainer.ops.warm`; ``TRAINER_WARM_KERNELS=0``
    turns it off). Returns whether anything is compiled."""
    import os
    from pathlib import Path

    from trainer.compile import cache
    from trainer.ops import warm

    cfg = plan.cfg
    inductor_on_cuda = plan.compiled and cache.wants_workers(cfg.compile.backend, plan.device.type)
    # trainer's kernels compiled in a second process, as the compile finds them (None: not in this run)
    warm.enable(plan.device if inductor_on_cuda and os.environ.get("TRAINER_WARM_KERNELS", "1") != "0" else None)
    if not (plan.compiled or cfg.compile.autograd):
        return False
    cache.use_cache_dir(Path(cfg.compile.cache_dir) if cfg.compile.cache_dir else Path(run_dir) / "compile_cache")
    if inductor_on_cuda:
        cache.start_workers()
    return True


def compile_watcher(plan: plan_rules.Plan, model: nn.Module | None = None):
    """A :class:`trainer.compile.report.CompileWatcher` (graphs, breaks, recompiles, compile time) that warns on a
    recompile after warm-up, when anything is compiled; else None. Under ``train.precision=fp8`` its report lists
    ``model``'s linears in float8 and the others with the reason."""
    cfg = plan.cfg
    if not (plan.compiled or cfg.compile.autograd):
        return None
    from trainer.compile.report import CompileWatcher

    warn = lambda rec: console.warn(rec["message"])  # noqa: E731
    watcher = CompileWatcher(max_recompiles=cfg.compile.max_recompiles, on_recompile=warn)
    if plan.precision == "fp8" and model is not None:
        from trainer.precision import fp8

        watcher.extra["fp8"] = fp8.conversion_of(model, cfg.train.fp8_recipe).as_dict()
    return watcher.start()


def lr_lambda(cfg: Config):
    """Multiplier of optim.lr at a step: linear warm-up, then cosine/linear decay to min_lr_ratio."""
    warmup, total = cfg.schedule.warmup_steps, cfg.train.steps
    floor, decay = cfg.schedule.min_lr_ratio, cfg.schedule.decay

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if decay == "constant" or total <= warmup:
            return 1.0
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if decay == "cosine" else 1.0 - progress
        return floor + (1.0 - floor) * shape

    return f


def make_optimizer(model: nn.Module, plan: plan_rules.Plan) -> torch.optim.Optimizer:
    """:func:`trainer.optim.build_optimizer` as the plan describes it (its ``optim_impl``), over ``model``'s
    :func:`~trainer.optim.param_groups`; sharded over the bucket plan with ``distributed.shard_optimizer`` (build
    it before :func:`wrap`, which reduces over that plan)."""
    from trainer.optim import build_optimizer, param_groups

    o = plan.cfg.optim
    opt = build_optimizer(
        param_groups(model, o.weight_decay),
        name=o.name,
        impl=plan.optim_impl,
        lr=o.lr,
        betas=tuple(o.betas),
        eps=o.eps,
        weight_decay=o.weight_decay,
        momentum=o.momentum,
        max_grad_norm=o.grad_clip,
        device=plan.device,
        sharded=is_sharded(model),
        scaled=plan.autocast == torch.float16,
        buckets=plan.layout_of(model) if plan.strategy.zero else None,
        stochastic_rounding=o.master_weights == "bf16",
    )
    if fp8_all_gather(plan):  # the float8 weights' scales for the next all-gather, after each update
        from trainer.precision import fp8

        opt.register_step_post_hook(fp8.after_optimizer_step(model))
    return opt


def grad_scaler(dtype, device: torch.device):
    """fp16's gradient scaler (None for other precisions)."""
    return torch.amp.GradScaler(device.type) if dtype == torch.float16 else None


def splits_at_buckets(compiled: bool, scope: str, autograd: bool) -> bool:
    """Whether DDP splits the forward graph at the buckets (``compiled``: ``compile.enabled`` as resolved; ``scope``,
    ``autograd``: ``compile.scope``, ``compile.autograd``).

    Only where the model is one graph with one backward graph: per-block graphs already end at whole
    blocks, and under compiled autograd the backward is one graph whatever the forward's pieces.
    """
    return compiled and scope == "model" and not autograd


def checkpoint_activations(model: nn.Module, plan: plan_rules.Plan) -> None:
    """``train.activation_checkpointing`` on the model's repeated blocks, in place (idempotent), and says so.

    Before anything compiles or wraps the blocks: the recompute is then inside their compiled graphs (and under
    FSDP inside its hooks, which gather the parameters again for the backward).
    """
    cfg = plan.cfg
    t = cfg.train
    if t.activation_checkpointing == "none":
        if t.checkpoint_every_n != 1:
            console.info("train.checkpoint_every_n has no effect with train.activation_checkpointing=none")
        return
    if cfg.compile.autograd and not plan.compiled:
        # Compiled autograd cannot trace an eager checkpoint's recompute (torch 2.13: "Attempted to call function
        # marked as skipped ... unpack_hook"); inside a compiled forward the recompute is part of its graph.
        raise ValueError(
            f"train.activation_checkpointing={t.activation_checkpointing} with compile.autograd=true needs the "
            "model compiled: set compile.enabled=true, or compile.autograd=false"
        )
    from trainer.models.recompute import apply_activation_checkpointing

    note = apply_activation_checkpointing(model, t.activation_checkpointing, t.checkpoint_every_n, cfg.compile.blocks)
    console.info(f"activation checkpointing: {note}")


def wrap(
    model: nn.Module,
    plan: plan_rules.Plan,
    env,
    compile: bool = True,
    opt=None,  # noqa: A002
) -> tuple[nn.Module, object | None]:
    """Compilation and data-parallel wrapping: ``(the module the loop calls, the DDP graph splitter or None)``.

    ``opt``: the run's optimizer; a sharded one (``distributed.shard_optimizer``) brings the bucket plan and the flat
    buffers its parameters live in, and ddp reduce-scatters into its gradient shards."""
    cfg = plan.cfg
    strategy = cfg.distributed.strategy
    if env.distributed and strategy == "none":
        raise ValueError(
            f"distributed.strategy: 'none' with {env.world_size} processes would train {env.world_size} "
            "independent models; set distributed.strategy=ddp or fsdp"
        )
    if strategy != "none" and not env.distributed:
        console.info(f"distributed.strategy={strategy} has no effect in a single process (no torchrun)")
        if cfg.distributed.shard_optimizer:
            console.info("distributed.shard_optimizer=true has no effect in a single process (no torchrun)")
    checkpoint_activations(model, plan)  # before compile and DDP; under FSDP shard() did it already
    buckets = splitter = None
    # distributed.shard_optimizer: the bucket plan the parameters were moved into
    shards = opt.shards if plan.strategy.zero and opt is not None else None
    if plan.strategy.ddp:
        from trainer.distributed import ddp

        buckets = shards.plan if shards is not None else plan.layout_of(model)
        c = cfg.compile
        if compile and splits_at_buckets(plan.compiled, plan.scope, c.autograd):
            from trainer.compile.capture import inner_backend

            backend = inner_backend(c.backend, c.mode, dict(c.inductor_options), plan.kernels)
            splitter = ddp.PlanSplitter(buckets, backend)
    # A sharded model had its blocks compiled by shard(), before fully_shard.
    if compile and plan.compiled and not is_sharded(model):
        from trainer.compile.capture import apply_compile

        scoped = dataclasses.replace(cfg.compile, scope=plan.scope)
        no_mask = plan.graphed and plan.scope == "blocks" and cfg.model.hf is not None
        model = apply_compile(model, scoped, backend=splitter, kernels=plan.kernels, no_mask=no_mask)
    if buckets is not None:
        from trainer.distributed.fsdp import DTYPES

        model = ddp.DataParallel(model, buckets, reduce_dtype=DTYPES[plan.reduce_dtype], shards=shards)
    return model, splitter


def shard(model: nn.Module, plan: plan_rules.Plan, env) -> None:
    """FSDP2 on the plan's mesh (HSDP with ``distributed.replicate``), after tensor parallel where ``distributed.tp``
    asks for it (torchtitan's order: tensor parallel, activation checkpointing, compile each block, then FSDP):
    compile each block (its forward, so FSDP's hooks stay outside the graph), then shard; every rank's shards are
    then rank 0's values (``model`` as :func:`make_model` built it under fsdp).

    Raises:
        ConfigError: a tensor-parallel layout the model cannot take (:mod:`trainer.distributed.tp`)."""
    from trainer.distributed.fsdp import DTYPES, apply_fsdp, describe_units, full_state, materialize_from_rank0

    cfg = plan.cfg
    c, d = cfg.compile, cfg.distributed
    mesh = plan.with_device_mesh().strategy.mesh  # built once by the run (trainer.loop); here for a caller alone
    full = full_state(model) if env.rank == 0 else None  # rank 0 built it whole (make_model), the others on meta
    _apply_tp_and_cp(model, mesh)
    with console.quiet():  # inside the compiled forward and FSDP's hooks; wrap() says so
        checkpoint_activations(model, plan)
    if plan.compiled:
        from trainer.compile.capture import apply_compile

        blocks = dataclasses.replace(c, scope="blocks")  # the plan's scope under fsdp, and its line says why
        apply_compile(model, blocks, hooks_outside=True, kernels=plan.kernels)
    param_dtype = DTYPES[plan.param_dtype]
    units = plan.layout_of(model)
    # The report's first line; `trainer explain` prints all of it.
    console.info(describe_units(model, units, d.fsdp_unit_mb).split("\n", 1)[0])
    apply_fsdp(
        model,
        units,
        param_dtype=None if param_dtype in (None, torch.float32) else param_dtype,
        reduce_dtype=DTYPES[plan.reduce_dtype],
        reshard_after_forward=d.reshard_after_forward,
        keep_gathered=d.keep_gathered,
        mesh=mesh.fsdp_mesh(),
    )
    materialize_from_rank0(model, full, env.device)


def _apply_tp_and_cp(model: nn.Module, mesh) -> None:
    """Tensor parallel and context parallel on ``model`` as the mesh asks (:mod:`trainer.distributed.tp`,
    :mod:`trainer.distributed.cp`), each said in one line.

    Raises:
        ConfigError: a layout the model cannot take."""
    from trainer.distributed.mesh import LayoutError

    try:
        if mesh.tp > 1:
            from trainer.distributed.tp import apply_tp

            console.info(apply_tp(model, mesh.tp_mesh()))
        if mesh.cp > 1:
            from trainer.distributed.cp import apply_cp

            console.info(apply_cp(model, mesh.cp_mesh()))
    except LayoutError as e:  # the model's shape, a user error: exit 2
        raise ConfigError(str(e)) from None


def uncompiled(model: nn.Module) -> nn.Module:
    """Undo per-block compilation: ``nn.Module.compile`` on submodules and a compiled ``head_loss``; activation
    checkpointing stays."""
    from trainer.models.recompute import checkpointed

    for mod in model.modules():
        if getattr(mod, "_compiled_call_impl", None) is not None:
            mod._compiled_call_impl = None
        forward = mod.__dict__.pop("forward", None)  # a compiled forward set as an instance attribute (fsdp)
        if checkpointed(forward) is not None:  # activation checkpointing's forward, compiled or not, stays
            mod.forward = checkpointed(forward)
    model.__dict__.pop("head_loss", None)  # the instance attribute apply_compile set; the method shows again
    return model


def fsdp_units(model: nn.Module, cfg: Config) -> list[list[nn.Module]]:
    """The blocks' FSDP units for ``cfg`` (``distributed.fsdp_unit_mb``, 0: a unit per block)."""
    from trainer.distributed.fsdp import block_units

    return block_units(model, cfg.compile.blocks, cfg.distributed.fsdp_unit_mb or None)
