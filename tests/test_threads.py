"""torch's threads for a run on the CPU: the rule (cores, load -> threads), the OMP_NUM_THREADS a user set against
the one torchrun sets, and what the startup line says. The rule's inputs are given, not read from this machine."""

import os

import pytest
import torch

from trainer import threads
from trainer.threads import busy_cores, cpu_threads, set_threads, user_omp_threads


@pytest.mark.parametrize(
    "usable, load, kwargs, expected",
    [
        (2, 0.1, {}, 2),  # idle: every core
        (2, 3.5, {}, 1),  # the slow case: busier than the cores, one thread still
        (2, 1.4, {}, 1),  # one core busy with other work
        (2, 0.5, {}, 1),  # half a core rounds up
        (2, 0.4, {}, 2),
        (16, 4.4, {}, 12),
        (8, None, {}, 8),  # no load average on this system
        (8, 2.3, {"own": 2.0}, 8),  # what this job's own processes added while starting is not other work
        (8, 6.0, {"busy_now": 0.2}, 8),  # a run that ended a moment ago still weighs in the 1-minute average
        (8, 6.0, {"busy_now": 7.9}, 2),
        (2, 40.0, {"machine": 64}, 1),  # 2 of a machine's 64 cores: 40 / 32 of a core busy on them
        (2, 10.0, {"machine": 64}, 2),
    ],
)
def test_threads_are_the_cores_other_work_leaves_idle(usable, load, kwargs, expected):
    machine = kwargs.pop("machine", usable)
    assert cpu_threads(usable, busy_cores(load, usable, machine, **kwargs)) == expected


def test_local_ranks_share_the_idle_cores():
    assert cpu_threads(8, 0, local_ranks=2) == 4
    assert cpu_threads(8, 3, local_ranks=2) == 2
    assert cpu_threads(8, 0, local_ranks=3) == 2
    assert cpu_threads(2, 0, local_ranks=4) == 1  # more ranks than cores: one thread each


def _environ(tmp_path, *items: str) -> str:
    path = tmp_path / "environ"
    path.write_bytes(b"\0".join(item.encode() for item in items) + b"\0")
    return str(path)


def test_omp_num_threads_is_kept_where_the_user_set_it_not_where_torchrun_did(tmp_path):
    assert user_omp_threads({}) is None
    assert user_omp_threads({"OMP_NUM_THREADS": "3"}) == "3"
    assert user_omp_threads({"OMP_NUM_THREADS": "1"}) == "1"  # no torchrun: the user's
    worker = {"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2"}
    torchrun_set_it = _environ(tmp_path, "PATH=/bin", "HOME=/root")
    assert user_omp_threads(worker, launcher=torchrun_set_it) is None
    user_set_it = _environ(tmp_path, "PATH=/bin", "OMP_NUM_THREADS=1")
    assert user_omp_threads(worker, launcher=user_set_it) == "1"
    assert user_omp_threads(worker, launcher=str(tmp_path / "unreadable")) == "1"


@pytest.fixture
def restore_threads():
    """torch's thread count as the test found it, afterwards (through the real setter, should a test replace it)."""
    saved, setter = torch.get_num_threads(), torch.set_num_threads
    yield
    setter(saved)


def _machine(monkeypatch, usable=2, load=3.5, busy_now=2.0):
    """This process sees ``usable`` cores of a machine of as many, a 1-minute load of ``load`` and ``busy_now``."""
    monkeypatch.setattr(threads, "usable_cores", lambda: usable)
    monkeypatch.setattr(os, "cpu_count", lambda: usable)
    monkeypatch.setattr(threads, "load_average", lambda: load)
    monkeypatch.setattr(threads, "cores_busy_now", lambda machine: busy_now)
    monkeypatch.setattr(threads, "process_age_s", lambda: 0.0)


def test_a_cpu_run_takes_the_idle_cores_and_says_why(monkeypatch, restore_threads):
    _machine(monkeypatch)
    cpu = torch.device("cpu")
    note = set_threads(None, cpu, environ={})
    assert note == "threads: 1 of 2 cores (load 3.5: 2 busy with other work; train.threads sets it)"
    assert torch.get_num_threads() == 1
    _machine(monkeypatch, load=1.9, busy_now=0.1)  # the load of a run that just ended
    note = set_threads(None, cpu, environ={"LOCAL_WORLD_SIZE": "2"})
    assert note == (
        "threads: 1 of 2 cores for each of 2 local ranks (load 1.9, 0.1 cores busy now: none busy with other work; "
        "train.threads sets it)"
    )
    _machine(monkeypatch, load=0.2)
    assert set_threads(None, cpu, environ={}).startswith("threads: 2 of 2 cores (load 0.2: none busy")
    assert torch.get_num_threads() == 2
    assert set_threads(1, cpu, environ={}) == "threads: 1 of 2 cores (train.threads)"
    assert torch.get_num_threads() == 1


def test_omp_num_threads_and_cuda_keep_torchs_count(monkeypatch, restore_threads):
    _machine(monkeypatch, load=0.0)

    def refuse(n):
        raise AssertionError(f"set_num_threads({n}) where torch's count stays")

    monkeypatch.setattr(torch, "set_num_threads", refuse)
    note = set_threads(None, torch.device("cpu"), environ={"OMP_NUM_THREADS": "2"})
    assert note == f"threads: {torch.get_num_threads()} of 2 cores (OMP_NUM_THREADS=2; train.threads sets it)"
    assert set_threads(None, torch.device("cuda"), environ={}) is None
