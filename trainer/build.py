"""Building a run's pieces from the config: model precision, optimizer, schedule, compile and parallel wrapping.

:class:`trainer.loop.Trainer` calls these in order; ``trainer explain`` and the benchmarks reuse them.
"""

from __future__ import annotations

import math
import random
import warnings

import numpy as np
import torch
import torch.nn as nn

from trainer import console
from trainer import plan as plan_rules
from trainer.config import Config, ConfigError
from trainer.distributed.fsdp import is_sharded


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
        model = master_weights(_maybe_fp8(check_fits_data(check_trainable(model, cfg), cfg, vocab_size), plan), cfg)
        if plan.documents is not None:  # packed instruction data: each document attends to itself only
            from trainer.models.hf import use_document_mask

            if why := use_document_mask(model, plan.documents):
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


def build_model_of(cfg: Config, vocab_size: int, pretrained: bool, attention: str | None = None) -> nn.Module:
    """The config's model, built where the default device says, without the checks of :func:`make_model`;
    ``attention`` in place of ``model.attention`` if given."""
    from trainer.models import build_model

    m = cfg.model
    return build_model(
        preset=m.preset,
        vocab_size=vocab_size,
        seq_len=cfg.data.seq_len,
        n_layer=m.n_layer,
        n_head=m.n_head,
        n_embd=m.n_embd,
        dropout=m.dropout,
        bias=m.bias,
        attention=attention or m.attention,
        target=m.target,
        kwargs=dict(m.kwargs),
        hf=m.hf,
        hf_overrides=dict(m.hf_overrides),
        pretrained=pretrained,
    )


def master_weights(model: nn.Module, cfg: Config) -> nn.Module:
    """``model`` with its floating-point parameters in ``optim.master_weights``'s dtype: bf16 casts them once
    (buffers, such as rotary tables, are kept); fp32 leaves them as built."""
    if cfg.optim.master_weights == "bf16":
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(torch.bfloat16)
    return model


def fp8_all_gather(plan: plan_rules.Plan) -> bool:
    """Whether fp8 weights are all-gathered in float8: fsdp on several ranks with the tensorwise recipe."""
    return plan.precision == "fp8" and plan.strategy.fsdp and plan.cfg.train.fp8_recipe == "tensorwise"


def _maybe_fp8(model: nn.Module, plan: plan_rules.Plan) -> nn.Module:
    """``model`` with its linears converted to float8 training under ``train.precision=fp8`` (the rule:
    :mod:`trainer.precision.fp8`); says how many, and why the others are not."""
    cfg = plan.cfg
    if plan.precision != "fp8":
        return model
    from trainer.precision import fp8

    all_gather = fp8_all_gather(plan)
    conversion = fp8.convert(model, cfg.train.fp8_recipe, fsdp_all_gather=all_gather)
    console.info(conversion.describe() + ("; weights all-gathered in float8" if all_gather else ""))
    return model


def model_source(cfg: Config) -> str:
    """The config's model in words, by the key that names it: ``model.hf NAME``, ``model.target PATH`` or the
    built-in GPT."""
    m = cfg.model
    return f"model.hf {m.hf}" if m.hf else f"model.target {m.target}" if m.target else "the built-in GPT"


def check_trainable(model: nn.Module, cfg: Config) -> nn.Module:
    """``model``, once it has a parameter to train: without one the first backward would stop with torch's
    ``element 0 of tensors does not require grad`` (a loss computed from no parameter), or every step would update
    nothing.

    Raises:
        ValueError: no parameter, or none with ``requires_grad`` (exit 2).
    """
    params = list(model.parameters())
    if any(p.requires_grad for p in params):
        return model
    if params:
        n = sum(p.numel() for p in params)
        what = f"its {len(params)} parameters ({n:,} values) all have" if len(params) > 1 else "its one parameter has"
        what += " requires_grad=False"
    else:
        what = "it has no parameters"
    raise _nothing_to_train(f"{model_source(cfg)} has no trainable parameters ({what})")


def _nothing_to_train(problem: str) -> ValueError:
    return ValueError(
        f"{problem}: training would have nothing to update. Return a model whose forward(idx, targets) computes the "
        "loss from parameters that require grad (nn.Parameter, nn.Linear, nn.Embedding; not frozen with "
        "requires_grad_(False) or detach())"
    )


def check_fits_data(model: nn.Module, cfg: Config, vocab_size: int) -> nn.Module:
    """``model``, once one meta-device forward (:func:`trainer.models.fit_check.check_model_fits`) shows it takes
    sequences of ``data.seq_len`` tokens with ids below ``vocab_size``, and returns a loss that trains a parameter. A
    model trained from scratch whose token table is more than 4x the data's vocabulary gets one warning naming the
    share of the model's parameters its embedding and head hold (:func:`vocabulary_parameters`).

    Raises:
        ValueError: a table shorter than the data needs, the model's own refusal of the length, or a loss that no
            parameter requiring grad reaches (exit 2).
    """
    from trainer.models.fit_check import check_model_fits

    m = cfg.model
    fit = check_model_fits(model, cfg.data.seq_len, vocab_size)
    source = model_source(cfg)
    resize = "model.hf_overrides" if m.hf else "model.kwargs" if m.target else "model"
    if fit.problems:
        kinds = {kind for kind, _ in fit.problems}
        ways = ["lower data.seq_len, or give the model more positions (" + resize + ")"] if kinds - {"tokens"} else []
        ways += (
            [
                f"use data tokenized for this model, or give it a vocabulary of at least {vocab_size} tokens "
                f"({resize}.vocab_size)"
            ]
            if "tokens" in kinds
            else []
        )
        lines = "; ".join(line for _, line in fit.problems)
        raise ValueError(f"{source} does not fit the data: {lines}. To fix: {'; '.join(ways)}")
    if fit.trains is False:
        raise _nothing_to_train(
            f"{source} has no trainable parameters in its loss (the loss its forward returns does not require grad: "
            "a constant, or computed from frozen or detached tensors only)"
        )
    rows = fit.token_table
    if rows is not None and rows > 4 * vocab_size and not (m.hf and m.pretrained):
        grows, total = vocabulary_parameters(model, fit.token_table_name, rows)
        share = (
            f": its embedding and head hold {_params(grows)} of its {_params(total)} parameters ({grows / total:.0%}), "
            f"where the data's vocabulary needs {_params(round(grows * vocab_size / rows))}. The head's matmul and "
            "the optimizer's work and memory grow with them"
            if grows and total
            else ""
        )
        console.warn(
            f"{source} has a {rows:,}-token vocabulary for data of {vocab_size:,} tokens{share}. "
            f"Set {resize}.vocab_size={vocab_size} (or a multiple of 64 above it)"
        )
    return model


