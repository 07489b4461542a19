"""Peak device memory per rank, predicted from the plan before anything is allocated.

The prediction is a sum of parts:

- **parameters, gradients and optimizer state**, counted from the model's shapes (built on the meta device: no
  memory) by the strategy and the dtypes: fp32 parameters and gradients, one fp32 tensor per optimizer state
  (AdamW two, SGD with momentum one), all three divided by the world under fsdp, the state alone under
  ``distributed.shard_optimizer``;
- **fsdp's gathered parameters**: two units in ``distributed.param_dtype`` (the one computing, the one prefetched),
  or the ``distributed.keep_gathered`` units kept from the forward into the backward and one prefetched, and the
  root's (embeddings, head: never resharded after its forward), or every unit with
  ``distributed.reshard_after_forward=false``;
- **the workspace**: cuBLAS's, a fixed 64 MiB on CUDA;
- **the optimizer step's temporaries** (torch's ``foreach`` Adam keeps one fp32 tensor per parameter; ``fused``
  and the Triton optimizer none), which replace the activations once the backward has freed them: the peak is
  the larger of the two;
- **activations**: bytes per sequence for each checkpointing mode, measured. One short run of the model at one
  micro-batch (a *probe*: ``trainer explain --memory`` and ``trainer tune`` make them) gives a peak; what the
  counted parts do not explain, divided by the micro-batch, is the mode's bytes per sequence. With two or more
  measured micro-batches of a mode, the line through the two largest also fits its intercept: where it meets
  micro-batch 0, above or below the counted parts (with checkpointing the peak comes in the backward, before every
  gradient exists). Under the graphed step the activations live in the step's CUDA-graph pool: its peak is the
  measured one.

On CUDA the probe's peak is ``torch.cuda.max_memory_allocated``; on CPU it is the peak of live tensor bytes during
one step (:class:`LiveBytes`). A device's capacity is :data:`USABLE` of its memory: the rest holds the CUDA
context, NCCL's buffers and what the caching allocator cannot reuse.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from trainer import console
from trainer.config import Config, to_dict

MODES = ("none", "selective", "full")
USABLE = 0.89  # of the device's memory, for the allocator's peak (the boundary measured on an H100: docs/tuning.md)
WORKSPACE = 64 * 2**20  # cuBLAS's workspace on CUDA
GB = 1e9
OPTIMIZER_STATES = {"adamw": 2, "adam": 2}  # fp32 tensors per parameter; sgd: one with momentum, else none


def model_on_meta(cfg: Config, vocab_size: int) -> nn.Module:
    """The config's model with its parameters on the meta device: shapes and dtypes, no memory."""
    from trainer.model_setup import build_model_of

    with torch.device("meta"):
        return build_model_of(cfg, vocab_size, pretrained=False)


