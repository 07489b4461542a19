"""Corpora and batches.

The corpus is a flat array of tokens: the embedded default (this Python's standard-library
source, read as bytes: it ships with every Python, so nothing is downloaded), a text file
read as bytes, a token file in nanoGPT's ``.bin`` format (uint16, or uint32 with ``data.dtype``),
or a directory written by ``trainer prepare`` (train.bin and val.bin in the dtype and vocabulary
its meta.json gives). Token files are memory-mapped, never read whole; loading checks that a file
is a whole number of tokens and that every id is inside the vocabulary (one vectorised pass).

Batches are random windows drawn from a generator seeded by ``(seed, step)``. The global
batch of a step is fixed by the step and the global batch size alone; each data-parallel rank
takes its contiguous slice. So with the global batch fixed (``train.global_batch_size``) the
data a run sees does not depend on the world size, and the sampler's whole position is the
step number, which checkpoints store.
"""

from __future__ import annotations

import json
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_files() -> list[Path]:
    """The standard library's own ``.py`` files (tests and installed packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        out.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return sorted(out)


def _stdlib_corpus(val_fraction: float) -> tuple[np.ndarray, np.ndarray, str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val = [], []
    for f in stdlib_files():
        rel = f.relative_to(root).as_posix()
        # A file goes to validation by a hash of its path: deterministic, and unrelated to its name's order.
        is_val = (zlib.crc32(rel.encode()) % 10_000) < val_fraction * 10_000
        (val if is_val else train).append(f.read_bytes())
    as_array = lambda parts: np.frombuffer(b"\n".join(parts), dtype=np.uint8)
    return as_array(train), as_array(val), f"python stdlib source ({root})"


@dataclass
class Documents:
    """One split of an instruction directory: the tokens, their loss mask, each document's start.

    Attributes:
        tokens: the token ids, a memory map.
        mask: uint8, 1 where the token is a training target, a memory map of the same length.
        starts: int64, each document's first token, then the total (documents + 1 entries).
    """

    tokens: np.ndarray
    mask: np.ndarray
    starts: np.ndarray

    def pieces(self, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """``(start, length)`` of every piece: each document, cut into pieces of ``seq_len`` where it is longer."""
        starts, lengths = self.starts[:-1], np.diff(self.starts)
        keep = lengths > 0
        starts, lengths = starts[keep], lengths[keep]
        n = -(-lengths // seq_len)  # pieces per document
        first = np.repeat(starts, n)
        k = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)  # the piece's index within its document
        offset = k * seq_len
        return first + offset, np.minimum(np.repeat(lengths, n) - offset, seq_len)

    def split_documents(self, seq_len: int) -> int:
        """How many documents are longer than ``seq_len`` (cut into pieces)."""
        return int((np.diff(self.starts) > seq_len).sum())


@dataclass
class Corpus:
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    description: str
    eos_id: int | None = None
    """The end-of-document token of a prepared directory (meta.json's ``eos_id``); None for bytes and bare .bin."""
    documents: tuple[Documents, Documents] | None = None
    """An instruction directory's train and validation documents, with their loss masks (:mod:`trainer.packing`
    packs them); None for pretraining text, whose batches are windows of the token stream."""


META = "meta.json"
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_SCAN_CHUNK = 1 << 26  # tokens per np.max call: bounds what one call touches (128 MiB of uint16)


def token_dtype(path: str | None, dtype: str) -> tuple[str, str]:
    """What ``data.dtype`` stands for with ``data.path``, and why: a prepared directory's ``meta.json`` dtype, uint16
    for a bare ``.bin`` token file (nanoGPT's) when ``auto``, ``bytes`` for text (the embedded corpus, a text file).
    A given dtype that disagrees with meta.json is refused when the data loads."""
    p = _data_path(path)
    if p is not None and p.is_dir() and (p / META).is_file():
        return read_meta(p)["dtype"], f"{p / META}'s"
    if p is not None and p.suffix == ".bin":
        return ("uint16", "a bare .bin token file, as nanoGPT's") if dtype == "auto" else (dtype, "as given")
    return "bytes", "text is read as bytes"


def load_corpus(
    path: str | None, vocab_size: int | None, val_fraction: float, seq_len: int, dtype: str = "auto"
) -> Corpus:
    """Load the token corpus and split it into train and validation.

    Args:
        path: ``data.path``: a prepared directory, a ``.bin`` token file, a text file, or None (the embedded corpus).
        vocab_size: ``data.vocab_size`` (None: the data's own).
        val_fraction: the validation share of a corpus that has no split of its own.
        seq_len: ``data.seq_len``; each split must hold more tokens than a sequence.
        dtype: ``data.dtype``: ``auto``, ``uint16`` or ``uint32`` (token files only).

    Raises:
        ValueError, FileNotFoundError: a missing file or meta.json, a ``.bin`` without ``data.vocab_size``, a
            vocabulary or dtype that disagrees with meta.json, a token file whose size is not a whole number of
            tokens, token ids outside the vocabulary, or a split shorter than a sequence.
    """
    p = _data_path(path)
    if p is not None and p.is_dir():
        corpus = _prepared_corpus(p, vocab_size, dtype)
    elif p is not None and p.suffix == ".bin":
        corpus = _token_file_corpus(_existing(p), vocab_size, dtype, val_fraction)
    else:
        if dtype != "auto":
            what = "the embedded corpus" if p is None else f"the text file {p}"
            raise ValueError(
                f"data.dtype: {dtype} applies to token files (.bin) and prepared directories; {what} "
                "is read as bytes: leave data.dtype=auto"
            )
        corpus = _byte_corpus(p if p is None else _existing(p), vocab_size, val_fraction)
    for name, arr in (("train", corpus.train), ("validation", corpus.val)):
        if corpus.documents is not None:  # packed documents: any length of document fills sequences
            if len(arr) < 2:
                raise ValueError(f"data: the {name} split of {p} holds no document of two tokens or more")
            continue
        if len(arr) <= seq_len + 1:
            raise ValueError(
                f"data: the {name} split has {len(arr)} tokens, fewer than data.seq_len + 1 = {seq_len + 1}; "
                "use a larger corpus, a smaller data.seq_len or another data.val_fraction"
            )
    return corpus


def _data_path(path: str | None) -> Path | None:
    """``data.path`` as a Path; prepare's own train.bin stands for its directory (its meta.json says how to read it)."""
    p = None if path is None else Path(path)
    if p is not None and p.is_file() and p.name == "train.bin" and (p.parent / META).is_file():
        return p.parent
    return p


def data_vocab_size(path: str | None, vocab_size: int | None) -> int:
    """The vocabulary :func:`load_corpus` gives ``data.path`` and ``data.vocab_size``, without reading the tokens
    (``trainer sample`` rebuilds a run's model with it).

    Raises:
        ValueError, FileNotFoundError: as :func:`load_corpus` for a prepared directory or a bare ``.bin``.
    """
    p = _data_path(path)
    if p is not None and p.is_dir():
        return read_meta(p)["vocab_size"]
    if p is not None and p.suffix == ".bin" and vocab_size is None:
        raise ValueError(f"data.vocab_size: required for the token file {p} (its tokenizer's vocabulary size)")
    return vocab_size or 256


def _existing(p: Path) -> Path:
    if not p.is_file():
        raise FileNotFoundError(f"data.path: no such file or directory: {p}")
    return p


def _byte_corpus(p: Path | None, vocab_size: int | None, val_fraction: float) -> Corpus:
    """The embedded corpus (``p`` None) or a text file, as bytes: vocabulary 256, or ``vocab_size`` to widen it."""
    if p is None:
        train, val, desc = _stdlib_corpus(val_fraction)
    else:
        train, val = _tail_split(np.frombuffer(p.read_bytes(), dtype=np.uint8), val_fraction)
        desc = f"bytes of {p}"
    if vocab_size is not None and vocab_size < 256:
        raise ValueError(f"data.vocab_size: {vocab_size} is smaller than the byte vocabulary (256)")
    # A larger vocabulary only widens the embedding, e.g. GPT-2's 50304 for benchmarks.
    return Corpus(train=train, val=val, vocab_size=vocab_size or 256, description=desc)


def _token_file_corpus(p: Path, vocab_size: int | None, dtype: str, val_fraction: float) -> Corpus:
    """A bare ``.bin`` token file (nanoGPT's): ``train.bin`` with a ``val.bin`` beside it uses that as validation."""
    dtype, _ = token_dtype(str(p), dtype)
    if vocab_size is None:
        raise ValueError(f"data.vocab_size: required for the {dtype} token file {p} (its tokenizer's vocabulary size)")
    tokens = read_tokens(p, dtype, vocab_size)
    sibling = p.with_name("val.bin") if p.name == "train.bin" else None
    if sibling is not None and sibling.is_file():
        train, val = tokens, read_tokens(sibling, dtype, vocab_size)
    else:
        train, val = _tail_split(tokens, val_fraction)
    return Corpus(train=train, val=val, vocab_size=vocab_size, description=f"{dtype} tokens ({p})")


def read_meta(directory: Path) -> dict:
    """A prepared directory's ``meta.json`` (written by ``trainer prepare``), checked for what loading needs.

    Raises:
        FileNotFoundError: no meta.json in ``directory``.
        ValueError: meta.json is not JSON, or lacks ``vocab_size`` or a known ``dtype``.
    """
    path = Path(directory) / META
    if not path.is_file():
        raise FileNotFoundError(
            f"data.path: {directory} is a directory without {META}; expected one written by `trainer prepare` "
            "(train.bin, val.bin, meta.json), or point data.path at a token or text file"
        )
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"data.path: {path} is not valid JSON ({e}); run `trainer prepare` again") from None
    meta = meta if isinstance(meta, dict) else {}
    vocab, dtype = meta.get("vocab_size"), meta.get("dtype")
    if not isinstance(vocab, int) or vocab <= 0 or dtype not in TOKEN_DTYPES:
        raise ValueError(
            f"data.path: {path} needs a positive integer vocab_size and a dtype of "
            f"{' or '.join(TOKEN_DTYPES)}; got vocab_size={vocab!r}, dtype={dtype!r}"
        )
    return meta


