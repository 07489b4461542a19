"""torch's intra-op threads for a run's process: ``train.threads``, else ``OMP_NUM_THREADS``, else on the CPU the
cores that other work leaves idle.

torch starts one intra-op thread per core whatever else runs there, and beside other busy processes those threads
wait on each other: on 2 cores at a load of about 3.5, a step of configs/tiny.yaml took 1.7-2.4 s against 0.23 s
alone. A run on the CPU that sets neither takes (:func:`busy_cores`, :func:`cpu_threads`)

    threads = max(1, (usable - busy) // local_ranks)

- ``usable``: the cores this process may run on (its affinity mask, else the machine's count);
- ``busy``: the cores other work keeps busy, rounded: the 1-minute load average less what this job's own processes
  added to it while they started, but no more than the cores busy right now (a quarter-second sample of
  ``/proc/stat``: the average lags, and a run that ended a moment ago still weighs in it for a minute), each taken as
  spread evenly over the machine's cores;
- ``local_ranks``: torchrun's ``LOCAL_WORLD_SIZE``, the processes of this job on this machine, which share the cores.

``OMP_NUM_THREADS`` set by the user is kept; the ``1`` torchrun gives its workers when it is unset is not (torchrun's
own environment, as it started, tells the two apart). On CUDA torch's default stays: the host threads only feed the
GPU.
"""

from __future__ import annotations

import math
import os
import time

import torch

WINDOW_S = 0.25  # the sample of the cores busy now: 25 clock ticks per core at Linux's 100 Hz


def cpu_threads(usable: int, busy: int, local_ranks: int = 1) -> int:
    """Intra-op threads for each of ``local_ranks`` processes sharing ``usable`` cores, ``busy`` of them kept busy by
    other work: the idle cores shared out, at least one thread each."""
    return max(1, (usable - busy) // max(local_ranks, 1))


def busy_cores(load: float | None, usable: int, machine: int, own: float = 0.0, busy_now: float | None = None) -> int:
    """Of the ``usable`` cores, how many other work keeps busy.

    Args:
        load: the machine's 1-minute load average (None where the system has none: no core counts as busy).
        usable: the cores this process may run on.
        machine: the machine's cores, over which ``load`` and ``busy_now`` are spread evenly.
        own: the part of ``load`` that is this job's own processes.
        busy_now: the machine's cores busy right now, if known: a bound on what the lagging average claims.
    """
    if load is None:
        return 0
    others = max(0.0, load - own)
    if busy_now is not None:
        others = min(others, busy_now)
    busy = math.floor(others * usable / max(machine, usable) + 0.5)  # rounded half up: 1.5 busy cores count as 2
    return min(busy, usable)


def set_threads(setting: int | None, device: torch.device, environ=os.environ) -> str | None:
    """Set torch's intra-op threads for this process: ``setting`` (``train.threads``) if given, else on the CPU the
    rule above unless the user set ``OMP_NUM_THREADS``. Returns the startup line's part that says how many and why
    (None off the CPU)."""
    usable = usable_cores()
    if setting is not None:
        torch.set_num_threads(setting)
        return f"threads: {setting} of {usable} cores (train.threads)" if device.type == "cpu" else None
    if device.type != "cpu":
        return None
    if (omp := user_omp_threads(environ)) is not None:
        return f"threads: {torch.get_num_threads()} of {usable} cores (OMP_NUM_THREADS={omp}; train.threads sets it)"
    local = int(environ.get("LOCAL_WORLD_SIZE") or 1)
    machine = os.cpu_count() or usable
    load = load_average()
    # Each of this job's processes, running since it started, weighs in the 1-minute average as 1 - e^(-age / 60).
    own = local * (1 - math.exp(-process_age_s() / 60))
    busy = by_average = busy_cores(load, usable, machine, own)
    now = None
    if by_average:  # the average says some are busy: a sample says whether they still are
        now = cores_busy_now(machine)
        busy = busy_cores(load, usable, machine, own, now)
    n = cpu_threads(usable, busy, local)
    torch.set_num_threads(n)
    shared = f" for each of {local} local ranks" if local > 1 else ""
    if load is None:
        why = "no load average on this system"
    else:
        why = f"load {load:.1f}" + (f", {now:.1f} cores busy now" if busy < by_average else "")
        why += f": {busy} busy with other work" if busy else ": none busy with other work"
    return f"threads: {n} of {usable} cores{shared} ({why}; train.threads sets it)"


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask where the system has one, else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows
        return os.cpu_count() or 1


def user_omp_threads(environ=os.environ, launcher: str | None = None) -> str | None:
    """``OMP_NUM_THREADS`` as the user set it; None where unset or set by torchrun. torchrun sets ``1`` for its
    workers where the variable is unset, in its own process after it started: its environment as it started
    (``launcher``: ``/proc/PID/environ`` of this worker's parent, torchrun) then does not hold the variable. Where
    that cannot be read, the value counts as the user's."""
    value = environ.get("OMP_NUM_THREADS")
    if value != "1" or "TORCHELASTIC_RUN_ID" not in environ:
        return value
    try:
        with open(launcher or f"/proc/{os.getppid()}/environ", "rb") as f:
            launcher = f.read().split(b"\0")
    except OSError:
        return value
    return value if any(item.startswith(b"OMP_NUM_THREADS=") for item in launcher) else None


def load_average() -> float | None:
    """The machine's 1-minute load average: the processes running or waiting to run, averaged; None without one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows
        return None


def process_age_s() -> float:
    """Seconds since this process started (``/proc/self/stat`` against ``/proc/uptime``); 0 without /proc."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rpartition(")")[2].split()[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
        with open("/proc/uptime") as f:
            return max(0.0, float(f.read().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return 0.0


def cores_busy_now(machine: int, window_s: float = WINDOW_S) -> float | None:
    """The machine's cores busy over the next ``window_s`` seconds, this process asleep (``/proc/stat``'s counters of
    time each state took); None without /proc."""

    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        return sum(ticks), ticks[3] + ticks[4]

    try:
        total, idle = read()
        time.sleep(window_s)
        total2, idle2 = read()
    except (OSError, ValueError):
        return None
    if total2 <= total:
        return None
    return machine * (1 - (idle2 - idle) / (total2 - total))