def vocabulary_parameters(model: nn.Module, table: str | None, rows: int) -> tuple[int, int]:
    """``(parameters that grow with the vocabulary, all parameters)`` of ``model``: the token table (the parameter
    named ``table``) and the LM head (the last ``nn.Linear`` with ``rows`` outputs, its bias too), once each where
    the two are tied."""
    params = dict(model.named_parameters())
    grows = {id(params[table]): params[table].numel()} if table in params else {}
    heads = [mod for mod in model.modules() if isinstance(mod, nn.Linear) and mod.out_features == rows]
    for p in heads[-1].parameters(recurse=False) if heads else ():
        grows[id(p)] = p.numel()
    return sum(grows.values()), sum(p.numel() for p in model.parameters())


def _params(n: int) -> str:
    """A count of parameters: ``32.80M``, or ``65,536`` below 100K."""
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n:,}"


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
        packed = PackedBatches(*corpus.documents, filler=corpus.eos_id or 0, **common)
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
        eval_model=_eval_model(raw_model, plan),
    )


def _eval_model(raw_model: nn.Module, plan: plan_rules.Plan) -> nn.Module | None:
    """What the evaluation calls in place of the compiled model (None: the compiled model): the model uncompiled under
    FlexAttention's document mask. torch 2.11's compiled inference graph of a model with FlexAttention inside (the
    evaluation's, under no_grad) stops on an H200 with an illegal memory access in the attention kernel, with or
    without Inductor's prologue fusion; uncompiled, transformers compiles the attention alone, and it runs."""
    if plan.documents != "flex" or not plan.compiled:
        return None
    console.info("evaluation: the model uncompiled (compiled FlexAttention fails in torch 2.11's inference graphs)")
    return raw_model


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


def check_attention(cfg: Config, device: torch.device, dtype) -> None:
    """Fail at startup, with the key, when ``model.attention`` names a kernel this device cannot run.

    torch checks a backend's constraints (device, dtype, head size) only when attention first runs, and
    inside a compiled graph that is the first training step; a probe of the model's head size and dtype
    answers before anything is compiled.
    """
    name = cfg.model.attention
    if name == "auto":
        return
    from torch.nn.attention import sdpa_kernel

    from trainer.distributed.fsdp import DTYPES
    from trainer.models import GPTConfig, gpt_shape
    from trainer.models.gpt import sdpa_backend

    m = cfg.model
    shape = {**vars(GPTConfig()), **gpt_shape(m.preset, n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd)}
    n_head = shape["n_head"]
    head_dim = shape["n_embd"] // n_head
    d = cfg.distributed
    if d.strategy == "fsdp" and d.param_dtype != "auto":  # FSDP computes in its parameter dtype
        dtype = DTYPES[d.param_dtype]
    # The model's shape, sequence length, dropout and compute dtype: each can rule a kernel out.
    q = torch.zeros(1, n_head, cfg.data.seq_len, head_dim, device=device, dtype=dtype or torch.float32)
    q.requires_grad_()
    try:
        with warnings.catch_warnings(record=True) as said, sdpa_kernel(sdpa_backend(name)):
            warnings.simplefilter("always")
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=m.dropout, is_causal=True)
            out.sum().backward()
    except RuntimeError as e:
        # torch gives its reasons as warnings ("... not used because ...") and then "No available kernel".
        reasons = [str(w.message).strip().splitlines()[0] for w in said if "because" in str(w.message)]
        reasons = reasons or [str(e).strip().splitlines()[0]]
        first = "; ".join(reasons[:2])
        raise ConfigError(
            f"model.attention: '{name}' cannot run on {device} with {str(q.dtype).removeprefix('torch.')} and "
            f"head size {head_dim} ({first}); use auto"
        ) from None


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
        if compile and splits_at_buckets(plan.compiled, c.scope, c.autograd):
            from trainer.compile.capture import inner_backend

            backend = inner_backend(c.backend, c.mode, dict(c.inductor_options), plan.kernels)
            splitter = ddp.PlanSplitter(buckets, backend)
    # A sharded model had its blocks compiled by shard(), before fully_shard.
    if compile and plan.compiled and not is_sharded(model):
        from trainer.compile.capture import apply_compile

        model = apply_compile(model, cfg.compile, backend=splitter, kernels=plan.kernels)
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
    import dataclasses

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

        if c.scope == "model":
            console.info(
                "fsdp: compiling each block (as compile.scope=blocks): a compiled root runs eagerly under FSDP"
            )
        blocks = dataclasses.replace(c, scope="blocks")
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
