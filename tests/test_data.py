"""Corpora and batches: the embedded corpus, files, and world-size-independent batches."""

import numpy as np
import pytest
import torch

from trainer.data import Batches, load_corpus, stdlib_files


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(None, None, 0.05, 64)


def test_embedded_corpus_is_the_stdlib(corpus):
    files = stdlib_files()
    assert len(files) > 200 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts or "test" in f.parts for f in files)
    assert corpus.vocab_size == 256 and corpus.train.dtype == np.uint8
    assert len(corpus.train) > 5_000_000  # the stdlib without tests is ~12 MB of source
    # deterministic split, about val_fraction of the bytes
    again = load_corpus(None, None, 0.05, 64)
    assert np.array_equal(again.val, corpus.val)
    assert 0.01 < len(corpus.val) / (len(corpus.train) + len(corpus.val)) < 0.15


def _batches(corpus, world, rank, mbs, accum):
    return Batches(corpus, seq_len=16, micro_batch_size=mbs, grad_accum=accum, rank=rank, world_size=world,
                   seed=7, device="cpu")  # fmt: skip


def _global_batch(corpus, world, mbs, accum, step):
    rows = []
    for rank in range(world):
        b = _batches(corpus, world, rank, mbs, accum)
        rows += [b.train_batch(step, m)[0] for m in range(accum)]
    return torch.cat(rows)


def test_global_batch_does_not_depend_on_world_size(corpus):
    for step in (0, 5):
        one = _global_batch(corpus, world=1, mbs=8, accum=1, step=step)
        two = _global_batch(corpus, world=2, mbs=4, accum=1, step=step)
        four_accum = _global_batch(corpus, world=2, mbs=2, accum=2, step=step)
        assert torch.equal(one, two) and torch.equal(one, four_accum)
    assert not torch.equal(_global_batch(corpus, 1, 8, 1, 0), _global_batch(corpus, 1, 8, 1, 1))


def test_targets_are_inputs_shifted(corpus):
    x, y = _batches(corpus, 1, 0, 4, 1).train_batch(3, 0)
    assert x.shape == y.shape == (4, 16) and x.is_contiguous() and y.is_contiguous()
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert x.dtype == torch.int64


def test_val_batches_repeat(corpus):
    b = _batches(corpus, 1, 0, 4, 1)
    assert torch.equal(b.val_batch(2)[0], b.val_batch(2)[0])
    assert not torch.equal(b.val_batch(0)[0], b.val_batch(1)[0])


def test_text_and_bin_files(tmp_path):
    text = tmp_path / "a.txt"
    text.write_bytes(bytes(range(256)) * 40)
    c = load_corpus(str(text), None, 0.1, 16)
    assert c.vocab_size == 256 and len(c.train) + len(c.val) == 256 * 40
    tokens = np.arange(5000, dtype=np.uint16) % 1000
    tokens.tofile(tmp_path / "train.bin")
    (np.arange(300, dtype=np.uint16)).tofile(tmp_path / "val.bin")
    c = load_corpus(str(tmp_path / "train.bin"), 1000, 0.1, 16)
    assert c.vocab_size == 1000 and len(c.train) == 5000 and len(c.val) == 300
    with pytest.raises(ValueError, match="data.vocab_size"):
        load_corpus(str(tmp_path / "train.bin"), None, 0.1, 16)
    with pytest.raises(FileNotFoundError, match="data.path"):
        load_corpus(str(tmp_path / "missing.txt"), None, 0.1, 16)
    with pytest.raises(ValueError, match="fewer than data.seq_len"):
        load_corpus(str(text), None, 0.1, 5000)
