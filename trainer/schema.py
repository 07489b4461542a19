"""The config schema: one dataclass per section, every field with a one-line docstring under it.

:mod:`trainer.config` loads, validates and prints configs of this schema; its introspection reads the docstrings, so
``trainer print-config`` and docs/configuration.md show the same text. Range and choice checks are declared in
field metadata (``choices``, ``ge``, ``gt``, ``names``); cross-field checks live in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from trainer.compile.passes import KERNEL_NAMES
from trainer.models.presets import PRESETS


class ConfigError(ValueError):
    """A user error in a config file, an override or a CLI argument (exit status 2)."""


def _f(default: Any = dataclasses.MISSING, *, choices=None, ge=None, gt=None, factory=None, names=None):
    meta = {k: v for k, v in (("choices", choices), ("ge", ge), ("gt", gt), ("names", names)) if v is not None}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(kw_only=True)
class RunConfig:
    name: str = "run"
    """Run name, one directory name (no / or \\); used in the default run directory and in plots."""
    dir: str = "runs/${run.name}"
    """Run directory (any path): resolved config.yaml, metrics.jsonl, checkpoints/, compile report."""
    overwrite: bool = False
    """A fresh run into a directory that holds a run: false refuses (exit 2; resume=last continues it); true moves
    the old run aside to <run.dir>.old-N (nothing is deleted) and starts afresh."""

    def __post_init__(self):
        if why := _not_a_directory_name(self.name):
            raise ConfigError(
                f"run.name: {_quoted(self.name)} is not a single directory name ({why}); run.name names the run "
                "and, by default, its directory runs/<run.name>: to write the run elsewhere, set run.dir, which takes "
                "any path"
            )


def _not_a_directory_name(name: str) -> str | None:
    """Why ``name`` is not one path component a directory can be named (None if it is)."""
    special = {"": "it is empty", ".": "'.' is the directory it stands in", "..": "'..' is the parent directory"}
    if name in special:
        return special[name]
    separators = {"/", "\\", os.sep, os.altsep} - {None}
    if found := sorted(c for c in separators if c in name):
        return f"it holds {' and '.join(_quoted(c) for c in found)}, a path separator"
    if "\0" in name:
        return "it holds a NUL character"
    if len(name.encode()) > 255:
        return f"{len(name.encode())} bytes long; a file system allows 255"
    return None


def _quoted(text: str) -> str:
    """``text`` in quotes as the user wrote it (a backslash not doubled); escaped where it holds unprintable bytes."""
    return f"'{text}'" if text.isprintable() else repr(text)


@dataclass(kw_only=True)
class ModelConfig:
    preset: str | None = _f("tiny", choices=["tiny", "gpt2-small", "gpt2-medium"])
    """Built-in GPT size (tiny | gpt2-small | gpt2-medium); null with model.target; ignored (set to null) with
    model.hf."""
    n_layer: int | None = _f(None, gt=0)
    """Number of transformer blocks; overrides the preset."""
    n_head: int | None = _f(None, gt=0)
    """Attention heads per block; overrides the preset."""
    n_embd: int | None = _f(None, gt=0)
    """Embedding width; overrides the preset. Must be divisible by n_head."""
    dropout: float = _f(0.0, ge=0.0)
    """Dropout probability (0 disables dropout)."""
    bias: bool = True
    """Biases in linear layers and LayerNorms, as GPT-2."""
    attention: str = _f("auto", choices=["auto", "flash", "cudnn", "efficient", "math"])
    """Built-in GPT: the scaled-dot-product-attention kernel (auto: torch's choice, which is cuDNN's on H100
    with torch 2.11; scripts/bench_attention.py times them). Checked on the device at startup."""
    target: str | None = None
    """Your own model as "pkg.module:factory"; the factory returns an nn.Module whose
    forward(idx, targets) returns the loss (or a tuple ending in it)."""
    kwargs: dict[str, Any] = _f(factory=dict)
    """Keyword arguments passed to model.target's factory."""
    hf: str | None = None
    """A Hugging Face causal LM: a local directory holding config.json (and its weights), or a hub name (fetched
    where the machine can download). Sets model.preset to null; the built-in GPT's keys are errors with it (change
    the model through model.hf_overrides). Needs pip install -e '.[hf]'."""
    hf_overrides: dict[str, Any] = _f(factory=dict)
    """Fields of model.hf's config to change before the model is built, e.g. {num_hidden_layers: 2}."""
    pretrained: bool = False
    """model.hf: load its weights (from_pretrained); false initialises it at random from its config (from_config)."""

    def __post_init__(self):
        if self.target is not None and ":" not in self.target:
            raise ConfigError(f"model.target: expected 'pkg.module:factory', got {self.target!r}")
        if self.hf is None:
            for key in ("hf_overrides", "pretrained"):
                if getattr(self, key):
                    raise ConfigError(f"model.{key}: applies to a Hugging Face model only; set model.hf")
            return
        if self.target is not None:
            raise ConfigError("model.hf: model.hf and model.target name two different models; set one of them")
        gpt_keys = {
            "n_layer": self.n_layer is not None,
            "n_head": self.n_head is not None,
            "n_embd": self.n_embd is not None,
            "dropout": self.dropout != 0.0,
            "bias": not self.bias,
        }
        for key, chosen in gpt_keys.items():
            if chosen:
                raise ConfigError(
                    f"model.{key}: applies to the built-in GPT only; with model.hf change the Hugging Face config "
                    "through model.hf_overrides (e.g. {num_hidden_layers: 2, hidden_size: 256})"
                )
        self.preset = None  # as model.target would need it: the model's shape is the Hugging Face config's


