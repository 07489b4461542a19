"""`trainer prepare` on instruction data: chat and prompt/completion records, their loss masks and document offsets
(trainer/instruct.py), chat templates (trainer/chat.py) and the stdlib:functions source, on CPU with small inputs."""

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer import chat, cli, instruct, prepare
from trainer.codec import load_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]
CHAT = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "bye"},
    {"role": "assistant", "content": "ciao"},
]
# The ChatML rendering of CHAT cut where the targets (the assistant turns and their end-of-turn markers) begin and end.
CHAT_PIECES = [
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", False),
    ("hello<|im_end|>\n", True),
    ("<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n", False),
    ("ciao<|im_end|>\n", True),
]


def _prepare(*argv) -> int:
    return cli.main(["prepare", *map(str, argv)])


def _byte_tokenizer(d: Path, config: dict | None = None, specials: list[str] = SPECIALS) -> Path:
    """A model directory: a byte-level BPE without merges (one token per byte) and ``specials`` as the first ids,
    built without our code, and a tokenizer_config.json where ``config`` is given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    d.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {**{t: i for i, t in enumerate(specials)}, **{c: i + len(specials) for i, c in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(d / "tokenizer.json"))
    if config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def _expected(tok_dir: Path, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Tokens and mask of ``pieces``, each encoded by the tokenizers library (special tokens read as such)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tokens, mask = [], []
    for text, target in pieces:
        ids = tok.encode(text, add_special_tokens=False).ids
        tokens += ids
        mask += [int(target)] * len(ids)
    return tokens, mask


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _split(out: Path, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A split's tokens, mask and document offsets, checked against each other and meta.json."""
    meta = json.loads((out / "meta.json").read_text())
    tokens = np.fromfile(out / f"{split}.bin", dtype=np.dtype(meta["dtype"]))
    mask = np.fromfile(out / f"{split}.mask.bin", dtype=np.uint8)
    docs = np.load(out / f"{split}.docs.npy")
    assert docs.dtype == np.int64 and len(docs) == meta["documents"][split] + 1
    assert docs[0] == 0 and docs[-1] == len(tokens) == len(mask) == meta["tokens"][split]
    assert (np.diff(docs) > 0).all() and set(np.unique(mask)) <= {0, 1}
    assert int(mask.sum()) == meta["targets"][split]
    return tokens, mask, docs


def test_chat_masks_only_the_assistant_turns(tmp_path):
    tok = _byte_tokenizer(tmp_path / "tok")
    src = _jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    out = tmp_path / "out"
    assert _prepare(src, "--tokenizer", tok, "--out", out, "--val-fraction", "0") == 0
    tokens, mask, docs = _split(out, "train")
    expected_tokens, expected_mask = _expected(tok, CHAT_PIECES)
    assert tokens.tolist() == expected_tokens and mask.tolist() == expected_mask
    assert docs.tolist() == [0, len(expected_tokens)]  # no EOS after a chat: the template ends each turn
    codec = load_tokenizer(str(out / "tokenizer.json"))
    assert codec.decode(tokens[mask == 1].tolist()) == "hello<|im_end|>\nciao<|im_end|>\n"
    assert tokens.tolist().count(SPECIALS.index("<|im_end|>")) == 4  # each marker is one special token
    meta = json.loads((out / "meta.json").read_text())
    assert meta["format"] == "chat" and meta["train_on"] == "completion" and meta["skipped"] == 0
    assert meta["document_tokens"] == {"min": len(tokens), "median": float(len(tokens)), "max": len(tokens)}
    assert meta["chat_template"] == "chat_template.jinja"
    assert (out / "chat_template.jinja").read_text() == chat.DEFAULT_TEMPLATE
    assert meta["chat_template_variables"] == {"eos_token": "<|endoftext|>"}  # from the codec: no config names one
    assert _split(out, "val")[0].size == 0


