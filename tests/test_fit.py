"""End-to-end runs of `trainer fit` on CPU: training, metrics, exact resume, crashes, signals, NaN.

A run that is killed (TRAINER_FAULT's SIGKILL points) or signalled runs in a process of its own (`python -m
trainer`); the others run in the test's process through trainer.cli.main, with the same exit codes and output."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import FAST, ROOT, cli, run_cli


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _fit(capsys, run_dir, *extra):
    """`trainer fit` in this process."""
    return cli(capsys, "fit", "configs/tiny.yaml", *FAST, f"run.dir={run_dir}", *extra)


def _fit_killed(run_dir, *extra, fault: str):
    """`trainer fit` in a process of its own, which TRAINER_FAULT=fault SIGKILLs."""
    return run_cli("fit", "configs/tiny.yaml", *FAST, f"run.dir={run_dir}", *extra, env={"TRAINER_FAULT": fault})


def test_fit_trains_and_writes_the_run_dir(tmp_path, capsys):
    r = _fit(capsys, tmp_path, "train.steps=30", "optim.lr=3e-3", "train.eval_every=15", "checkpoint.every=10")
    assert r.returncode == 0, r.stderr
    rows = _metrics(tmp_path)
    assert [x["step"] for x in rows if "loss" in x] == [1, 5, 10, 15, 20, 25, 30]  # the first step, then log.every
    for key in ("step", "loss", "lr", "tokens_per_s", "grad_norm", "step_time"):
        assert all(key in x for x in rows if "loss" in x), key
    assert "mfu" not in rows[0]  # no peak FLOP/s on CPU
    assert [x["step"] for x in rows if "val_loss" in x] == [15, 30]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5, rows  # from ~5.5 it falls fast at this lr
    assert (tmp_path / "config.yaml").read_text().count("lr: 0.003") == 1
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert ckpts == ["last", "step_000010", "step_000020", "step_000030"]
    assert (tmp_path / "checkpoints/last").read_text().strip() == "step_000030"
    assert "done: 30 steps" in r.stdout


def test_resume_is_bitwise_exact(tmp_path, capsys):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    common = ["train.steps=40", "log.every=1", "checkpoint.every=20", "train.eval_every=0", "model.dropout=0.1"]
    assert _fit(capsys, straight, *common).returncode == 0
    # The process dies (SIGKILL) right after the step-20 checkpoint; resume=last continues it (here, in this process:
    # tests/conftest.py gives both the same thread count).
    r = _fit_killed(broken, *common, fault="after_checkpoint:20")
    assert r.returncode == -signal.SIGKILL, r.stderr
    r = _fit(capsys, broken, *common, "resume=last")
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout
    a = {x["step"]: x["loss"] for x in _metrics(straight) if "loss" in x}
    b = {x["step"]: x["loss"] for x in _metrics(broken) if "loss" in x}
    assert sorted(b) == list(range(1, 41))
    for step in range(21, 41):
        assert a[step] == b[step], (step, a[step], b[step])  # bitwise: same floats, not merely close
    pa = torch.load(straight / "checkpoints/step_000040/model.pt", weights_only=True)
    pb = torch.load(broken / "checkpoints/step_000040/model.pt", weights_only=True)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_kill_during_checkpoint_write_keeps_the_previous_one(tmp_path, capsys, background):
    """SIGKILL between two files of the step-20 checkpoint (with checkpoint.async_save, in the writer thread while
    the steps go on): step 10 stays last, the torn write is cleaned up by the next start, and the resumed run's
    losses are an uninterrupted run's."""
    common = ["train.steps=30", "checkpoint.every=10", "checkpoint.keep=5", "log.every=1", "train.eval_every=0",
              f"checkpoint.async_save={str(background).lower()}"]  # fmt: skip
    r = _fit_killed(tmp_path / "run", *common, fault="checkpoint_write:20")
    assert r.returncode == -signal.SIGKILL
    root = tmp_path / "run" / "checkpoints"
    assert (root / "last").read_text().strip() == "step_000010"
    assert not (root / "step_000020").exists() and (root / ".tmp-step_000020").exists()
    r = _fit(capsys, tmp_path / "run", *common, "resume=auto")
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout and "step_000010" in r.stdout
    assert (root / "last").read_text().strip() == "step_000030"
    assert not (root / ".tmp-step_000020").exists()  # the torn write is cleaned up
    assert _fit(capsys, tmp_path / "straight", *common).returncode == 0
    a = {x["step"]: x["loss"] for x in _metrics(tmp_path / "straight") if "loss" in x}
    b = {x["step"]: x["loss"] for x in _metrics(tmp_path / "run") if "loss" in x}
    assert sorted(b) == list(range(1, 31)) and all(a[k] == b[k] for k in range(11, 31)), (a, b)


