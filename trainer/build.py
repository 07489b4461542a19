"""Building a run's pieces from the config: model precision, optimizer, schedule, compile and parallel wrapping.

:class:`trainer.loop.Trainer` calls these in order; ``trainer explain`` and the benchmarks reuse them.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn as nn

from trainer.config import Config, ConfigError
from trainer.distributed.fsdp import is_sharded


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


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: not on norms, biases or embeddings (tied heads count as embeddings)."""
    embedding_ids = {id(mod.weight) for mod in model.modules() if isinstance(mod, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 and id(p) not in embedding_ids else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: Config, device: torch.device) -> torch.optim.Optimizer:
    from trainer.compile import optimizer

    o = cfg.optim
    return optimizer.build_optimizer(
        param_groups(model, o.weight_decay),
        name=o.name,
        impl=o.impl,
        lr=o.lr,
        betas=tuple(o.betas),
        eps=o.eps,
        weight_decay=o.weight_decay,
        momentum=o.momentum,
        max_grad_norm=o.grad_clip,
        device=device,
        sharded=is_sharded(model),
        scaled=amp_dtype(cfg.train.precision, device) == torch.float16,
    )


def fused_loss(cfg: Config, device: torch.device) -> bool:
    """``model.fused_loss``, with null resolved: on for the built-in GPT under compiled autograd on a GPU
    (unless ``model.cross_entropy: triton`` asks for the other loss kernel).

    Why: AOTAutograd lets Inductor write the logits' gradient into the saved logits buffer ("donated
    buffers"), but only in its own backward graphs; compiled autograd's graph is compiled as an inference
    graph, so it allocates a second (tokens x vocab) buffer: +1.5 GB for gpt2-small. The fused loss has
    no logits buffer at all; measured on an H100: compiled autograd 452K tok/s at 8.0 GB with it, the
    same as without compiled autograd (452K, 8.1 GB), against 10.6 GB without the fused loss.
    """
    if cfg.model.fused_loss is not None:
        return cfg.model.fused_loss
    explicit_other = cfg.model.cross_entropy == "triton"  # asked for by name: not silently replaced
    return cfg.compile.autograd and cfg.model.target is None and device.type == "cuda" and not explicit_other


def cross_entropy(cfg: Config, device: torch.device) -> str:
    """``model.cross_entropy`` with auto resolved: our Triton loss kernel on CUDA (not with fp16, where its weight
    gradient could overflow, nor under the fused loss, which replaces it), F.cross_entropy elsewhere."""
    if cfg.model.cross_entropy != "auto":
        return cfg.model.cross_entropy
    usable = cfg.model.target is None and cfg.train.precision != "fp16" and not fused_loss(cfg, device)
    return "triton" if device.type == "cuda" and usable else "torch"


def layer_norm(cfg: Config, device: torch.device) -> str:
    """``model.layer_norm`` with auto resolved: the fused residual add + LayerNorm Triton kernels for the built-in
    GPT on CUDA, nn.LayerNorm elsewhere (on CPU Triton runs only in its interpreter)."""
    if cfg.model.layer_norm != "auto":
        return cfg.model.layer_norm
    return "triton" if device.type == "cuda" and cfg.model.target is None else "torch"


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


def amp_dtype(precision: str, device: torch.device):
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def precision_name(dtype) -> str:
    return {None: "fp32", torch.bfloat16: "bf16 autocast", torch.float16: "fp16 autocast + grad scaler"}[dtype]


def splits_at_buckets(c) -> bool:
    """Whether DDP splits the forward graph at the buckets (``c``: the compile section).

    Only where the model is one graph with one backward graph: per-block graphs already end at whole
    blocks, and under compiled autograd the backward is one graph whatever the forward's pieces.
    """
    return c.enabled and c.scope == "model" and not c.autograd


def wrap(model: nn.Module, cfg: Config, env, say, compile: bool = True) -> tuple[nn.Module, object | None]:  # noqa: A002
    """Compilation and data-parallel wrapping: ``(the module the loop calls, the DDP graph splitter or None)``."""
    strategy = cfg.distributed.strategy
    if env.distributed and strategy == "none":
        raise ValueError(
            f"distributed.strategy: 'none' with {env.world_size} processes would train {env.world_size} "
            "independent models; set distributed.strategy=ddp or fsdp"
        )
    if strategy != "none" and not env.distributed:
        say(f"distributed.strategy={strategy} has no effect in a single process (no torchrun)")
    plan = splitter = None
    if env.distributed and strategy == "ddp":
        from trainer.distributed import ddp
        from trainer.distributed.buckets import plan_buckets

        plan = plan_buckets(model, cfg.distributed.bucket_mb, cfg.compile.blocks, cfg.distributed.split_tail)
        if compile and splits_at_buckets(cfg.compile):
            c = cfg.compile
            splitter = ddp.PlanSplitter(plan, ddp.inner_backend(c.backend, c.mode, dict(c.inductor_options)))
    # A sharded model had its blocks compiled by shard(), before fully_shard.
    if compile and cfg.compile.enabled and not is_sharded(model):
        from trainer.compile.capture import apply_compile

        model = apply_compile(model, cfg.compile, say=say, backend=splitter)
    if plan is not None:
        from trainer.distributed.fsdp import DTYPES

        model = ddp.DataParallel(model, plan, reduce_dtype=DTYPES[cfg.distributed.reduce_dtype])
    return model, splitter


def shard(model: nn.Module, cfg: Config, amp_dtype, say) -> None:
    """FSDP2: compile each block (its forward, so FSDP's hooks stay outside the graph), then shard."""
    import dataclasses

    from trainer.distributed.fsdp import DTYPES, apply_fsdp, describe_units

    c, d = cfg.compile, cfg.distributed
    if c.enabled:
        from trainer.compile.capture import apply_compile

        if c.scope == "model" and say:
            say("fsdp: compiling each block (as compile.scope=blocks): a compiled root runs eagerly under FSDP")
        blocks = dataclasses.replace(c, scope="blocks")
        apply_compile(model, blocks, say=say or (lambda m: None), hooks_outside=True)
    param_dtype = amp_dtype if d.param_dtype == "auto" else DTYPES[d.param_dtype]
    units = fsdp_units(model, cfg)
    if say:  # the report's first line; `trainer explain` prints all of it
        say(describe_units(model, units, d.fsdp_unit_mb).split("\n", 1)[0])
    apply_fsdp(
        model,
        units,
        param_dtype=None if param_dtype in (None, torch.float32) else param_dtype,
        reduce_dtype=DTYPES[d.reduce_dtype],
        reshard_after_forward=d.reshard_after_forward,
    )


def uncompiled(model: nn.Module) -> nn.Module:
    """Undo per-block compilation: ``nn.Module.compile`` on submodules and a compiled ``head_loss``."""
    for mod in model.modules():
        if getattr(mod, "_compiled_call_impl", None) is not None:
            mod._compiled_call_impl = None
        mod.__dict__.pop("forward", None)  # a compiled forward set as an instance attribute (fsdp)
    model.__dict__.pop("head_loss", None)  # the instance attribute apply_compile set; the method shows again
    return model


def fsdp_units(model: nn.Module, cfg: Config) -> list[list[nn.Module]]:
    """The blocks' FSDP units for ``cfg`` (``distributed.fsdp_unit_mb``, 0: a unit per block)."""
    from trainer.distributed.fsdp import block_units

    return block_units(model, cfg.compile.blocks, cfg.distributed.fsdp_unit_mb or None)


def fsdp_units_report(model: nn.Module, cfg: Config) -> str:
    """``trainer explain``'s view of the FSDP units (as :func:`shard` builds them)."""
    from trainer.distributed.fsdp import describe_units

    return describe_units(model, fsdp_units(model, cfg), cfg.distributed.fsdp_unit_mb)


def ddp_plan_report(model: nn.Module, cfg: Config, splitter=None) -> str:
    """``trainer explain``'s view of the bucket plan: bucket -> units -> parameters -> bytes -> graph piece.

    ``splitter`` is the one a run used (under torchrun); without one, the forward is traced once with
    a splitter over the eager backend (no code generation) to find where the pieces end.
    """
    from trainer.distributed import ddp
    from trainer.distributed.buckets import plan_buckets

    c = cfg.compile
    d = cfg.distributed
    plan = splitter.plan if splitter is not None else plan_buckets(model, d.bucket_mb, c.blocks, d.split_tail)
    lines = []
    if splits_at_buckets(c):
        if splitter is None:
            splitter = ddp.PlanSplitter(plan, ddp.inner_backend("eager"))
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
        if c.enabled and c.autograd:
            lines.append("compiled autograd: one backward graph; each bucket's all-reduce is a node inside it")
        elif c.enabled:
            lines.append("compile.scope=blocks: one graph per block; buckets hold whole blocks")
        else:
            lines.append("eager: each bucket's all-reduce starts when its last gradient is accumulated")
    lines.append("parameters per bucket:")
    lines.append(plan.describe_params())
    return "\n".join(lines)