def _prepared_corpus(d: Path, vocab_size: int | None, dtype: str) -> Corpus:
    """A directory written by ``trainer prepare``: train.bin and val.bin in meta.json's dtype and vocabulary."""
    meta = read_meta(d)
    vocab, meta_dtype = meta["vocab_size"], meta["dtype"]
    if vocab_size is not None and vocab_size != vocab:
        raise ValueError(
            f"data.vocab_size: {vocab_size}, but {d / META} says the data's vocabulary is {vocab}; leave "
            "data.vocab_size unset for a prepared directory (it is read from meta.json)"
        )
    if dtype not in ("auto", meta_dtype):
        raise ValueError(
            f"data.dtype: {dtype}, but {d / META} says the tokens are {meta_dtype}; leave "
            "data.dtype=auto for a prepared directory"
        )
    splits = {}
    for split in ("train", "val"):
        f = d / f"{split}.bin"
        if not f.is_file():
            raise FileNotFoundError(f"data.path: {d} has {META} but no {f.name}; run `trainer prepare` again")
        splits[split] = read_tokens(f, meta_dtype, vocab, meta=d / META)
        expected = meta.get("tokens", {}).get(split) if isinstance(meta.get("tokens"), dict) else None
        if isinstance(expected, int) and expected != len(splits[split]):
            raise ValueError(
                f"data.path: {f} holds {len(splits[split])} tokens, but {d / META} says {expected}: the "
                "directory is incomplete or mixed up; run `trainer prepare` again"
            )
    desc = f"{meta_dtype} tokens of {meta.get('tokenizer', 'an unnamed tokenizer')} ({d})"
    documents = None
    if meta.get("format") in INSTRUCTION_FORMATS:
        documents = tuple(_documents(d, split, splits[split]) for split in ("train", "val"))
        desc = f"{meta['format']} documents, {desc}"
    return Corpus(
        train=splits["train"],
        val=splits["val"],
        vocab_size=vocab,
        description=desc,
        eos_id=meta.get("eos_id"),
        documents=documents,
    )