@dataclass(kw_only=True)
class DataConfig:
    path: str | None = None
    """A directory written by trainer prepare (train.bin, val.bin, meta.json: its vocabulary and dtype are read from
    meta.json), a token file (.bin: nanoGPT's uint16 format, or data.dtype), a text file (read as bytes, vocabulary
    256), or null = the embedded corpus (this Python's standard library source)."""
    vocab_size: int | None = _f(None, gt=0)
    """Vocabulary size: required for a bare .bin token file, read from meta.json for a prepared directory (a different
    value is an error), 256 for bytes. A larger value only widens the embedding (e.g. GPT-2's 50304)."""
    dtype: str = _f("auto", choices=["auto", "uint16", "uint32"])
    """Token dtype of a .bin file: auto = meta.json's for a prepared directory, uint16 (nanoGPT) for a bare .bin."""
    seq_len: int = _f(256, gt=0)
    """Tokens per training sequence (the model's context length)."""
    val_fraction: float = _f(0.05, gt=0.0)
    """Fraction of the corpus held out for validation (deterministic split)."""


@dataclass(kw_only=True)
class OptimConfig:
    name: str = _f("adamw", choices=["adamw", "adam", "sgd"])
    """Optimizer: adamw | adam | sgd."""
    lr: float = _f(6e-4, gt=0.0)
    """Peak learning rate."""
    weight_decay: float = _f(0.1, ge=0.0)
    """Decoupled weight decay, applied to matrices only (not norms, biases, embeddings)."""
    betas: list[float] = _f(factory=lambda: [0.9, 0.95])
    """Adam betas (beta1, beta2)."""
    eps: float = _f(1e-8, gt=0.0)
    """Adam epsilon."""
    momentum: float = _f(0.9, ge=0.0)
    """SGD momentum."""
    grad_clip: float = _f(1.0, ge=0.0)
    """Clip gradients to this global L2 norm (0 disables clipping)."""
    impl: str = _f("auto", choices=["auto", "eager", "foreach", "fused", "compiled", "triton"])
    """Optimizer implementation: auto picks the fastest measured: on CUDA trainer's Triton AdamW/Adam (triton) for
    adamw/adam, torch's fused for sgd, fsdp or fp16; foreach elsewhere."""
    master_weights: str = _f("fp32", choices=["fp32", "bf16"])
    """The parameters' and AdamW states' dtype. bf16: both kept in bf16 (half the optimizer's bytes; under fsdp no
    copy of the parameters to bf16 for the forward), each update computed in fp32 and stored with stochastic
    rounding by trainer's Triton AdamW, so that updates smaller than a bf16 step still count, on average. Needs
    optim.name adamw or adam, optim.impl auto or triton, train.precision bf16 (auto: bf16 on CUDA), and a model
    trained from its initialization or a checkpoint (its parameters are cast once)."""

    def __post_init__(self):
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas: expected two numbers in [0, 1), got {list(self.betas)}")