def static_parts(
    model: nn.Module, cfg: Config, world: int = 1, device_type: str = "cuda"
) -> dict[str, tuple[float, str]]:
    """Bytes per rank of what does not scale with the micro-batch, by part, each with how it was counted."""
    from trainer.distributed.fsdp import block_units, kept_units

    strategy = _strategy(cfg, world)
    mesh = strategy.mesh
    params = [p for p in model.parameters() if p.requires_grad]
    split = _tp_split(model, mesh.tp)  # tensor parallel: the split linears' parameters hold 1/tp on each rank
    n = sum(p.numel() / (mesh.tp if id(p) in split else 1) for p in params)
    stored = sum(p.numel() * p.element_size() / (mesh.tp if id(p) in split else 1) for p in params)
    shard = mesh.fsdp_ranks if strategy.fsdp else 1  # FSDP shards over shard x cp; replicate holds copies (HSDP)
    states = OPTIMIZER_STATES.get(cfg.optim.name, 1 if cfg.optim.momentum > 0 else 0)
    state_shard = shard if strategy.fsdp else world if strategy.zero else 1
    on = (f", the split linears / tp {mesh.tp}" if split else "") + (f" / {shard} ranks" if shard > 1 else "")
    dtype, state_dtype = _dtype_name(params), "fp32"
    if cfg.optim.master_weights == "bf16":  # the parameters cast once, the states kept in bf16 (optim.master_weights)
        stored, dtype, state_dtype = 2 * n, "bf16", "bf16"
    parts = {
        "parameters": (stored / shard, f"{_count(int(n))}, {dtype}{on}"),
        "gradients": (stored / shard, f"as the parameters{on}"),
        "optimizer state": (
            n * (2 if state_dtype == "bf16" else 4) * states / state_shard,
            f"{cfg.optim.name}: {states} {state_dtype} per parameter"
            + (f" / {state_shard} ranks" if state_shard > 1 else ""),
        ),
    }
    if strategy.fsdp:
        from trainer.plan import param_dtype, precision

        gathered = param_dtype(cfg.distributed.param_dtype, precision(cfg.train.precision, torch.device(device_type)))
        gathered_bytes = 4 if gathered == "fp32" else 2
        if not cfg.distributed.reshard_after_forward:
            parts["gathered (fsdp)"] = (n * gathered_bytes, "every unit stays gathered from forward to backward")
        else:
            root = 0  # the root's parameters (embeddings, head): not resharded after the forward (apply_fsdp)
            try:
                units = block_units(model, cfg.compile.blocks, cfg.distributed.fsdp_unit_mb or None)
                sizes = [sum(p.numel() for m in u for p in m.parameters()) for u in units]
                in_units = {id(p) for u in units for m in u for p in m.parameters()}
                root = sum(p.numel() for p in params if id(p) not in in_units)
            except ValueError:  # no repeated blocks: one unit
                sizes = [n]
            kept = kept_units(len(sizes), True, cfg.distributed.keep_gathered)
            # At the backward's start: the kept units, and the next one prefetched; at least two units (the one
            # computing, the one prefetched) at any time; and the root's, gathered from its forward to the end of
            # its backward.
            held = max(sum(sizes[:kept]) + max(sizes[kept:], default=0), 2 * max(sizes)) + root
            what = (
                f"{kept} unit(s) kept from forward to backward, one prefetched"
                if kept > 1
                else "two units: the one computing, the one prefetched"
            ) + (f"; the root's {_count(int(root))} from forward to backward" if root else "")
            parts["gathered (fsdp)"] = (held * gathered_bytes, what)
    if device_type == "cuda":
        parts["workspace"] = (WORKSPACE, "cuBLAS")
    return parts


def _strategy(cfg: Config, world: int):
    """The strategy and mesh ``cfg`` resolves to on ``world`` ranks (:class:`trainer.plan.Strategy`)."""
    from types import SimpleNamespace

    from trainer.plan import Strategy

    return Strategy.of(cfg, SimpleNamespace(world_size=world, distributed=world > 1))


def _tp_split(model: nn.Module, tp: int) -> set[int]:
    """The ids of the parameters tensor parallel splits over ``tp`` ranks (its plan's linears); none for tp 1 or a
    model without a plan."""
    if tp == 1:
        return set()
    from trainer.distributed.mesh import LayoutError
    from trainer.distributed.tp import model_plan, module_matches

    try:
        plan, _ = model_plan(model)
    except LayoutError:
        return set()
    return {id(p) for name, m in model.named_modules() if module_matches(plan, name) for p in m.parameters()}


def step_transient(model: nn.Module, cfg: Config, world: int = 1, device_type: str = "cuda") -> tuple[float, str]:
    """The optimizer step's own temporaries: torch's ``foreach`` AdamW/Adam keeps one fp32 tensor per parameter
    (its denominators) while it runs; ``fused`` and the Triton optimizer none to count. The step runs after the
    backward has freed the activations: the peak is the larger of the two."""
    from trainer import plan

    strategy = _strategy(cfg, world)
    device = torch.device(device_type)
    impl, _ = plan.optim_impl(cfg, device, strategy, plan.precision(cfg.train.precision, device))
    if impl != "foreach" or cfg.optim.name not in OPTIMIZER_STATES:
        return 0.0, f"{impl}: none counted"
    shard = strategy.mesh.fsdp_ranks * strategy.mesh.tp if strategy.fsdp else world if strategy.zero else 1
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return n * 4 / shard, "foreach: one fp32 temporary per parameter"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def _dtype_name(params: list[nn.Parameter]) -> str:
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
    return "/".join(dtypes)


@dataclass
class Point:
    """One measured run: the checkpointing mode, the micro-batch, its peak bytes (None: out of memory) and its
    throughput (tokens/s per rank's share: the run's tokens/s)."""

    mode: str
    micro_batch: int
    peak: float | None
    tokens_per_s: float | None = None
    status: str = "ok"
    overrides: list[str] = field(default_factory=list)
    seconds: float = 0.0
    predicted: float | None = None  # the estimate's peak before the run


