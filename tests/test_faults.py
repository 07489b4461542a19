"""Faults under torchrun (2 gloo ranks on CPU; 2 NCCL ranks on 2 GPUs) and in one process: a rank killed, a rank
raising, a NaN loss on one rank, a full disk during a checkpoint, a hung rank. Each ends the run promptly, with one
message that names the rank or the file, and leaves the last checkpoint and the metrics usable."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import FAST, ROOT, rank_process, torchrun

SHAPE = [f for f in FAST if not f.startswith(("train.micro_batch_size", "model.n_layer"))] + ["model.n_layer=1"]
DDP = [*SHAPE, "train.micro_batch_size=2", "distributed.strategy=ddp", "log.every=1", "train.eval_every=0"]


# The same faults on 2 gloo ranks (CPU) and on 2 NCCL ranks (2 GPUs; eager: the faults do not depend on compiling).
DEVICES = [pytest.param("cpu", id="gloo"), pytest.param("cuda", id="nccl", marks=pytest.mark.multi_gpu)]
ON = {"cpu": [], "cuda": ["train.device=cuda", "compile.enabled=false", "compile.cudagraphs=false"]}


def _env(**extra: str) -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra}


def _torchrun_cmd(device: str, *args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "trainer",
            "fit", "configs/tiny.yaml", *DDP, *ON[device], *args]  # fmt: skip


def _torchrun(device: str, *args, fault: str, timeout=180) -> tuple[subprocess.CompletedProcess, float]:
    """Two ranks with ``TRAINER_FAULT=fault`` (see trainer.faults.fault_point); the result and its seconds."""
    start = time.monotonic()
    r = torchrun(_torchrun_cmd(device, *args), timeout=timeout, env=_env(TRAINER_FAULT=fault))
    return r, time.monotonic() - start


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _last(run_dir) -> str:
    return (run_dir / "checkpoints" / "last").read_text().strip()


@pytest.mark.parametrize("device", DEVICES)
def test_sigkill_of_one_rank_stops_the_other_naming_it(tmp_path, device):
    """Rank 1 SIGKILLed mid-run (by the test, at whatever point of its step it is): rank 0 stops within seconds
    instead of waiting for the collective timeout; torchrun's report names rank 1 as the cause. With gloo rank 0
    sees the closed connection and says so itself; with NCCL it waits inside the collective until torchrun, which
    saw rank 1 die, ends it."""

    proc = subprocess.Popen(_torchrun_cmd(device, "train.steps=100000", f"run.dir={tmp_path}"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())  # fmt: skip
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 5):
        time.sleep(0.1)
    rank1 = rank_process(proc, 1)
    killed = time.monotonic()
    rank1.send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    seconds = time.monotonic() - killed
    print(f"SIGKILL of rank 1 ({device}) -> torchrun exited after {seconds:.2f} s")
    assert proc.returncode != 0
    assert seconds < 60, seconds  # observed ~0.3 s on 2 CPU cores (gloo sees the closed connection at once)
    if device == "cpu":
        assert f"trainer: rank 0: lost rank 1 (pid {rank1.pid} " in err, err[-3000:]
        assert "[rank0]: Traceback" not in err  # rank 0 stops with a message, not gloo's traceback
    root_cause = err.split("Root Cause")[-1]
    assert "rank      : 1 (local_rank: 1)" in root_cause and "SIGKILL" in root_cause, root_cause
    assert _rows(tmp_path)[-1]["step"] >= 5


@pytest.mark.parametrize("device", DEVICES)
def test_exception_on_one_rank_ends_the_job_with_its_message(tmp_path, device):
    r, seconds = _torchrun(device, "train.steps=20", f"run.dir={tmp_path}", fault="raise:3@1")
    print(f"RuntimeError on rank 1 ({device}) -> torchrun exited after {seconds:.2f} s (start-up included)")
    assert r.returncode != 0
    assert "[rank1]: RuntimeError: injected fault on rank 1 at step 3" in r.stderr, r.stderr[-3000:]
    if device == "cpu":  # rank 0 says why it stopped, not a gloo traceback (NCCL: torchrun ends rank 0)
        assert "trainer: rank 0: lost rank 1 " in r.stderr
        assert "[rank0]: Traceback" not in r.stderr
    assert "rank      : 1 (local_rank: 1)" in r.stderr.split("Root Cause")[-1]
    assert max(row["step"] for row in _rows(tmp_path)) == 2


@pytest.mark.parametrize("device", DEVICES)
def test_nan_loss_on_one_rank_stops_every_rank_at_that_step(tmp_path, device):
    """Rank 1's loss is NaN at step 5 (rank 0's is not): both stop at step 5 with one message, the checkpoint of
    step 4 stays last. Without agreement rank 1 stops alone and rank 0 fails in its next collective."""
    args = ("train.steps=20", "checkpoint.every=2", f"run.dir={tmp_path}")
    r, seconds = _torchrun(device, *args, fault="nan_loss:5@1")
    print(f"NaN loss on rank 1 ({device}) -> torchrun exited after {seconds:.2f} s (start-up included)")
    assert r.returncode != 0
    err = r.stderr
    assert err.count("loss is nan at step 5: stopping without saving") == 1, err[-3000:]
    assert "(rank 1 of 2; every rank stops at this step)" in err
    assert "lost rank" not in err and "[rank0]: Traceback" not in err and "[rank1]: Traceback" not in err, err
    assert _last(tmp_path) == "step_000004"
    assert max(row["step"] for row in _rows(tmp_path)) == 4


def test_a_wrong_sum_of_the_losses_stops_the_run_naming_it(tmp_path):
    """Rank 1 receives every rank's step-5 losses 4 times over (as from a collective that summed wrongly): its own
    slot is not its own loss, so it stops the job with the numbers. Rank 0, which received the right sums, logged
    step 5 and no later one. (Gloo; the check itself is exact on any backend: one rank's loss plus zeros.)"""
    r, _ = _torchrun("cpu", "train.steps=20", "log.every=1", f"run.dir={tmp_path}", fault="wrong_sum:5@1")
    assert r.returncode != 0
    err = r.stderr
    assert err.count("step 5: the all-reduce of every rank's loss gave") == 1, err[-3000:]
    assert "for rank 1, whose own loss is" in err and "A collective returned a wrong sum" in err
    assert "[rank1]: Traceback" not in err, err[-3000:]
    print(err[-1500:])
    assert max(row["step"] for row in _rows(tmp_path)) == 5


def test_replicas_that_differ_stop_every_rank_before_the_checkpoint(tmp_path):
    """Rank 1's parameters move at step 4, a checkpoint step: the ranks compare their parameters' fingerprints
    there, all stop with one message naming rank 1, and the step-2 checkpoint stays the last."""
    r, _ = _torchrun("cpu", "train.steps=20", "checkpoint.every=2", f"run.dir={tmp_path}", fault="replica_drift:4@1")
    assert r.returncode != 0
    err = r.stderr
    assert err.count("step 4: the data-parallel replicas' parameters differ: rank(s) 1 against rank 0") == 1, err[
        -3000:
    ]
    assert "stopping without saving" in err and "[rank0]: Traceback" not in err and "[rank1]: Traceback" not in err
    assert _last(tmp_path) == "step_000002"


def test_disk_full_during_a_checkpoint_keeps_the_last_one(tmp_path, capsys, monkeypatch):
    """One process: ENOSPC while writing the step-20 checkpoint: exit 1 naming the file, step 10 stays last, the
    partial checkpoint is gone; resume=last continues from step 10 and drops the metrics rows past it."""
    from trainer.cli import main

    common = ["fit", "configs/tiny.yaml", *SHAPE, "train.steps=30", "checkpoint.every=10", "train.eval_every=0",
              f"run.dir={tmp_path}"]  # fmt: skip
    monkeypatch.setenv("TRAINER_FAULT", "disk_full:20")
    start = time.monotonic()
    assert main(common) == 1
    print(f"ENOSPC at the step-20 checkpoint -> exit 1 after {time.monotonic() - start:.2f} s")
    err = capsys.readouterr().err
    optim = tmp_path / "checkpoints" / ".tmp-step_000020" / "optim.pt"
    assert f"cannot save the checkpoint of step 20: [Errno 28] No space left on device: '{optim}'" in err, err
    assert f"the last checkpoint is still {tmp_path / 'checkpoints' / 'step_000010'}" in err
    assert "Traceback" not in err
    assert _last(tmp_path) == "step_000010"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last", "step_000010"]
    assert max(row["step"] for row in _rows(tmp_path)) == 20
    assert not (tmp_path / ".lock").exists()  # released on the way out

    monkeypatch.delenv("TRAINER_FAULT")
    assert main([*common, "resume=last"]) == 0
    assert "metrics.jsonl: dropped 2 rows (steps 15-20) past step 10" in capsys.readouterr().err
    steps = [row["step"] for row in _rows(tmp_path)]
    assert steps == [1, 5, 10, 11, 15, 20, 25, 30]  # the first step logged, log.every=5: increasing, no repeats


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rank", [0, 1])
def test_disk_full_on_one_rank_stops_both_cleanly(tmp_path, rank, device, background):
    """Two ranks: ENOSPC on one rank's file of the step-4 checkpoint: both stop with one message naming that
    file; step 2 stays last. Written in the background (checkpoint.async_save), the failure stops both ranks at
    the next save, each rank's writer having ended."""
    args = ("train.steps=8", "checkpoint.every=2", f"run.dir={tmp_path}", f"checkpoint.async_save={background}")
    r, seconds = _torchrun(device, *args, fault=f"disk_full:4@{rank}")
    print(f"ENOSPC on rank {rank} ({device}) -> torchrun exited after {seconds:.2f} s (start-up included)")
    assert r.returncode != 0
    name = "optim.pt" if rank == 0 else "rng_rank1.pt"  # the main rank's last file; rank 1 writes one file
    path = tmp_path / "checkpoints" / ".tmp-step_000004" / name
    assert r.stderr.count(f"No space left on device: '{path}' (rank {rank})") == 1, r.stderr[-3000:]
    assert "lost rank" not in r.stderr and "[rank0]: Traceback" not in r.stderr and "[rank1]: Traceback" not in r.stderr
    assert _last(tmp_path) == "step_000002"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last", "step_000002"]


HUNG = """
import os, pathlib, sys, time, torch, torch.distributed as dist
from trainer.distributed import env as dist_env
from trainer.errors import TrainingError

# Both ranks done importing before the process group starts: its start waits distributed.timeout_s too (1 s), and
# one rank's imports can take a second longer than the other's on busy cores.
here = pathlib.Path(__file__).parent
(here / f"ready{os.environ['RANK']}").touch()
while not all((here / f"ready{r}").exists() for r in range(int(os.environ["WORLD_SIZE"]))):
    time.sleep(0.01)
env = dist_env.setup("cpu", "gloo", timeout_s=float(sys.argv[1]))
if env.rank == 1:
    time.sleep(4)  # hung: alive, but not in the collective
else:
    start = time.monotonic()
    try:
        with dist_env.lost_rank_stops(env, float(sys.argv[1]), TrainingError):
            dist.all_reduce(torch.ones(1))
    except TrainingError as e:
        print(f"stopped after {time.monotonic() - start:.1f} s: {e}", flush=True)
dist_env.teardown(env)
dist_env.exit_code(0)
"""


def test_a_hung_rank_fails_the_collective_after_distributed_timeout_s(tmp_path):
    """distributed.timeout_s reaches the process group: a rank waiting for a hung one stops after it, saying so."""
    script = tmp_path / "hung.py"
    script.write_text(HUNG)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), "1"]
    start = time.monotonic()
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    r = torchrun(cmd, timeout=120, env=_env(PYTHONPATH=path))
    assert r.returncode == 0, r.stderr[-3000:]
    line = next((x for x in r.stdout.splitlines() if x.startswith("stopped after ")), r.stdout)
    assert "rank 0: a collective waited longer than distributed.timeout_s=1 s" in line, line
    print(f"distributed.timeout_s=1, a rank hung for 4 s: {line[:22]}; torchrun exited after "
          f"{time.monotonic() - start:.1f} s (start-up included)")  # fmt: skip


