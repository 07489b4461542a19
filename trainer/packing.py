"""Instruction data as fixed-shape batches: whole documents packed into sequences, each attending only to itself.

A prepared instruction directory (``trainer prepare`` with chat or prompt/completion records) holds, beside its
tokens, a loss mask (1 where a token is a training target) and each document's start. Training on it:

- **Pieces.** A document longer than ``data.seq_len`` is cut into pieces of ``seq_len`` (the last one shorter); every
  other document is one piece, whole.
- **Packing.** The pieces of an epoch, in an order drawn from ``(seed, epoch)``, are taken in windows of
  :data:`WINDOW`; each window is packed best-fit-decreasing into sequences of ``seq_len`` tokens (a piece goes into
  the fullest sequence it fits), and the window's sequences are shuffled by the same generator. What a sequence has
  left over (a fraction of a percent over a window) is filler: one more "document" of the EOS token with no target.
  No example is padded to a batch's longest, and the shape is always ``(B, seq_len)``, so the compiled step and its
  CUDA graph are reused.
- **Positions** restart at 0 at each piece: the model builds its document mask from them (a document attends to
  itself only; :meth:`trainer.models.hf.HFCausalLM.forward`).
- **Targets.** The target of token ``i`` is token ``i + 1`` of the same piece where the mask marks it, else -100
  (ignored by the loss); a piece's last token has none.
- **Weights.** The step's loss is the sum of the token losses over the global batch divided by the global number of
  targets. Each micro-batch's model returns its mean over its own targets, so micro-batch ``m`` is weighted
  ``n_m * ranks / N`` (``n_m`` its targets, ``N`` the global batch's, ``ranks`` the data-parallel ranks whose
  gradients are averaged): any ``micro_batch_size x grad_accum x ranks`` cut of the same global batch gives the
  same gradient, up to rounding. Every count is known on the host from the packing: no collective. The validation
  loss is weighted the same way over an evaluation's micro-batches: the mean over all of their targets.

The global batch of step ``k`` is sequences ``k * G .. (k + 1) * G - 1`` of the epochs laid end to end (``G`` the
global batch), and data-parallel rank ``r`` takes its contiguous slice, as :class:`trainer.data.Batches` does: the
data of a step does not depend on the world size, and a resume anywhere in an epoch continues it exactly.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from trainer.data import Documents, StepSlices, data_step

IGNORE = -100
"""The target of a token that is not trained on: ``F.cross_entropy``'s default ``ignore_index``."""
WINDOW = 4096
"""Pieces packed together: enough for best-fit to fill sequences to within a fraction of a percent, few enough that
an epoch's packing costs milliseconds per window."""


def piece_targets(mask: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The number of targets of each piece: its mask summed over every token but its first (which nothing in the
    piece predicts)."""
    if len(starts) == 0:
        return np.zeros(0, dtype=np.int64)
    sums = np.add.reduceat(mask, starts, dtype=np.int64) if len(mask) else np.zeros(len(starts), np.int64)
    # reduceat sums from each start to the next start; pieces are in document order and tile the tokens, except for
    # empty documents (none here: pieces have length > 0), so the sum runs to the piece's end.
    ends = starts + lengths
    assert np.all(ends[:-1] == starts[1:]) and ends[-1] <= len(mask), "pieces must tile the tokens in order"
    if ends[-1] < len(mask):
        sums[-1] = int(mask[starts[-1] : ends[-1]].sum())
    return sums - mask[starts].astype(np.int64)


def pack(lengths: np.ndarray, seq_len: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Pack pieces of ``lengths`` (each <= ``seq_len``) into sequences, in windows of :data:`WINDOW` of an order
    drawn from ``rng``, best-fit decreasing.

    Returns:
        ``(items, bounds)``: the piece indices of every sequence, one after another, and where each sequence's begin
        (sequences + 1 entries): sequence ``s`` holds ``items[bounds[s]:bounds[s + 1]]``.
    """
    order = rng.permutation(len(lengths))
    items, bounds = [], [0]
    for w in range(0, len(order), WINDOW):
        window = order[w : w + WINDOW]
        bins: list[list[int]] = []
        free: list[tuple[int, int]] = []  # (room left, sequence), sorted: the fullest that fits is found by bisection
        for i in window[np.argsort(-lengths[window], kind="stable")]:
            need = int(lengths[i])
            k = bisect.bisect_left(free, (need, -1))
            if k == len(free):
                bins.append([int(i)])
                room, b = seq_len - need, len(bins) - 1
            else:
                room, b = free.pop(k)
                bins[b].append(int(i))
                room -= need
            if room > 0:
                bisect.insort(free, (room, b))
        for b in rng.permutation(len(bins)):
            items.extend(bins[b])
            bounds.append(len(items))
    return np.asarray(items, dtype=np.int64), np.asarray(bounds, dtype=np.int64)


def document_mask(
    path: str | None, hf: str | None, target: str | None, cp: int, device: torch.device
) -> tuple[str | None, str | None]:
    """How the packed documents of ``data.path`` are kept apart, and the line that says so: ``flex`` on CUDA
    (FlexAttention's block mask), ``dense`` elsewhere (SDPA with a (B, 1, T, T) mask: torch's FlexAttention has no
    backward on the CPU); ``(None, None)`` for pretraining data.

    Args:
        path: ``data.path``.
        hf, target: ``model.hf`` and ``model.target`` (only a Hugging Face model takes a document mask).
        cp: the context-parallel degree.
        device: where the model trains.

    Raises:
        ValueError: instruction data with a model that takes no document mask, or with context parallel.
    """
    from trainer.data import instruction_format

    fmt = instruction_format(path)
    if fmt is None:
        return None, None
    if hf is None:
        model = f"model.target={target}" if target else "the built-in GPT"
        raise ValueError(
            f"data.path: {path} holds {fmt} documents, packed into sequences that must not attend across "
            f"documents; {model} takes no document mask. Train a Hugging Face model (model.hf), or prepare the data "
            "as text (trainer prepare --format text)"
        )
    if cp > 1:
        raise ValueError(
            f"distributed.cp: {cp}, but data.path {path} holds packed {fmt} documents, which context parallel does "
            "not split; set distributed.cp=1"
        )
    kind = "flex" if device.type == "cuda" else "dense"
    how = "FlexAttention's block mask" if kind == "flex" else "SDPA with a dense mask: FlexAttention trains on CUDA"
    return kind, (
        f"data: {fmt} documents packed into sequences of data.seq_len, each attending to itself only ({how}; "
        "trainer's causal-attention substitution steps aside); the loss is per target token of the global batch"
    )


class Packing:
    """One split's pieces packed epoch after epoch: sequence ``g`` of the run (epochs laid end to end) as its tokens,
    targets and positions, and its number of targets.

    Args:
        docs: the split.
        seq_len: tokens per sequence.
        seed, tag: what the epochs' orders are drawn from, with the epoch (``tag`` 0 train, 1 validation).
        filler: the token that fills what a sequence has left over (the EOS, or 0).
    """

    def __init__(self, docs: Documents, seq_len: int, seed: int, tag: int, filler: int):
        self.docs, self.T, self.seed, self.tag, self.filler = docs, seq_len, seed, tag, filler
        self.starts, self.lengths = docs.pieces(seq_len)
        self.targets = piece_targets(docs.mask, self.starts, self.lengths)
        self._epochs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (items, bounds, targets per sequence)
        self._first: list[int] = [0]  # the run's index of each epoch's first sequence, and the next epoch's

    def epoch(self, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Epoch ``e``'s packing: ``(items, bounds, targets of each sequence)``; packed once, then kept."""
        while len(self._epochs) <= e:
            k = len(self._epochs)
            items, bounds = pack(self.lengths, self.T, np.random.default_rng([self.seed, self.tag, k]))
            per_seq = np.add.reduceat(self.targets[items], bounds[:-1]) if len(items) else np.zeros(0, np.int64)
            self._epochs.append((items, bounds, per_seq))
            self._first.append(self._first[-1] + len(bounds) - 1)
        return self._epochs[e]

    def locate(self, g: int) -> tuple[int, int]:
        """``(epoch, index within it)`` of the run's sequence ``g``."""
        while self._first[-1] <= g:
            self.epoch(len(self._epochs))
        e = bisect.bisect_right(self._first, g) - 1
        return e, g - self._first[e]

    def sequences_per_epoch(self) -> int:
        return len(self.epoch(0)[1]) - 1

    def fill(self) -> float:
        """The share of the first epoch's sequence tokens that are documents' (not filler)."""
        return float(self.lengths.sum()) / (self.sequences_per_epoch() * self.T)

    def count(self, first: int, n: int) -> np.ndarray:
        """The number of targets of the run's sequences ``first .. first + n - 1``."""
        out = np.empty(n, dtype=np.int64)
        for j in range(n):
            e, i = self.locate(first + j)
            out[j] = self._epochs[e][2][i]
        return out

    def rows(self, first: int, n: int) -> np.ndarray:
        """The run's sequences ``first .. first + n - 1`` as ``(3, n, T)`` int64: tokens, targets, positions."""
        out = np.empty((3, n, self.T), dtype=np.int64)
        tokens, mask = self.docs.tokens, self.docs.mask
        for j in range(n):
            e, i = self.locate(first + j)
            items, bounds, _ = self._epochs[e]
            at = 0
            for p in items[bounds[i] : bounds[i + 1]]:
                s, length = int(self.starts[p]), int(self.lengths[p])
                piece = tokens[s : s + length].astype(np.int64)
                out[0, j, at : at + length] = piece
                out[1, j, at : at + length - 1] = np.where(mask[s + 1 : s + length] != 0, piece[1:], IGNORE)
                out[1, j, at + length - 1] = IGNORE
                out[2, j, at : at + length] = np.arange(length)
                at += length
            out[0, j, at:], out[1, j, at:], out[2, j, at:] = self.filler, IGNORE, np.arange(self.T - at)
        return out


class PackedBatches(StepSlices):
    """This rank's micro-batches of packed documents: ``(x, y, positions, weight)`` per micro-batch, a pure function of
    ``(seed, step)`` and the global batch, with :class:`trainer.data.Batches`' interface.

    ``weight`` (a device scalar) is what the step multiplies the micro-batch's mean loss by (the module docstring);
    :meth:`targets` is the global batch's number of targets, for the log.

    Args:
        train, val: the splits.
        filler: the token that fills a sequence's leftover (the EOS, or 0).
        eval_batches: the validation micro-batches an evaluation runs (``train.eval_batches``): their weights make
            its loss the mean over all of their targets.
        Others: as :class:`trainer.data.Batches`.
    """

    def __init__(self, train: Documents, val: Documents, *, filler: int = 0, eval_batches: int = 1, **slices):
        super().__init__(**slices)
        self.train = Packing(train, self.T, self.seed, 0, filler)
        self.val = Packing(val, self.T, self.seed, 1, filler)
        self.eval_batches = eval_batches
        self._val_targets: int | None = None  # the targets of an evaluation's micro-batches over the ranks
        self._step: tuple[int, tuple[torch.Tensor, ...], int] | None = None  # the step whose batch is on the device

    def _first(self, step: int) -> int:
        """The run's index of the first sequence of step ``step``'s global batch (0 for the first step)."""
        return (data_step(step + 1, self.skip) - 1) * self.global_batch

    def _to_device(self, rows: np.ndarray, weights: np.ndarray) -> tuple[torch.Tensor, ...]:
        xyp = torch.from_numpy(rows)
        w = torch.from_numpy(weights.astype(np.float32))
        if self._pin:
            xyp, w = xyp.pin_memory(), w.pin_memory()
        return (*xyp.to(self.device, non_blocking=True).unbind(0), w.to(self.device, non_blocking=True))

    def _load(self, step: int) -> tuple[tuple[torch.Tensor, ...], int]:
        """This rank's sequences of step ``step`` on the device (``(accum * B, T)`` each, and the weights), and the
        global batch's targets; the step's batch is made once, for all its micro-batches."""
        if self._step is None or self._step[0] != step:
            first = self._first(step)
            counts = self.train.count(first, self.global_batch)
            total = int(counts.sum())
            mine = slice(self.rank * self.B * self.accum, (self.rank + 1) * self.B * self.accum)
            per_micro = counts[mine].reshape(self.accum, self.B).sum(axis=1)
            weights = per_micro * self.world / total if total else np.zeros(self.accum)
            rows = self.train.rows(first + mine.start, self.B * self.accum)
            self._step = (step, self._to_device(rows, weights), total)
        return self._step[1], self._step[2]

    def train_batch(self, step: int, micro: int) -> tuple[torch.Tensor, ...]:
        """Micro-batch ``micro`` of optimizer step ``step`` (0 for the first) for this rank: ``(x, y, positions,
        weight)``, the first three (B, T), ``weight`` a scalar."""
        (x, y, pos, w), _ = self._load(step)
        rows = slice(micro * self.B, (micro + 1) * self.B)
        return x[rows], y[rows], pos[rows], w[micro]

    def targets(self, step: int) -> int:
        """The number of targets of step ``step``'s global batch (0 for the first step): the loaded step's count."""
        if self._step is not None and self._step[0] == step:
            return self._step[2]
        return int(self.train.count(self._first(step), self.global_batch).sum())

    def _val_counts(self, index: int) -> tuple[int, np.ndarray]:
        """The first validation sequence of the ranks' micro-batches ``index``, and each sequence's targets."""
        first = (index * self.B * self.world) % self.val.sequences_per_epoch()
        return first, self.val.count(first, self.B * self.world)

    def val_batch(self, index: int) -> tuple[torch.Tensor, ...]:
        """Validation micro-batch ``index`` for this rank, ``(x, y, positions, weight)``: the same at every
        evaluation, its weight ``n * ranks * E / N``: its targets n, over the targets N of all the ranks' first E
        micro-batches (``eval_batches``). The evaluation's mean of weighted losses over E micro-batches and the
        ranks is then the mean loss over all of its targets, whatever each micro-batch holds."""
        if self._val_targets is None:
            self._val_targets = int(sum(self._val_counts(i)[1].sum() for i in range(self.eval_batches)))
        first, counts = self._val_counts(index)
        own, total = int(counts[self.rank * self.B : (self.rank + 1) * self.B].sum()), self._val_targets
        weight = np.asarray([own * self.world * self.eval_batches / total if total else 0.0])
        rows = self.val.rows(first + self.rank * self.B, self.B)
        x, y, pos, w = self._to_device(rows, weight)
        return x, y, pos, w[0]