@dataclass
class Estimate:
    """The prediction: the counted parts, and the activations of each mode from the measured points."""

    parts: dict[str, tuple[float, str]]
    seq_len: int
    capacity: float | None = None  # bytes the allocator may reach on this device; None: unknown (CPU)
    points: list[Point] = field(default_factory=list)
    transient: tuple[float, str] = (0.0, "")  # the optimizer step's temporaries (step_transient)
    traced: dict = field(default_factory=dict)  # mode -> trainer.memory.trace.Traced: the step's graphs counted
    keep_grads: bool = True  # the backward makes the gradients (one micro-batch a step): not live before it

    @property
    def static(self) -> float:
        return sum(b for b, _ in self.parts.values())

    def fit(self, mode: str) -> tuple[float, float] | None:
        """``(bytes per sequence, constant beyond the counted parts)`` of ``mode``, or None before a probe.
        One measured micro-batch: the line through the counted parts; more: the line through the two largest.
        The peak's make-up changes with the micro-batch (docs/tuning.md has the measured slopes), so the largest
        probes are the ones that speak for the micro-batches near the device's limit."""
        by_size: dict[int, list[float]] = {}
        for p in self.points:
            if p.mode == mode and p.peak is not None:
                by_size.setdefault(p.micro_batch, []).append(p.peak)
        if not by_size:
            return None
        (b1, y1), *rest = sorted(((b, sum(ys) / len(ys)) for b, ys in by_size.items()), reverse=True)
        if not rest:
            return max(0.0, (y1 - self.static) / b1), 0.0
        b0, y0 = rest[0]
        slope = max(0.0, (y1 - y0) / (b1 - b0))
        return slope, y1 - slope * b1 - self.static

    def peak(self, mode: str, micro_batch: int) -> float | None:
        """The predicted peak bytes of ``mode`` at ``micro_batch``: from the mode's measured points where it has
        them, else from its traced step; None with neither."""
        source = self.source(mode)
        if source == "measured":
            f = self.fit(mode)
            return self.static + max(f[1] + micro_batch * f[0], self.transient[0])
        if source is None:
            return None
        traced = self.traced[mode]
        made = self.parts.get("gradients", (0.0, ""))[0] if self.keep_grads else 0.0  # in the traced backward
        # Each traced gradient byte as the run holds it: the gradients part over the traced step's gradients (1 on
        # one GPU; a rank's shard in the stored dtype under fsdp, where the trace computes in the gathered one).
        scale = made / traced.grads() if made and traced.grads() else 0.0
        # The optimizer step runs after the backward, with every gradient made.
        return self.static - made + max(traced.activations(micro_batch, scale), made + self.transient[0])

    def source(self, mode: str) -> str | None:
        """Where ``mode``'s activations come from: "measured" (its probes: a line through two of them beats the
        trace; one, only without a trace), "traced", or None (neither)."""
        sizes = {p.micro_batch for p in self.points if p.mode == mode and p.peak is not None}
        if sizes and (mode not in self.traced or len(sizes) >= 2):
            return "measured"
        return "traced" if mode in self.traced else None

    def largest_fitting(self, mode: str, limit: int = 4096) -> int | None:
        """The largest micro-batch predicted to fit (None: none does, or unknown); the peak grows with it."""
        if not self.fits(mode, 1):
            return None
        lo, hi = 1, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.fits(mode, mid) else (lo, mid - 1)
        return lo

    def fits(self, mode: str, micro_batch: int) -> bool | None:
        """Whether ``micro_batch`` is predicted to fit; None where unknown (no probe, or no known capacity).
        A micro-batch measured out of memory never fits, nor does any larger one of the mode."""
        if any(p.mode == mode and p.status == "out of memory" and p.micro_batch <= micro_batch for p in self.points):
            return False
        peak = self.peak(mode, micro_batch)
        if peak is None or self.capacity is None:
            return None
        return peak <= self.capacity

    def largest(self, mode: str, sizes: list[int]) -> int | None:
        """The largest of ``sizes`` predicted to fit (None: none does, or unknown)."""
        fitting = [b for b in sizes if self.fits(mode, b)]
        return max(fitting) if fitting else None

    def describe(self, sizes: list[int], title: str) -> str:
        """The parts, and per mode the bytes per sequence and the largest micro-batch of ``sizes`` that fits."""
        lines = [title]
        for name, (b, why) in self.parts.items():
            lines.append(f"  {name:<17} {size(b):>9}   {why}")
        lines.append(f"  {'counted':<17} {size(self.static):>9}")
        if self.transient[0]:
            lines.append(
                f"  {'optimizer step':<17} {size(self.transient[0]):>9}   {self.transient[1]}; while it runs, "
                "in place of the activations"
            )
        cap = f"; the device allows {size(self.capacity)} ({USABLE:.0%} of its memory)" if self.capacity else ""
        lines.append(f"activations per sequence of {self.seq_len} tokens, measured{cap}:")
        for mode in MODES:
            f = self.fit(mode)
            if f is None:
                lines.append(f"  {mode:<10} not measured")
                continue
            probes = sorted({p.micro_batch for p in self.points if p.mode == mode and p.peak is not None})
            # The line's intercept is a parameter of the fit, not memory that is there: where the line through the
            # two largest probes meets micro-batch 0, against the counted parts. It is below them where part of the
            # counted memory is not live at the peak (with checkpointing the peak comes in the backward, before
            # every gradient exists) or where the activations grow faster than linearly between the probes, and
            # above them for memory the parts do not count. So it is said as where the line runs, never as a part.
            side = "below" if f[1] < 0 else "above"
            extra = f"; their line meets micro-batch 0 {size(abs(f[1]))} {side} the counted parts" if f[1] else ""
            fits = ""
            if self.capacity:
                best = self.largest(mode, sizes)
                fits = (
                    f"; largest micro-batch that fits: {best} ({size(self.peak(mode, best))})"
                    if best
                    else "; no micro-batch fits"
                )
            lines.append(
                f"  {mode:<10} {size(f[0]):>9} (measured at micro-batch {', '.join(map(str, probes))}{extra}){fits}"
            )
        return "\n".join(lines)