@pytest.mark.parametrize("backend, failed, want", [("nccl", True, "abort"), ("nccl", False, "destroy"),
                                                   ("gloo", True, "destroy")])  # fmt: skip
def test_a_failed_nccl_run_aborts_its_process_group(monkeypatch, backend, failed, want):
    """Destroying an NCCL group waits for its unfinished collectives (a lost peer's never finish): after a failure
    the group is aborted. gloo has no abort; its destroy returns."""
    import torch
    import torch.distributed as dist

    from trainer.distributed import env as dist_env

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: calls.append("destroy"))
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda *a: calls.append("abort"))
    env = dist_env.DistEnv(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"), backend=backend)
    dist_env.teardown(env, failed=failed)
    assert calls == [want]


def test_a_rank_that_lost_a_local_peer_waits_for_torchrun_to_end_it():
    """await_launcher: under torchrun, SIGTERM ends the waiting process at once, whatever handler the run had
    installed; outside torchrun it returns without waiting."""
    code = ("import signal, sys\nfrom trainer.distributed.env import await_launcher\n"
            "signal.signal(signal.SIGTERM, lambda *a: None)  # the run's stop-signal handler: it would not exit\n"
            "print('waiting', flush=True)\nawait_launcher(wait_s=60)\nprint('returned', flush=True)\n")  # fmt: skip
    env = {k: v for k, v in _env(PYTHONPATH=str(ROOT)).items() if k != "TORCHELASTIC_RUN_ID"}
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["waiting", "returned"] and time.monotonic() - start < 30
    proc = subprocess.Popen([sys.executable, "-c", code], env={**env, "TORCHELASTIC_RUN_ID": "test"},
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "waiting"
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert proc.stdout.read() == ""


def test_a_lost_rank_is_said_when_found_not_on_the_way_out(capsys, monkeypatch):
    """The message naming the lost rank is printed inside lost_rank_stops, before the run's teardown: torchrun, which
    saw that rank exit, may end this one at any moment after. The CLI then does not print it twice."""
    import socket

    from trainer import cli
    from trainer.distributed import env as dist_env
    from trainer.errors import TrainingError

    monkeypatch.setenv("RANK", "0")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    env = dist_env.DistEnv(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"), backend="gloo",
                           peers=[(socket.gethostname(), os.getpid()), (socket.gethostname(), dead.pid)])  # fmt: skip
    with pytest.raises(TrainingError) as info:
        with dist_env.lost_rank_stops(env, 5.0, TrainingError):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")
    said = capsys.readouterr().err
    assert f"trainer: rank 0: lost rank 1 (pid {dead.pid} on {socket.gethostname()}): its process exited" in said
    assert info.value.reported and info.value.peer_exited
    cli._user_error(info.value, prefix="trainer")
    assert capsys.readouterr().err == ""


def test_torchruns_sigterm_while_a_rank_names_the_lost_one_is_noted_not_handled_as_a_stop(monkeypatch):
    """torchrun ends the other ranks once it sees one exit: a SIGTERM that comes while this rank works out which
    rank it lost is noted (the launcher need not be waited for), neither killing it before it says so nor starting
    the run's finish-the-step-and-save; after the message SIGTERM has its default action."""
    import signal as sig

    from trainer.distributed import env as dist_env
    from trainer.errors import TrainingError

    def lost_peer(e, env, timeout_s):
        os.kill(os.getpid(), sig.SIGTERM)  # torchrun's, arriving now
        time.sleep(0.1)
        return "rank 0: lost rank 1 (pid 1 on h): its process exited; stopping.", True

    monkeypatch.setattr(dist_env, "lost_peer", lost_peer)
    env = dist_env.DistEnv(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"), backend="gloo")
    stops = []
    before = sig.signal(sig.SIGTERM, lambda *a: stops.append(1))  # the run's StopSignals
    try:
        with pytest.raises(TrainingError) as info:
            with dist_env.lost_rank_stops(env, 5.0, TrainingError):
                raise RuntimeError("gloo: Connection closed by peer")
        assert info.value.terminated and not stops
        assert sig.getsignal(sig.SIGTERM) is sig.SIG_DFL
    finally:
        sig.signal(sig.SIGTERM, before)


def test_a_spike_on_one_rank_rolls_back_every_rank(tmp_path):
    """train.on_spike=rollback on 2 gloo ranks: rank 1's loss spikes at step 15. The loss each rank compares is the
    mean over the ranks, so both roll back to step 10 at the same step, pass over the batches of steps 11-15, and
    end as a 2-rank run given train.skip_batches=[[11,15]] from the start."""
    args = ("train.steps=30", "checkpoint.every=10", "train.spike_window=4")
    r, _ = _torchrun("cpu", *args, "train.on_spike=rollback", f"run.dir={tmp_path / 'a'}", fault="spike:15@1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("loss spike at step 15: ") == 1, r.stderr[-3000:]  # said by rank 0
    r = torchrun(_torchrun_cmd("cpu", *args, "train.skip_batches=[[11,15]]", f"run.dir={tmp_path / 'b'}"), env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = ({row["step"]: row["loss"] for row in _rows(tmp_path / d) if "loss" in row} for d in "ab")
    assert sorted(a) == list(range(1, 31)) and a == b, (a, b)


def test_a_spike_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """train.on_spike=skip on 2 gloo ranks under ddp: rank 1's loss spikes at step 15. Each rank compares the mean
    over the ranks before its update, so both skip it (had one applied it, the replicas would differ at the next
    checkpoint's comparison and the run would stop), and the run ends."""
    args = ("train.steps=20", "checkpoint.every=10", "train.spike_window=4", "train.on_spike=skip")
    r, _ = _torchrun("cpu", *args, f"run.dir={tmp_path}", fault="spike:15@1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("step 15: loss spike: ") == 1, r.stderr[-3000:]  # said by rank 0
    last = [row for row in _rows(tmp_path) if "loss" in row][-1]
    assert last["step"] == 20 and last["skipped_steps"] == 1


def test_a_rank_waiting_on_a_lost_rank_exits_at_torchruns_sigterm(tmp_path):
    """Rank 1 is SIGKILLed at step 10 while rank 0 waits for good in its main thread (as a rank waiting on the device
    for a collective with the lost rank does: the Python handler never runs). torchrun sends rank 0 SIGTERM to end
    the job; rank 0 sees that rank 1 exited, says so and exits at once, not after torchrun's 30 s shutdown timeout."""
    args = ("train.steps=30", "checkpoint.every=5", f"run.dir={tmp_path}")
    r, _ = _torchrun("cpu", *args, fault="kill:10@1,hang:10@0", timeout=120)
    ended = time.time()
    hung = [float(line.rsplit(" at ", 1)[1]) for line in r.stderr.splitlines() if line.startswith("injected hang")]
    assert r.returncode != 0 and len(hung) == 1, r.stderr[-3000:]
    assert "trainer: rank 0: lost rank 1 (pid " in r.stderr and "exiting now" in r.stderr, r.stderr[-3000:]
    assert ended - hung[0] < 15, (ended - hung[0], r.stderr[-3000:])  # torchrun's timeout alone is 30 s


@pytest.mark.parametrize("under_torchrun", [True, False])
def test_a_torchrun_worker_on_its_way_out_keeps_its_exit_code_at_torchruns_sigterm(under_torchrun):
    """torchrun SIGTERMs every rank once one exits: a rank that had decided to exit 2 (a config error every rank
    found) then still exits 2, not -15. Outside torchrun the signal is left alone."""
    code = (
        "import os, signal, time\n"
        "from trainer.cli import _exit_on_sigterm\n"
        "_exit_on_sigterm(2)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(30)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    if under_torchrun:
        env["TORCHELASTIC_RUN_ID"] = "test"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, timeout=60)
    assert r.returncode == (2 if under_torchrun else -signal.SIGTERM)
