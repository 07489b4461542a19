"""Corpora and batches: the embedded corpus, files, and world-size-independent batches."""

import json

import numpy as np
import pytest
import torch

from tests.conftest import FAST, ROOT
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


def test_the_plans_global_batch_is_the_same_data_on_one_or_two_ranks(corpus):
    """train.global_batch_size=8 of micro-batches of 2: one process accumulates 4 of them, each of 2 ranks 2 (the
    plan derives grad_accum); the sequences of a step, rank 0's micro-batches then rank 1's, are the same."""
    from trainer import build, plan
    from trainer.config import load_config
    from trainer.distributed.env import DistEnv

    overrides = ["data.seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=8", "distributed.strategy=ddp"]
    cfg = load_config(ROOT / "configs/tiny.yaml", overrides)

    def step_rows(world: int, step: int) -> torch.Tensor:
        rows = []
        for rank in range(world):
            env = DistEnv(rank=rank, local_rank=rank, world_size=world, device=torch.device("cpu"),
                          backend=None if world == 1 else "gloo")  # fmt: skip
            the_plan = plan.resolve(cfg, env)
            b = build.batches(the_plan, corpus, env)
            assert b.global_batch == 8 and the_plan.cfg.train.grad_accum == 4 // world
            rows += [b.train_batch(step, m)[0] for m in range(the_plan.cfg.train.grad_accum)]
        return torch.cat(rows)

    for step in (0, 3):
        one, two = step_rows(1, step), step_rows(2, step)
        assert one.shape == (8, 16) and torch.equal(one, two)
    with pytest.raises(AssertionError, match="global batch 6 != micro_batch_size 2 x grad_accum 4 x 1 ranks"):
        Batches(corpus, seq_len=16, micro_batch_size=2, grad_accum=4, rank=0, world_size=1, seed=7, device="cpu",
                global_batch=6)  # fmt: skip


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


def _prepared(root, train, val, **meta):
    """A directory as `trainer prepare` writes it (train.bin, val.bin, meta.json), written by hand."""
    root.mkdir(parents=True, exist_ok=True)
    train.tofile(root / "train.bin")
    val.tofile(root / "val.bin")
    meta = {"format": 1, "tokenizer": "bpe:test", "vocab_size": 70_000, "eos_id": 0, "dtype": train.dtype.name,
            "tokens": {"train": len(train), "val": len(val)}, "documents": {"train": 3, "val": 1},
            "sources": ["test"], "field": "text", **meta}  # fmt: skip
    (root / "meta.json").write_text(json.dumps(meta))
    return root


def _ids(n, vocab, dtype, top=None):
    """``n`` ids below ``vocab``; ``top`` (if given) placed once in the middle."""
    ids = (np.arange(n, dtype=np.int64) * 7919 % vocab).astype(dtype)
    if top is not None:
        ids[n // 2] = top
    return ids


def test_prepared_directory_reads_meta_vocab_dtype_and_eos(tmp_path):
    train, val = _ids(5000, 70_000, np.uint32, top=69_999), _ids(400, 70_000, np.uint32)
    d = _prepared(tmp_path / "prep", train, val, eos_id=3)
    for path in (d, d / "train.bin"):  # prepare's own train.bin reads as its directory
        c = load_corpus(str(path), None, 0.1, 16)
        assert c.vocab_size == 70_000 and c.eos_id == 3
        assert c.train.dtype == np.uint32 and isinstance(c.train, np.memmap)
        assert np.array_equal(c.train, train) and np.array_equal(c.val, val)  # val.bin as is, no split
    assert load_corpus(str(d), 70_000, 0.1, 16, dtype="uint32").vocab_size == 70_000  # agreeing settings are fine
    small = _prepared(tmp_path / "u16", _ids(3000, 300, np.uint16), _ids(300, 300, np.uint16), vocab_size=300)
    c = load_corpus(str(small), None, 0.1, 16)
    assert c.train.dtype == np.uint16 and c.vocab_size == 300 and len(c.train) == 3000


def test_prepared_directory_errors(tmp_path):
    d = _prepared(tmp_path / "prep", _ids(5000, 70_000, np.uint32), _ids(400, 70_000, np.uint32))
    with pytest.raises(ValueError, match="data.dtype: uint16, but .*meta.json says the tokens are uint32"):
        load_corpus(str(d), None, 0.1, 16, dtype="uint16")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="without meta.json"):
        load_corpus(str(tmp_path / "empty"), None, 0.1, 16)
    (d / "meta.json").write_text(json.dumps({**json.loads((d / "meta.json").read_text()), "tokens": {"train": 9}}))
    with pytest.raises(ValueError, match="train.bin holds 5000 tokens, but .*meta.json says 9"):
        load_corpus(str(d), None, 0.1, 16)
    (d / "meta.json").write_text("{not json")
    with pytest.raises(ValueError, match="meta.json is not valid JSON"):
        load_corpus(str(d), None, 0.1, 16)
    (d / "meta.json").write_text(json.dumps({"format": 1, "vocab_size": 70_000, "dtype": "int8"}))
    with pytest.raises(ValueError, match="dtype of uint16 or uint32; got vocab_size=70000, dtype='int8'"):
        load_corpus(str(d), None, 0.1, 16)
    (d / "meta.json").unlink()
    (d / "val.bin").unlink()
    with pytest.raises(ValueError, match="data.vocab_size: required"):  # now a bare train.bin
        load_corpus(str(d / "train.bin"), None, 0.1, 16)


