"""The error a run stops with, and what it carries for the way out (:mod:`trainer.cli` reads it)."""

from __future__ import annotations


class TrainingError(RuntimeError):
    """The run cannot go on (a NaN loss, a compile failure, too many recompiles, a lost rank, a checkpoint that
    cannot be written); the message says why.

    Attributes:
        all_ranks: every rank raised it at the same point with the same message (rank 0 alone reports it).
        peer_exited: raised because another rank on this host exited (:func:`trainer.distributed.env.lost_peer`):
            this rank waits for torchrun to see that exit before its own (``await_launcher``).
        terminated: torchrun's SIGTERM came while it was being raised (no second wait for it).
        reported: already printed, where it was raised (not again on the way out).
    """

    def __init__(self, message: str, *, all_ranks: bool = False):
        super().__init__(message)
        self.all_ranks = all_ranks
        self.peer_exited = False
        self.terminated = False
        self.reported = False


class Rollback(Exception):
    """A loss spike under ``train.on_spike=rollback``: the run goes back to its last checkpoint (:mod:`trainer.loop`).
    Every rank raises it at the same step: the loss compared is the mean over the ranks, which every rank reads.

    Attributes:
        step: the step whose loss spiked; ``why``: the spike, in words.
    """

    def __init__(self, step: int, why: str):
        super().__init__(f"loss spike at step {step}: {why}")
        self.step, self.why = step, why