@dataclass(kw_only=True)
class ScheduleConfig:
    warmup_steps: int = _f(100, ge=0)
    """Linear warm-up from 0 to optim.lr over this many steps."""
    decay: str = _f("cosine", choices=["cosine", "linear", "constant"])
    """Decay after warm-up, down to min_lr_ratio * lr at train.steps."""
    min_lr_ratio: float = _f(0.1, ge=0.0)
    """Final learning rate as a fraction of optim.lr."""


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = _f(1000, gt=0)
    """Optimizer steps to train for."""
    stop_at: int | None = _f(None, gt=0)
    """Stop this invocation after this step, with a checkpoint; the schedule still spans train.steps."""
    micro_batch_size: int = _f(8, gt=0)
    """Sequences per forward/backward on each rank."""
    grad_accum: int = _f(1, gt=0)
    """Micro-batches accumulated per optimizer step; derived (and this value replaced) when train.global_batch_size
    is set."""
    global_batch_size: int | None = _f(None, gt=0)
    """Sequences per optimizer step over all ranks, the same on any number of GPUs: train.grad_accum becomes
    global_batch_size / (micro_batch_size x data-parallel ranks); null: micro_batch_size x grad_accum x ranks."""
    precision: str = _f("auto", choices=["auto", "fp32", "bf16", "fp16", "fp8"])
    """Autocast precision: auto = bf16 on GPU, fp32 on CPU; fp8 = bf16 autocast with float8 matmuls in the linear
    layers large enough to gain (torchao, pip install -e '.[fp8]'; a GPU with float8 tensor cores)."""
    fp8_recipe: str = _f("tensorwise", choices=["tensorwise", "rowwise"])
    """With train.precision=fp8: one float8 scale per tensor (tensorwise; under fsdp the weights are all-gathered
    in float8) or per row (rowwise: finer, slower)."""
    device: str = "auto"
    """Device: auto (cuda if available, else cpu), cpu, cuda, cuda:N."""
    threads: int | None = _f(None, gt=0)
    """Threads for torch's CPU ops (torch.set_num_threads). null: on a CPU, OMP_NUM_THREADS if set, else the cores
    this process may use less those other work keeps busy (the 1-minute load average, bounded by a sample of the
    cores busy now), shared among torchrun's local ranks; on CUDA torch's default. The startup line says how many and
    why. trainer tune searches it on a CPU."""
    eval_every: int = _f(0, ge=0)
    """Validation loss every N steps and at the end (0: only at the end)."""
    eval_batches: int = _f(8, gt=0)
    """Micro-batches per validation pass."""
    on_nan: str = _f("stop", choices=["stop", "skip"])
    """On a NaN/inf loss: stop the run, or skip the step's update."""
    on_spike: str = _f("stop", choices=["stop", "skip", "rollback"])
    """On a loss spike (a loss above the mean + train.spike_sigma standard deviations of the last train.spike_window
    steps' losses, the mean over ranks; or a NaN/inf loss, unless train.on_nan=skip skips it): stop the run; skip
    the step's update (the step compares its loss before the update: one host sync per step, as train.on_nan=skip,
    and no graphed step); or roll back: load the last checkpoint, pass over the batches of the steps since it
    (train.skip_batches gains them), and go on, at most train.max_rollbacks times. stop and rollback read the losses
    as the log reads them: no host sync of their own."""
    spike_sigma: float = _f(6.0, gt=0.0)
    """A loss spike is this many standard deviations above the mean of the window (OLMo-core's 6)."""
    spike_window: int = _f(128, ge=2)
    """Steps whose losses make the window; no spike is called before it is full (after each start)."""
    max_rollbacks: int = _f(3, ge=0)
    """train.on_spike=rollback: rollbacks a run may make; the next spike stops it."""
    skip_batches: list[list[int]] = _f(factory=list)
    """[first, last] ranges of steps (numbered as in a run that skips nothing, from 1) whose batches are passed over:
    e.g. [[1201, 1400]]. A rollback adds its steps; a checkpoint keeps them."""
    activation_checkpointing: str = _f("none", choices=["none", "full", "selective"])
    """Recompute each repeated block's activations in the backward instead of keeping them (the blocks of
    compile.scope=blocks and of the FSDP units): none; full (keep only each block's input); selective (keep the
    matmul and attention outputs, recompute the cheap ops between them)."""
    checkpoint_every_n: int = _f(1, gt=0)
    """With train.activation_checkpointing: checkpoint every Nth block only (1: all of them)."""