INSTRUCTION_FORMATS = ("chat", "completion")
"""meta.json's ``format`` of an instruction directory: documents with a loss mask, packed (:mod:`trainer.packing`)."""


def instruction_format(path: str | None) -> str | None:
    """``data.path``'s instruction format (chat or completion: documents packed, with a loss mask), read from its
    meta.json without the tokens; None for pretraining data."""
    p = _data_path(path)
    if p is None or not p.is_dir() or not (p / META).is_file():
        return None
    fmt = read_meta(p).get("format")
    return fmt if fmt in INSTRUCTION_FORMATS else None


def _documents(d: Path, split: str, tokens: np.ndarray) -> Documents:
    """An instruction directory's split: its tokens, ``<split>.mask.bin`` and ``<split>.docs.npy``, checked against
    each other."""
    mask_file, docs_file = d / f"{split}.mask.bin", d / f"{split}.docs.npy"
    for f in (mask_file, docs_file):
        if not f.is_file():
            raise FileNotFoundError(f"data.path: {d} is instruction data without {f.name}; run `trainer prepare` again")
    mask = np.memmap(mask_file, dtype=np.uint8, mode="r") if mask_file.stat().st_size else np.zeros(0, np.uint8)
    starts = np.load(docs_file)
    ok = (
        len(mask) == len(tokens)
        and starts.ndim == 1
        and len(starts) >= 1
        and starts[0] == 0
        and starts[-1] == len(tokens)
        and bool(np.all(np.diff(starts) >= 0))
    )
    if not ok:
        raise ValueError(
            f"data.path: {d}: {mask_file.name} ({len(mask)} tokens) and {docs_file.name} do not match {split}.bin "
            f"({len(tokens)} tokens); run `trainer prepare` again"
        )
    if len(mask) and max_token(mask) > 1:
        raise ValueError(
            f"data.path: {mask_file} holds values other than 0 and 1 (a target or not); run `trainer prepare` again"
        )
    return Documents(tokens=tokens, mask=mask, starts=starts.astype(np.int64))


def read_tokens(path: Path, dtype: str, vocab_size: int, meta: Path | None = None) -> np.ndarray:
    """Map a token file read-only and check it: a whole number of ``dtype`` tokens, every id below ``vocab_size``.

    Args:
        meta: the meta.json that gave ``dtype`` and ``vocab_size`` (None: the config did, for a bare .bin); the
            errors' advice depends on it.

    Raises:
        ValueError: naming the file, for a size that is not a multiple of the dtype's, or an id >= ``vocab_size``.
    """
    item = np.dtype(TOKEN_DTYPES[dtype]).itemsize
    size = path.stat().st_size
    if size % item:
        fix = (
            "set data.dtype to the dtype the file was written in"
            if meta is None
            else f"it does not match {meta}; run `trainer prepare` again"
        )
        raise ValueError(
            f"data.path: {path} is {size} bytes, not a whole number of {dtype} tokens ({item} bytes each); {fix}"
        )
    if size == 0:
        return np.zeros(0, dtype=TOKEN_DTYPES[dtype])
    tokens = np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r")
    largest = max_token(tokens)
    if largest >= vocab_size:
        raise ValueError(
            f"data.path: {path} holds token id {largest}, outside the vocabulary of {vocab_size} "
            f"tokens (ids 0..{vocab_size - 1}); {_range_fix(largest, dtype, meta)}"
        )
    return tokens


def _range_fix(largest: int, dtype: str, meta: Path | None) -> str:
    """What to change when a token file holds ``largest``, an id outside the vocabulary."""
    if meta is not None:
        return f"the file does not match {meta}; run `trainer prepare` again"
    other = "uint16" if dtype == "uint32" else "uint32"
    return (
        f"set data.vocab_size to the vocabulary the file was tokenized with (at least {largest + 1}), or "
        f"data.dtype={other} if the file holds {other} tokens"
    )


def max_token(tokens: np.ndarray) -> int:
    """The largest id in ``tokens``, in one vectorised pass over chunks (a memmap is read, never copied)."""
    return int(max(tokens[i : i + _SCAN_CHUNK].max() for i in range(0, len(tokens), _SCAN_CHUNK)))


def _tail_split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    n_val = max(int(len(tokens) * val_fraction), 1)
    return tokens[:-n_val], tokens[-n_val:]


class StepSlices:
    """What every sampler of the trainer shares: a step's global batch of ``micro_batch_size x grad_accum x
    world_size`` sequences, of which data-parallel rank ``rank`` takes its contiguous slice, drawn from
    ``(seed, step)`` with the steps in ``skip`` passed over; its checkpointed state is the next step
    (:class:`Batches`, :class:`trainer.packing.PackedBatches`; their Args)."""

    def __init__(
        self, *, seq_len, micro_batch_size, grad_accum, rank, world_size, seed, device, global_batch=None, skip=None
    ):
        self.skip = merge_ranges(skip or [])  # steps whose batches are passed over (train.skip_batches, rollbacks)
        self.T, self.B, self.accum = seq_len, micro_batch_size, grad_accum
        self.rank, self.world, self.seed, self.device = rank, world_size, seed, torch.device(device)
        self.global_batch = micro_batch_size * grad_accum * world_size
        assert global_batch in (None, self.global_batch), (
            f"global batch {global_batch} != micro_batch_size {micro_batch_size} x grad_accum {grad_accum} x "
            f"{world_size} ranks"
        )
        self._pin = self.device.type == "cuda"

    def state_dict(self, next_step: int) -> dict:
        return {"seed": self.seed, "next_step": next_step, "global_batch": self.global_batch, "skip": self.skip}


