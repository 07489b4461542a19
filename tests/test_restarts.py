"""Runs that outlive their faults: ``resume=auto``, torchrun's restarts (``--max-restarts``) and a job stopped by
SIGTERM then started again with the same command, on 2 gloo ranks against an uninterrupted run; what resume=auto
decides in a run directory, a damaged checkpoint passed over included; the startup line and ``starts.jsonl`` that
say it."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from tests.conftest import FAST, GPU_CACHE, ROOT, cli, shared_run, torchrun
from trainer.checkpoint import rundir
from trainer.distributed.env import DistEnv, restart_warning
from trainer.faults import fault_point

SHAPE = [f for f in FAST if not f.startswith(("train.micro_batch_size", "model.n_layer"))] + ["model.n_layer=1"]
# 30 steps of 2 ranks, a checkpoint every 10, every step logged: the steps of a restarted run are compared one by one.
RUN = [*SHAPE, "train.micro_batch_size=2", "distributed.strategy=ddp", "log.every=1", "train.eval_every=0",
       "train.steps=30", "checkpoint.every=10", "resume=auto"]  # fmt: skip


def _env(**extra: str) -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra}


def _job(run_dir, *extra: str, restarts: int = 1, fault: str | None = None, timeout: int = 180):
    """``torchrun --max-restarts N`` of 2 ranks with ``RUN`` (and ``extra``) into ``run_dir``; ``fault``:
    ``TRAINER_FAULT``. Returns the ``subprocess.CompletedProcess``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--max-restarts={restarts}", "-m", "trainer", "fit", "configs/tiny.yaml", *RUN, *extra,
           f"run.dir={run_dir}"]  # fmt: skip
    return torchrun(cmd, timeout=timeout, env=_env(**({"TRAINER_FAULT": fault} if fault else {})))


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _starts(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "starts.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 2-rank run: ``{step: (loss, grad_norm)}``."""

    def make(run_dir):
        r = _job(run_dir)
        assert r.returncode == 0, r.stderr[-3000:]

    run_dir = shared_run(tmp_path_factory, "restarts-reference", make)
    return {row["step"]: (row["loss"], row["grad_norm"]) for row in _rows(run_dir)}


def _same_run(run_dir, reference) -> None:
    """Steps 1..30 logged once each, every loss and gradient norm equal to the uninterrupted run's, bit for bit:
    the restored state and the batches from (seed, step) continue exactly (observed: equal floats, no tolerance)."""
    rows = _rows(run_dir)
    assert [row["step"] for row in rows] == list(range(1, 31))
    got = {row["step"]: (row["loss"], row["grad_norm"]) for row in rows}
    assert got == reference, [(s, got[s], reference[s]) for s in reference if got.get(s) != reference[s]]


def test_a_rank_killed_under_torchrun_restarts_resumes_and_ends_as_an_uninterrupted_run(tmp_path, reference):
    """``torchrun --max-restarts 1``: rank 0 SIGKILLed at step 15 of the first start (after the checkpoint of step
    10). torchrun restarts both ranks; resume=auto continues from step 10 and the job exits 0 with the uninterrupted
    run's losses. The killed rank 0 left its lock behind, which the restart takes over; the restart's process group
    is set up in torchrun's store, which still holds the first start's keys (trainer.distributed.env._restart_store).
    (A lost rank 1 ends rank 0 with an error, which releases the lock: tests/test_faults.py.)"""
    r = _job(tmp_path, fault="kill:15@0#0")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith("resume=auto: ")]
    assert lines == [
        f"resume=auto: no complete checkpoint in {tmp_path / 'checkpoints'}; starting fresh at step 0",
        f"resume=auto: resumed from {tmp_path / 'checkpoints' / 'step_000010'} at step 10 (torchrun restart 1 of "
        "at most 1)",
    ], r.stdout
    assert "metrics.jsonl: dropped 4 rows (steps 11-14) past step 10" in r.stderr
    assert "was left by a run that is no longer running" in r.stderr
    _same_run(tmp_path, reference)
    starts = _starts(tmp_path)
    got = [(s["restart"], s["max_restarts"], s["step"], s["resume"]) for s in starts]
    assert got == [(0, 1, 0, "auto"), (1, 1, 10, "auto")]
    assert starts[1]["checkpoint"] == str(tmp_path / "checkpoints" / "step_000010")
    assert not (tmp_path / ".lock").exists()


