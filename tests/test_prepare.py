"""`trainer prepare` and the tokenizer layer (trainer/codec.py), on CPU with small inputs and vocabularies."""

import hashlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT

from trainer import cli, prepare
from trainer.codec import ByteCodec, codec_for_data, load_tokenizer

# A literal "<|endoftext|>" inside a document must stay text: only the EOS written between documents is EOS.
TEXT_DOC = "A text file: naïve café, 日本語, tabs\tand\nnewlines.\nIt mentions <|endoftext|> literally.\n"
JSONL_DOCS = [f"json document {i}: " + "word " * (i % 7) + "ünïcode" for i in range(40)]
PARQUET_DOCS = [f"parquet row {i} — {'x' * i}" for i in range(30)]


def _prepare(*argv) -> int:
    return cli.main(["prepare", *map(str, argv)])


@pytest.fixture
def mixed(tmp_path):
    """A text file, a .jsonl (with a blank line and an extra field) and a .parquet; returns (paths, documents)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "notes.txt").write_text(TEXT_DOC, encoding="utf-8")
    lines = [json.dumps({"id": i, "text": t}) for i, t in enumerate(JSONL_DOCS)]
    (src / "docs.jsonl").write_text("\n".join(lines[:20] + [""] + lines[20:]) + "\n", encoding="utf-8")
    pq.write_table(pa.table({"text": PARQUET_DOCS, "n": list(range(30))}), src / "rows.parquet")
    paths = [src / "notes.txt", src / "docs.jsonl", src / "rows.parquet"]
    return paths, [TEXT_DOC, *JSONL_DOCS, *PARQUET_DOCS]


def _byte_tokenizer_json(path: Path) -> None:
    """A byte-level BPE with no merges (one token per byte) and <|endoftext|> as id 0, built without our code."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path))


def _tokens(out: Path, split: str) -> np.ndarray:
    meta = json.loads((out / "meta.json").read_text())
    return np.fromfile(out / f"{split}.bin", dtype=np.dtype(meta["dtype"]))


def _decoded_documents(out: Path) -> list[str]:
    """Every document of train.bin and val.bin, split at EOS; each file must end with EOS."""
    codec = codec_for_data(str(out))
    docs = []
    for split in ("train", "val"):
        ids = _tokens(out, split)
        if len(ids):
            assert ids[-1] == codec.eos_id
        ends = np.flatnonzero(ids == codec.eos_id)
        starts = np.concatenate([[0], ends[:-1] + 1])
        docs += [codec.decode(ids[s:e].tolist()) for s, e in zip(starts, ends)]
    return docs


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("tok", ["bpe:512", "tokenizer.json"])
def test_prepare_round_trips_mixed_sources(tmp_path, mixed, tok):
    paths, docs = mixed
    if tok == "tokenizer.json":
        tok = tmp_path / "tokenizer.json"
        _byte_tokenizer_json(tok)
    out = tmp_path / "out"
    assert _prepare(*paths, "--tokenizer", tok, "--out", out, "--val-fraction", "0.2", "--workers", "2") == 0
    assert sorted(_decoded_documents(out)) == sorted(docs)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["format"] == 1 and meta["tokenizer"] == str(tok) and meta["field"] == "text"
    assert meta["dtype"] == "uint16" and meta["eos_id"] == 0
    assert meta["documents"]["train"] + meta["documents"]["val"] == len(docs)
    assert meta["documents"]["val"] > 0 and meta["documents"]["train"] > 0
    for split in ("train", "val"):
        assert (out / f"{split}.bin").stat().st_size == 2 * meta["tokens"][split]
    assert meta["sources"] == [{"path": str(p), "sha256": _sha256(p)} for p in paths]
    assert load_tokenizer(str(out / "tokenizer.json")).vocab_size == meta["vocab_size"]
    if meta["tokenizer"].startswith("bpe:"):
        assert meta["vocab_size"] <= 512
    else:  # one token per byte: the token count is the byte count plus one EOS per document
        assert sum(meta["tokens"].values()) == sum(len(d.encode()) + 1 for d in docs)