GPUS = {"h100": 85.02e9, "h200": 150.76e9}
"""The memory of each GPU ``--gpu`` names, in bytes, as CUDA reports it (H100 80GB HBM3 and H200 141GB)."""


def device_bytes(value: str) -> float:
    """``--gpu``'s value in bytes: a GPU of :data:`GPUS`, or a size in GB.

    Raises:
        ValueError: neither."""
    name = value.strip().lower()
    if name in GPUS:
        return GPUS[name]
    try:
        gb = float(name.removesuffix("gb"))
    except ValueError:
        from difflib import get_close_matches

        near = get_close_matches(name, GPUS, n=1)
        hint = f" (did you mean '{near[0]}'?)" if near else ""
        raise ValueError(f"--gpu: '{value}' is not {', '.join(GPUS)} or a size in GB{hint}") from None
    if not gb > 0:
        raise ValueError(f"--gpu: a size in GB must be positive (got {value})")
    return gb * GB


def traced_estimate(
    cfg: Config, world: int, device_memory: float | None, modes=MODES, say=None, cache: Path | None = None
) -> Estimate:
    """The estimate per rank of ``world`` on a CUDA device of ``device_memory`` bytes, each mode's activations from
    its traced step (:mod:`trainer.memory.trace`), on this host; ``cache`` (``traced.json``) keeps the traces of
    each config and gives back those traced before."""
    from trainer.memory.trace import trace_mode

    vocab = _vocab_size(cfg)
    model = model_on_meta(cfg, vocab)
    est = Estimate(
        static_parts(model, cfg, world, "cuda"),
        cfg.data.seq_len,
        None if device_memory is None else USABLE * device_memory,
        transient=step_transient(model, cfg, world, "cuda"),
        keep_grads=grads_made_in_backward(cfg, world),
    )
    key = traced_key(cfg, world)
    known = load_traced(cache, key) if cache else {}
    for mode in modes:
        if mode in known:
            est.traced[mode] = known[mode]
            continue
        est.traced[mode] = trace_mode(cfg, vocab, mode, sharded=_strategy(cfg, world).fsdp)
        if say:
            say(f"  traced {mode} in {est.traced[mode].seconds:.1f} s")
        if cache:
            save_traced(cache, key, est.traced[mode])
    return est


def grads_made_in_backward(cfg: Config, world: int) -> bool:
    """Whether the step's backward makes the gradients (one micro-batch a step), so that they are not live before it:
    the step ends with ``zero_grad(set_to_none=True)``, and under fsdp each unit's reduce-scatter makes its shard of
    them as the backward reaches it; else they exist from the first micro-batch on (accumulation)."""
    t, strategy = cfg.train, _strategy(cfg, world)
    per_rank = t.global_batch_size // strategy.dp_ranks if t.global_batch_size else None
    accumulates = t.grad_accum > 1 if per_rank is None else per_rank > t.micro_batch_size
    return not accumulates


