"""The run's plan: every ``auto`` of the config resolved once, for this device and world, with the reason.

:func:`resolve` makes a frozen :class:`Plan` at the start of a run; the fit loop builds from the plan's fields and
``plan.cfg`` (the config as given, ``auto`` kept: what the plan resolved is read from its fields, never from
``plan.cfg``). Each ``auto`` has one rule, which this module applies (and states, or calls where the rule belongs
to its piece: the optimizer's, the device's); the functions elsewhere that still accept ``auto``, for callers that
build a piece alone (the benchmarks, tests), call the same rule.

The run directory keeps ``plan.json``: the values the run used, each ``auto`` replaced, and one line per ``auto``
saying what it became and why. ``trainer explain`` prints the same lines.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainer.config import Config, ConfigError
from trainer.distributed.mesh import Mesh
from trainer.global_batch import GlobalBatch, SavedBatch, global_batch

AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
DTYPE_NAMES = {None: "fp32", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Strategy:
    """Parallelism as it runs: the configured ``distributed.strategy`` on ``world`` ranks, laid out on ``mesh``
    (:class:`trainer.distributed.mesh.Mesh`: replicate x shard x cp x tp; a small value object, as torchtitan's
    ``ParallelDims``). With one rank every strategy runs as ``none``."""

    name: str  # none, ddp or fsdp, as configured
    world: int
    shard_optimizer: bool = False
    mesh: Mesh = field(default_factory=Mesh)

    @property
    def ddp(self) -> bool:
        """Replicated parameters, gradients all-reduced over the bucket plan."""
        return self.name == "ddp" and self.world > 1

    @property
    def fsdp(self) -> bool:
        """Parameters, gradients and optimizer states sharded by FSDP2 (on the mesh: HSDP, with tp and cp)."""
        return self.name == "fsdp" and self.world > 1

    @property
    def zero(self) -> bool:
        """ddp with the optimizer state sharded over the ranks (``distributed.shard_optimizer``)."""
        return self.ddp and self.shard_optimizer

    @property
    def dp_ranks(self) -> int:
        """The data-parallel ranks: those that split the global batch, the mesh's replicate x shard (the ranks of
        one tensor- or context-parallel group read the same sequences)."""
        return self.mesh.dp

    @property
    def tp(self) -> int:
        return self.mesh.tp

    @property
    def cp(self) -> int:
        return self.mesh.cp

    @classmethod
    def of(cls, cfg: Config, env=None) -> Strategy:
        """The strategy ``cfg`` asks for on ``env``'s ranks (:class:`trainer.distributed.env.DistEnv`; None: one).

        Raises:
            ConfigError: a mesh that cannot be laid out on these ranks (:func:`trainer.distributed.mesh.resolve`).
        """
        return cls.with_notes(cfg, env)[0]

    @classmethod
    def with_notes(cls, cfg: Config, env=None) -> tuple[Strategy, list[str]]:
        """:meth:`of`, and the notes its mesh gives (keys that have no effect in one process)."""
        from trainer.distributed import mesh as meshes

        world = env.world_size if env is not None and env.distributed else 1
        d = cfg.distributed
        try:
            mesh, notes = meshes.resolve(d.strategy, replicate=d.replicate, shard=d.shard, cp=d.cp, tp=d.tp,
                                         world=world)  # fmt: skip
        except meshes.LayoutError as e:
            raise ConfigError(str(e)) from None
        return cls(d.strategy, world, d.shard_optimizer, mesh), notes

    def __str__(self) -> str:
        if self.world == 1:
            return "one process"
        layout = f" ({self.mesh})" if self.fsdp and self.mesh.shard != self.world else ""
        return f"{self.name} over {self.world} ranks{layout}" + (", optimizer state sharded" if self.zero else "")


@dataclass(frozen=True)
class Plan:
    """What a run does, resolved: every ``auto`` of ``cfg`` as a field.

    Attributes:
        cfg: the config as given (its ``auto`` kept), but for ``train.grad_accum`` and ``train.global_batch_size``,
            which carry the global batch as resolved (:attr:`batch`).
        device: where the model trains (``train.device``).
        strategy: data parallelism as it runs.
        backend: the process group's (nccl, gloo), None for one process.
        precision: ``train.precision``: fp32, bf16, fp16 or fp8.
        param_dtype: the dtype FSDP gathers parameters in (fp32: as stored); fp32 without fsdp.
        reduce_dtype: the dtype gradients are reduced in across ranks.
        optim_impl: ``optim.impl``: eager, foreach, fused, compiled or triton.
        data_dtype: the token dtype read from disk: uint16, uint32, or bytes (text read as bytes).
        attention: the built-in GPT's attention kernel: torch's choice per call, or the one named.
        checkpointing: ``train.activation_checkpointing`` (none, full, selective).
        batch: the global batch, and ``train.grad_accum`` as ``cfg`` carries it.
        compiled: ``compile.enabled``: whether the model is compiled.
        graphed: ``compile.cudagraphs``: whether the whole step is replayed as one CUDA graph (on CUDA only).
        kernels: ``compile.kernels``: the names of trainer's kernels substituted into the compiled graphs.
        scope: ``compile.scope``: what is compiled, the whole model (``model``) or each block (``blocks``).
        choices: one line per ``auto`` (and per derived value): what it became and why.
        device_memory: the device's memory in bytes (CUDA), None elsewhere.
        capability: the CUDA device's compute capability, e.g. ``(9, 0)``; None elsewhere.
        rank: this process's rank (its place on the mesh).
        layout: once :meth:`placed` on the model: the bucket plan (ddp, a
            :class:`~trainer.distributed.buckets.BucketPlan`) or the FSDP units (fsdp, lists of modules); else None.
        units: the layout's units by name, for ``plan.json``: each bucket's or FSDP unit's modules.
        async_save: ``checkpoint.async_save``, once :meth:`placed` on the model (``auto`` needs the state's size).
        documents: how the model keeps packed documents apart (instruction data, :mod:`trainer.packing`): ``flex``
            (FlexAttention's block mask, on CUDA) or ``dense`` (SDPA with a (B, 1, T, T) mask); None for pretraining
            data, whose sequences are windows of one stream.
    """

    cfg: Config
    device: torch.device
    strategy: Strategy
    backend: str | None
    precision: str
    param_dtype: str
    reduce_dtype: str
    optim_impl: str
    data_dtype: str
    attention: str
    checkpointing: str
    batch: GlobalBatch
    compiled: bool
    graphed: bool
    kernels: tuple[str, ...]
    scope: str = "model"
    choices: tuple[str, ...] = field(default=())
    device_memory: int | None = None
    capability: tuple[int, int] | None = None
    rank: int = 0
    layout: object | None = field(default=None, compare=False, repr=False)
    units: tuple[tuple[str, ...], ...] = ()
    async_save: bool = False
    documents: str | None = None

    @property
    def autocast(self) -> torch.dtype | None:
        """The autocast dtype of the forward (None: fp32, no autocast)."""
        return AUTOCAST[self.precision]

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all data-parallel ranks."""
        return self.batch.sequences

    def with_device_mesh(self) -> Plan:
        """This plan with its mesh's ``DeviceMesh`` built (fsdp on several ranks: every rank calls this once, after
        the process group exists); itself otherwise."""
        if not self.strategy.fsdp or self.strategy.mesh.device_mesh is not None:
            return self
        mesh = self.strategy.mesh.build(self.device.type)
        return dataclasses.replace(self, strategy=dataclasses.replace(self.strategy, mesh=mesh))

    def placed(self, model) -> Plan:
        """This plan with ``model``'s layout: the bucket plan under ddp, the FSDP units under fsdp (on any rank's
        model, whole or on the meta device); and ``checkpoint.async_save`` resolved for its state's size."""
        asked = self.cfg.checkpoint.async_save
        if asked == "auto":
            from trainer.checkpoint.background import available_host_memory, background_checkpoints, local_ranks

            shards = self.strategy.world if self.strategy.fsdp else 1
            state = sum(p.numel() * (p.element_size() + 8) for p in model.parameters()) // shards  # + AdamW's two
            on, why = background_checkpoints(self.device.type, state, local_ranks(), available_host_memory(),
                                             sharded=self.strategy.fsdp)  # fmt: skip
            plan = dataclasses.replace(
                self, async_save=on, choices=(*self.choices, f"checkpoint.async_save=auto: {why}")
            )
        else:
            plan = dataclasses.replace(self, async_save=bool(asked))
        return plan._with_layout(model)

    def _with_layout(self, model) -> Plan:
        d = self.cfg.distributed
        if self.strategy.ddp:
            from trainer.distributed.buckets import plan_buckets

            layout = plan_buckets(model, d.bucket_mb, self.cfg.compile.blocks, d.split_tail)
            units = tuple(tuple(b.units) for b in layout.buckets)
        elif self.strategy.fsdp:
            from trainer.distributed.fsdp import block_units

            layout = block_units(model, self.cfg.compile.blocks, d.fsdp_unit_mb or None)
            names = {id(m): name for name, m in model.named_modules()}
            units = tuple(tuple(names[id(m)] for m in unit) for unit in layout)
        else:
            return self
        return dataclasses.replace(self, layout=layout, units=units)

    def layout_of(self, model):
        """The bucket plan or FSDP units: this plan's, or ``model``'s when the plan was not :meth:`placed`."""
        return self.layout if self.layout is not None else self.placed(model).layout

    @property
    def compile_reasons(self) -> list[str]:
        """The choices of the compile switches: the startup line's reasons for its path."""
        return [line for line in self.choices if line.startswith("compile.")]

    def as_dict(self) -> dict:
        """The resolved values, by config key, and the choices: ``plan.json``."""
        return {
            "train.device": str(self.device),
            "device.memory_gb": None if self.device_memory is None else round(self.device_memory / 1e9, 3),
            "device.capability": None if self.capability is None else ".".join(map(str, self.capability)),
            "world": self.strategy.world,
            "mesh": self.strategy.mesh.as_dict(self.rank),
            "distributed.strategy": self.strategy.name if self.strategy.world > 1 else "none",
            "distributed.backend": self.backend or "none",
            "train.precision": self.precision,
            "autocast": DTYPE_NAMES[self.autocast],
            "distributed.param_dtype": self.param_dtype,
            "distributed.reduce_dtype": self.reduce_dtype,
            "optim.impl": self.optim_impl,
            "data.dtype": self.data_dtype,
            "model.attention": self.attention,
            "train.activation_checkpointing": self.checkpointing,
            "train.grad_accum": self.cfg.train.grad_accum,
            "global_batch": self.batch.sequences,
            "compile.enabled": self.compiled,
            "compile.cudagraphs": self.graphed,
            "compile.kernels": list(self.kernels),
            "compile.scope": self.scope,
            "checkpoint.async_save": self.async_save,
            "documents": self.documents,
            "units": [list(u) for u in self.units],
            "choices": list(self.choices),
        }

    def run_config(self) -> Config:
        """The config as the run records it, in ``config.yaml`` and in each checkpoint's ``meta.json``: a copy of
        ``cfg`` with ``compile.enabled``, ``compile.kernels``, ``compile.scope`` and an ``auto``
        ``compile.cudagraphs`` as resolved.

        A record, not something to build from (the fields are what the run reads): a resume compares its
        checkpoint's config with this one (:func:`trainer.checkpoint.compare_configs`), and checkpoints written
        with the switches resolved would otherwise report them changed (``compile.enabled: True -> 'auto'``)."""
        cfg = copy.deepcopy(self.cfg)
        c = cfg.compile
        c.enabled, c.kernels = self.compiled, list(self.kernels)
        if c.cudagraphs == "auto":
            c.cudagraphs = self.graphed
        c.scope = self.scope
        return cfg

    def write(self, run_dir: Path) -> None:
        """``run_dir/config.yaml`` (:meth:`run_config`) and ``run_dir/plan.json`` (:meth:`as_dict`, and ``cwd``: the
        working directory, against which the config's relative paths are read; ``trainer sample`` and ``trainer
        export`` read them against it from anywhere)."""
        import os

        from trainer.config import to_yaml
        from trainer.io import atomic_write_text

        atomic_write_text(Path(run_dir) / "config.yaml", to_yaml(self.run_config()))
        doc = {**self.as_dict(), "cwd": os.getcwd()}
        atomic_write_text(Path(run_dir) / "plan.json", json.dumps(doc, indent=1) + "\n")


# -- the rules for auto, one function each ----------------------------------------------------------------------


def precision(spec: str, device: torch.device) -> str:
    """``train.precision``: ``auto`` is bf16 autocast on CUDA, fp32 elsewhere."""
    if spec != "auto":
        return spec
    return "bf16" if device.type == "cuda" else "fp32"


def param_dtype(spec: str, precision_: str) -> str:
    """``distributed.param_dtype`` (FSDP's compute dtype): ``auto`` is the precision's autocast dtype."""
    return DTYPE_NAMES[AUTOCAST[precision_]] if spec == "auto" else spec


def optim_impl(cfg: Config, device: torch.device, strategy: Strategy, precision_: str) -> tuple[str, str]:
    """``optim.impl`` and why (see :func:`trainer.optim.factory.resolve_impl`; the sharded optimizer's inner
    update is torch's ``fused`` on CUDA: a shard must stay a view of its bucket's buffer)."""
    from trainer.optim.factory import resolve_impl

    o = cfg.optim
    if o.impl == "triton" and strategy.fsdp and strategy.tp > 1:
        raise ConfigError(
            f"optim.impl=triton: trainer's Triton {o.name} updates parameters of one device mesh, and under "
            f"distributed.tp={strategy.tp} the split linears and the replicated norms and embeddings lie on two; "
            "use optim.impl=auto (torch's fused) or fused"
        )
    if strategy.zero:
        impl = o.impl if o.impl != "auto" else "fused" if device.type == "cuda" else "foreach"
        return impl, "the sharded optimizer's update of each shard"
    if o.master_weights == "bf16":  # the stochastic rounding is the Triton kernel's
        return "triton", "optim.master_weights=bf16: trainer's Triton AdamW rounds bf16 stochastically"
    impl = resolve_impl(o.impl, device, name=o.name, sharded=strategy.fsdp, scaled=precision_ == "fp16")
    if device.type != "cuda":
        why = f"torch's foreach on {device.type}"
    elif impl == "triton":
        why = f"trainer's Triton {o.name} on CUDA"
    else:
        why = "torch's fused " + (
            "under fsdp" if strategy.fsdp else "with fp16's scaler" if precision_ == "fp16" else f"for {o.name}"
        )
    return impl, why


@dataclass(frozen=True)
class CompileSwitches:
    """``compile.enabled``, ``compile.cudagraphs`` and ``compile.kernels`` as resolved (:func:`compile_switches`).

    Attributes:
        compiled: whether the model is compiled.
        graphed: whether the whole step is replayed as one CUDA graph (on CUDA only).
        kernels: the names of trainer's kernels substituted into the compiled graphs.
        why: the startup line's reasons: one line per ``auto``, and per value that has no effect.
    """

    compiled: bool
    graphed: bool
    kernels: tuple[str, ...]
    why: tuple[str, ...]
    scope: str = "model"


def compile_switches(
    cfg: Config, device: torch.device, precision_: str, impl: str, strategy: Strategy | None = None,
    documents: str | None = None,
) -> CompileSwitches:  # fmt: skip
    """``compile.enabled``, ``compile.scope``, ``compile.cudagraphs`` and ``compile.kernels`` resolved for ``device``,
    and why (the startup line's reasons); ``precision_`` and ``impl``: ``train.precision`` and ``optim.impl`` as
    resolved; ``strategy`` and ``documents`` as the plan has them (None: one process, pretraining data). ``auto`` is
    the fastest measured path: compiled on CUDA (:func:`compile_scope` says what), and the whole step as one CUDA
    graph wherever the step allows it.

    Raises:
        ConfigError: ``compile.cudagraphs=true`` with compiled blocks of a ``model.hf`` model that makes its
            attention mask between them (the schema cannot tell before the model's config is read)."""
    c, why = cfg.compile, []
    compiled = c.enabled if c.enabled != "auto" else device.type == "cuda"
    if c.enabled == "auto":
        why.append(f"compile.enabled=auto: {'on for CUDA' if compiled else 'off on ' + device.type}")
    scope, scope_why, masks = compile_scope(cfg, device, strategy or Strategy("none", 1), documents, compiled)
    why += [scope_why] if scope_why else []
    from trainer.compile.graphed import blocker, unmet_requirement
    from trainer.schema import graphed_step_settings

    # distributed.strategy and .backend as configured, as the schema reads them for compile.cudagraphs=true:
    # one process gets the answer its config gets under torchrun.
    settings = {**graphed_step_settings(cfg), "optim_impl": impl, "precision": precision_, "scope": scope,
                "masks": masks}  # fmt: skip
    if c.cudagraphs is True and device.type == "cuda" and (problem := unmet_requirement(**settings)):
        raise ConfigError(problem)
    if c.cudagraphs == "auto":
        reason = blocker(compiled, **settings) if device.type == "cuda" else None
        graphed = device.type == "cuda" and reason is None
        state = "on" if graphed else f"off, {reason}" if reason else f"off on {device.type}"
        why.append(f"compile.cudagraphs=auto: {state}")
    else:
        graphed = c.cudagraphs and device.type == "cuda"
        if c.cudagraphs and device.type != "cuda":
            why.append(f"compile.cudagraphs=true has no effect on {device.type}")
    names, note = kernels(cfg, device, compiled, precision_)
    why += [note] if note else []
    return CompileSwitches(bool(compiled), bool(graphed), tuple(names), tuple(why), scope)


def compile_scope(
    cfg: Config, device: torch.device, strategy: Strategy, documents: str | None, compiled: bool
) -> tuple[str, str | None, str | None]:
    """``compile.scope`` resolved, its choice line (None where there is nothing to say), and why the blocks of a
    ``model.hf`` model get an attention mask made between them (None where they get none, or it does not apply).

    ``auto`` compiles each block once for a ``model.hf`` model on one CUDA device that makes no mask between its
    blocks (:func:`trainer.models.hf.mask_between_blocks`): measured as fast as the whole model on an H200, with a
    first step 2.3x shorter (the Llama-3.2-1B shape: 65.0K tokens/s either way, 15.3 s against 35.4 s), since
    Dynamo, AOTAutograd and Inductor see one block instead of all of them. fsdp compiles each block whatever the
    scope. The whole model otherwise: the built-in GPT measured 1.3% faster whole (GPT-2 124M), ddp splits the
    whole model's graph at its buckets, and a model of one's own (``model.target``) is not known to have blocks."""
    c, m = cfg.compile, cfg.model

    def masks() -> str | None:  # the model's config read where the answer is used
        if m.hf is None:
            return None
        from trainer.models.hf import load_hf_config, mask_between_blocks

        return mask_between_blocks(load_hf_config(m.hf, dict(m.hf_overrides or {})), documents is not None)

    if compiled and strategy.fsdp:  # whatever the scope: a compiled root runs eagerly under FSDP
        said = {"auto": "compile.scope=auto: each block", "model": "compile.scope=model: each block, as blocks"}
        why = said.get(c.scope, "") and f"{said[c.scope]} (fsdp compiles the blocks, its hooks outside them)"
        return "blocks", why or None, None
    if c.scope != "auto":
        return c.scope, None, masks() if c.scope == "blocks" else None
    if not compiled:
        return "model", None, None
    if m.hf is None or device.type != "cuda" or strategy.ddp:
        why = (
            "ddp splits the whole model's graph at its buckets" if strategy.ddp
            else "a model of one's own (model.target)" if m.target is not None
            else "the built-in GPT measured 1.3% faster compiled whole" if m.hf is None
            else f"each block is measured on CUDA only, not on {device.type}"
        )  # fmt: skip
        return "model", f"compile.scope=auto: the whole model ({why})", None
    if (why := masks()) is not None:
        return "model", f"compile.scope=auto: the whole model ({why}, between compiled blocks)", None
    return "blocks", "compile.scope=auto: each block once (no attention mask made between them)", None


def kernels(cfg: Config, device: torch.device, compiled: bool, precision_: str) -> tuple[list[str], str | None]:
    """``compile.kernels`` as a list of names for ``device``, and a note when the choice needs one; ``compiled`` and
    ``precision_``: ``compile.enabled`` and ``train.precision`` as resolved. ``auto`` leaves out the loss row kernel
    under fp16 (its weight-gradient sum could overflow unscaled) and under compiled autograd (whose backward graph
    would keep a second logits buffer; the fused loss keeps none)."""
    from trainer.compile.capture import resolve_kernels

    c = cfg.compile
    names = resolve_kernels(c.kernels, device.type)
    if not (compiled or c.autograd):
        return [], (
            f"compile.kernels={c.kernels} has no effect without compile" if names and c.kernels != "auto" else None
        )
    if c.kernels == "auto" and (precision_ == "fp16" or c.autograd):
        names = [k for k in names if k != "cross_entropy"]
    if cfg.distributed.cp > 1 and "causal_attention" in names:
        names = [k for k in names if k != "causal_attention"]
        return names, (
            "compile.kernels: causal_attention steps aside under distributed.cp: ring attention takes the causal "
            "attention call as trainer's context parallel makes it (is_causal, no mask, the key/value heads repeated)"
        )
    return names, None


def resolve(cfg: Config, env, saved: SavedBatch | None = None) -> Plan:
    """The plan of ``cfg`` on ``env`` (:class:`trainer.distributed.env.DistEnv`: its device, world and backend,
    which :func:`trainer.distributed.env.setup` resolved); ``saved``: the batch of the checkpoint the run resumes,
    read before anything is built (None: a fresh start), whose global batch the plan keeps
    (:func:`trainer.global_batch.global_batch`).

    Raises:
        ConfigError: a ``train.global_batch_size`` that these ranks cannot split
            (:func:`trainer.global_batch.derive_grad_accum`).
    """
    device = env.device
    t, d = cfg.train, cfg.distributed
    strategy, mesh_notes = Strategy.with_notes(cfg, env)
    batch = global_batch(t, strategy.dp_ranks, saved)
    resolved = copy.deepcopy(cfg)  # the config as given, but for the global batch it carries
    resolved.train.grad_accum = batch.grad_accum
    if batch.choice is not None:  # derived: the config carries the global batch it keeps
        resolved.train.global_batch_size = batch.sequences
    prec = precision(t.precision, device)
    if cfg.optim.master_weights == "bf16" and prec != "bf16":
        raise ConfigError(
            f"optim.master_weights=bf16: needs train.precision=bf16 (train.precision={t.precision} is {prec} on "
            f"{device.type}); set train.precision=bf16"
        )
    impl, impl_why = optim_impl(cfg, device, strategy, prec)
    from trainer.packing import document_mask

    m = cfg.model
    documents, documents_why = document_mask(cfg.data.path, m.hf, m.target, strategy.cp, device)
    switches = compile_switches(cfg, device, prec, impl, strategy, documents)
    choices = []
    if t.device == "auto":
        choices.append(f"train.device=auto: {device} ({'CUDA is available' if device.type == 'cuda' else 'no CUDA'})")
    if env.backend is not None and d.backend == "auto":
        choices.append(f"distributed.backend=auto: {env.backend} (for {device.type})")
    if t.precision == "auto":
        why = "bf16 autocast on CUDA" if prec == "bf16" else f"on {device.type}"
        choices.append(f"train.precision=auto: {prec} ({why})")
    choices += [*switches.why, *mesh_notes]
    choices += [batch.choice] if batch.choice else []
    pdt = param_dtype(d.param_dtype, prec) if strategy.fsdp else "fp32"
    if strategy.fsdp and d.param_dtype == "auto":
        choices.append(f"distributed.param_dtype=auto: {pdt} (train.precision's)")
    if cfg.optim.impl == "auto":
        choices.append(f"optim.impl=auto: {impl} ({impl_why})")
    from trainer.data import token_dtype

    ddtype, why = token_dtype(cfg.data.path, cfg.data.dtype)
    if cfg.data.dtype == "auto":
        choices.append(f"data.dtype=auto: {ddtype} ({why})")
    choices += [documents_why] if documents_why else []
    attention = cfg.model.attention
    if cfg.model.target is not None or cfg.model.hf is not None:
        attention = "the model's own (model.attention is the built-in GPT's)"
    elif attention == "auto":
        attention = "sdpa (torch's kernel choice per call)"
        choices.append("model.attention=auto: scaled_dot_product_attention picks its kernel per call")
    return Plan(
        cfg=resolved,
        device=device,
        strategy=strategy,
        backend=env.backend,
        precision=prec,
        param_dtype=pdt,
        reduce_dtype=d.reduce_dtype,
        optim_impl=impl,
        data_dtype=ddtype,
        attention=attention,
        checkpointing=t.activation_checkpointing,
        batch=batch,
        compiled=switches.compiled,
        graphed=switches.graphed,
        kernels=switches.kernels,
        scope=switches.scope,
        choices=tuple(choices),
        rank=env.rank,
        documents=documents,
        **_device_facts(device),
    )


def one_process(cfg: Config, device: str | torch.device = "cpu") -> Plan:
    """The plan of ``cfg`` in one process on ``device``, without torchrun: for pieces built alone (tests, probes)."""
    from trainer.distributed.env import DistEnv

    return resolve(cfg, DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device(device), backend=None))


def _device_facts(device: torch.device) -> dict:
    """The CUDA device's memory and compute capability (nothing elsewhere, nor for a plan made without the GPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return {}
    props = torch.cuda.get_device_properties(device)
    return {"device_memory": props.total_memory, "capability": (props.major, props.minor)}