def _files(checkpoint) -> dict:
    skip = ("meta.json", "manifest.json")  # the config in meta.json, and so its checksum, differ by the key
    return {p.name: p.read_bytes() for p in sorted(checkpoint.iterdir()) if p.name not in skip}


def test_background_checkpoints_are_those_of_a_synchronous_run(tmp_path, capsys):
    """checkpoint.async_save: every checkpoint's files are byte for byte a synchronous run's (the copies keep the
    storages shared, their offsets, the objects met twice), meta.json differs only by the key and the run dir, and
    last and the pruning are the same."""
    common = ["train.steps=8", "checkpoint.every=2", "checkpoint.keep=3", "train.eval_every=0", "log.every=1"]
    assert _fit(capsys, tmp_path / "sync", *common, "checkpoint.async_save=false").returncode == 0
    r = _fit(capsys, tmp_path / "async", *common, "checkpoint.async_save=true")
    assert r.returncode == 0, r.stderr
    sync, background = tmp_path / "sync/checkpoints", tmp_path / "async/checkpoints"
    names = sorted(p.name for p in sync.iterdir())
    assert names == ["last", "step_000004", "step_000006", "step_000008"]
    assert names == sorted(p.name for p in background.iterdir())
    assert (background / "last").read_text() == (sync / "last").read_text()
    for name in names[1:]:
        assert _files(sync / name) == _files(background / name), name
        a, b = (json.loads((d / name / "meta.json").read_text()) for d in (sync, background))
        assert a["config"]["checkpoint"].pop("async_save") is False and b["config"]["checkpoint"].pop("async_save")
        a["config"]["run"].pop("dir"), b["config"]["run"].pop("dir")
        assert a == b, name
    losses = [[x["loss"] for x in _metrics(tmp_path / d) if "loss" in x] for d in ("sync", "async")]
    assert losses[0] == losses[1]