TRACE_FORMAT = 2  # of trainer.memory.trace.Walk: traces kept in another are traced again


def traced_key(cfg: Config, world: int) -> str:
    """What a traced step depends on: :func:`memory_key` at world 1 (one rank's step), whether it is sharded, and the
    format the trace is kept in (:data:`TRACE_FORMAT`)."""
    return memory_key(cfg, 1) + (" fsdp" if _strategy(cfg, world).fsdp else "") + f" trace {TRACE_FORMAT}"


def load_traced(path: Path, key: str) -> dict:
    """The traced modes of ``path`` (``traced.json``) under ``key``: mode -> :class:`~trainer.memory.trace.Traced`."""
    from trainer.memory.trace import Traced

    return {r["traced"]["mode"]: Traced.from_dict(r["traced"]) for r in _rows(path) if r.get("key") == key}


def save_traced(path: Path, key: str, traced) -> None:
    """Keep ``traced`` under ``key`` in ``path`` (replacing the same mode's; written whole, atomically)."""
    rows = [r for r in _rows(path) if not (r.get("key") == key and r["traced"]["mode"] == traced.mode)]
    _write_rows(path, [*rows, {"key": key, "traced": traced.to_dict()}], indent=None)


def traced_report(est: Estimate, sizes: list[int], title: str) -> tuple[str, dict]:
    """The traced estimate said (the parts, per mode the bytes saved per sequence, the largest micro-batch that
    fits and the peaks at ``sizes``) and as JSON."""
    lines = [title]
    for name, (b, why) in est.parts.items():
        made = name == "gradients" and est.keep_grads
        lines.append(f"  {name:<17} {size(b):>9}   {why}" + ("; made in the backward (traced)" if made else ""))
    if est.transient[0]:
        lines.append(f"  {'optimizer step':<17} {size(est.transient[0]):>9}   {est.transient[1]}")
    cap = f"; the device allows {size(est.capacity)} ({USABLE:.0%} of its memory)" if est.capacity else ""
    lines.append(f"activations, traced, per sequence of {est.seq_len} tokens{cap}:")
    modes = {}
    for mode, traced in est.traced.items():
        best = est.largest_fitting(mode) if est.capacity else None
        fits = ""
        if est.capacity:
            fits = f"; largest micro-batch that fits: {best} ({size(est.peak(mode, best))})" if best else "; none fits"
        lines.append(f"  {mode:<10} {size(traced.saved_per_sequence()):>9} saved for the backward{fits}")
        modes[mode] = {
            "saved_gb_per_sequence": round(traced.saved_per_sequence() / GB, 6),
            "largest_micro_batch": best,
            "peak_gb": {str(b): round(est.peak(mode, b) / GB, 2) for b in sizes},
            "trace_s": round(traced.seconds, 1),
        }
    lines.append("predicted peak per rank (GB):")
    lines.append(peak_table(est, sizes, list(est.traced)))
    result = {
        "usable_gb": None if est.capacity is None else round(est.capacity / GB, 2),
        "parts_gb": {k: round(b / GB, 3) for k, (b, _) in est.parts.items()},
        "modes": modes,
    }
    return "\n".join(lines), result


