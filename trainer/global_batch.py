"""The global batch of a run: sequences per optimizer step over every data-parallel rank, and ``train.grad_accum``.

:func:`global_batch` resolves them from the config's train section, the data-parallel ranks and the batch of the
checkpoint a run resumes (:class:`SavedBatch`): ``train.global_batch_size`` fixes the global batch on any number of
ranks (grad_accum derived), and a resume keeps the checkpoint's. :func:`trainer.plan.resolve` calls it once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainer import console
from trainer.config import ConfigError


@dataclass(frozen=True)
class SavedBatch:
    """The global batch of the checkpoint a run resumes, from its ``meta.json``: what the resume keeps.

    Attributes:
        sequences: sequences per optimizer step it trained on (``sampler.global_batch``); None where not recorded.
        key: its config's ``train.global_batch_size`` (None: not set).
        grad_accum: its config's ``train.grad_accum``, as it ran.
        dp_ranks: its data-parallel ranks.
    """

    sequences: int | None
    key: int | None = None
    grad_accum: int | None = None
    dp_ranks: int | None = None

    @classmethod
    def read(cls, checkpoint: str | None) -> SavedBatch | None:
        """The batch of the checkpoint a run resumes (``start.resume``, as
        :func:`trainer.checkpoint.rundir.claim` decided it); None for a fresh start."""
        if checkpoint is None:
            return None
        from trainer.checkpoint import checkpoint_meta

        return cls.of(checkpoint_meta(Path(checkpoint)))

    @classmethod
    def of(cls, meta: dict) -> SavedBatch:
        """The batch of a checkpoint's ``meta.json`` (:func:`trainer.checkpoint.checkpoint_meta`)."""
        train = (meta.get("config") or {}).get("train") or {}
        sequences = (meta.get("sampler") or {}).get("global_batch")
        micro, accum = train.get("micro_batch_size"), train.get("grad_accum")
        ranks = sequences // (micro * accum) if sequences and micro and accum else meta.get("world_size")
        return cls(sequences, train.get("global_batch_size"), accum, ranks)


@dataclass(frozen=True)
class GlobalBatch:
    """The global batch as resolved (:func:`global_batch`): sequences per optimizer step over all data-parallel
    ranks, the ``train.grad_accum`` that makes them up, and what the run says about them at startup.

    Attributes:
        sequences: sequences per optimizer step, micro_batch_size x grad_accum x data-parallel ranks.
        grad_accum: micro-batches per step on each rank.
        choice: plan.json's line when grad_accum is derived from ``train.global_batch_size``.
        note: a line for the log: how a resume kept or changed the global batch, a given grad_accum replaced.
        warning: a resume that changes the global batch without ``train.global_batch_size``.
    """

    sequences: int
    grad_accum: int
    choice: str | None = None
    note: str | None = None
    warning: str | None = None

    def say(self) -> None:
        """Say the note and the warning (rank 0)."""
        console.info(self.note)
        if self.warning:
            console.warn(self.warning)


def _ranks(n: int) -> str:
    return f"{n} data-parallel rank{'' if n == 1 else 's'}"


def derive_grad_accum(sequences: int, micro_batch_size: int, dp_ranks: int, what: str = "") -> int:
    """``train.grad_accum`` for a global batch of ``sequences`` on ``dp_ranks`` data-parallel ranks of
    ``micro_batch_size`` sequences each: ``sequences / (micro_batch_size x dp_ranks)``.

    Args:
        what: where ``sequences`` came from, for the error (after ``train.global_batch_size: N``).

    Raises:
        ConfigError: ``sequences`` is not a multiple of ``micro_batch_size x dp_ranks``; it names both numbers.
    """
    per_micro_step = micro_batch_size * dp_ranks
    if sequences % per_micro_step == 0:
        return sequences // per_micro_step
    ways = [f"set train.global_batch_size to a multiple of {per_micro_step}"]
    if sequences % dp_ranks == 0:
        ways.append(f"train.micro_batch_size to a divisor of {sequences // dp_ranks}")
    elif sequences % micro_batch_size == 0:
        ways.append(f"run on a number of ranks that divides {sequences // micro_batch_size}")
    raise ConfigError(
        f"train.global_batch_size: {sequences}{what} is not a multiple of train.micro_batch_size ({micro_batch_size}) "
        f"x {_ranks(dp_ranks)} = {per_micro_step}; {', or '.join(ways)}"
    )


def global_batch(train, dp_ranks: int, saved: SavedBatch | None = None) -> GlobalBatch:
    """The global batch and ``train.grad_accum`` of the train section ``train`` on ``dp_ranks`` data-parallel ranks;
    ``saved``: the batch of the checkpoint the run resumes (None: a fresh start).

    With ``train.global_batch_size`` set (in the config, or in the resumed checkpoint's), the global batch is that
    many sequences on any number of ranks and grad_accum is derived from it (a given grad_accum is replaced, with
    a note); a resume keeps the checkpoint's global batch unless the config sets another. Without it the global
    batch is ``micro_batch_size x grad_accum x dp_ranks``, and a resume on another number of ranks that changes it
    warns.

    Raises:
        ConfigError: a global batch that is not a multiple of ``micro_batch_size x dp_ranks``.
    """
    micro, given, key = train.micro_batch_size, train.grad_accum, train.global_batch_size
    resumed = saved.sequences if saved is not None else None
    if key is None and (saved is None or saved.key is None):
        sequences = micro * given * dp_ranks
        if resumed in (None, sequences) or saved.dp_ranks == dp_ranks:
            return GlobalBatch(sequences, given)
        where = f" on {_ranks(saved.dp_ranks)}" if saved.dp_ranks else ""
        warning = (
            f"resume: the global batch changes from the checkpoint's {resumed} sequences per step{where} to "
            f"{sequences} (train.micro_batch_size {micro} x train.grad_accum {given} x {_ranks(dp_ranks)}); set "
            f"train.global_batch_size={resumed} to keep it on any number of GPUs"
        )
        return GlobalBatch(sequences, given, warning=warning)
    sequences = key if key is not None else resumed or saved.key
    kept = saved is not None and sequences == resumed
    accum = derive_grad_accum(sequences, micro, dp_ranks, " (the resumed checkpoint's global batch)" if kept else "")
    choice = (
        f"train.grad_accum: {accum} = train.global_batch_size {sequences} / (train.micro_batch_size {micro} x "
        f"{_ranks(dp_ranks)})" + ("; the resumed checkpoint's global batch" if kept else "")
    )
    notes = []
    if kept and (saved.grad_accum, saved.dp_ranks) != (accum, dp_ranks):
        notes.append(
            f"resume: global batch {sequences} sequences kept; train.grad_accum {saved.grad_accum} -> {accum} for "
            f"{_ranks(dp_ranks)}"
        )
    elif resumed is not None and not kept:
        notes.append(
            f"resume: train.global_batch_size {sequences} replaces the checkpoint's global batch of {resumed} "
            f"sequences; train.grad_accum {accum} for {_ranks(dp_ranks)}"
        )
    if given not in (1, accum):
        notes.append(f"train.grad_accum={given} replaced by {accum}: derived from train.global_batch_size")
    return GlobalBatch(sequences, accum, choice=choice, note="\n".join(notes) or None)