def test_completion_masks_the_completion_and_its_eos(tmp_path):
    tok = _byte_tokenizer(tmp_path / "tok")
    records = [{"prompt": "Q: 1+1?\nA:", "completion": " 2"}, {"prompt": "Q: naïve?\nA:", "completion": " yes"}]
    out = tmp_path / "out"
    argv = [_jsonl(tmp_path / "qa.jsonl", records), "--tokenizer", tok, "--out", out, "--val-fraction", "0"]
    assert _prepare(*argv) == 0
    tokens, mask, docs = _split(out, "train")
    want_tokens, want_mask = [], []
    for r in records:
        t, m = _expected(tok, [(r["prompt"], False), (r["completion"], True)])
        want_tokens += t + [0]  # EOS (<|endoftext|>, id 0) ends a completion, a target
        want_mask += m + [1]
    assert tokens.tolist() == want_tokens and mask.tolist() == want_mask
    assert docs.tolist() == [0, len(records[0]["prompt"] + records[0]["completion"]) + 1, len(want_tokens)]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["format"] == "completion" and "chat_template" not in meta and not (out / "chat_template.jinja").exists()


def test_train_on_all_makes_every_token_a_target(tmp_path):
    tok = _byte_tokenizer(tmp_path / "tok")
    src = _jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    for train_on in ("completion", "all"):
        argv = [src, "--tokenizer", tok, "--out", tmp_path / train_on, "--val-fraction", "0", "--train-on", train_on]
        assert _prepare(*argv) == 0
    tokens, mask, _ = _split(tmp_path / "all", "train")
    assert tokens.tolist() == _split(tmp_path / "completion", "train")[0].tolist()  # one token per byte: no merges
    assert mask.all() and json.loads((tmp_path / "all" / "meta.json").read_text())["train_on"] == "all"


def test_load_template_sources_in_order(tmp_path):
    assert chat.load_template("bpe:512") == (chat.DEFAULT_TEMPLATE, {"eos_token": "<|endoftext|>"})
    tok = _byte_tokenizer(tmp_path / "tok")
    assert chat.load_template(str(tok)) == (chat.DEFAULT_TEMPLATE, {})
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": "from config"}
    _byte_tokenizer(tok, config)
    for spec in (tok, tok / "tokenizer.json"):  # a directory, or the tokenizer.json in it
        assert chat.load_template(str(spec)) == ("from config", {"bos_token": "<s>", "eos_token": "</s>"})
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "listed"}]
    _byte_tokenizer(tok, config)
    assert chat.load_template(str(tok))[0] == "listed"
    (tok / "chat_template.jinja").write_text("from file")
    assert chat.load_template(str(tok))[0] == "from file"
    (tmp_path / "mine.jinja").write_text("given")
    assert chat.load_template(str(tok), tmp_path / "mine.jinja")[0] == "given"
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}]
    _byte_tokenizer(tok, config)
    (tok / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="none named 'default'; pass --chat-template PATH"):
        chat.load_template(str(tok))