def test_background_fsdp_checkpoints_are_those_of_a_synchronous_run(tmp_path):
    """Under fsdp on 2 gloo ranks, checkpoint.async_save: DCP's shards staged by its stager and written by the
    threads over a gloo group of their own are byte for byte a synchronous run's (DCP's .metadata differs only by
    its checkpoint id and random save ids), as are the other files; a resume in one process reads it."""
    from torch.distributed.checkpoint import FileSystemReader

    from tests.conftest import torchrun

    def fit(name: str, *extra: str):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "trainer",
               "fit", "configs/tiny.yaml", *FAST, "model.n_layer=1", "distributed.strategy=fsdp", "train.steps=4",
               "checkpoint.every=2", "train.eval_every=0", f"run.dir={tmp_path / name}", *extra]  # fmt: skip
        r = torchrun(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr[-3000:]

    fit("sync")
    fit("async", "checkpoint.async_save=true")
    for step in ("step_000002", "step_000004"):
        a, b = tmp_path / "sync/checkpoints" / step, tmp_path / "async/checkpoints" / step
        names = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
        assert names == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
        for name in names:
            if name not in ("meta.json", "manifest.json", "dcp/.metadata"):
                assert (a / name).read_bytes() == (b / name).read_bytes(), (step, name)
        ma, mb = (FileSystemReader(str(d / "dcp")).read_metadata() for d in (a, b))
        assert ma.state_dict_metadata == mb.state_dict_metadata and ma.storage_data == mb.storage_data
    r = run_cli("fit", "configs/tiny.yaml", *FAST, "model.n_layer=1", "train.steps=5", "train.eval_every=0",
                f"run.dir={tmp_path / 'async'}", "checkpoint.async_save=true", "resume=last")  # fmt: skip
    assert r.returncode == 0 and "resumed from" in r.stdout and "step_000004" in r.stdout, r.stderr[-3000:]


def test_bad_checkpoints_exit_2_naming_the_file(tmp_path, capsys, monkeypatch):
    import io
    import struct
    import zipfile

    from trainer.checkpoint import integrity

    assert _fit(capsys, tmp_path, "train.steps=5").returncode == 0
    checkpoint = tmp_path / "checkpoints/step_000005"
    model_pt = checkpoint / "model.pt"
    data = model_pt.read_bytes()
    model_pt.write_bytes(data[: len(data) // 2])
    r = _fit(capsys, tmp_path, "train.steps=10", "resume=last")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    cut = f"model.pt is {len(data) // 2:,} bytes, its manifest says {len(data):,}"
    assert f"resume=last: no intact checkpoint in {checkpoint.parent}: step_000005 ({cut})" in r.stderr, r.stderr

    # Damaged inside, its size unchanged, and no checksum to find it (as for a file over CHECKSUM_MAX_BYTES): the
    # integrity check passes, the load fails: exit 2 with the reason in whole words.
    monkeypatch.setattr(integrity, "CHECKSUM_MAX_BYTES", 0)
    info = next(i for i in zipfile.ZipFile(io.BytesIO(data)).infolist() if i.filename.endswith("data.pkl"))
    name, extra = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])  # its local header's
    start = info.header_offset + 30 + name + extra
    model_pt.write_bytes(data[: start + 2] + b"\xff" * 8 + data[start + 10 :])  # opcodes after the protocol's
    integrity.write_manifest(checkpoint)
    r = _fit(capsys, tmp_path, "train.steps=10", "resume=last")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert (
        f"cannot load checkpoint file {model_pt}: its pickled data is corrupt (Unsupported operand 255)\n" in r.stderr
    )

    # A checkpoint file carrying a pickled object that runs code on load is refused, and the code never runs (its
    # manifest rewritten to match, as whoever planted it could).
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):  # called by torch.save: unpickling calls os.system("touch ...")
            return (os.system, (f"touch {marker}",))

    torch.save({"x": Evil()}, model_pt)
    integrity.write_manifest(checkpoint)
    assert not marker.exists()  # saving ran nothing
    r = _fit(capsys, tmp_path, "train.steps=10", "resume=last")
    assert r.returncode == 2, r.stderr
    assert "would run code" in r.stderr and str(model_pt) in r.stderr
    assert not marker.exists()


