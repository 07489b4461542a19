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