def test_uint32_token_file_and_the_scan(tmp_path):
    ids = _ids(6000, 100_000, np.uint32, top=99_999)
    ids.tofile(tmp_path / "tokens.bin")
    c = load_corpus(str(tmp_path / "tokens.bin"), 100_000, 0.1, 16, dtype="uint32")
    assert c.train.dtype == np.uint32 and c.vocab_size == 100_000 and c.eos_id is None
    assert np.array_equal(np.concatenate([c.train, c.val]), ids)
    # The same bytes read as uint16 (the default): 12000 ids, the low and high halves of the uint32 ones.
    largest = int(ids.view(np.uint16).max())
    with pytest.raises(ValueError, match=rf"tokens.bin holds token id {largest}, outside the vocabulary of 1000 tok"):
        load_corpus(str(tmp_path / "tokens.bin"), 1000, 0.1, 16)
    with pytest.raises(ValueError, match=r"data.dtype: uint32 applies to token files"):
        load_corpus(None, None, 0.1, 16, dtype="uint32")


def test_max_token_scans_every_chunk(monkeypatch):
    from trainer import data

    monkeypatch.setattr(data, "_SCAN_CHUNK", 1000)
    ids = np.zeros(10_500, dtype=np.uint16)
    for where in (0, 999, 1000, 5555, 10_499):
        ids[:] = 0
        ids[where] = 77
        assert data.max_token(ids) == 77


def _fit_exit(capsys, tmp_path, *overrides):
    """Exit status and stderr of an in-process one-step `trainer fit` of a tiny GPT."""
    from trainer.cli import main

    capsys.readouterr()
    code = main(["fit", str(ROOT / "configs/tiny.yaml"), *FAST, "train.steps=1", "model.n_layer=1",
                 "checkpoint.enabled=false", f"run.dir={tmp_path / 'run'}", *overrides])  # fmt: skip
    return code, capsys.readouterr().err


def test_fit_on_a_uint32_prepared_directory(capsys, tmp_path):
    d = _prepared(tmp_path / "prep", _ids(5000, 70_000, np.uint32, top=69_999), _ids(400, 70_000, np.uint32))
    code, err = _fit_exit(capsys, tmp_path, f"data.path={d}")
    assert code == 0, err


def test_fit_exits_2_on_token_ids_outside_the_vocabulary(capsys, tmp_path):
    _ids(5000, 1000, np.uint16, top=4321).tofile(tmp_path / "train.bin")
    code, err = _fit_exit(capsys, tmp_path, f"data.path={tmp_path / 'train.bin'}", "data.vocab_size=1000")
    assert code == 2 and "Traceback" not in err
    assert f"{tmp_path / 'train.bin'} holds token id 4321" in err and "vocabulary of 1000 tokens" in err
    assert "data.vocab_size" in err and "(at least 4322)" in err and "data.dtype=uint32" in err
    d = _prepared(tmp_path / "prep", _ids(5000, 300, np.uint16), _ids(400, 300, np.uint16, top=300), vocab_size=300)
    code, err = _fit_exit(capsys, tmp_path, f"data.path={d}")
    assert code == 2 and f"{d / 'val.bin'} holds token id 300, outside the vocabulary of 300 tokens" in err
    assert "does not match" in err and "meta.json" in err


def test_fit_exits_2_on_a_token_file_of_a_bad_size(capsys, tmp_path):
    _ids(5001, 1000, np.uint16).tofile(tmp_path / "tokens.bin")  # 10002 bytes: not a whole number of uint32
    code, err = _fit_exit(capsys, tmp_path, f"data.path={tmp_path / 'tokens.bin'}", "data.vocab_size=1000",
                          "data.dtype=uint32")  # fmt: skip
    assert code == 2 and "Traceback" not in err
    assert f"{tmp_path / 'tokens.bin'} is 10002 bytes, not a whole number of uint32 tokens (4 bytes each)" in err


def test_fit_exits_2_when_data_vocab_size_disagrees_with_meta(capsys, tmp_path):
    d = _prepared(tmp_path / "prep", _ids(5000, 300, np.uint16), _ids(400, 300, np.uint16), vocab_size=300)
    code, err = _fit_exit(capsys, tmp_path, f"data.path={d}", "data.vocab_size=512")
    assert code == 2 and "Traceback" not in err
    assert "data.vocab_size: 512" in err and f"{d / 'meta.json'}" in err and "vocabulary is 300" in err
    assert "leave data.vocab_size unset" in err