def peak_table(est: Estimate, sizes: list[int], modes=MODES) -> str:
    """Predicted peaks by mode and micro-batch (GB), a cell past the device's memory marked."""
    lines = ["| micro-batch | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for b in sizes:
        cells = []
        for mode in modes:
            peak = est.peak(mode, b)
            over = est.capacity is not None and peak is not None and peak > est.capacity
            cells.append("-" if peak is None else f"{peak / GB:.1f}" + (" (too large)" if over else ""))
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _vocab_size(cfg: Config) -> int | None:
    """The data's vocabulary where the data is there; else ``data.vocab_size``, or the model's own (a Hugging Face
    config's)."""
    from trainer.data import load_corpus

    try:
        c = cfg.data
        return load_corpus(c.path, c.vocab_size, c.val_fraction, c.seq_len, dtype=c.dtype).vocab_size
    except (OSError, ValueError):
        if cfg.data.vocab_size or cfg.model.hf:
            return cfg.data.vocab_size
        raise


def size(b: float) -> str:
    """Bytes in GB, or MB below 1 GB."""
    return f"{b / GB:.2f} GB" if abs(b) >= GB else f"{b / 1e6:.1f} MB"


def memory_key(cfg: Config, world: int) -> str:
    """What a probe's measurement depends on beyond the micro-batch and the checkpointing mode: the config without
    its batch, checkpointing, length, logging and run keys, and the world."""
    d = to_dict(cfg)
    for section in ("run", "log", "checkpoint", "schedule"):
        d.pop(section, None)
    for key in (
        "micro_batch_size",
        "grad_accum",
        "global_batch_size",
        "activation_checkpointing",
        "steps",
        "stop_at",
        "eval_every",
        "eval_batches",
    ):
        d.get("train", {}).pop(key, None)
    d.get("compile", {}).pop("cache_dir", None)
    d["world"] = world
    return json.dumps(d, sort_keys=True, default=str)


def work_dir(cfg: Config) -> Path:
    """Where ``trainer explain --memory`` and ``trainer tune`` keep their measurements, short runs and compile
    cache: ``<run.dir>.tune``."""
    run = Path(cfg.run.dir)
    return run.with_name(run.name + ".tune")


def load_points(path: Path, key: str) -> list[Point]:
    """The measured points of ``path`` (``measured.json``) whose key is ``key``."""
    return [Point(**r["point"]) for r in _rows(path) if r.get("key") == key]


def save_point(path: Path, key: str, point: Point) -> None:
    """Append ``point`` under ``key`` to ``path`` (written whole, atomically)."""
    _write_rows(path, [*_rows(path), {"key": key, "point": dataclasses.asdict(point)}])


def _rows(path: Path) -> list[dict]:
    """The keyed rows of a work-dir file (``measured.json``, ``traced.json``); none if it is missing or torn."""
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def _write_rows(path: Path, rows: list[dict], indent: int | None = 1) -> None:
    from trainer.io import atomic_write_text

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(path), json.dumps(rows, indent=indent) + "\n")


def say_startup_note(cfg: Config, model: nn.Module, world: int, device_memory: int | None) -> None:
    """Say :func:`startup_note`'s line, as a warning when it is one."""
    note = startup_note(cfg, model, world, device_memory)
    if note and note.startswith("warning: "):
        console.warn(note.removeprefix("warning: "))
    else:
        console.info(note)


def startup_note(cfg: Config, model: nn.Module, world: int, device_memory: int | None) -> str | None:
    """The line ``trainer fit`` prints before step 1 (None on the CPU): the predicted peak per rank against what the
    device allows, with a warning when it exceeds it. The activations come from the traces of ``trainer explain
    --memory`` or ``trainer tune`` of this config (``<run.dir>.tune/traced.json``) or their measurements
    (``measured.json``); without them only the counted parts are checked."""
    if device_memory is None:
        return None
    est = Estimate(
        static_parts(model, cfg, world, "cuda"),
        cfg.data.seq_len,
        USABLE * device_memory,
        transient=step_transient(model, cfg, world, "cuda"),
    )
    est.points = load_points(work_dir(cfg) / "measured.json", memory_key(cfg, world))
    est.traced = load_traced(work_dir(cfg) / "traced.json", traced_key(cfg, world))
    est.keep_grads = grads_made_in_backward(cfg, world)
    t = cfg.train
    mode, b = t.activation_checkpointing, t.micro_batch_size
    peak = est.peak(mode, b)
    if peak is None:
        if est.static <= est.capacity:
            return None
        return (
            f"warning: memory: the parameters, gradients and optimizer state alone need {size(est.static)} per "
            f"rank, more than the {size(est.capacity)} this GPU allows ({USABLE:.0%} of its memory); shard "
            "them: distributed.strategy=fsdp over more GPUs"
        )
    how = est.source(mode)
    said = (
        f"memory: predicted peak {size(peak)} per rank of the {size(est.capacity)} this GPU allows (micro-batch "
        f"{b}, train.activation_checkpointing={mode}; activations {how} in {work_dir(cfg)})"
    )
    if peak <= est.capacity:
        return said
    dp = _strategy(cfg, world).dp_ranks
    per_rank = t.global_batch_size // dp if t.global_batch_size else b * t.grad_accum  # sequences per step
    best = est.largest(mode, [x for x in range(1, b) if per_rank % x == 0])
    hint = f"; micro-batch {best} is predicted to fit" if best else ""
    return f"warning: {said}: it will likely run out of memory{hint} (trainer tune searches)"
