"""Throughput, MFU and memory, and where they go: the console, metrics.jsonl and TensorBoard.

:class:`StepLog` reads each training step's numbers one step late and makes the records; :class:`Metrics` writes
them. Only rank 0 creates sinks; other ranks get a :class:`Metrics` whose methods do nothing.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainer import console, startup
from trainer.distributed.env import per_rank
from trainer.errors import TrainingError
from trainer.faults import fault_point
from trainer.io import atomic_write_text

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
    """Step timing: the first (compile) step apart, then tokens/s and step time between log lines.

    On CUDA a step's time is the GPU's, between the events recorded on the stream after the step before it and
    after it (:func:`copy_to_host`'s): from the end of one step's work to the end of the next, the GPU's idle time
    between them included. The host's clock at the reads would not do: a step whose launch waits on the GPU (a
    copy from pageable memory into a micro-batch, say) returns when most of its own work is done, and the read after
    the last step then comes a fraction of a step after the one before it (a 16-micro-batch step measured twice as
    fast as it ran). On the CPU, and for the first step, the host's clock at each read."""

    def __init__(self):
        self.first_step_s = None
        self.last_tps = None
        self._last = time.perf_counter()
        self._event = None  # the CUDA event after the last step read (or the restart), once there is one
        self._tokens = self._time = self._steps = 0
        self._all_tokens = self._all_time = 0.0
        self._times: list[float] = []

    def restart(self) -> None:
        """Exclude the time since the last read (evaluation, checkpointing): the next step is timed from now (on
        CUDA, from an event recorded now on the stream)."""
        self._last = time.perf_counter()
        if self._event is not None:
            self._event = torch.cuda.Event(enable_timing=True)
            self._event.record()

    def tick(self, tokens: int, first: bool, event=None) -> None:
        """Step read: ``tokens`` of it; ``first``: the compile step; ``event``: the CUDA event recorded on the stream
        after it (None on the CPU), complete by now."""
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        if event is not None and self._event is not None and not first:
            seconds = self._event.elapsed_time(event) / 1e3
        self._event = event if event is not None else self._event
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
        wandb: also log to this Weights & Biases project (``log.wandb``; None: not), one W&B run per run directory
            (its id a digest of the directory's path, so a resume continues it), the run's config.yaml its config.
        start_step: the step this process starts after (non-zero on resume): rows of ``metrics.jsonl`` past it,
            written by a run that stopped after the checkpoint resumed from, are dropped (with a note).
    """

    def __init__(
        self,
        run_dir: Path | None,
        *,
        total_steps: int,
        progress: bool,
        tensorboard: bool,
        wandb: str | None = None,
        start_step=0,
    ):
        self.enabled = run_dir is not None
        self._jsonl = None
        self._tb = None
        self._wandb = None
        self._progress = None
        if not self.enabled:
            return
        dropped = drop_rows_after(run_dir / "metrics.jsonl", start_step)
        if dropped:
            why = (
                "written after the checkpoint it resumes from"
                if start_step
                else "written by an earlier start that stopped before its first checkpoint"
            )
            console.warn(f"metrics.jsonl: dropped {dropped} past step {start_step}, where this run continues ({why})")
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)  # line-buffered: a crash loses nothing
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                msg = "log.tensorboard: needs the tensorboard package: pip install -e '.[tensorboard]'"
                raise ValueError(msg) from None
            self._tb = SummaryWriter(str(run_dir / "tb"))
        if wandb:
            self._wandb = _wandb_run(wandb, run_dir)
        if progress:
            self._progress = console.progress(total_steps, start_step)  # None unless stderr is a terminal

    def advance(self, step: int, loss: float | None = None, tokens_per_s: float | None = None) -> None:
        if self._progress is not None:
            self._progress.update(
                step,
                loss=None if loss is None else f"{loss:.4f}",
                tps=None if tokens_per_s is None else fmt_si(tokens_per_s),
            )

    def log(self, record: dict[str, Any], *, echo: bool = True, compiled: bool = False) -> None:
        """Append one record (it must hold ``step``) to every sink; ``compiled``: the first step was the compile."""
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._jsonl.write(json.dumps(clean) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(f"train/{k}" if not k.startswith("val") else k, v, record["step"])
        if self._wandb is not None:  # numbers only (startup_s is a dict of phases)
            numbers = {k: v for k, v in clean.items() if k != "step" and isinstance(v, (int, float))}
            self._wandb.log({f"train/{k}" if not k.startswith("val") else k: v for k, v in numbers.items()},
                            step=record["step"])  # fmt: skip
        if echo:
            console.info(summary_line(record, compiled))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _wandb_run(project: str, run_dir: Path):
    """A Weights & Biases run for ``run_dir`` in ``project``: named for the directory, its id a digest of the
    directory's absolute path (a resume of the run continues it; W&B ignores a step logged again), its config the run's
    config.yaml.

    Raises:
        ValueError: the wandb package is not installed.
    """
    import hashlib

    try:
        import wandb
    except ImportError:
        raise ValueError(f"log.wandb: {project}: needs the wandb package: pip install wandb") from None
    from omegaconf import OmegaConf

    config_file = run_dir / "config.yaml"
    config = OmegaConf.to_container(OmegaConf.load(config_file)) if config_file.is_file() else {}
    run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
    return wandb.init(project=project, name=run_dir.name, id=run_id, resume="allow", dir=str(run_dir), config=config)


def drop_rows_after(path: Path, step: int) -> str | None:
    """Rewrite ``path`` (a metrics.jsonl) without its rows past ``step`` and any unreadable row (a torn last line),
    atomically (written aside, fsynced, renamed over); the rows kept are untouched. Returns what was dropped, in
    words (``"3 rows (steps 21-25)"``), or None when nothing was."""
    try:
        lines = path.read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return None
    keep, past, torn = [], [], 0
    for line in lines:
        try:
            row_step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            torn += 1
            continue
        if not line.endswith("\n"):  # a last row cut short of its newline: the next append would join it
            line += "\n"
        (past if row_step > step else keep).append((row_step, line))
    if not past and not torn:
        return None
    atomic_write_text(path, "".join(line for _, line in keep))
    what = [f"{len(past)} row{'s' if len(past) > 1 else ''} (steps {past[0][0]}-{past[-1][0]})"] if past else []
    return " and ".join([*what, *([f"{torn} unreadable line{'s' if torn > 1 else ''}"] if torn else [])])


def host_rss() -> int | None:
    """This process's resident memory in bytes (``/proc/self/statm``: one small read), None without /proc."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def format_fields(record: dict[str, Any], fields: list[tuple[str, str]]) -> str:
    """``"a | b | c"`` from ``(key, template)`` pairs, skipping keys that are absent or None."""
    return " | ".join(t.format(record[k]) for k, t in fields if record.get(k) is not None)


# The console line of a metrics record.
LINE_FIELDS = [
    ("step", "step {:>6}"),
    ("first_step", "{}"),
    ("loss", "loss {:.4f}"),
    ("val_loss", "val_loss {:.4f}"),
    ("lr", "lr {:.2e}"),
    ("grad_norm", "gnorm {:.3f}"),
    ("tokens_per_s", "{} tok/s"),  # shown through fmt_si
    ("step_time_ms", "{:.1f} ms/step"),
    ("mfu_pct", "mfu {:.1f}%"),
    ("peak_mem_gb", "mem {:.2f} GB"),
]


def summary_line(r: dict[str, Any], compiled: bool = False) -> str:
    """The console line of a record; a run's first step says how long it took (the compile, when compiled)."""
    shown = dict(r)
    if r.get("first_step_s") is not None:  # its time is the compile's, or the first step's: no step time
        shown["first_step"] = f"{'compiled in' if compiled else 'first step'} {r['first_step_s']:.1f} s"
    elif r.get("step_time") is not None:
        shown["step_time_ms"] = r["step_time"] * 1e3
    if r.get("mfu") is not None:
        shown["mfu_pct"] = r["mfu"] * 100
    if r.get("tokens_per_s") is not None:
        shown["tokens_per_s"] = fmt_si(r["tokens_per_s"])
    return format_fields(shown, LINE_FIELDS)


def copy_to_host(*values):
    """Start copying tensors to the host; returns a function that waits for them alone and gives their values:
    a float for a scalar tensor or a number, a list of floats for a vector, None for None.

    ``tensor.item()`` would queue its copy behind everything launched since, so reading step k's loss after
    launching step k+1 would wait for step k+1 and leave the GPU idle while the host prepares step k+2. A
    non-blocking copy into pinned memory plus an event waits only for step k's own numbers.
    """

    def value(v, it):
        if not isinstance(v, torch.Tensor):
            return float(v) if v is not None else None
        got = [next(it) for _ in range(v.numel())]
        return got[0] if v.dim() == 0 else got

    present = [v for v in values if isinstance(v, torch.Tensor)]
    if not present or present[0].device.type != "cuda":  # read now: a buffer may be reused by the next step
        got = [
            value(v, iter(v.detach().float().reshape(-1).tolist()) if isinstance(v, torch.Tensor) else None)
            for v in values
        ]
        return lambda: got
    flat = torch.cat([v.detach().float().reshape(-1) for v in present])
    host = torch.empty(flat.numel(), dtype=torch.float32, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    done = torch.cuda.Event(enable_timing=True)  # also the step's end, for StepTimer
    done.record()

    def read() -> list:
        done.synchronize()
        it = iter(host.tolist())
        return [value(v, it) for v in values]

    read.event = done
    return read


def _check_own_slot(losses: list[float], own: float, rank: int, step: int) -> None:
    """Every rank's losses come from an all-reduce (a sum) of one-hot rows, so this rank's slot is its own loss plus
    exact zeros: anything else means the collective returned a wrong sum, and then the gradients reduced over the
    same process group cannot be trusted either. Raises :class:`~trainer.errors.TrainingError` (a non-finite loss is
    the NaN check's to report)."""
    if math.isfinite(own) and losses[rank] != own:
        raise TrainingError(
            f"step {step}: the all-reduce of every rank's loss gave {losses[rank]!r} for rank {rank}, whose own loss "
            f"is {own!r} (all ranks: {losses}). A collective returned a wrong sum, so the gradients reduced over the "
            "same process group may be wrong too: stopping."
        )


class StepLog:
    """Each training step's loss and gradient norm, read one step late, into records for :class:`Metrics`.

    :meth:`launched` queues a step and reads the one before it: by then the GPU has the new step queued, so the
    wait (for that step alone, :func:`copy_to_host`) never leaves it idle. :meth:`read` reads the queued step at
    once (before an evaluation or a checkpoint reads the state, and on the first step, whose time is the
    compile). Every read step moves the progress bar and, unless its update was skipped, goes through
    ``check(step, loss, first, ranks)`` (a NaN loss, recompiles); the first step, every ``log_every``-th, the last
    and forced reads become records.

    Under torchrun each step's loss is gathered from every rank as it is queued (a collective of one float per
    rank, no host sync): the loss read and checked is the mean over ranks on every rank, so every rank stops at the
    same step when any rank's loss is not finite, and ``ranks`` names those ranks (None for one process).

    Args:
        metrics: where records go.
        env: the process environment (the logged loss is the mean over ranks, a collective: every rank reads).
        start_step: the step this process starts after (non-zero on resume).
        last_step: ``train.steps``.
        log_every: ``log.every``.
        tokens_per_step: tokens of one step's global batch.
        flops_per_token: training FLOPs per token, for MFU.
        peak_flops: the device's peak FLOP/s (None: no MFU).
        compiled: the first step includes the compile (its line says so).
        check: ``check(step, loss, first, ranks)`` raises to stop the run (``ranks``: the ranks whose loss was
            not finite, under torchrun).
        targets: ``targets(k)``: the number of target tokens of step ``k``'s global batch (0 for the first step;
            packed documents, :meth:`trainer.packing.PackedBatches.targets`), which records give as ``targets``
            and ``targets_per_s``; None where every token is a target.
    """

    def __init__(
        self,
        metrics: Metrics,
        *,
        env,
        start_step: int,
        last_step: int,
        log_every: int,
        tokens_per_step: int,
        flops_per_token: float,
        peak_flops: float | None,
        compiled: bool,
        check: Callable[[int, float, bool, list[int] | None], None],
        targets: Callable[[int], int] | None = None,
    ):
        self.metrics, self.env, self.start_step, self.last_step = metrics, env, start_step, last_step
        self.log_every, self.tokens_per_step, self.compiled, self.check = log_every, tokens_per_step, compiled, check
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.timer = StepTimer()
        if env.device.type == "cuda":  # the peak the records report: the training's, from here
            torch.cuda.reset_peak_memory_stats(env.device)
        self.pending: dict[str, Any] | None = None
        self.last: dict[str, Any] = {}  # the newest record written
        self.checkpoint_s = 0.0  # the seconds the steps waited for checkpoints since the last record
        self.checkpoint_wait_s = 0.0  # of which for a background write still in flight at the next save
        self.skipped = 0  # steps whose update was skipped, in this start
        self.targets = targets
        self.targets_since = [0, 0]  # target tokens and steps read since the last record
        startup.mark("wrap")

    def launched(self, step: int, out, lr: float, tokens: int) -> None:
        """Queue step ``step`` (``out``: its :class:`~trainer.step.StepOutput`, numbers still on the device) and
        write the record of the one before it."""
        self.write(self.read())
        rank, loss = self.env.rank, out.loss
        fault_point("kill", step, rank)  # tests: this rank is lost here
        fault_point("sigterm", step, rank)  # tests: the job is stopped here (preempted)
        fault_point("raise", step, rank)  # tests: this rank fails here
        fault_point("hang", step, rank)  # tests: this rank waits here for good
        if fault_point("nan_loss", step, rank):  # tests: this rank's loss is not finite
            loss = loss * float("nan")
        losses = per_rank(loss, self.env) if self.env.distributed else loss  # (world,): every rank's
        if fault_point("wrong_sum", step, rank):  # tests: the losses' all-reduce gives a wrong sum on this rank
            losses = losses * 4
        own = loss if self.env.distributed else None  # what this rank's slot of ``losses`` must hold, exactly
        read = copy_to_host(losses, out.grad_norm, own)  # started now, waited for at the read
        targets = None if self.targets is None else self.targets(step - 1)
        self.pending = {"step": step, "read": read, "lr": lr, "tokens": tokens, "out": out, "targets": targets}

    def reads_at_once(self, step: int) -> bool:
        """Whether ``step`` is read as soon as it is queued: the first (its time is the compile), and every step on
        the CPU, where every op runs before the host moves on (reading one step late gains nothing)."""
        return step == self.start_step + 1 or self.env.device.type != "cuda"

    def read(self, force: bool = False) -> dict[str, Any] | None:
        """Read the queued step; returns its record when it is logged (or ``force``), else None."""
        p, self.pending = self.pending, None
        if p is None:
            return None
        step, first = p["step"], p["step"] == self.start_step + 1
        loss, grad_norm, own = p["read"]()  # waits for this step's numbers only, not for the queued next step
        ranks = None
        if isinstance(loss, list):  # every rank's: the mean, and which ranks were not finite
            _check_own_slot(loss, own, self.env.rank, step)
            ranks, loss = [r for r, x in enumerate(loss) if not math.isfinite(x)], sum(loss) / len(loss)
        self.timer.tick(self.tokens_per_step, first=first, event=getattr(p["read"], "event", None))
        if p["out"].skipped:  # not applied: train.on_nan=skip, train.on_spike=skip
            self.skipped += 1
            console.warn(f"step {step}: {p['out'].skipped}; update skipped")
        else:
            self.check(step, loss, first, ranks)
        self.metrics.advance(step, loss, self.timer.last_tps)
        if p["targets"] is not None:
            self.targets_since = [self.targets_since[0] + p["targets"], self.targets_since[1] + 1]
        if not (force or first or step % self.log_every == 0 or step == self.last_step):
            return None
        tps, step_time = self.timer.read()
        record = {
            "step": step,
            "loss": loss,
            "lr": p["lr"],
            "grad_norm": grad_norm,
            "tokens_per_s": None if first else tps,
            "step_time": step_time,
            "tokens": p["tokens"],
        }
        if self.skipped:
            record["skipped_steps"] = self.skipped
        if p["targets"] is not None:  # the share of the interval's tokens that were targets gives their rate
            share = self.targets_since[0] / (self.targets_since[1] * self.tokens_per_step)
            record["targets"], record["targets_per_s"] = p["targets"], None if first else tps * share
            self.targets_since = [0, 0]
        if first:
            record["first_step_s"] = step_time
            if (phases := startup.phases()) is not None:  # where this process's start went (trainer.startup)
                record["startup_s"], record["process_started_at"] = phases, startup.started_at()
        elif self.peak_flops is not None:
            record["mfu"] = self.flops_per_token * tps / self.env.world_size / self.peak_flops
        if self.env.device.type == "cuda":  # the caching allocator's counters, read on the host: no device sync
            record["peak_mem_gb"] = torch.cuda.max_memory_allocated(self.env.device) / 1e9
            record["mem_allocated_gb"] = torch.cuda.memory_allocated(self.env.device) / 1e9
            record["mem_reserved_gb"] = torch.cuda.memory_reserved(self.env.device) / 1e9
        if (rss := host_rss()) is not None:
            record["host_rss_gb"] = rss / 1e9
        return record

    def held(self, seconds: float, previous: float = 0.0) -> None:
        """The steps waited ``seconds`` for a checkpoint (not training time: the timer restarts), ``previous`` of them
        for the background write before it: the next record's ``checkpoint_s`` and ``checkpoint_wait_s`` add them
        up."""
        self.checkpoint_s += seconds
        self.checkpoint_wait_s += previous
        self.timer.restart()

    def write(self, record: dict[str, Any] | None) -> None:
        """Write a record from :meth:`read` (with anything added to it, such as ``val_loss``); None: nothing. Its
        ``checkpoint_s``: the seconds the steps waited for the checkpoints saved since the record before."""
        if record is not None:
            if self.checkpoint_s:
                record["checkpoint_s"], self.checkpoint_s = self.checkpoint_s, 0.0
                record["checkpoint_wait_s"], self.checkpoint_wait_s = self.checkpoint_wait_s, 0.0
            self.metrics.log(record, compiled=self.compiled)
            self.last.update(record)

    def summary(self, **extra) -> dict[str, Any]:
        """The run's summary: the last record's values, the timing over the run, ``extra``."""
        out = {
            **self.last,
            "first_step_s": self.timer.first_step_s,
            "mean_tokens_per_s": self.timer.mean_tps,
            "median_step_s": self.timer.median_step_s,
            **extra,
        }
        if self.skipped:
            out["skipped_steps"] = self.skipped
        if self.env.device.type == "cuda":
            out["peak_mem_gb"] = torch.cuda.max_memory_allocated(self.env.device) / 1e9
        return out