def test_resume_rejects_an_incompatible_config_and_reports_changes(tmp_path, capsys):
    assert _fit(capsys, tmp_path, "train.steps=5").returncode == 0
    r = _fit(capsys, tmp_path, "train.steps=10", "model.n_embd=64", "resume=last")
    assert r.returncode == 2 and "model.n_embd" in r.stderr and "incompatible" in r.stderr
    r = _fit(capsys, tmp_path, "train.steps=8", "optim.lr=1e-3", "resume=last")
    assert r.returncode == 0, r.stderr
    assert "changed on resume: optim.lr" in r.stdout and "train.steps: 5 -> 8" in r.stdout
    r = _fit(capsys, tmp_path / "fresh", "resume=last")
    assert r.returncode == 2 and "no complete checkpoint" in r.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_a_checkpoint_and_exits_cleanly(tmp_path, sig):
    cmd = [sys.executable, "-m", "trainer", "fit", "configs/tiny.yaml", *FAST, f"run.dir={tmp_path}",
           "train.steps=100000", "log.every=1"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        time.sleep(0.2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "saving a checkpoint" in out and "stopped by signal" in err, out + err
    last = (tmp_path / "checkpoints/last").read_text().strip()
    meta = json.loads((tmp_path / "checkpoints" / last / "meta.json").read_text())
    assert meta["step"] == _metrics(tmp_path)[-1]["step"] >= 3


def test_nan_loss_stops_without_overwriting_the_last_checkpoint(tmp_path, capsys):
    r = _fit(capsys, tmp_path, "train.steps=60", "checkpoint.every=2", "optim.lr=1e4", "optim.grad_clip=0",
             "schedule.warmup_steps=0", "log.every=1")  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "loss is nan" in r.stderr or "loss is inf" in r.stderr
    step = int(r.stderr.split(" at step ")[1].split(":")[0])
    last = (tmp_path / "checkpoints/last").read_text().strip()
    assert int(last.split("_")[1]) < step
    assert "Traceback" not in r.stderr


def test_tensorboard_and_plot(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert _fit(capsys, a, "train.steps=10", "log.tensorboard=true", "train.eval_every=5").returncode == 0
    assert list((a / "tb").glob("events.out.tfevents.*"))
    assert _fit(capsys, b, "train.steps=10", "optim.lr=1e-3", "run.name=slow").returncode == 0
    r = cli(capsys, "plot", str(a), str(b), "-o", str(tmp_path / "p.png"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = cli(capsys, "plot", str(tmp_path / "nope"))
    assert r.returncode == 2 and "no metrics.jsonl" in r.stderr


def test_wandb_gets_every_record_and_a_resume_continues_its_run(tmp_path, capsys, monkeypatch):
    """log.wandb=PROJECT: one W&B run per run directory (named for it, the run's config.yaml its config), each
    record's numbers at its step, finished at the end; a resume opens the same run (the same id, resume="allow").
    Without the package it exits 2 naming the key. A stand-in ``wandb`` module records the calls."""
    import types

    calls = []

    class Run:
        def log(self, values, step):
            calls.append(("log", step, values))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    common = ("train.steps=6", "log.wandb=proj", "log.every=2", "checkpoint.every=3", "train.eval_every=3")
    assert _fit(capsys, tmp_path, *common, "train.stop_at=3").returncode == 0
    assert _fit(capsys, tmp_path, *common, "resume=last").returncode == 0
    inits = [c[1] for c in calls if c[0] == "init"]
    assert len(inits) == 2 and inits[0]["id"] == inits[1]["id"] and inits[0]["resume"] == "allow"
    assert inits[0]["project"] == "proj" and inits[0]["name"] == tmp_path.name
    assert inits[0]["config"]["train"]["steps"] == 6 and inits[0]["dir"] == str(tmp_path)
    logged = {step: values for kind, step, values in (c for c in calls if c[0] == "log")}
    assert sorted(logged) == [1, 2, 3, 4, 6] and "val_loss" in logged[3] and "val_loss" in logged[6]
    assert logged[6]["train/loss"] == _metrics(tmp_path)[-1]["loss"]
    assert [c[0] for c in calls].count("finish") == 2
    monkeypatch.setitem(sys.modules, "wandb", None)  # an import of it fails
    r = _fit(capsys, tmp_path / "none", "train.steps=1", "log.wandb=proj")
    assert r.returncode == 2 and "log.wandb: proj: needs the wandb package" in r.stderr


def test_nan_skip_mode_skips_updates_and_finishes(tmp_path, capsys):
    r = _fit(capsys, tmp_path, "train.steps=30", "optim.lr=1e4", "optim.grad_clip=0", "schedule.warmup_steps=0",
             "train.on_nan=skip", "checkpoint.enabled=false")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "non-finite loss or gradient norm; update skipped" in r.stderr
    assert "done: 30 steps" in r.stdout


def test_a_run_that_stops_early_logs_its_last_step(tmp_path, capsys):
    # log.every=5 (FAST): step 11 is no log step, yet the run's last; metrics.jsonl and the summary end with it.
    r = _fit(capsys, tmp_path, "train.steps=20", "train.stop_at=11")
    assert r.returncode == 0, r.stderr
    rows = _metrics(tmp_path)
    assert [x["step"] for x in rows] == [1, 5, 10, 11]
    assert f"done: 11 steps | loss {rows[-1]['loss']:.4f} |" in r.stdout, r.stdout
    assert "stopped at train.stop_at at step 11" in r.stderr


def test_startup_warns_of_a_warm_up_longer_than_the_run_and_says_the_threads(tmp_path, capsys):
    r = _fit(capsys, tmp_path, "train.steps=20", "train.stop_at=1", "schedule.warmup_steps=500")
    assert r.returncode == 0, r.stderr
    # The last of 20 steps runs at lr_lambda(19) = 20 / 501 of optim.lr: 3.99%.
    said = "schedule.warmup_steps=500 is longer than train.steps=20: the learning rate reaches only 4% of optim.lr"
    assert r.stderr.count(said) == 1, r.stderr
    fits = _fit(capsys, tmp_path / "fits", "train.steps=2", "schedule.warmup_steps=2")
    assert fits.returncode == 0 and "is longer than train.steps" not in fits.stderr, fits.stderr
    # The startup line says how many threads torch runs and why (OMP_NUM_THREADS=1: tests/conftest.py sets it).
    assert "; threads: 1 of " in r.stdout and " cores (OMP_NUM_THREADS=1; train.threads sets it); " in r.stdout


def test_data_steps_pass_over_the_skipped_ranges():
    from trainer.data import data_step, merge_ranges

    skip = merge_ranges([[6, 6], [3, 4], [5, 5], [10, 12]])
    assert skip == [[3, 6], [10, 12]]
    assert [data_step(s, skip) for s in range(1, 8)] == [1, 2, 7, 8, 9, 13, 14]
    assert [data_step(s, []) for s in (1, 5)] == [1, 5]


def _spiked(capsys, run_dir, monkeypatch, *extra, fault="spike:15"):
    from trainer import faults

    monkeypatch.setattr(faults, "_FIRED", set())  # each run in this process fires its fault once
    common = ["train.steps=30", "checkpoint.every=10", "log.every=1", "train.eval_every=0", "train.spike_window=4"]
    return cli(capsys, "fit", "configs/tiny.yaml", *FAST, f"run.dir={run_dir}", *common, *extra,
               env={"TRAINER_FAULT": fault})  # fmt: skip


def test_a_rolled_back_spike_trains_as_a_run_that_skipped_its_batches(tmp_path, capsys, monkeypatch):
    """train.on_spike=rollback: a spike at step 15 goes back to the checkpoint of step 10 and passes over the batches
    of steps 11-15; the losses of steps 11-30 are those of a run given train.skip_batches=[[11,15]] from the start,
    bit for bit, and later checkpoints keep the range."""
    r = _spiked(capsys, tmp_path / "a", monkeypatch, "train.on_spike=rollback")
    assert r.returncode == 0, r.stderr
    said = "loss spike at step 15: "
    assert (
        r.stderr.count(said) == 1
        and "rolling back to" in r.stderr
        and "steps 11-15 (rollback 1 of at most 3)" in r.stderr
    )
    r = _spiked(capsys, tmp_path / "b", monkeypatch, "train.skip_batches=[[11,15]]", fault="")
    assert r.returncode == 0, r.stderr
    a, b = ({x["step"]: x["loss"] for x in _metrics(tmp_path / d) if "loss" in x} for d in ("a", "b"))
    assert sorted(a) == list(range(1, 31)) and all(a[s] == b[s] for s in range(1, 31)), (a, b)
    meta = json.loads((tmp_path / "a/checkpoints/step_000030/meta.json").read_text())
    assert meta["sampler"]["skip"] == [[11, 15]]
    starts = [json.loads(line)["resume"] for line in (tmp_path / "a/starts.jsonl").read_text().splitlines()]
    assert starts == [None, "rollback"]


def test_a_skipped_spike_leaves_the_model_and_optimizer_as_the_step_before(tmp_path, capsys, monkeypatch):
    """train.on_spike=skip: step 15's loss spikes; the step compares it with the limit before its update and skips
    the update. The checkpoint of step 15 holds the model and optimizer of step 14, bit for bit, and the run goes
    on; metrics count the skipped step and its tokens are not counted as seen."""
    extra = ("train.on_spike=skip", "checkpoint.keep=20", "checkpoint.every=1", "train.steps=16")
    r = _spiked(capsys, tmp_path, monkeypatch, *extra)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("step 15: loss spike: ") == 1 and "; update skipped" in r.stderr, r.stderr

    def load(step, name):
        return _tensors(torch.load(tmp_path / f"checkpoints/step_{step:06d}/{name}.pt", weights_only=False))

    for name in ("model", "optim"):
        assert load(14, name) and _equal(load(14, name), load(15, name)), name
    assert not _equal(load(15, "model"), load(16, "model"))  # step 16 trains again
    rows = [x for x in _metrics(tmp_path) if "loss" in x]
    assert rows[-1]["skipped_steps"] == 1 and rows[-1]["tokens"] == rows[0]["tokens"] * 15


def _tensors(tree) -> list:
    if isinstance(tree, torch.Tensor):
        return [tree]
    items = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list | tuple) else []
    return [t for x in items for t in _tensors(x)]


def _equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_spike_stops_the_run_by_default_and_past_max_rollbacks(tmp_path, capsys, monkeypatch):
    r = _spiked(capsys, tmp_path / "stop", monkeypatch)
    assert r.returncode == 1 and "loss spike at step 15: " in r.stderr and "train.on_spike=rollback" in r.stderr
    assert "Traceback" not in r.stderr
    r = _spiked(capsys, tmp_path / "most", monkeypatch, "train.on_spike=rollback", "train.max_rollbacks=0")
    assert r.returncode == 1 and "train.max_rollbacks=0 rollbacks made already" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_bf16_master_weights_train_and_resume_bit_for_bit(tmp_path, capsys):
    """optim.master_weights=bf16: the parameters and AdamW's states are bf16 in the checkpoint, and a run stopped at
    step 3 and resumed ends as the run that was not stopped, bit for bit (the stochastic rounding's random bits are
    a function of the step)."""
    common = ["optim.master_weights=bf16", "train.precision=bf16", "train.steps=6", "checkpoint.every=3",
              "log.every=1", "train.eval_every=0", "schedule.warmup_steps=0", "optim.lr=3e-3"]  # fmt: skip
    assert _fit(capsys, tmp_path / "whole", *common).returncode == 0
    r = _fit(capsys, tmp_path / "cut", *common, "train.stop_at=3")
    assert r.returncode == 0, r.stderr
    r = _fit(capsys, tmp_path / "cut", *common, "resume=last")
    assert r.returncode == 0 and "triton adamw" in r.stdout + r.stderr, r.stderr
    a, b = ({x["step"]: x["loss"] for x in _metrics(tmp_path / d) if "loss" in x} for d in ("whole", "cut"))
    assert sorted(a) == sorted(b) == list(range(1, 7)) and a == b, (a, b)
    model = torch.load(tmp_path / "whole/checkpoints/step_000006/model.pt", weights_only=True)
    optim = torch.load(tmp_path / "whole/checkpoints/step_000006/optim.pt", weights_only=True)
    states = [t for s in optim["optimizer"]["state"].values() for k, t in s.items() if k != "step"]
    assert {t.dtype for t in model.values() if t.is_floating_point()} == {torch.bfloat16}
    assert states and {t.dtype for t in states} == {torch.bfloat16}


@pytest.mark.parametrize(
    "override, said",
    [
        ("optim.impl=fused", "optim.master_weights=bf16: needs optim.impl auto or triton"),
        ("optim.name=sgd", "optim.master_weights=bf16: needs optim.name adamw or adam"),
        ("train.precision=fp32", "optim.master_weights=bf16: needs train.precision bf16"),
    ],
)
def test_bf16_master_weights_refuse_what_cannot_round_them(tmp_path, capsys, override, said):
    r = _fit(capsys, tmp_path, "optim.master_weights=bf16", override)
    assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr
