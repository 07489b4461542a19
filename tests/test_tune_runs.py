"""A candidate of ``trainer tune`` run in a spare (trainer/tune_runs.py): a process that imported ahead while the
previous candidate ran, then ran ``trainer fit`` with the arguments it was given, as a new process would."""

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import FAST, ROOT
from trainer.tune_runs import Runner, _last_step


def _losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def test_a_candidate_in_a_spare_trains_as_one_in_a_new_process(tmp_path):
    """The same candidate twice on the CPU: the first in a new process, the second in the spare started meanwhile;
    the same losses, bit for bit, and the startup counted from the spare's go; a third spare is ended by close()."""
    runner = Runner(str(ROOT / "configs/tiny.yaml"), [*FAST, "train.device=cpu"], tmp_path, spares=True)
    candidate = ["train.micro_batch_size=2"]
    first = runner.run("none", 2, candidate)
    assert first.status == "ok", first.status
    spare, _ = runner._spare
    assert spare.poll() is None  # waiting, imports done or under way
    environ = dict(v.split("=", 1) for v in open(f"/proc/{spare.pid}/environ").read().split("\0") if "=" in v)
    assert environ["TRITON_CACHE_DIR"] == str((tmp_path / "compile_cache" / "triton").resolve())  # its workers'
    losses = _losses(tmp_path / "runs" / "2")
    second = runner.run("none", 2, candidate)
    assert second.status == "ok", second.status
    assert spare.poll() in (0, -signal.SIGKILL)  # it ran the second candidate (ended once its last row was in)
    assert _losses(tmp_path / "runs" / "2") == losses and losses[-1][0] == runner.steps
    third, go = runner._spare
    runner.close()
    assert third.poll() is not None and runner._spare is None and not go.exists()
    rows = [json.loads(line) for line in (tmp_path / "runs" / "2" / "metrics.jsonl").read_text().splitlines()]
    startup = next(r["startup_s"] for r in rows if r.get("startup_s"))
    assert startup["imports"] < second.seconds, startup  # from the go, not from the spare's creation


def _child(tmp_path, rows: list[int], then: str) -> subprocess.Popen:
    """A process in a session of its own that writes metrics rows for ``rows`` steps to ``tmp_path``, then runs
    ``then`` (Python)."""
    code = (f"import json, sys, time\nf = open({str(tmp_path / 'metrics.jsonl')!r}, 'a', buffering=1)\n"
            f"for s in {rows!r}:\n    f.write(json.dumps({{'step': s}}) + '\\n')\n{then}\n")  # fmt: skip
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_a_candidate_ends_once_its_last_row_and_compile_report_are_written(tmp_path, monkeypatch):
    """What a candidate's process does after its last row and compile report measures nothing: the runner ends it
    there (a process that would sleep a minute after them returns at once, 0); with no report (an eager run), once
    the grace for one is over; one that exits first keeps its code, whether before its last row or after it."""
    from trainer import tune_runs

    runner = Runner("tiny", [], tmp_path)
    report = f"open({str(tmp_path / 'compile_report.json')!r}, 'w').write('{{}}')"
    monkeypatch.setattr(tune_runs, "REPORT_GRACE_S", 600.0)  # only the report can end it in time
    started = time.monotonic()
    proc = _child(tmp_path, [2, 4, runner.steps], f"{report}\ntime.sleep(60)")
    assert runner._wait_for_rows(proc, tmp_path) == 0
    assert time.monotonic() - started < 30 and proc.poll() == -signal.SIGKILL
    for f in ("metrics.jsonl", "compile_report.json"):
        (tmp_path / f).unlink()
    monkeypatch.setattr(tune_runs, "REPORT_GRACE_S", 0.5)
    started = time.monotonic()
    assert runner._wait_for_rows(_child(tmp_path, [2, 4, runner.steps], "time.sleep(60)"), tmp_path) == 0
    assert time.monotonic() - started < 30
    (tmp_path / "metrics.jsonl").unlink()
    assert runner._wait_for_rows(_child(tmp_path, [2, 4], "sys.exit(3)"), tmp_path) == 3
    (tmp_path / "metrics.jsonl").unlink()
    assert runner._wait_for_rows(_child(tmp_path, [2, 4, runner.steps], "sys.exit(3)"), tmp_path) == 3
    (tmp_path / "metrics.jsonl").write_text('{"step": 2}\n{"step": ' + str(runner.steps))  # a torn last row
    assert _last_step(tmp_path) == 2


def test_a_candidate_past_the_deadline_is_stopped(tmp_path):
    """A candidate that has not written its last row by the deadline: TimeoutExpired, for the caller's stop."""
    runner = Runner("tiny", [], tmp_path, deadline=time.monotonic() + 1.0)
    proc = _child(tmp_path, [2], "time.sleep(60)")
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            runner._wait_for_rows(proc, tmp_path)
    finally:
        proc.kill()
        proc.wait()