class Batches(StepSlices):
    """Random windows of ``seq_len + 1`` tokens, a pure function of ``(seed, split, step)`` and the global batch:
    a step's global batch is drawn whole, and data-parallel rank ``r`` takes its contiguous slice (its
    micro-batches one after another), so the data of a step is the same on 1 or N ranks.

    Args:
        corpus: the token arrays.
        seq_len: tokens per sequence.
        micro_batch_size: sequences per micro-batch on one rank.
        grad_accum: micro-batches per step.
        rank, world_size: this data-parallel rank's slice of the global batch, and the number of such ranks.
        seed: the run's seed.
        device: where batches go.
        global_batch: sequences per step over all ranks (the plan's, :attr:`trainer.plan.Plan.global_batch`); it
            must be ``micro_batch_size x grad_accum x world_size``. None: that product.
        positions: under context parallel, the positions of each sequence this rank holds
            (:func:`trainer.distributed.cp.positions_of`); its batches are then ``(x, y, positions)`` of those
            tokens alone, positions (B, len(positions)). None: whole sequences, ``(x, y)``.
        skip: ``[first, last]`` ranges of steps (numbered as in a run that skips nothing, from 1) whose batches are
            passed over: step ``s`` trains on the ``s``-th batch not in them (:func:`data_step`).
    """

    def __init__(self, corpus: Corpus, *, positions: np.ndarray | None = None, **slices):
        super().__init__(**slices)
        self.corpus = corpus
        self._arange = np.arange(self.T + 1)
        self._positions = None if positions is None else torch.as_tensor(positions, dtype=torch.int64)

    def _offsets(self, split: str, index: int, count: int) -> np.ndarray:
        data = self.corpus.train if split == "train" else self.corpus.val
        tag = 0 if split == "train" else 1
        rng = np.random.default_rng([self.seed, tag, index])
        return rng.integers(0, len(data) - self.T - 1, size=count)

    def _windows(self, split: str, offsets: np.ndarray) -> tuple[torch.Tensor, ...]:
        data = self.corpus.train if split == "train" else self.corpus.val
        rows = torch.from_numpy(data[offsets[:, None] + self._arange].astype(np.int64))  # (B, T+1)
        parts = [rows[:, :-1], rows[:, 1:]]
        if self._positions is not None:  # context parallel: this rank's tokens of each sequence, and where they are
            parts = [p[:, self._positions] for p in parts] + [self._positions.expand(len(rows), -1)]
        xy = torch.stack(parts)  # (2 or 3, B, T), contiguous: one host-to-device copy
        if self._pin:
            xy = xy.pin_memory()
        return tuple(xy.to(self.device, non_blocking=True).unbind(0))

    def train_batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch ``micro`` of optimizer step ``step`` (0 for the first) for this rank: ``(x, y)``, each
        (B, T); the batch of the ``step + 1``-th step not passed over (``skip``)."""
        offsets = self._offsets("train", data_step(step + 1, self.skip) - 1, self.global_batch)
        start = self.rank * self.B * self.accum + micro * self.B
        return self._windows("train", offsets[start : start + self.B])

    def val_batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Validation micro-batch ``index`` for this rank; the same windows at every evaluation."""
        offsets = self._offsets("val", index, self.B * self.world)
        return self._windows("val", offsets[self.rank * self.B : (self.rank + 1) * self.B])


def merge_ranges(ranges) -> list[list[int]]:
    """``[first, last]`` ranges of step numbers, sorted, overlapping and adjacent ones merged."""
    out: list[list[int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in ranges):
        if out and a <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def data_step(step: int, skip: list[list[int]]) -> int:
    """The batch (numbered as in a run that skips nothing, from 1) that step ``step`` trains on: the ``step``-th
    not in the merged ranges ``skip``."""
    for a, b in skip:
        if step >= a:
            step += b - a + 1
    return step
