"""Corpora and batches.

The corpus is a flat array of tokens: the embedded default (this Python's standard-library
source, read as bytes: it ships with every Python, so nothing is downloaded), a text file
read as bytes, or a uint16 token file in nanoGPT's ``.bin`` format.

Batches are random windows drawn from a generator seeded by ``(seed, step)``. The global
batch of a step is fixed by the step alone; each rank takes its contiguous slice. So the
data a run sees does not depend on the world size, and the sampler's whole position is the
step number, which checkpoints store.
"""

from __future__ import annotations

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
class Corpus:
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    description: str


def load_corpus(path: str | None, vocab_size: int | None, val_fraction: float, seq_len: int) -> Corpus:
    """Load the token corpus and split it into train and validation.

    Raises:
        ValueError, FileNotFoundError: a missing file, a ``.bin`` without ``data.vocab_size``, a
            corpus shorter than a sequence, or tokens outside the vocabulary.
    """
    if path is None:
        train, val, desc = _stdlib_corpus(val_fraction)
        vocab = 256
    else:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"data.path: no such file: {path}")
        if p.suffix == ".bin":
            if vocab_size is None:
                raise ValueError(f"data.vocab_size: required for the uint16 token file {path}")
            tokens = np.memmap(p, dtype=np.uint16, mode="r")
            vocab = vocab_size
            sibling = p.with_name("val.bin") if p.name == "train.bin" else None
            if sibling is not None and sibling.is_file():
                train, val = tokens, np.memmap(sibling, dtype=np.uint16, mode="r")
            else:
                train, val = _tail_split(tokens, val_fraction)
            desc = f"uint16 tokens ({path})"
        else:
            tokens = np.frombuffer(p.read_bytes(), dtype=np.uint8)
            vocab = 256
            train, val = _tail_split(tokens, val_fraction)
            desc = f"bytes of {path}"
    if vocab_size is not None:
        if vocab_size < vocab:
            raise ValueError(f"data.vocab_size: {vocab_size} is smaller than the byte vocabulary ({vocab})")
        vocab = vocab_size  # a larger embedding than the data needs, e.g. GPT-2's 50304 for benchmarks
    for name, arr in (("train", train), ("validation", val)):
        if len(arr) <= seq_len + 1:
            raise ValueError(
                f"data: the {name} split has {len(arr)} tokens, fewer than data.seq_len + 1 = {seq_len + 1}; "
                "use a larger corpus, a smaller data.seq_len or another data.val_fraction"
            )
    return Corpus(train=train, val=val, vocab_size=vocab, description=desc)


def _tail_split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    n_val = max(int(len(tokens) * val_fraction), 1)
    return tokens[:-n_val], tokens[-n_val:]


class Batches:
    """Random windows of ``seq_len + 1`` tokens, a pure function of ``(seed, split, step)``.

    Args:
        corpus: the token arrays.
        seq_len: tokens per sequence.
        micro_batch_size: sequences per micro-batch on one rank.
        grad_accum: micro-batches per step.
        rank, world_size: this rank's slice of the global batch.
        seed: the run's seed.
        device: where batches go.
    """

    def __init__(self, corpus: Corpus, *, seq_len, micro_batch_size, grad_accum, rank, world_size, seed, device):
        self.corpus, self.T, self.B, self.accum = corpus, seq_len, micro_batch_size, grad_accum
        self.rank, self.world, self.seed, self.device = rank, world_size, seed, torch.device(device)
        self.global_batch = micro_batch_size * grad_accum * world_size
        self._pin = self.device.type == "cuda"
        self._arange = np.arange(seq_len + 1)

    def _offsets(self, split: str, index: int, count: int) -> np.ndarray:
        data = self.corpus.train if split == "train" else self.corpus.val
        tag = 0 if split == "train" else 1
        rng = np.random.default_rng([self.seed, tag, index])
        return rng.integers(0, len(data) - self.T - 1, size=count)

    def _windows(self, split: str, offsets: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.corpus.train if split == "train" else self.corpus.val
        rows = torch.from_numpy(data[offsets[:, None] + self._arange].astype(np.int64))  # (B, T+1)
        xy = torch.stack([rows[:, :-1], rows[:, 1:]])  # (2, B, T), contiguous: one host-to-device copy
        if self._pin:
            xy = xy.pin_memory()
        x, y = xy.to(self.device, non_blocking=True).unbind(0)
        return x, y

    def train_batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch ``micro`` of optimizer step ``step`` for this rank: ``(x, y)``, each (B, T)."""
        offsets = self._offsets("train", step, self.global_batch)
        start = self.rank * self.B * self.accum + micro * self.B
        return self._windows("train", offsets[start : start + self.B])

    def val_batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Validation micro-batch ``index`` for this rank; the same windows at every evaluation."""
        offsets = self._offsets("val", index, self.B * self.world)
        return self._windows("val", offsets[self.rank * self.B : (self.rank + 1) * self.B])

    def state_dict(self, next_step: int) -> dict:
        return {"seed": self.seed, "next_step": next_step, "global_batch": self.global_batch}