def test_a_rank_killed_in_a_background_checkpoint_write_restarts_as_an_uninterrupted_run(tmp_path, reference):
    """checkpoint.async_save under ``torchrun --max-restarts 1``: rank 0 SIGKILLed by its writer thread between two
    files of the step-20 checkpoint, while the steps go on. torchrun restarts both ranks; resume=auto continues from
    step 10 (the torn checkpoint never became ``last``), the temporary directory is removed, and the job ends with
    the uninterrupted (synchronous) run's losses."""
    r = _job(tmp_path, "checkpoint.async_save=true", fault="checkpoint_write:20@0#0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {tmp_path / 'checkpoints' / 'step_000010'} at step 10 (torchrun restart 1" in r.stdout
    _same_run(tmp_path, reference)
    assert (tmp_path / "checkpoints" / "last").read_text().strip() == "step_000030"
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


@pytest.mark.multi_gpu
def test_a_rank_killed_under_torchrun_restarts_on_two_gpus(tmp_path):
    """The same kill and restart on 2 GPUs under NCCL, with CUDA's defaults: compiled, the whole step (all-reduces
    included) one CUDA graph, bf16. The restarted job ends as an uninterrupted one: steps 1..30 once each, every
    loss and gradient norm within 0.2% of the uninterrupted run's. Not bit for bit as on the CPU: a start runs its
    first steps as ordinary compiled steps before it captures the graph (trainer.step.GRAPH_AFTER_STEPS), so steps
    11-13 of the restarted job are ordinary where the uninterrupted run's were replays, whose bf16 results differ
    in the last bits (observed: up to 8.5e-4 on losses near 4 by step 30; steps 1-10 equal bit for bit).

    The checkpoints are written in the step (``checkpoint.async_save=false``): the kill comes 5 steps after the save
    at step 10, about 25 ms on these GPUs, and a background write still in flight then leaves no complete checkpoint
    (observed once in two runs: the restart began at step 0, as it should). A kill during a background write is
    ``test_a_rank_killed_in_a_background_checkpoint_write_restarts_as_an_uninterrupted_run``'s."""
    cuda = ["train.device=cuda", "model.dropout=0.0", "checkpoint.async_save=false", *GPU_CACHE]
    ref, run = tmp_path / "ref", tmp_path / "run"
    r = _job(ref, *cuda, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "captured as one CUDA graph" in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    r = _job(run, *cuda, fault="kill:15@0#0", timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resume=auto: resumed from {run / 'checkpoints' / 'step_000010'} at step 10" in r.stdout, r.stdout
    rows, want = _rows(run), {row["step"]: row for row in _rows(ref)}
    assert [row["step"] for row in rows] == list(range(1, 31))

    def diff(steps, relative=False):
        return max(abs(r[k] - want[r["step"]][k]) / (abs(want[r["step"]][k]) if relative else 1.0)
                   for r in rows if r["step"] in steps for k in ("loss", "grad_norm"))  # fmt: skip

    print("2 GPUs, NCCL, graphed: max |loss or grad-norm difference| restarted vs uninterrupted, steps 1-10 (before "
          f"the kill): {diff(range(1, 11))}; steps 11-30: {diff(range(11, 31))}")  # fmt: skip
    assert diff(range(1, 31), relative=True) <= 2e-3, diff(range(1, 31), relative=True)
    assert [(s["restart"], s["step"]) for s in _starts(run)] == [(0, 0), (1, 10)]


def test_a_stopped_job_started_again_with_the_same_command_ends_as_an_uninterrupted_run(tmp_path, reference):
    """Preemption: at step 12 the job's launcher gets SIGTERM (as a scheduler sends it); every rank finishes its
    step and saves; torchrun exits with the signal. The same command again resumes there and finishes as the
    uninterrupted run."""
    first = _job(tmp_path, fault="sigterm:12@0#0")
    assert first.returncode != 0  # torchrun itself ends by the signal, once its ranks have saved and exited
    assert "stopped by signal at step " in first.stderr, first.stderr[-3000:]
    stopped = json.loads((tmp_path / "checkpoints" / (tmp_path / "checkpoints/last").read_text().strip() /
                          "meta.json").read_text())["step"]  # fmt: skip
    assert 12 <= stopped < 30 and _rows(tmp_path)[-1]["step"] == stopped
    again = _job(tmp_path, fault="sigterm:12@0#0")  # the same command, fault included: step 12 is not run again
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = f"resume=auto: resumed from {tmp_path / 'checkpoints'}/step_{stopped:06d} at step {stopped}\n"
    assert resumed in again.stdout, again.stdout
    _same_run(tmp_path, reference)
    assert [(s["step"], s["restart"]) for s in _starts(tmp_path)] == [(0, 0), (stopped, 0)]


def test_a_checkpoint_damaged_before_a_rank_is_lost_is_passed_over_on_the_restart(tmp_path):
    """``torchrun --max-restarts 1``, 12 steps, a checkpoint every 4: the step-8 checkpoint is cut short once
    published (its largest file to half its size, as a disk or a copy damages one), then rank 0 is SIGKILLed at step
    10. On the restart rank 0 finds it damaged, says so, moves it aside and points ``last`` at step 4; every rank
    resumes there and the job finishes, each step logged once. (Shorter than the runs above, which compare with the
    uninterrupted run: the in-process fallback test does, bit for bit.)"""
    r = _job(tmp_path, "train.steps=12", "checkpoint.every=4", fault="damage_checkpoint:8#0,kill:10@0#0")
    assert r.returncode == 0, r.stderr[-3000:]
    root = tmp_path / "checkpoints"
    damaged, intact, aside = (str(root / name) for name in ("step_000008", "step_000004", "step_000008.damaged-1"))
    said = re.findall(rf"warning: checkpoint {damaged} is damaged \((\S+) is ([\d,]+) bytes, its manifest says "
                      rf"([\d,]+)\): resuming from {intact}, the newest intact one; the damaged one moved aside to "
                      rf"{aside}\n", r.stderr)  # fmt: skip
    assert len(said) == 1, r.stderr[-3000:]
    name, size, manifest = said[0][0], int(said[0][1].replace(",", "")), int(said[0][2].replace(",", ""))
    assert size == manifest // 2 == (root / "step_000008.damaged-1" / name).stat().st_size
    resumed = f"resume=auto: resumed from {intact} at step 4 (torchrun restart 1 of at most 1)"
    assert resumed in r.stdout.splitlines(), r.stdout
    assert [row["step"] for row in _rows(tmp_path)] == list(range(1, 13))
    assert [(s["restart"], s["step"]) for s in _starts(tmp_path)] == [(0, 0), (1, 4)]
    names = ["last", "step_000004", "step_000008", "step_000008.damaged-1", "step_000012"]
    assert sorted(p.name for p in root.iterdir()) == names


ONE = [*SHAPE, "train.eval_every=0", "checkpoint.every=5", "resume=auto"]


def _fit(capsys, run_dir, *extra):
    return cli(capsys, "fit", "configs/tiny.yaml", *ONE, f"run.dir={run_dir}", *extra)


def test_resume_auto_starts_fresh_in_an_empty_directory_and_resumes_from_a_checkpoint(tmp_path, capsys):
    """One process: the same command twice. The first start says it starts fresh, the second that it resumes (one
    line each); starts.jsonl records both."""
    r = _fit(capsys, tmp_path, "train.steps=7")
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stdout.splitlines() if line.startswith(("resume", "starting", "resumed"))]
    assert said == [f"resume=auto: no complete checkpoint in {tmp_path / 'checkpoints'}; starting fresh at step 0"]
    r = _fit(capsys, tmp_path, "train.steps=12")
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stdout.splitlines() if line.startswith(("resume", "starting", "resumed"))]
    assert said == [f"resume=auto: resumed from {tmp_path / 'checkpoints' / 'step_000007'} at step 7"]
    assert [row["step"] for row in _rows(tmp_path)] == [1, 5, 7, 8, 10, 12]
    starts = _starts(tmp_path)
    got = [(s["step"], s["resume"], s["restart"], s["world_size"]) for s in starts]
    assert got == [(0, "auto", None, 1), (7, "auto", None, 1)]
    assert all(row["host_rss_gb"] > 0.05 for row in _rows(tmp_path))  # the process's resident memory, in GB


def _cut(path) -> tuple[int, int]:
    """Truncate ``path`` to half its size, as a write or a copy cut short leaves it; returns (new, old) size."""
    size = path.stat().st_size
    os.truncate(path, size // 2)
    return size // 2, size


def test_resume_falls_back_past_a_damaged_checkpoint_and_ends_as_an_uninterrupted_run(tmp_path, capsys):
    """The newest checkpoint's model.pt cut to half its size after it was saved: resume=last, and later resume=auto
    (the step-20 one cut), resume from the newest intact one before it, say so in one line, move the damaged one
    aside (nothing deleted) and point ``last`` at the intact one. The run ends as the uninterrupted run: steps 1..25
    logged once each, every loss equal bit for bit (the restored state and the batches from (seed, step) continue
    exactly; observed: equal floats, no tolerance)."""
    straight, run = tmp_path / "straight", tmp_path / "run"
    common = ["train.steps=25", "log.every=1"]
    assert _fit(capsys, straight, *common).returncode == 0
    assert _fit(capsys, run, *common, "train.stop_at=15").returncode == 0  # checkpoints 5, 10, 15
    root = run / "checkpoints"
    for step, asked, stop in ((15, "last", ["train.stop_at=20"]), (20, "auto", [])):
        damaged, intact = root / f"step_{step:06d}", root / f"step_{step - 5:06d}"
        size, manifest = _cut(damaged / "model.pt")
        r = _fit(capsys, run, *common, *stop, f"resume={asked}")
        assert r.returncode == 0, r.stderr
        warned = [line for line in r.stderr.splitlines() if "damaged" in line]
        assert warned == [
            f"warning: checkpoint {damaged} is damaged (model.pt is {size:,} bytes, its manifest says {manifest:,}): "
            f"resuming from {intact}, the newest intact one; the damaged one moved aside to {damaged}.damaged-1"
        ], r.stderr
        assert f"resumed from {intact} at step {step - 5}" in r.stdout, r.stdout
        assert (root / f"{damaged.name}.damaged-1" / "model.pt").stat().st_size == size
    rows, want = _rows(run), {row["step"]: row["loss"] for row in _rows(straight)}
    assert [row["step"] for row in rows] == list(range(1, 26))
    assert {row["step"]: row["loss"] for row in rows} == want
    assert [s["checkpoint"] for s in _starts(run)] == [None, str(root / "step_000010"), str(root / "step_000015")]
    names = ["last", "step_000015", "step_000015.damaged-1", "step_000020", "step_000020.damaged-1", "step_000025"]
    assert sorted(p.name for p in root.iterdir()) == names  # checkpoint.keep=3 intact ones, the damaged ones kept
    assert (root / "last").read_text() == "step_000025\n"


def test_no_intact_checkpoint_or_a_damaged_one_asked_for_exits_2(tmp_path, capsys):
    """A damaged checkpoint named by resume=PATH exits 2 with why, naming the intact one beside it (no fallback: it
    was asked for); with every checkpoint damaged, resume=auto exits 2 listing each and why, and moves nothing."""
    assert _fit(capsys, tmp_path, "train.steps=10").returncode == 0  # checkpoints 5 and 10
    root = tmp_path / "checkpoints"
    size, manifest = _cut(root / "step_000010" / "optim.pt")
    cut = f"optim.pt is {size:,} bytes, its manifest says {manifest:,}"
    r = _fit(capsys, tmp_path, "train.steps=15", f"resume={root / 'step_000010'}")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert (
        f"resume={root / 'step_000010'}: checkpoint {root / 'step_000010'} is damaged ({cut}); the newest intact one "
        f"beside it is {root / 'step_000005'}\n" in r.stderr
    ), r.stderr
    (root / "step_000005" / "rng_rank0.pt").unlink()
    r = _fit(capsys, tmp_path, "train.steps=15")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert (
        f"resume=auto: no intact checkpoint in {root}: step_000010 ({cut}); step_000005 (rng_rank0.pt is missing). "
        "Nothing was moved or deleted." in r.stderr
    ), r.stderr
    assert sorted(p.name for p in root.iterdir()) == ["last", "step_000005", "step_000010"]


def test_resume_auto_starts_again_over_a_start_that_saved_no_checkpoint(tmp_path, capsys):
    """A run killed before its first checkpoint (its config keeps checkpoints) is started again from step 0 in place,
    its rows dropped with a note; a run that keeps no checkpoints is refused as a fresh run would be."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n{"step": 2, "loss": 5.4}\n')
    (tmp_path / "config.yaml").write_text("checkpoint:\n  enabled: true\n  every: 5\n")
    r = _fit(capsys, tmp_path, "train.steps=3")
    assert r.returncode == 0, r.stderr
    assert "starting fresh at step 0 (an earlier start here stopped before its first checkpoint)" in r.stdout, r.stdout
    assert (
        "metrics.jsonl: dropped 2 rows (steps 1-2) past step 0, where this run continues (written by an earlier "
        "start that stopped before its first checkpoint)" in r.stderr
    ), r.stderr
    assert [row["step"] for row in _rows(tmp_path)] == [1, 3]
    assert _starts(tmp_path)[0]["again"] is True

    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "metrics.jsonl").write_text('{"step": 9, "loss": 5.0}\n')
    (kept / "config.yaml").write_text("checkpoint:\n  enabled: false\n")
    r = _fit(capsys, kept, "train.steps=3")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"run.dir {kept} holds a run (metrics.jsonl up to step 9) that keeps no checkpoints" in r.stderr
    assert "resume=auto cannot continue it" in r.stderr and "run.overwrite=true" in r.stderr
    assert (kept / "metrics.jsonl").read_text() == '{"step": 9, "loss": 5.0}\n'


ENV = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None)


def _claim(run_dir, resume="auto", overwrite=False) -> rundir.Start:
    notes = []
    with rundir.claim(run_dir, resume=resume, overwrite=overwrite, env=ENV, say=notes.append) as start:
        assert (run_dir / ".lock").exists()
    return start


def test_claim_decides_resume_auto_from_the_last_pointer(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert _claim(tmp_path / "new") == rundir.Start(None, "auto")
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "step_000020").mkdir(parents=True)
    shutil.copytree(ROOT / "tests" / "data" / "tiny_checkpoint", ckpts / "step_000010")
    (ckpts / "last").write_text("step_000010\n")  # the newest complete one: step 20 was never published
    assert _claim(tmp_path / "run") == rundir.Start(str(ckpts / "step_000010"), "auto")
    assert _claim(tmp_path / "run", resume="last") == rundir.Start(str(ckpts / "step_000010"), "last")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    start = _claim(tmp_path / "run")
    assert (start.restart, start.max_restarts) == (2, 3)
    assert start.headline().format(path="P", step=10) == "resume=auto: resumed from P at step 10 (torchrun restart 2 " \
        "of at most 3)"  # fmt: skip


def test_the_resume_line_names_what_was_asked():
    """resume=last and resume=auto name themselves; a path asked for is the path resumed from, said once."""
    lines = {asked: rundir.Start(asked, asked).headline().format(path="P", step=10) for asked in ("last", "auto", "P")}
    assert lines == {
        "last": "resume=last: resumed from P at step 10",
        "auto": "resume=auto: resumed from P at step 10",
        "P": "resumed from P at step 10",
    }


def test_resume_auto_keeps_the_lock(tmp_path):
    """A live run's lock refuses resume=auto too."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        tmp_path.joinpath(".lock").write_text(json.dumps({"pid": sleeper.pid, "host": socket.gethostname()}))
        with pytest.raises(rundir.RunDirError, match=f"is in use by a live run \\(pid {sleeper.pid} "):
            _claim(tmp_path)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_resume_argument(capsys):
    from trainer.cli import _split_resume

    assert _split_resume(["optim.lr=1", "resume=auto", "train.steps=3"]) == (["optim.lr=1", "train.steps=3"], "auto")
    assert _split_resume(["resume=last", "resume=runs/x"]) == ([], "runs/x")  # the last one wins, as for overrides
    r = cli(capsys, "fit", "configs/tiny.yaml", "resume=")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "resume: expected resume=last, resume=auto or resume=PATH (in argument 'resume=')" in r.stderr
    r = cli(capsys, "explain", "configs/tiny.yaml", "resume=auto")
    assert r.returncode == 2 and "resume: not supported by explain" in r.stderr


def test_a_fault_can_be_limited_to_one_start_of_a_torchrun_job(monkeypatch):
    monkeypatch.setenv("TRAINER_FAULT", "nan_loss:3@1#0")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert fault_point("nan_loss", 3, 1) and not fault_point("nan_loss", 3, 0) and not fault_point("nan_loss", 4, 1)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not fault_point("nan_loss", 3, 1)  # the restart does not meet it again
    monkeypatch.setenv("TRAINER_FAULT", "nan_loss:3")
    assert fault_point("nan_loss", 3, 1)  # without #N: every start


def test_several_nodes_with_torchruns_shared_store_are_warned(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in restart_warning()
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")  # one node: the restart count keeps the starts apart
    assert restart_warning() is None
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert restart_warning() is None
