"""Throughput, MFU and memory, and where they go: the console, metrics.jsonl and TensorBoard.

Only rank 0 creates sinks; other ranks get a :class:`Metrics` whose methods do nothing.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

# Dense bf16 peak FLOP/s by device-name substring, first match wins (datasheet numbers).
# ``log.peak_flops`` overrides this; MFU is absent for devices not listed.
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("B200", 2250e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
]


def peak_flops(device: torch.device, override: float | None = None) -> float | None:
    """The device's peak bf16 FLOP/s: ``override``, else the table entry for its name, else None (CPU)."""
    if override:
        return float(override)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


class StepTimer:
    """Step timing from when each step's loss is read: the first (compile) step apart, then
    tokens/s and step time between log lines. Steps are read one behind the GPU, so in steady
    state the interval between two reads is the GPU's step time."""

    def __init__(self):
        self.first_step_s = None
        self.last_tps = None
        self._last = time.perf_counter()
        self._tokens = self._time = self._steps = 0
        self._all_tokens = self._all_time = 0.0
        self._times: list[float] = []

    def restart(self) -> None:
        """Exclude the time since the last read (evaluation, checkpointing)."""
        self._last = time.perf_counter()

    def tick(self, tokens: int, first: bool) -> None:
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        if first:
            self.first_step_s = seconds
        else:
            self._all_tokens += tokens
            self._all_time += seconds
            self._times.append(seconds)
        self._tokens += tokens
        self._time += seconds
        self._steps += 1
        self.last_tps = tokens / max(seconds, 1e-9)

    def read(self) -> tuple[float, float]:
        """Tokens/s and seconds per step since the last read."""
        out = self._tokens / max(self._time, 1e-9), self._time / max(self._steps, 1)
        self._tokens = self._time = self._steps = 0
        return out

    @property
    def median_step_s(self) -> float | None:
        """Median step time over the run, the first step excluded."""
        return sorted(self._times)[len(self._times) // 2] if self._times else None

    @property
    def mean_tps(self) -> float | None:
        """Mean tokens/s over the run, the first step excluded."""
        return self._all_tokens / self._all_time if self._all_time else None


def fmt_si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


class Metrics:
    """Writes metric records to metrics.jsonl, TensorBoard and the console (rank 0 only).

    Args:
        run_dir: where metrics.jsonl (and tb/) go; None for a non-main rank (no output).
        total_steps: for the progress bar.
        progress: show a live progress bar when stderr is a terminal.
        tensorboard: also write TensorBoard events.
        start_step: the first step of this process (non-zero on resume).
    """

    def __init__(self, run_dir: Path | None, *, total_steps: int, progress: bool, tensorboard: bool, start_step=0):
        self.enabled = run_dir is not None
        self.console = Console(stderr=True, highlight=False, soft_wrap=True)
        self._jsonl = None
        self._tb = None
        self._progress = None
        if not self.enabled:
            return
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)  # line-buffered: a crash loses nothing
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                msg = "log.tensorboard: needs the tensorboard package: pip install 'trainer[tensorboard]'"
                raise ValueError(msg) from None
            self._tb = SummaryWriter(str(run_dir / "tb"))
        if progress and sys.stderr.isatty():
            self._progress = Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tok/s"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, loss="-", tps="-")
            self._progress.start()

    def print(self, msg: str) -> None:
        if self.enabled:
            self.console.print(msg)

    def advance(self, step: int, loss: float | None = None, tokens_per_s: float | None = None) -> None:
        if self._progress is not None:
            fields = {}
            if loss is not None:
                fields["loss"] = f"{loss:.4f}"
            if tokens_per_s is not None:
                fields["tps"] = fmt_si(tokens_per_s)
            self._progress.update(self._task, completed=step, **fields)

    def log(self, record: dict[str, Any], *, echo: bool = True) -> None:
        """Append one record (it must hold ``step``) to every sink."""
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._jsonl.write(json.dumps(clean) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(f"train/{k}" if not k.startswith("val") else k, v, record["step"])
        if echo:
            self.print(summary_line(record))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def format_fields(record: dict[str, Any], fields: list[tuple[str, str]]) -> str:
    """``"a | b | c"`` from ``(key, template)`` pairs, skipping keys that are absent or None."""
    return " | ".join(t.format(record[k]) for k, t in fields if record.get(k) is not None)


# The console line of a metrics record.
LINE_FIELDS = [
    ("step", "step {:>6}"),
    ("loss", "loss {:.4f}"),
    ("val_loss", "val_loss {:.4f}"),
    ("lr", "lr {:.2e}"),
    ("grad_norm", "gnorm {:.3f}"),
    ("tokens_per_s", "{} tok/s"),  # shown through fmt_si
    ("step_time_ms", "{:.1f} ms/step"),
    ("mfu_pct", "mfu {:.1f}%"),
    ("peak_mem_gb", "mem {:.2f} GB"),
]


def summary_line(r: dict[str, Any]) -> str:
    shown = dict(r)
    if r.get("step_time") is not None:
        shown["step_time_ms"] = r["step_time"] * 1e3
    if r.get("mfu") is not None:
        shown["mfu_pct"] = r["mfu"] * 100
    if r.get("tokens_per_s") is not None:
        shown["tokens_per_s"] = fmt_si(r["tokens_per_s"])
    return format_fields(shown, LINE_FIELDS)
