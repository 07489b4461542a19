"""The step timer (trainer.metrics.StepTimer): on CUDA a step's time is the GPU's, between the events recorded after
each step, whenever the host reads it."""

import time

import torch

from trainer.metrics import StepTimer


class FakeEvent:
    """A CUDA event that completed at ``at`` seconds of GPU time."""

    now = 0.0

    def __init__(self, enable_timing=True, at=None):
        self.at = at

    def record(self):
        self.at = FakeEvent.now

    def elapsed_time(self, end):  # milliseconds, as torch.cuda.Event's
        return (end.at - self.at) * 1e3


def test_a_step_is_timed_from_the_gpu_events_not_from_when_the_host_reads_it(monkeypatch):
    """Steps of 2 s on the GPU, read by the host at uneven times (the last one 0.1 s after the one before it, as a
    step whose launch waited on the GPU leaves it): every step measures 2 s."""
    timer = StepTimer()
    timer.tick(100, first=True, event=FakeEvent(at=10.0))  # the compile step: the host's clock, its row read alone
    timer.read()
    for k in range(1, 4):
        timer.tick(100, first=False, event=FakeEvent(at=10.0 + 2 * k))
        time.sleep(0.001 if k < 3 else 0.0)
    tps, step_s = timer.read()
    assert (tps, step_s) == (50.0, 2.0)
    assert timer.median_step_s == 2.0 and timer.mean_tps == 50.0
    # an evaluation between steps is not training time: the next step counts from the restart's event
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.now = 30.0
    timer.restart()
    timer.tick(100, first=False, event=FakeEvent(at=31.5))
    assert timer.read() == (100 / 1.5, 1.5)


def test_without_events_the_host_clock_times_the_steps():
    timer = StepTimer()
    timer.tick(100, first=True)
    timer.read()
    time.sleep(0.05)
    timer.tick(100, first=False)
    tps, step_s = timer.read()
    assert 0.05 <= step_s < 1.0 and tps == 100 / step_s
