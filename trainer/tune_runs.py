"""The candidate runs of ``trainer tune`` and ``trainer explain --memory --measure``: where the tune process stands
under torchrun (:class:`World`), and a candidate's ``trainer fit`` in child processes, measured (:class:`Runner`).

On one node of one process, each candidate after the first runs in a *spare*: a process started while the previous
candidate ran, which has imported torch, transformers (the model's own module), Dynamo, Inductor and trainer, and
waits with no CUDA context (so it holds no device memory) for the arguments of the next candidate
(:mod:`trainer.spare`). Its run is the run a new process would make; only the imports were done ahead. There, a
candidate ends once its last row and its compile report are written: what its process would do after (the run's
summary, the interpreter's and the device's teardown) measures nothing and would only delay the next.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainer import console
from trainer.compile.cache import cache_env
from trainer.memory import GB, Point
from trainer.plot import read_metrics

STEPS, LOG_EVERY = 6, 2  # a candidate's run: rows at 2 (compile), 4 (the graph's capture at the 4th step), 6 (steady)
POLL_S = 0.1  # how often a candidate's rows are looked at
REPORT_GRACE_S = 2.0  # how long after its last row a candidate may take to write its compile report
CHILD_ENV_DROP = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@dataclass
class World:
    """The tune process's place under torchrun (one process: rank 0 of 1)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    node_rank: int = 0

    @classmethod
    def from_env(cls) -> World:
        e = os.environ
        return cls(
            int(e.get("RANK", 0)),
            int(e.get("WORLD_SIZE", 1)),
            int(e.get("LOCAL_RANK", 0)),
            int(e.get("LOCAL_WORLD_SIZE", 1)),
            int(e.get("GROUP_RANK", 0)),
        )

    def join(self) -> None:
        """The tune processes' own gloo group, under torchrun (nothing for one process)."""
        if self.size > 1:
            from trainer.distributed.env import coordination_group

            coordination_group()

    def broadcast(self, obj):
        """``obj`` of rank 0, on every rank (the tune processes' own gloo group)."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


@dataclass
class Runner:
    """Runs candidates: ``trainer fit CONFIG *overrides *candidate`` for :data:`STEPS` steps in the work dir."""

    config: str
    overrides: list[str]
    work: Path
    world: World = field(default_factory=World)
    deadline: float | None = None  # time.monotonic() past which a running candidate is stopped
    say: object = console.info
    steps: int = STEPS
    log_every: int = LOG_EVERY
    spares: bool = False  # candidates after the first start in a process that imported ahead (one node, one process)
    _spare: tuple[subprocess.Popen, Path] | None = field(default=None, repr=False)

    @property
    def cache_dir(self) -> Path:
        """The compile cache every candidate shares."""
        return self.work / "compile_cache"

    def run(self, mode: str, micro_batch: int, overrides: list[str], predicted: float | None = None) -> Point:
        """One candidate's measurement (on rank 0; the other ranks' copies carry no numbers)."""
        slug = "_".join(o.split("=", 1)[1].replace("/", "-") for o in overrides) or "as-given"
        run_dir = self.work / "runs" / slug
        forced = [
            f"train.steps={self.steps + 1}",
            f"train.stop_at={self.steps}",
            "train.eval_every=0",
            "checkpoint.enabled=false",
            f"log.every={self.log_every}",
            "log.progress=false",
            f"run.dir={run_dir}",
            f"compile.cache_dir={self.cache_dir}",
        ]
        args = ["fit", self.config, *self.overrides, *overrides, *forced]
        port = self.world.broadcast(_free_port() if self.world.rank == 0 else None)
        started = time.monotonic()
        code = None
        if self.world.local_rank == 0:
            if self.world.rank == 0:
                shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            code = self._launch(args, port, run_dir.with_suffix(f".{self.world.node_rank}.log"), run_dir)
        codes = self._gather(code)
        seconds = time.monotonic() - started
        point = Point(mode, micro_batch, None, overrides=overrides)
        if self.world.rank != 0:
            return point
        log_file = run_dir.with_suffix(".0.log")
        log = log_file.read_text(errors="replace") if log_file.exists() else ""
        rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
        tps = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")]
        peaks = [r["peak_mem_gb"] for r in rows if r.get("peak_mem_gb") is not None]
        if any(c == "budget" for c in codes):
            point.status = "stopped: budget"
        elif any(codes) and ("OutOfMemoryError" in log or "out of memory" in log.lower()):
            point.status = "out of memory"
        elif any(codes) or not tps:
            last = [ln for ln in log.strip().splitlines() if ln.strip()][-1:] or ["no output"]
            point.status = f"failed (exit {next((c for c in codes if c), 0)}): {last[0][:120]}"
        else:
            point.tokens_per_s, point.peak = tps[-1], (max(peaks) * GB if peaks else None)
        point.seconds, point.predicted = round(seconds, 1), predicted
        return point

    def _launch(self, args: list[str], port: int, log: Path, run_dir: Path) -> int | str:
        """This node's part of a candidate: its exit code, or "budget" once stopped at the deadline; in one process,
        0 once its last row and compile report are in ``run_dir`` (:meth:`_wait_for_rows`)."""
        env = {k: v for k, v in os.environ.items() if k not in CHILD_ENV_DROP and not k.startswith("TORCHELASTIC")}
        if self.world.size > 1:
            nnodes = self.world.size // self.world.local_size
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={nnodes}",
                f"--nproc-per-node={self.world.local_size}",
                f"--node-rank={self.world.node_rank}",
                f"--master-addr={os.environ.get('MASTER_ADDR', '127.0.0.1')}",
                f"--master-port={port}",
                "-m",
                "trainer",
                *args,
            ]
        else:
            cmd = [sys.executable, "-m", "trainer", *args]
        proc = self._take_spare(args, log) if self.world.size == 1 else None
        if proc is None:
            with open(log, "w") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            if self.world.size == 1 and self.spares:
                # Its imports and its compile workers' start overlap this candidate's run; the workers inherit the
                # candidates' cache directories.
                self._start_spare({**env, **cache_env(self.cache_dir)})
            if self.world.size == 1:
                return self._wait_for_rows(proc, run_dir)
            timeout = None if self.deadline is None else max(1.0, self.deadline - time.monotonic())
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
            return "budget"
        except BaseException:  # interrupted: the candidate (in a session of its own) goes with the tune process
            os.killpg(proc.pid, 9)
            proc.wait()
            raise

    def _wait_for_rows(self, proc: subprocess.Popen, run_dir: Path) -> int:
        """``proc``'s exit code, or 0 once the run's last row (step :attr:`steps`) and its compile report are
        written (the report: for :data:`REPORT_GRACE_S` at most, none is written without a compile): the process,
        in a session of its own, is then killed. Raises TimeoutExpired at the deadline."""
        last_row_at = None
        while True:
            try:
                return proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                pass
            if last_row_at is None and _last_step(run_dir) >= self.steps:
                last_row_at = time.monotonic()
            if last_row_at is not None and ((run_dir / "compile_report.json").is_file()
                                            or time.monotonic() - last_row_at > REPORT_GRACE_S):  # fmt: skip
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()  # its own code where it ended between the poll and the kill
                return 0 if code == -signal.SIGKILL else code
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise subprocess.TimeoutExpired(proc.args, POLL_S)

    def _start_spare(self, env: dict) -> None:
        go = self.work / "runs" / f".spare-{os.getpid()}-{time.monotonic_ns()}.json"
        cmd = [sys.executable, "-m", "trainer.spare", str(os.getpid()), str(go), self.config, *self.overrides]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=env, start_new_session=True)  # fmt: skip
        self._spare = (proc, go)

    def _take_spare(self, args: list[str], log: Path) -> subprocess.Popen | None:
        """The spare, given ``args`` (its output to ``log``); None where there is none alive."""
        spare, self._spare = self._spare, None
        if spare is None or spare[0].poll() is not None:
            return None
        proc, go = spare
        from trainer.io import atomic_write_text

        atomic_write_text(go, json.dumps({"args": args, "log": str(log)}))
        return proc

    def close(self) -> None:
        """End the spare, if one is waiting."""
        spare, self._spare = self._spare, None
        if spare is not None and spare[0].poll() is None:
            spare[0].kill()
            spare[0].wait()
        if spare is not None:
            spare[1].unlink(missing_ok=True)

    def _gather(self, code):
        if self.world.size == 1:
            return [code]
        import torch.distributed as dist

        codes = [None] * self.world.size
        dist.all_gather_object(codes, code)
        return [c for c in codes if c is not None]


def _last_step(run_dir: Path) -> int:
    """The step of the last whole row of ``run_dir``'s metrics.jsonl, 0 before there is one."""
    rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []  # a torn last row is skipped
    return int(rows[-1].get("step", 0)) if rows else 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def plan_facts(work: Path) -> dict:
    """plan.json of the latest candidate run that wrote one: the device's memory and capability."""
    plans = sorted((work / "runs").glob("*/plan.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(plans[-1].read_text()) if plans else {}
