"""A candidate of ``trainer tune`` run in a spare (trainer/tune_runs.py): a process that imported ahead while the
previous candidate ran, then ran ``trainer fit`` with the arguments it was given, as a new process would."""

import json

from tests.conftest import FAST, ROOT
from trainer.tune_runs import Runner


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
    losses = _losses(tmp_path / "runs" / "2")
    second = runner.run("none", 2, candidate)
    assert second.status == "ok", second.status
    assert spare.poll() == 0  # it ran the second candidate
    assert _losses(tmp_path / "runs" / "2") == losses and losses[-1][0] == runner.steps
    third, go = runner._spare
    runner.close()
    assert third.poll() is not None and runner._spare is None and not go.exists()
    rows = [json.loads(line) for line in (tmp_path / "runs" / "2" / "metrics.jsonl").read_text().splitlines()]
    startup = next(r["startup_s"] for r in rows if r.get("startup_s"))
    assert startup["imports"] < second.seconds, startup  # from the go, not from the spare's creation
