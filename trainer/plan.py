"""The run's plan: every ``auto`` of the config resolved once, for this device and world, with the reason.

:func:`resolve` makes a frozen :class:`Plan` at the start of a run; the fit loop builds from ``plan.cfg`` (the
config with the compile switches resolved) and the plan's other fields. Each ``auto`` has one rule, which this
module applies (and states, or calls where the rule belongs to its piece: the optimizer's, the device's); the
functions elsewhere that still accept ``auto``, for callers that build a piece alone (the benchmarks, tests), call
the same rule.

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

from trainer.config import Config

AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
DTYPE_NAMES = {None: "fp32", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Strategy:
    """Data parallelism as it runs: the configured ``distributed.strategy`` on ``world`` ranks (a small value
    object, as torchtitan's ``ParallelDims``). With one rank every strategy runs as ``none``."""

    name: str  # none, ddp or fsdp, as configured
    world: int
    shard_optimizer: bool = False

    @property
    def ddp(self) -> bool:
        """Replicated parameters, gradients all-reduced over the bucket plan."""
        return self.name == "ddp" and self.world > 1

    @property
    def fsdp(self) -> bool:
        """Parameters, gradients and optimizer states sharded by FSDP2."""
        return self.name == "fsdp" and self.world > 1

    @property
    def zero(self) -> bool:
        """ddp with the optimizer state sharded over the ranks (``distributed.shard_optimizer``)."""
        return self.ddp and self.shard_optimizer

    @classmethod
    def of(cls, cfg: Config, env=None) -> Strategy:
        """The strategy ``cfg`` asks for on ``env``'s ranks (:class:`trainer.distributed.env.DistEnv`; None: one)."""
        world = env.world_size if env is not None and env.distributed else 1
        return cls(cfg.distributed.strategy, world, cfg.distributed.shard_optimizer)

    def __str__(self) -> str:
        if self.world == 1:
            return "one process"
        return f"{self.name} over {self.world} ranks" + (", optimizer state sharded" if self.zero else "")


@dataclass(frozen=True)
class Plan:
    """What a run does, resolved: ``cfg`` with its compile switches resolved, and every other ``auto`` as a field.

    Attributes:
        cfg: the config, ``compile.enabled``, ``compile.cudagraphs`` and ``compile.kernels`` resolved.
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
        choices: one line per ``auto``: what it became and why.
        device_memory: the device's memory in bytes (CUDA), None elsewhere.
        capability: the CUDA device's compute capability, e.g. ``(9, 0)``; None elsewhere.
        layout: once :meth:`placed` on the model: the bucket plan (ddp, a
            :class:`~trainer.distributed.buckets.BucketPlan`) or the FSDP units (fsdp, lists of modules); else None.
        units: the layout's units by name, for ``plan.json``: each bucket's or FSDP unit's modules.
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
    choices: tuple[str, ...] = field(default=())
    device_memory: int | None = None
    capability: tuple[int, int] | None = None
    layout: object | None = field(default=None, compare=False, repr=False)
    units: tuple[tuple[str, ...], ...] = ()

    @property
    def autocast(self) -> torch.dtype | None:
        """The autocast dtype of the forward (None: fp32, no autocast)."""
        return AUTOCAST[self.precision]

    def placed(self, model) -> Plan:
        """This plan with ``model``'s layout: the bucket plan under ddp, the FSDP units under fsdp (on any rank's
        model, whole or on the meta device); itself otherwise."""
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
        c = self.cfg.compile
        return {
            "train.device": str(self.device),
            "device.memory_gb": None if self.device_memory is None else round(self.device_memory / 1e9, 3),
            "device.capability": None if self.capability is None else ".".join(map(str, self.capability)),
            "world": self.strategy.world,
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
            "compile.enabled": bool(c.enabled),
            "compile.cudagraphs": bool(c.cudagraphs) and self.device.type == "cuda",
            "compile.kernels": list(c.kernels),
            "units": [list(u) for u in self.units],
            "choices": list(self.choices),
        }

    def write(self, run_dir: Path) -> None:
        """``run_dir/config.yaml`` (``cfg``: the config as given, its compile switches resolved) and
        ``run_dir/plan.json`` (:meth:`as_dict`)."""
        from trainer.config import to_yaml
        from trainer.io import atomic_write_text

        atomic_write_text(Path(run_dir) / "config.yaml", to_yaml(self.cfg))
        atomic_write_text(Path(run_dir) / "plan.json", json.dumps(self.as_dict(), indent=1) + "\n")


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
    if strategy.zero:
        impl = o.impl if o.impl != "auto" else "fused" if device.type == "cuda" else "foreach"
        return impl, "the sharded optimizer's update of each shard"
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


def compile_switches(cfg: Config, device: torch.device) -> tuple[Config, list[str]]:
    """A copy of ``cfg`` with ``compile.enabled`` and ``compile.cudagraphs`` resolved for ``device``, and why (the
    startup line's reasons). ``auto`` is the fastest measured path: compiled on CUDA, and the whole step as one CUDA
    graph wherever the step allows it."""
    cfg = copy.deepcopy(cfg)
    c, why = cfg.compile, []
    if c.enabled == "auto":
        c.enabled = device.type == "cuda"
        why.append(f"compile.enabled=auto: {'on for CUDA' if c.enabled else 'off on ' + device.type}")
    if c.cudagraphs == "auto":
        from trainer.compile.graphed import blocker

        reason = blocker(cfg) if device.type == "cuda" else None
        c.cudagraphs = device.type == "cuda" and reason is None
        state = "on" if c.cudagraphs else f"off, {reason}" if reason else f"off on {device.type}"
        why.append(f"compile.cudagraphs=auto: {state}")
    elif c.cudagraphs and device.type != "cuda":
        why.append(f"compile.cudagraphs=true has no effect on {device.type}")
    c.kernels, note = kernels(cfg, device)
    why += [note] if note else []
    return cfg, why


def kernels(cfg: Config, device: torch.device) -> tuple[list[str], str | None]:
    """``compile.kernels`` as a list of names for ``device``, and a note when the choice needs one. ``auto`` leaves
    out the loss row kernel under fp16 (its weight-gradient sum could overflow unscaled) and under compiled
    autograd (whose backward graph would keep a second logits buffer; the fused loss keeps none)."""
    from trainer.compile.capture import resolve_kernels

    c = cfg.compile
    kernels = resolve_kernels(c.kernels, device.type)
    if not (c.enabled or c.autograd):
        return [], (
            f"compile.kernels={c.kernels} has no effect without compile" if kernels and c.kernels != "auto" else None
        )
    if c.kernels == "auto" and (cfg.train.precision == "fp16" or c.autograd):
        kernels = [k for k in kernels if k != "cross_entropy"]
    return kernels, None


def resolve(cfg: Config, env) -> Plan:
    """The plan of ``cfg`` on ``env`` (:class:`trainer.distributed.env.DistEnv`: its device, world and backend,
    which :func:`trainer.distributed.env.setup` resolved)."""
    device = env.device
    resolved, compile_why = compile_switches(cfg, device)
    t, d = cfg.train, cfg.distributed
    strategy = Strategy.of(cfg, env)
    choices = []
    if t.device == "auto":
        choices.append(f"train.device=auto: {device} ({'CUDA is available' if device.type == 'cuda' else 'no CUDA'})")
    if env.backend is not None and d.backend == "auto":
        choices.append(f"distributed.backend=auto: {env.backend} (for {device.type})")
    prec = precision(t.precision, device)
    if t.precision == "auto":
        why = "bf16 autocast on CUDA" if prec == "bf16" else f"on {device.type}"
        choices.append(f"train.precision=auto: {prec} ({why})")
    choices += compile_why
    pdt = param_dtype(d.param_dtype, prec) if strategy.fsdp else "fp32"
    if strategy.fsdp and d.param_dtype == "auto":
        choices.append(f"distributed.param_dtype=auto: {pdt} (train.precision's)")
    impl, why = optim_impl(cfg, device, strategy, prec)
    if cfg.optim.impl == "auto":
        choices.append(f"optim.impl=auto: {impl} ({why})")
    from trainer.data import token_dtype

    ddtype, why = token_dtype(cfg.data.path, cfg.data.dtype)
    if cfg.data.dtype == "auto":
        choices.append(f"data.dtype=auto: {ddtype} ({why})")
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
        choices=tuple(choices),
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
