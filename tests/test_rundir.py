"""The run directory: a fresh run never writes over an old one, one live run at a time (a lock), and metrics.jsonl
continues on resume without repeating steps."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import FAST, ROOT, run_cli, torchrun

SHAPE = [f for f in FAST if not f.startswith("model.n_layer")] + ["model.n_layer=1", "train.eval_every=0"]


def _main(capsys, run_dir, *overrides) -> tuple[int, str]:
    """An in-process `trainer fit` of configs/tiny.yaml: exit status and everything printed."""
    from trainer.cli import main

    capsys.readouterr()
    code = main(["fit", "configs/tiny.yaml", *SHAPE, f"run.dir={run_dir}", *overrides])
    out = capsys.readouterr()
    return code, out.out + out.err


def _snapshot(d) -> dict:
    """Every file under ``d`` (hidden ones too) and its bytes."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _steps(run_dir) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _lock(run_dir, **info) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / ".lock").write_text(json.dumps({"host": socket.gethostname(), "started": "earlier", **info}))


def test_a_fresh_run_into_a_used_directory_exits_2_and_overwrite_moves_it_aside(tmp_path, capsys):
    """The issue's scenario: 20 steps with checkpoints into R, then a fresh 5-step run into R (no resume=)."""
    run = tmp_path / "R"
    assert _main(capsys, run, "train.steps=20", "checkpoint.every=10")[0] == 0
    first = _snapshot(run)
    assert "checkpoints/step_000020/model.pt" in first and ".lock" not in first

    code, out = _main(capsys, run, "train.steps=5")
    assert code == 2, out
    old_run = f"metrics.jsonl up to step 20; last checkpoint {run}/checkpoints/step_000020"
    assert f"run.dir {run} holds a run ({old_run})" in out
    for way in ("resume=last", "run.dir=<another directory>", "run.overwrite=true", f"{run}.old-1"):
        assert way in out, way
    assert "Traceback" not in out
    assert _snapshot(run) == first  # untouched: not a byte written, no lock left

    code, out = _main(capsys, run, "train.steps=5", "run.overwrite=true")
    assert code == 0, out
    assert f"moved the old run in {run} ({old_run}) aside to {run}.old-1; nothing was deleted" in out
    assert _snapshot(tmp_path / "R.old-1") == first  # the first run, whole
    assert _steps(run) == [1, 5] and (run / "checkpoints/last").read_text().strip() == "step_000005"

    code, out = _main(capsys, run, "train.steps=2", "run.overwrite=true")  # the next free name
    assert code == 0 and f"aside to {run}.old-2" in out, out
    assert _snapshot(tmp_path / "R.old-1") == first and _steps(tmp_path / "R.old-2") == [1, 5]


def test_two_live_runs_cannot_share_a_directory(tmp_path, capsys):
    """A second run (fresh or resume=last) into the directory of a live run exits 2 naming it; the live run is not
    disturbed, and its lock goes when it ends."""
    cmd = [sys.executable, "-m", "trainer", "fit", "configs/tiny.yaml", *SHAPE, "train.steps=100000", "log.every=1",
           f"run.dir={tmp_path}"]  # fmt: skip
    live = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (tmp_path / "metrics.jsonl").exists():
            time.sleep(0.1)
        info = json.loads((tmp_path / ".lock").read_text())
        assert info["pid"] == live.pid and info["host"] == socket.gethostname()
        for extra in ([], ["resume=last"], ["run.overwrite=true"]):
            code, out = _main(capsys, tmp_path, "train.steps=3", *extra)
            assert code == 2, out
            assert f"run.dir {tmp_path} is in use by a live run (pid {live.pid} on {socket.gethostname()}" in out
        assert not list(tmp_path.parent.glob(f"{tmp_path.name}.old-*"))  # overwrite moved nothing
    finally:
        live.send_signal(signal.SIGTERM)  # it saves a checkpoint and exits cleanly
        _, err = live.communicate(timeout=120)
    assert live.returncode == 0, err
    assert not (tmp_path / ".lock").exists()


def test_a_lock_of_another_host_is_respected(tmp_path, capsys):
    _lock(tmp_path, pid=1, host="elsewhere")
    code, out = _main(capsys, tmp_path, "train.steps=2")
    assert code == 2, out
    assert "locked by a run on host elsewhere (pid 1" in out and f"delete {tmp_path}/.lock and start again" in out
    assert json.loads((tmp_path / ".lock").read_text())["host"] == "elsewhere"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("left_by", ["dead pid", "reused pid", "this pid in an earlier life", "unreadable"])
def test_a_stale_lock_is_taken_over(tmp_path, capsys, left_by):
    """A lock whose process is gone: its pid exited; or it runs another program now (its start time differs from
    the one the lock recorded); or it is this process's pid, which does not hold it (a restarted container).

    The directory is what a run killed before its first logged step leaves (or one stopped by a config error): a
    config.yaml, an empty metrics.jsonl: no run to protect, so a fresh run goes on there, keeping other files."""
    (tmp_path / "config.yaml").write_text("left by a run that never logged a step\n")
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "notes.txt").write_text("mine")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        if left_by == "unreadable":
            tmp_path.joinpath(".lock").write_text("{not json")
        else:
            pid = {"dead pid": _dead_pid(), "reused pid": sleeper.pid, "this pid in an earlier life": os.getpid()}
            _lock(tmp_path, pid=pid[left_by], proc_start="1")  # started 10 ms after boot: not the process there now
        code, out = _main(capsys, tmp_path, "train.steps=2")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert code == 0, out
    assert f"{tmp_path}/.lock was left by a run that is no longer running" in out and "taking it over" in out
    assert not (tmp_path / ".lock").exists()  # and released at the end
    assert (tmp_path / "notes.txt").read_text() == "mine" and _steps(tmp_path) == [1, 2]


def test_resume_appends_metrics_and_drops_the_rows_past_the_resumed_step(tmp_path, capsys):
    """A run SIGKILLed at step 8 (checkpoint at 5, rows to 7, its lock left behind, the last row torn): resume=last
    keeps rows 1-5 byte for byte, drops 6-7 and the torn line with a note, and logs 6-10 after them."""
    common = ["train.steps=10", "checkpoint.every=5", "log.every=1"]
    r = run_cli("fit", "configs/tiny.yaml", *SHAPE, f"run.dir={tmp_path}", *common, env={"TRAINER_FAULT": "kill:8"})
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert _steps(tmp_path) == [1, 2, 3, 4, 5, 6, 7] and (tmp_path / ".lock").exists()
    kept = (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)[:5]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "loss": 5.1')  # a write cut short by the kill

    code, out = _main(capsys, tmp_path, *common, "resume=last")
    assert code == 0, out
    assert "taking it over" in out
    assert "metrics.jsonl: dropped 2 rows (steps 6-7) and 1 unreadable line past step 5" in out, out
    assert _steps(tmp_path) == list(range(1, 11))
    assert (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)[:5] == kept


def test_under_torchrun_rank_0_decides_and_reports_once(tmp_path):
    """2 ranks, a directory holding a run: every rank stops at once (no hang), one message."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 3, "loss": 5.0}\n')
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "trainer", "fit",
           "configs/tiny.yaml", *SHAPE, "distributed.strategy=ddp", "train.steps=2", f"run.dir={tmp_path}"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    r = torchrun(cmd, timeout=120, env=env)
    assert r.returncode != 0
    assert r.stderr.count(f"run.dir {tmp_path} holds a run (metrics.jsonl up to step 3)") == 1, r.stderr[-3000:]
    assert "[rank0]: Traceback" not in r.stderr and "[rank1]: Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