# A Llama-2-like template: BOS, [INST] turns, the assistant's content ended by EOS; raise_exception on a bad order.
CONFIG_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %} {{ m['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)


def test_template_from_tokenizer_config(tmp_path, capsys):
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": CONFIG_TEMPLATE}
    tok = _byte_tokenizer(tmp_path / "tok", config)
    src = _jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    out = tmp_path / "out"
    assert _prepare(src, "--tokenizer", tok, "--out", out, "--val-fraction", "0") == 0
    tokens, mask, _ = _split(out, "train")
    pieces = [("<s>[INST] hi [/INST]", False), (" hello</s>", True), ("[INST] bye [/INST]", False), (" ciao</s>", True)]
    assert (tokens.tolist(), mask.tolist()) == _expected(tok, pieces)
    meta = json.loads((out / "meta.json").read_text())
    assert (out / "chat_template.jinja").read_text() == CONFIG_TEMPLATE
    assert meta["chat_template_variables"] == {"bos_token": "<s>", "eos_token": "</s>"}
    assert meta["eos_id"] == SPECIALS.index("</s>")
    bad = _jsonl(tmp_path / "bad.jsonl", [{"messages": CHAT[1:]}])
    assert _prepare(bad, "--tokenizer", tok, "--out", tmp_path / "bad") == 2
    assert f"{bad} line 1: the chat template failed: roles must alternate user/assistant" in capsys.readouterr().err


def test_a_template_whose_renderings_are_not_prefixes_is_refused(tmp_path, capsys):
    # The last message alone is followed by <end>: the rendering of the first two messages is no prefix of all four.
    template = "{% for m in messages %}{{ m['content'] }}{% if loop.last %}<end>{% endif %}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    src = _jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    argv = [src, "--tokenizer", "bpe:300", "--chat-template", tmp_path / "t.jinja", "--val-fraction", "0"]
    assert _prepare(*argv, "--out", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"{src} line 1: the chat template renders" in err and "prefixes of each other" in err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="record 7: .* assistant message 1"):
        chat.segments(template, CHAT, "completion", {}, where="record 7")
    assert _prepare(*argv, "--out", tmp_path / "all", "--train-on", "all") == 0  # one piece: nothing to cut


def test_segments_concatenate_to_the_rendering():
    messages = [{"role": "system", "content": "be brief"}, *CHAT, {"role": "user", "content": "one more"}]
    for train_on in ("completion", "all"):
        pieces = chat.segments(chat.DEFAULT_TEMPLATE, messages, train_on, {})
        assert "".join(text for text, _ in pieces) == chat.render(chat.DEFAULT_TEMPLATE, messages)
    pieces = chat.segments(chat.DEFAULT_TEMPLATE, messages, "completion", {})
    assert [text for text, target in pieces if target] == ["hello<|im_end|>\n", "ciao<|im_end|>\n"]
    assert pieces[-1] == ("<|im_start|>user\none more<|im_end|>\n", False)
    assert chat.render(chat.DEFAULT_TEMPLATE, CHAT[:1], add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    assert chat.render("{{ x | tojson }}", [], x={"é": [1]}) == '{"é": [1]}'  # transformers' tojson: no ASCII escapes


_MANY = [
    {"messages": [{"role": "user", "content": f"question {i} " * (i % 5 + 1)}, {"role": "assistant", "content": a}]}
    for i, a in enumerate(f"answer {j} é" * (j % 3 + 1) for j in range(60))
]


def test_instruction_files_do_not_depend_on_the_worker_count(tmp_path, monkeypatch):
    src = _jsonl(tmp_path / "chat.jsonl", _MANY)
    qa = _jsonl(tmp_path / "qa.jsonl", [{"prompt": f"p{i}", "completion": f" c{i}"} for i in range(40)])
    monkeypatch.setattr(prepare, "CHUNK_CHARS", 300)  # many chunks, so that two workers both get some
    for name, source in (("chat", src), ("completion", qa)):
        for workers in ("1", "2"):
            argv = [source, "--tokenizer", "bpe:400", "--val-fraction", "0.2", "--workers", workers]
            assert _prepare(*argv, "--out", tmp_path / f"{name}{workers}") == 0
        files = sorted(p.name for p in (tmp_path / f"{name}1").iterdir())
        assert {"train.mask.bin", "val.docs.npy"} <= set(files)
        for f in files:
            assert (tmp_path / f"{name}1" / f).read_bytes() == (tmp_path / f"{name}2" / f).read_bytes(), (name, f)
        meta = json.loads((tmp_path / f"{name}1" / "meta.json").read_text())
        assert meta["documents"]["val"] > 0 and meta["documents"]["train"] > 0
        for split in ("train", "val"):
            _split(tmp_path / f"{name}1", split)


def test_bpe_trained_for_chat_makes_the_template_markers_tokens(tmp_path):
    src = _jsonl(tmp_path / "chat.jsonl", _MANY)
    out = tmp_path / "out"
    assert _prepare(src, "--tokenizer", "bpe:300", "--out", out, "--val-fraction", "0") == 0
    codec = load_tokenizer(str(out / "tokenizer.json"))
    assert [codec.tokenizer.token_to_id(t) for t in SPECIALS[:3]] == [0, 1, 2]
    assert codec.encode("<|im_end|>", special=True) == [2] and len(codec.encode("<|im_end|>")) > 1
    tokens, mask, docs = _split(out, "train")
    assert (tokens == 1).sum() == (tokens == 2).sum() == 2 * len(_MANY)  # two turns a record
    assert tokens[docs[:-1]].tolist() == [1] * len(_MANY)  # each document opens with <|im_start|>
    assert (tokens == 0).sum() == 0  # no EOS in chat data


def test_parquet_and_dataset_chat_sources(tmp_path, monkeypatch):
    import sys
    import types

    class Rows(list):
        column_names = ["messages", "id"]
        _fingerprint = "f00d"

    rows = Rows({"messages": CHAT, "id": i} for i in range(3))
    fake = types.SimpleNamespace(load_dataset=lambda name, split: rows, load_from_disk=None, DatasetDict=dict)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    pq.write_table(pa.table({"messages": [CHAT, CHAT[:2]]}), tmp_path / "c.parquet")
    tok = _byte_tokenizer(tmp_path / "tok")
    out = tmp_path / "out"
    argv = [tmp_path / "c.parquet", "hf:someone/chats", "--tokenizer", tok, "--out", out, "--val-fraction", "0"]
    assert _prepare(*argv) == 0
    tokens, mask, docs = _split(out, "train")
    one = _expected(tok, CHAT_PIECES)
    assert tokens.tolist() == one[0] + _expected(tok, CHAT_PIECES[:2])[0] + 3 * one[0]
    assert np.diff(docs).tolist() == [len(one[0]), len(_expected(tok, CHAT_PIECES[:2])[0])] + 3 * [len(one[0])]


# The pretraining files of these inputs as trainer prepare wrote them before instruction data existed.
PRETRAINING_SHA256 = {
    "train.bin": "8cdc89369d18f82fef235559b1ce26fd83d31acee6b1fb4c9270978c8c400a5f",
    "val.bin": "f5d9b528e4a5fa0d0348b42654d6ba87d322cec18aa6f45582a016e8f5d9a824",
}


def test_pretraining_output_is_unchanged(tmp_path):
    """Text data keeps its files, bytes and meta.json keys (a tokenizer without merges: no training to vary)."""
    tok = _byte_tokenizer(tmp_path / "tok", specials=SPECIALS[:1])
    (tmp_path / "a.txt").write_text("A text file: naïve café.\n", encoding="utf-8")
    _jsonl(tmp_path / "b.jsonl", [{"text": f"line {i} " * (i % 5 + 1)} for i in range(30)])
    out = tmp_path / "out"
    argv = [tmp_path / "a.txt", tmp_path / "b.jsonl", "--tokenizer", tok / "tokenizer.json", "--out", out]
    assert _prepare(*argv, "--val-fraction", "0.2", "--workers", "1") == 0
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
    meta = json.loads((out / "meta.json").read_text())
    keys = ["format", "tokenizer", "vocab_size", "eos_id", "dtype", "tokens", "documents", "sources", "field"]
    assert list(meta) == [*keys, "val_fraction"] and meta["format"] == 1
    assert {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in PRETRAINING_SHA256} == (
        PRETRAINING_SHA256
    )


def test_stdlib_functions_records(tmp_path):
    source = (
        '''
import os


def plain(a, *, b: int = 2) -> int:
    """Add.

    More words.
    """
    # a comment stays
    if a:
        return a + b
    s = """
text at column 0
"""
    return b


def no_docstring():
    return 1


def only_docstring():
    """Nothing else."""


class K:
    async def m(self):
        """Wait."""
        await x

    def m(self):
        """Again."""
        return 2


def long():
    """Too long."""
    x = 1
'''
        + "    y = 2\n" * 700  # 4,206 characters, past MAX_BODY_CHARS
    )
    f = tmp_path / "mod.py"
    f.write_text(source)
    records = instruct._functions_in((f, "pkg/mod.py"))
    assert [(key, i) for key, i, _ in records] == [
        ("pkg/mod.py:plain", 0),
        ("pkg/mod.py:K.m", 0),
        ("pkg/mod.py:K.m", 1),
    ]
    user, assistant = records[0][2]
    assert user == {"role": "user", "content": "def plain(a, *, b: int=2) -> int:\nAdd.\n\nMore words."}
    body = '# a comment stays\nif a:\n    return a + b\ns = """\ntext at column 0\n"""\nreturn b'
    assert assistant == {"role": "assistant", "content": body}
    assert records[1][2][0]["content"] == "async def m(self):\nWait." and records[1][2][1]["content"] == "await x"


def test_stdlib_functions_source(tmp_path, monkeypatch, capsys):
    """Three files of the standard library keep this fast; the whole of it (6,561 records) takes about 8 s with
    bpe:4096 on 2 cores."""
    import trainer.data

    subset = [f for f in trainer.data.stdlib_files() if f.name in ("textwrap.py", "shlex.py", "bisect.py")]
    monkeypatch.setattr(trainer.data, "stdlib_files", lambda: subset)
    out = tmp_path / "sft"
    assert _prepare(instruct.FUNCTIONS, "--tokenizer", "bpe:400", "--out", out, "--seq-len", "64") == 0
    lines = capsys.readouterr().out.splitlines()
    meta = json.loads((out / "meta.json").read_text())
    records = instruct.stdlib_functions()
    assert meta["format"] == "chat" and meta["documents"]["train"] + meta["documents"]["val"] == len(records) > 20
    assert meta["sources"][0]["path"] == "stdlib:functions" and meta["targets"]["train"] > 0
    assert {key.partition(":")[0] for key, _, _ in records} == {"textwrap.py", "shlex.py", "bisect.py"}
    codec = load_tokenizer(str(out / "tokenizer.json"))
    tokens, mask, docs = _split(out, "train")
    first = codec.decode(tokens[docs[0] : docs[1]].tolist())
    assert re.match(r"<\|im_start\|>user\ndef \w+\(", first), first
    lengths = np.concatenate([np.diff(_split(out, s)[2]) for s in ("train", "val")])
    targets, total = sum(meta["targets"].values()), sum(meta["tokens"].values())
    assert lines[1] == (
        f"chat data, --train-on completion: {targets:,} target tokens ({targets / total:.1%} of tokens); document "
        f"tokens min {lengths[: meta['documents']['train']].min()}, median "
        f"{np.median(lengths[: meta['documents']['train']]):,.0f}, max {lengths[: meta['documents']['train']].max():,} "
        "(train)"
    )
    long = int((lengths > 64).sum())
    assert long > 0
    assert lines[2] == (
        f"{long} of {len(lengths)} documents are longer than --seq-len 64 tokens; they are split into pieces of 64 at "
        "training"
    )


def test_records_without_a_target_are_skipped_and_counted(tmp_path, capsys):
    records = [{"messages": CHAT}, {"messages": [{"role": "user", "content": "no answer"}]}, {"messages": []}]
    src = _jsonl(tmp_path / "chat.jsonl", records)
    tok = _byte_tokenizer(tmp_path / "tok")
    assert _prepare(src, "--tokenizer", tok, "--out", tmp_path / "out", "--val-fraction", "0") == 0
    assert "skipped 2 records without a target token" in capsys.readouterr().out
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["skipped"] == 2 and meta["documents"] == {"train": 1, "val": 0}
    none = _jsonl(tmp_path / "none.jsonl", records[1:])
    assert _prepare(none, "--tokenizer", tok, "--out", tmp_path / "none") == 2
    assert "holds no document with a target token (2 records without one" in capsys.readouterr().err


def _refusals(tmp_path: Path) -> list[tuple[list, str]]:
    j = lambda name, *records: _jsonl(tmp_path / name, list(records))  # noqa: E731
    text = tmp_path / "notes.txt"
    text.write_text("plain text")
    chat_src = j("chat.jsonl", {"messages": CHAT})
    (tmp_path / "syntax.jinja").write_text("{% for m in messages %}")
    return [
        ([j("a.jsonl", {"messages": "hi"})], "a.jsonl line 1: 'messages' holds a str, not a list of {role, content}"),
        ([j("b.jsonl", {"messages": ["hi"]})], "b.jsonl line 1: message 0 is a str, not a {role, content} dict"),
        (
            [j("c.jsonl", {"messages": [{"from": "human", "value": "hi"}]})],
            "c.jsonl line 1: message 0 has no 'role' (keys: from, value); ShareGPT's {from, value}: rename them",
        ),
        ([j("d.jsonl", {"messages": [{"role": "user", "contents": "x"}]})], "did you mean 'contents'?"),
        ([j("e.jsonl", {"messages": [{"role": "user", "content": 3}]})], "message 0's content is a int, not text"),
        ([j("f.jsonl", {"prompt": "x", "answer": "y"})], "f.jsonl: no field 'text' (fields: prompt, answer)"),
        ([j("f.jsonl", {"prompt": "x", "answer": "y"})], "a prompt without a completion"),
        (
            [j("g.jsonl", {"prompt": "x", "completion": "y"}, {"prompt": "x"})],
            "g.jsonl line 2: a prompt without a completion; give every record both",
        ),
        (
            [j("h.jsonl", {"prompt": "x", "answer": "y"}), "--format", "completion"],
            "no field 'completion' for --format completion (fields: prompt, answer); rename 'answer' to 'completion'",
        ),
        (
            [j("i.jsonl", {"conversations": []}), "--format", "chat"],
            "ShareGPT's 'conversations' of {from, value}: convert them",
        ),
        ([chat_src, j("k.jsonl", {"text": "x"})], f"source {tmp_path / 'k.jsonl'}: holds text records but source"),
        ([text, "--format", "chat"], "notes.txt: holds text, not chat records; --format chat reads .jsonl"),
        ([chat_src, "--format", "text"], "no field 'text' (fields: messages); pass --field NAME"),
        (["stdlib:function"], "source stdlib:function: no such embedded source (did you mean stdlib:functions?)"),
        (["stdlib:functions", "--format", "text"], "source stdlib:functions: holds chat, not text records"),
        (["--format", "chat"], "--format chat: the embedded corpus is text; name a chat source"),
        ([chat_src, "--chat-template", tmp_path / "nope.jinja"], "no such file"),
        ([chat_src, "--chat-template", tmp_path / "syntax.jinja"], "the chat template does not parse"),
    ]


def test_user_errors_exit_2_with_one_message(tmp_path, capsys):
    for argv, message in _refusals(tmp_path):
        out = tmp_path / "out"
        assert _prepare(*argv, "--tokenizer", "bpe:300", "--out", out) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.startswith("trainer: error: ") and err.count("\n") == 1, (argv, err)
        assert not out.exists(), argv
    # An unknown --format is the parser's to refuse, with the usage.
    assert _prepare("x.jsonl", "--format", "sharegpt", "--out", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "usage: trainer prepare" in err and "--format: invalid choice: 'sharegpt'" in err


def test_flags_without_effect_on_text_are_named(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("some text")
    argv = [tmp_path / "a.txt", "--tokenizer", "bpe:260", "--out", tmp_path / "out", "--seq-len", "8"]
    assert _prepare(*argv, "--train-on", "all") == 0
    err = capsys.readouterr().err
    assert "--train-on has no effect on text data" in err and "--seq-len has no effect on text data" in err
    assert not (tmp_path / "out" / "train.mask.bin").exists()