@dataclass(kw_only=True)
class CompileConfig:
    enabled: bool | str = _f("auto", choices=["auto", True, False])
    """Compile the model with torch.compile: auto = on for CUDA, off on CPU (the startup line says which); true or
    false."""
    backend: str = "inductor"
    """torch.compile backend: inductor, aot_eager, eager, or any registered backend."""
    mode: str = _f("default", choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"])
    """torch.compile mode."""
    inductor_options: dict[str, Any] = _f(factory=dict)
    """Inductor options for the model's compiled graphs, DDP pieces and compiled autograd (torch.compile's options=,
    dotted keys, e.g. {max_autotune: true}), over compile.mode's and the trainer's measured defaults
    (trainer.compile.capture.DEFAULT_INDUCTOR_OPTIONS); they win over TORCHINDUCTOR_* environment variables. Not for
    optim.impl=compiled."""
    fullgraph: bool = False
    """Fail on any graph break instead of splitting the graph."""
    dynamic: bool | None = False
    """Dynamic shapes: false (static), true, or null (torch decides)."""
    scope: str = _f("auto", choices=["auto", "model", "blocks"])
    """Compile the whole model, or each repeated block once (one graph reused by every block: a shorter first step).
    auto = each block for a model.hf model on one CUDA device whose attention makes no mask between blocks (measured
    as fast, a first step 2.3x shorter), and under fsdp (which compiles the blocks whatever the scope); the whole
    model otherwise (the built-in GPT measured 1.3% faster whole; ddp splits the whole graph at its buckets)."""
    blocks: str | None = None
    """Attribute path of the repeated blocks (e.g. transformer.h); found automatically when null."""
    autograd: bool = False
    """Compiled autograd: the backward, with its hooks, captured as one graph."""
    kernels: Any = _f("auto", names=KERNEL_NAMES)
    """trainer's Triton kernels substituted into the captured graphs wherever their pattern appears, in any model: auto
    (all on CUDA, none on CPU), all (also on CPU, where they run under TRITON_INTERPRET=1 or as torch code), none
    (plain Inductor), or a list of add_layer_norm, add_rms_norm, cross_entropy, linear_cross_entropy,
    causal_attention (a causal mask built in the graph becomes is_causal; repeated key/value heads become grouped
    attention). trainer explain lists each substitution."""
    loss: bool = True
    """With scope=blocks, also compile the model's head_loss(x, targets) (the built-in GPT's norm, head and
    cross-entropy) as its own graph."""
    max_recompiles: int = _f(8, ge=0)
    """Recompiles allowed after warm-up before the run stops with an error."""
    fallback: str = _f("error", choices=["error", "eager"])
    """On a compile failure: stop (error) or log loudly and run eagerly (eager)."""
    cudagraphs: bool | str = _f("auto", choices=["auto", True, False])
    """After 3 ordinary steps, capture the whole step (forward, backward, clipping, optimizer; with ddp the bucket
    all-reduces too) as one CUDA graph and replay it. auto = on wherever the step allows it: CUDA, compiled, static
    shapes, adamw or adam with optim.impl auto/fused/foreach/triton, not fsdp, not fp16, not train.on_nan=skip or
    train.on_spike=skip, not distributed.shard_optimizer, not compiled blocks of a model.hf model that makes its
    attention mask between them (the startup line says why when it is off); true insists, and a config it cannot
    apply is an error."""
    cache_dir: str | None = None
    """Compile cache directory; null = inside the run directory."""


@dataclass(kw_only=True)
class DistributedConfig:
    strategy: str = _f("none", choices=["none", "ddp", "fsdp"])
    """Data parallelism: none, ddp (replicated, bucketed all-reduce) or fsdp (FSDP2 sharding; with the mesh keys
    below, HSDP, tensor and context parallel)."""
    replicate: int = _f(1, ge=1)
    """fsdp: replicas of the sharded model (HSDP: shard within a group of distributed.shard ranks, e.g. a node,
    all-reduce across the replicate groups); 1: plain FSDP. ddp replicates on every rank."""
    shard: int = -1
    """fsdp: ranks each parameter is sharded over (with distributed.cp's); -1: the ranks the other dimensions
    leave (world / (replicate x cp x tp))."""
    tp: int = _f(1, ge=1)
    """Tensor parallel: ranks each layer's matmuls are split over, within a node (the model's own plan: a Hugging
    Face config's base_model_tp_plan, the built-in GPT's); needs fsdp. 1: none."""
    cp: int = _f(1, ge=1)
    """Context parallel: ranks each sequence is split over along its length, with ring attention (torch's
    context_parallel, head-tail load balancing); data.seq_len must divide by 2 x cp; needs fsdp. 1: none."""
    backend: str = _f("auto", choices=["auto", "nccl", "gloo"])
    """Process-group backend: auto = nccl on CUDA, gloo on CPU."""
    bucket_mb: float = _f(100.0, gt=0.0)
    """DDP gradient bucket cap in MiB: whole blocks per bucket up to this size; each bucket is one compiled graph
    piece (fewer, larger pieces: less host overhead)."""
    split_tail: bool = True
    """DDP bucket plan: the block ready last before the embeddings is a bucket of its own, so the blocks before
    it are reduced during its backward instead of after it (false: packed like the rest)."""
    fsdp_unit_mb: float = _f(512.0, ge=0.0)
    """FSDP: consecutive blocks share one fully_shard unit (one all-gather, one reduce-scatter) up to this many
    MiB of fp32 parameters; a larger block is a unit of its own; 0: a unit per block. FSDP2's hooks cost host
    time per unit, so small blocks gain from sharing one."""
    reshard_after_forward: bool = True
    """FSDP: free gathered parameters after forward (less memory, one more all-gather)."""
    keep_gathered: int = _f(1, ge=0)
    """FSDP with reshard_after_forward=true: the forward's last this-many units keep their gathered parameters into
    the backward, which needs them first: no second all-gather for them, their memory held until their backward.
    1, as torchtitan: the last unit, whose backward comes at once."""
    param_dtype: str = _f("auto", choices=["auto", "fp32", "bf16", "fp16"])
    """FSDP: dtype parameters are gathered in for compute; auto = train.precision's (bf16 on GPU)."""
    timeout_s: float = _f(300.0, gt=0.0)
    """Seconds a collective may wait for a rank before the job stops with an error naming it (torch's default
    is 10 minutes); covers the longest compile or checkpoint save of one rank while the others wait."""
    reduce_dtype: str = _f("fp32", choices=["fp32", "bf16"])
    """DDP and FSDP: dtype gradients are reduced in. bf16 halves the bytes on the wire (for fp32 gradients) and the
    sum itself is computed in bf16; fp32 sums them in fp32 (bf16 gradients too: upcast for the reduction)."""
    shard_optimizer: bool = False
    """ddp: each rank keeps and updates 1/world of the optimizer state: each bucket's gradients are reduce-scattered,
    every rank updates its shard of the bucket's parameters, and the parameters are all-gathered; the optimizer
    state's memory divides by the world size. Checkpoints hold the whole state, as without it, so a run resumes on
    any number of GPUs, with or without sharding. Not with compile.autograd, fp16, optim.impl=triton or
    compile.cudagraphs."""


@dataclass(kw_only=True)
class CheckpointConfig:
    enabled: bool = True
    """Write checkpoints (false: none at all, e.g. for benchmarks)."""
    every: int = _f(0, ge=0)
    """Save a checkpoint every N steps (0: only at the end)."""
    keep: int = _f(3, gt=0)
    """Keep the newest N checkpoints."""
    async_save: bool | str = _f("auto", choices=["auto", True, False])
    """Write checkpoints in the background: the step waits only for the states' copy to host memory (pinned on
    CUDA; under fsdp DCP's stager), a thread on each rank writes the files, and last moves once every rank's are
    written; at most one write in flight (the next save, the run's end and a stop wait for it). auto = on for CUDA
    when the host's available memory holds every local rank's copy twice over, off on a CPU and under fsdp (plan.json
    says why)."""


@dataclass(kw_only=True)
class LogConfig:
    every: int = _f(10, gt=0)
    """Print a summary line and write metrics.jsonl every N steps."""
    progress: bool = True
    """Show a live progress bar on a terminal."""
    tensorboard: bool = False
    """Also write TensorBoard event files (needs the tensorboard extra)."""
    wandb: str | None = None
    """Also log each record to this Weights & Biases project (needs the wandb package; WANDB_MODE=offline writes the
    run locally); null = not."""
    peak_flops: float | None = _f(None, gt=0.0)
    """Peak FLOP/s used for MFU; null = look the device up in a table."""


@dataclass(kw_only=True)
class Config:
    run: RunConfig = _f(factory=RunConfig)
    """Run identity and output directory."""
    seed: int = 1337
    """Seed for model initialisation and data order."""
    model: ModelConfig = _f(factory=ModelConfig)
    """The model."""
    data: DataConfig = _f(factory=DataConfig)
    """The corpus."""
    optim: OptimConfig = _f(factory=OptimConfig)
    """The optimizer."""
    schedule: ScheduleConfig = _f(factory=ScheduleConfig)
    """The learning-rate schedule."""
    train: TrainConfig = _f(factory=TrainConfig)
    """The training loop."""
    compile: CompileConfig = _f(factory=CompileConfig)
    """The compile layer."""
    distributed: DistributedConfig = _f(factory=DistributedConfig)
    """The distributed layer."""
    checkpoint: CheckpointConfig = _f(factory=CheckpointConfig)
    """Checkpointing."""
    log: LogConfig = _f(factory=LogConfig)
    """Logging and metrics."""

    def __post_init__(self):
        if (
            self.model.preset is None
            and self.model.target is None
            and self.model.hf is None
            and None
            in (
                self.model.n_layer,
                self.model.n_head,
                self.model.n_embd,
            )
        ):
            raise ConfigError("model: set model.preset, model.target, or all of n_layer, n_head and n_embd")
        if self.model.target is None and self.model.hf is None:
            shape = dict(PRESETS.get(self.model.preset or "", {}))
            shape.update({k: getattr(self.model, k) for k in ("n_embd", "n_head") if getattr(self.model, k)})
            if shape["n_embd"] % shape["n_head"]:
                raise ConfigError(f"model.n_embd: {shape['n_embd']} is not divisible by model.n_head={shape['n_head']}")
        if self.compile.inductor_options:
            from trainer.compile.capture import check_inductor_options

            try:
                check_inductor_options(self.compile.backend, dict(self.compile.inductor_options))
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.compile.cudagraphs is True:
            from trainer.compile.graphed import unmet_requirement

            problem = unmet_requirement(**graphed_step_settings(self))
            if problem:
                raise ConfigError(problem)
        if self.compile.autograd and self.distributed.strategy == "fsdp":
            # Upstream removed FSDP2 + compiled autograd support in 2.13: it runs without error and leaves
            # parameters unsharded and gradients unreduced. Refuse rather than train silently wrong.
            raise ConfigError(
                "compile.autograd: compiled autograd with distributed.strategy=fsdp is silently wrong in torch "
                ">= 2.13 (parameters stay unsharded, gradients are not reduced); set compile.autograd=false"
            )
        if self.distributed.shard_optimizer:
            _check_shard_optimizer(self)
        if self.optim.master_weights == "bf16":
            _check_bf16_master_weights(self)
        d = self.distributed
        if d.shard != -1 and d.shard < 1:
            raise ConfigError(f"distributed.shard: expected -1 (the rest) or a size >= 1, got {d.shard}")
        if d.cp > 1 and self.data.seq_len % (2 * d.cp):
            raise ConfigError(
                f"distributed.cp={d.cp}: data.seq_len ({self.data.seq_len}) must be a multiple of 2 x cp = "
                f"{2 * d.cp} (each rank holds one chunk from the sequence's head and one from its tail)"
            )
        m = self.model
        if m.attention != "auto" and (m.target is not None or m.hf is not None):
            which = "model.target" if m.target is not None else "model.hf"
            raise ConfigError(f"model.attention: applies to the built-in GPT only; drop it with {which}")


def graphed_step_settings(cfg: Config) -> dict:
    """What the graphed step's requirements read (:func:`trainer.compile.graphed.requirements`), as the config gives
    them; :func:`trainer.plan.resolve` puts what it resolved in their place (the optimizer, the precision)."""
    c, d = cfg.compile, cfg.distributed
    return {
        "strategy": d.strategy,
        "backend": d.backend,
        "optim_impl": cfg.optim.impl,
        "optim_name": cfg.optim.name,
        "precision": cfg.train.precision,
        "on_nan": cfg.train.on_nan,
        "on_spike": cfg.train.on_spike,
        "autograd": c.autograd,
        "dynamic": c.dynamic,
        "mode": c.mode,
        "inductor_options": dict(c.inductor_options),
        "shard_optimizer": d.shard_optimizer,
        "scope": c.scope,
    }


def _check_bf16_master_weights(cfg: Config) -> None:
    """What ``optim.master_weights=bf16`` needs (trainer's Triton AdamW and a bf16 step)."""
    o, t, why = cfg.optim, cfg.train, None
    if o.name not in ("adamw", "adam"):
        why = f"needs optim.name adamw or adam (trainer's Triton AdamW rounds stochastically), got {o.name}"
    elif o.impl not in ("auto", "triton"):
        why = f"needs optim.impl auto or triton (trainer's Triton AdamW rounds stochastically), got {o.impl}"
    elif t.precision not in ("auto", "bf16"):
        why = f"needs train.precision bf16 (the forward runs in the parameters' dtype), got {t.precision}"
    elif cfg.distributed.shard_optimizer:
        why = "not with distributed.shard_optimizer (its inner optimizer is torch's)"
    if why:
        raise ConfigError(f"optim.master_weights=bf16: {why}")


def _check_shard_optimizer(cfg: Config) -> None:
    """What ``distributed.shard_optimizer`` cannot run with (``compile.cudagraphs``: :mod:`trainer.compile.graphed`)."""
    d, why = cfg.distributed, None
    if d.strategy != "ddp":
        fsdp = " (fsdp shards the optimizer state with the parameters already)" if d.strategy == "fsdp" else ""
        why = f"needs distributed.strategy=ddp, got {d.strategy}{fsdp}"
    elif cfg.compile.autograd:
        why = (
            "not with compile.autograd=true (the reduce-scatters are not traced into the backward graph); set "
            "compile.autograd=false"
        )
    elif cfg.train.precision == "fp16":
        why = (
            "not with train.precision=fp16 (its grad scaler unscales and checks whole gradients, which no rank "
            "has); use bf16 or fp32"
        )
    elif cfg.optim.impl == "triton":
        why = (
            "not with optim.impl=triton (trainer's Triton optimizers move their parameters into flat buffers of "
            "their own; a rank's shard must stay a view of its bucket's buffer); use auto (torch's fused on CUDA), "
            "fused, foreach, eager or compiled"
        )
    if why:
        raise ConfigError(f"distributed.shard_optimizer: {why}")