def test_prepare_uint32_vocabulary(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    docs = ["w69999 w3 w65534", "w65535 w65536 w0", "w1 w2 w68000 w12345"]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    out = tmp_path / "out"
    argv = [tmp_path / "d.jsonl", "--field", "body", "--tokenizer", tmp_path / "tokenizer.json", "--out", out]
    assert _prepare(*argv, "--val-fraction", "0") == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_002
    assert (out / "train.bin").stat().st_size == 4 * meta["tokens"]["train"] == 4 * 13
    ids = _tokens(out, "train")
    assert ids.max() == 70_001 and (ids > 65_535).sum() == 5
    assert _decoded_documents(out) == docs


_DETERMINISM = """
import sys
from trainer import cli, prepare
prepare.CHUNK_CHARS = 300  # many chunks, so that two workers both get some
sys.exit(cli.main(["prepare", *sys.argv[1:]]))
"""


def test_prepare_is_deterministic_across_workers_and_processes(tmp_path, mixed, monkeypatch):
    paths, _ = mixed
    args = [*paths, "--tokenizer", "bpe:400", "--val-fraction", "0.2"]
    monkeypatch.setattr(prepare, "CHUNK_CHARS", 300)
    assert _prepare(*args, "--out", tmp_path / "a", "--workers", "1") == 0
    # Another process (its own hash seeds) with two workers: the BPE and the files must not change.
    argv = [*map(str, args), "--out", str(tmp_path / "b"), "--workers", "2"]
    run = subprocess.run(
        [sys.executable, "-c", _DETERMINISM, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    for name in ("train.bin", "val.bin", "meta.json", "tokenizer.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


_KILLED = """
import os, signal, sys
from trainer import cli, prepare
prepare.CHUNK_CHARS = 300
encode, calls = prepare._encode_chunk, []
def encode_then_die(chunk):
    calls.append(1)
    if len(calls) == 4:  # three chunks are written by now
        os.kill(os.getpid(), signal.SIGKILL)
    return encode(chunk)
prepare._encode_chunk = encode_then_die
sys.exit(cli.main(["prepare", *sys.argv[1:]]))
"""


def test_killed_prepare_leaves_no_output(tmp_path, mixed):
    paths, docs = mixed
    out = tmp_path / "out"
    argv = [*map(str, paths), "--tokenizer", "bpe:300", "--out", str(out), "--workers", "1"]
    run = subprocess.run([sys.executable, "-c", _KILLED, *argv], cwd=ROOT, capture_output=True, timeout=120)
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert not out.exists()
    (tmp,) = tmp_path.glob("out.tmp-*")  # the killed run's scratch directory, holding what it had written
    assert (tmp / "train.bin").stat().st_size > 0 and not (tmp / "meta.json").exists()
    assert _prepare(*paths, "--tokenizer", "bpe:300", "--out", out) == 0
    assert not tmp.exists(), "a later prepare removes the scratch directory of a dead one"
    assert sorted(_decoded_documents(out)) == sorted(docs)


def test_failed_prepare_cleans_up(tmp_path, mixed, monkeypatch):
    paths, _ = mixed
    calls = []

    def fail_third(chunk):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return encode(chunk)

    encode = prepare._encode_chunk
    monkeypatch.setattr(prepare, "CHUNK_CHARS", 300)
    monkeypatch.setattr(prepare, "_encode_chunk", fail_third)
    with pytest.raises(RuntimeError, match="boom"):
        _prepare(*paths, "--tokenizer", "bpe:300", "--out", tmp_path / "out", "--workers", "1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_existing_output_is_refused_unless_forced(tmp_path, mixed, capsys):
    paths, _ = mixed
    out = tmp_path / "out"
    assert _prepare(paths[0], "--tokenizer", "bpe:300", "--out", out) == 0
    before = (out / "meta.json").read_text()
    capsys.readouterr()
    assert _prepare(paths[1], "--tokenizer", "bpe:300", "--out", out) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "--force" in err and "Traceback" not in err
    assert (out / "meta.json").read_text() == before
    assert _prepare(paths[1], "--tokenizer", "bpe:300", "--out", out, "--force") == 0
    assert sum(json.loads((out / "meta.json").read_text())["documents"].values()) == len(JSONL_DOCS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_non_empty_directory_without_meta_is_refused(tmp_path, mixed, capsys):
    paths, _ = mixed
    out = tmp_path / "mine"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert _prepare(paths[0], "--out", out, "--force") == 2
    assert "not empty" in capsys.readouterr().err and (out / "keep.txt").read_text() == "precious"
    (out / "keep.txt").unlink()
    assert _prepare(paths[0], "--tokenizer", "bpe:300", "--out", out, "--val-fraction", "0") == 0  # empty: fine


def _refusals(tmp_path: Path, paths: list[Path]) -> list[tuple[list, str]]:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n\n')
    # A bad --val-fraction or --workers is the parser's to refuse, with the usage: tests/test_config.py.
    return [
        ([tmp_path / "missing.txt"], f"source {tmp_path / 'missing.txt'}: no such file or directory"),
        ([tmp_path / "empty.txt", tmp_path / "empty.jsonl"], "holds no documents"),
        ([paths[1], "--field", "body"], f"source {paths[1]}: no field 'body' (fields: id, text)"),
        ([paths[2], "--field", "body"], f"source {paths[2]}: no field 'body' (fields: text, n)"),
        ([paths[0], "--tokenizer", "bpe:100"], "tokenizer bpe:100: N must be at least 257"),
        ([paths[0], "--tokenizer", "bpe:8k"], "tokenizer bpe:8k: expected bpe:N with N an integer"),
        ([paths[0], "--tokenizer", "gpt2"], "did you mean tiktoken:gpt2?"),
        ([paths[0], "--tokenizer", "bpe-512"], "did you mean bpe:512?"),
        ([paths[0], "--tokenizer", "tiktokn:cl100k_base"], "did you mean tiktoken:cl100k_base?"),
        ([paths[0], "--tokenizer", tmp_path / "nope.json"], "no such file or directory"),
        ([paths[0], "--tokenizer", paths[1]], "is not a Hugging Face tokenizer.json"),
    ]


def test_user_errors_exit_2_with_one_message(tmp_path, mixed, capsys):
    paths, _ = mixed
    for argv, message in _refusals(tmp_path, paths):
        out = tmp_path / "out"
        assert _prepare(*argv, "--out", out) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.startswith("trainer: error: ") and err.count("\n") == 1, (argv, err)
        assert not out.exists(), argv


def test_missing_optional_packages_are_named(tmp_path, mixed, capsys, monkeypatch):
    paths, _ = mixed
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    cases = [
        (
            [paths[0], "--tokenizer", "tiktoken:gpt2"],
            "needs the tiktoken package (pip install tiktoken, or",
        ),
        ([paths[2]], "reading .parquet needs pyarrow (pip install pyarrow"),
        (["hf:roneneldan/TinyStories"], "needs the datasets package (pip install datasets"),
    ]
    for argv, message in cases:
        assert _prepare(*argv, "--out", tmp_path / "out") == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert _prepare(paths[0], "--tokenizer", "tiktoken:gpt2", "--out", tmp_path / "out") == 2
    assert "use bpe:N (trained on the sources, offline) or a local tokenizer.json" in capsys.readouterr().err


def test_embedded_corpus(tmp_path, monkeypatch):
    """No SOURCE: the standard library's files. A subset keeps this fast; the whole corpus takes ~3-7 s
    (bpe:8192 on 2 cores)."""
    import trainer.data

    files = trainer.data.stdlib_files()
    assert len(files) > 100
    subset = files[:5]
    monkeypatch.setattr(trainer.data, "stdlib_files", lambda: subset)
    out = tmp_path / "stdlib"
    assert _prepare("--out", out, "--tokenizer", "bpe:300", "--val-fraction", "0.2") == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["documents"]["train"] + meta["documents"]["val"] == len(subset) == 5
    assert meta["documents"]["val"] >= 1  # where no key hashes below 0.2, the lowest one goes to val
    expected = [f.read_text(encoding="utf-8", errors="replace") for f in subset]
    assert sorted(_decoded_documents(out)) == sorted(expected)


def test_single_document_goes_to_train(tmp_path, capsys):
    (tmp_path / "one.txt").write_text("just one document\n")
    assert _prepare(tmp_path / "one.txt", "--tokenizer", "bpe:260", "--out", tmp_path / "out") == 0
    assert "warning: val.bin is empty (the corpus is one document)" in capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["documents"] == {"train": 1, "val": 0}


def test_directory_source_is_recursive_and_skips_output(tmp_path):
    src = tmp_path / "corpus"
    (src / "b").mkdir(parents=True)
    (src / "a.md").write_text("first")
    (src / "b" / "c.py").write_text("second")
    (src / ".hidden").write_text("never read")
    out = src / "prepared"  # inside the source: a rerun must not read its own output
    for force in ([], ["--force"]):
        assert _prepare(src, "--tokenizer", "bpe:260", "--out", out, "--val-fraction", "0", *force) == 0
        assert sorted(_decoded_documents(out)) == ["first", "second"]


def test_codec_for_data(tmp_path, mixed):
    paths, _ = mixed
    assert isinstance(codec_for_data(None), ByteCodec) and isinstance(codec_for_data(str(paths[0])), ByteCodec)
    assert codec_for_data(None).decode(list("é".encode()) + [300]) == "é\ufffd"
    out = tmp_path / "out"
    assert _prepare(*paths, "--tokenizer", "bpe:300", "--out", out) == 0
    for path in (out, out / "train.bin"):
        codec = codec_for_data(str(path))
        assert codec.name == "bpe:300" and codec.eos_id == 0 and codec.decode(codec.encode(TEXT_DOC)) == TEXT_DOC
    bare = tmp_path / "bare.bin"
    np.zeros(10, np.uint16).tofile(bare)
    with pytest.raises(ValueError, match="no tokenizer is recorded"):
        codec_for_data(str(bare))
    with pytest.raises(FileNotFoundError):
        codec_for_data(str(tmp_path / "missing"))


def test_model_directory_eos_from_tokenizer_config(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "</s>": 1, "<|endoftext|>": 2, "hi": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["</s>", "<|endoftext|>"])
    model = tmp_path / "model"
    model.mkdir()
    tok.save(str(model / "tokenizer.json"))
    assert load_tokenizer(str(model)).eos_id == 2  # no tokenizer_config.json: <|endoftext|> comes first
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    codec = load_tokenizer(str(model))
    assert codec.eos_id == 1 and codec.vocab_size == 4 and codec.encode("hi hi") == [3, 3]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no tokenizer.json"):
        load_tokenizer(str(empty))


class _FakeDataset(list):
    """The part of a ``datasets.Dataset`` prepare uses: rows as dicts, column names, a fingerprint."""

    column_names = ["text", "id"]
    _fingerprint = "0123abcd"


def test_hf_source_reads_the_train_split(tmp_path, monkeypatch):
    import types

    rows = _FakeDataset({"text": f"story {i}", "id": i} for i in range(12))
    calls = []

    def load_dataset(name, split):
        calls.append((name, split))
        return rows

    fake = types.SimpleNamespace(load_dataset=load_dataset, load_from_disk=None, DatasetDict=dict)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    out = tmp_path / "out"
    assert _prepare("hf:someone/stories", "--tokenizer", "bpe:260", "--out", out) == 0
    assert calls == [("someone/stories", "train")]
    assert sorted(_decoded_documents(out)) == sorted(r["text"] for r in rows)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["sources"] == [{"path": "hf:someone/stories", "sha256": hashlib.sha256(b"0123abcd").hexdigest()}]
