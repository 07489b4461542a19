"""Instruction data for ``trainer prepare``: chat and prompt/completion records, the tokens a model is trained to
predict in them (the loss mask), and the embedded ``stdlib:functions`` source.

A chat record is ``{"messages": [{"role": ..., "content": ...}, ...]}``, rendered with a chat template
(:mod:`trainer.chat`); a completion record is ``{"prompt": ..., "completion": ...}``, its document the prompt, the
completion and EOS. Besides train.bin and val.bin, instruction data has per split:

- ``<split>.mask.bin``: uint8, one per token, 1 where the token is a training target (the model is trained to predict
  it from the tokens before it): the assistant turns (with the template's end-of-turn marker) or the completion and
  its EOS under ``--train-on completion``, every token under ``--train-on all``;
- ``<split>.docs.npy``: int64, each document's first token offset, then the split's token count.
"""

from __future__ import annotations

import ast
import difflib
import gc
import multiprocessing
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer import chat

FORMATS = ("auto", "text", "chat", "completion")
INSTRUCTION_FORMATS = ("chat", "completion")
TRAIN_ON = ("completion", "all")
FUNCTIONS = "stdlib:functions"
MAX_BODY_CHARS = 4000  # longer function bodies are left out of stdlib:functions
_FIELDS = {"chat": ("messages",), "completion": ("prompt", "completion")}
# Field names of other conventions, and what to do with them.
_FOREIGN = {
    "conversations": "ShareGPT's 'conversations' of {from, value}: convert them to 'messages' of {role, content}",
    "response": "rename 'response' to 'completion'",
    "output": "rename 'output' to 'completion'",
    "answer": "rename 'answer' to 'completion'",
}


# ---- formats and records -------------------------------------------------------------------------------------


def detect(names: list[str] | None) -> str | None:
    """The format of a source whose first record has the fields ``names``: chat with ``messages``, completion with
    ``prompt`` and ``completion``, text otherwise; None for a source without records (it fits any)."""
    if names is None:
        return None
    if "messages" in names:
        return "chat"
    if "prompt" in names and "completion" in names:
        return "completion"
    return "text"


def check_fields(names: list[str] | None, fmt: str, where: str) -> None:
    """Raise unless a source whose first record has the fields ``names`` can be read as ``fmt`` (chat or completion).

    Raises:
        ValueError: a field ``fmt`` needs is missing, naming the fields there are and what to change.
    """
    missing = [f for f in _FIELDS[fmt] if names is not None and f not in names]
    if missing:
        hint = next((_FOREIGN[n] for n in names if n in _FOREIGN), None)
        close = difflib.get_close_matches(missing[0], names, n=1, cutoff=0.6)
        hint = hint or (f"did you mean {close[0]!r}? rename it to {missing[0]!r}" if close else None)
        hint = hint or ("pass --format text to read it as text" if fmt != "text" else None)
        raise ValueError(
            f"source {where}: no field {missing[0]!r} for --format {fmt} (fields: {', '.join(names)}); {hint}"
        )


def columns(fmt: str) -> list[str]:
    """The fields a record of ``fmt`` is read from."""
    return list(_FIELDS[fmt])


@dataclass
class Record:
    """One chat (``messages``) or prompt/completion record; ``where`` names it in errors."""

    where: str
    messages: list[dict] | None = None
    prompt: str = ""
    completion: str = ""

    @property
    def chars(self) -> int:
        if self.messages is None:
            return len(self.prompt) + len(self.completion)
        return sum(len(m["content"]) for m in self.messages)


def parse(row: dict, fmt: str, where: str) -> Record:
    """The record of a row (a .jsonl line, a .parquet row, a dataset row) read as ``fmt``.

    Raises:
        ValueError: ``messages`` that is not a list of ``{role, content}`` dicts with text in both; a prompt without a
            completion; a prompt or completion that is not text.
    """
    if fmt == "completion":
        for name in ("prompt", "completion"):
            if row.get(name) is None:
                other = "prompt" if name == "completion" else "completion"
                raise ValueError(f"source {where}: a {other} without a {name}; give every record both")
            if not isinstance(row[name], str):
                raise ValueError(f"source {where}: {name!r} holds a {type(row[name]).__name__}, not text")
        return Record(where, prompt=row["prompt"], completion=row["completion"])
    messages = row.get("messages")
    if not isinstance(messages, list):
        raise ValueError(
            f"source {where}: 'messages' holds a {type(messages).__name__}, not a list of {{role, content}} messages"
        )
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"source {where}: message {k} is a {type(m).__name__}, not a {{role, content}} dict")
        for name in ("role", "content"):
            if name not in m:
                keys = ", ".join(map(str, m)) or "none"
                if "from" in m and "value" in m:
                    hint = "ShareGPT's {from, value}: rename them to role and content (human -> user, gpt -> assistant)"
                else:
                    close = difflib.get_close_matches(name, [str(key) for key in m], n=1, cutoff=0.6)
                    hint = f"did you mean {close[0]!r}?" if close else "give every message a role and a content"
                raise ValueError(f"source {where}: message {k} has no {name!r} (keys: {keys}); {hint}")
            if not isinstance(m[name], str):
                raise ValueError(f"source {where}: message {k}'s {name} is a {type(m[name]).__name__}, not text")
    return Record(where, messages=messages)


# ---- targets and tokens --------------------------------------------------------------------------------------


@dataclass
class Plan:
    """How instruction records become tokens: the format, which tokens are targets, the chat template."""

    format: str
    train_on: str
    template: str | None = None
    variables: dict | None = None
    eos_id: int | None = None

    def text(self, record: Record) -> str:
        """The record's document as one text (what a ``bpe:N`` tokenizer is trained on)."""
        if record.messages is None:
            return record.prompt + record.completion
        return chat.render(self.template, record.messages, **self.variables)

    def has_target(self, record: Record) -> bool:
        """Whether the record has a target, short of tokenizing it (a chat without an assistant turn has none)."""
        if record.messages is None or self.train_on == "all":
            return True
        return any(m["role"] == "assistant" for m in record.messages)

    def pieces(self, record: Record) -> list[tuple[str, bool]]:
        """The record's document as ``(text, is_target)`` pieces, each tokenized on its own (EOS not included)."""
        if record.messages is not None:
            return chat.segments(self.template, record.messages, self.train_on, self.variables, record.where)
        if self.train_on == "all":
            pieces = [(record.prompt + record.completion, True)]
        else:
            pieces = [(record.prompt, False), (record.completion, True)]
        return [(text, target) for text, target in pieces if text]


def template_tokens(template: str) -> tuple[str, ...]:
    """The ``<|...|>`` markers a template writes (ChatML's ``<|im_start|>``, ``<|im_end|>``), in order of first
    appearance: the special tokens of a ``bpe:N`` trained for it, so that each is one token."""
    return tuple(dict.fromkeys(re.findall(r"<\|[A-Za-z0-9_]+\|>", template)))


def encode_records(chunk: list[tuple[Record, bool]], codec, dtype: np.dtype, plan: Plan) -> tuple:
    """The chunk's tokens, masks and document lengths, train and val, and how many records had no target.

    Each piece is tokenized on its own, so a target begins and ends on a token boundary; a chat is read with its
    template's special tokens, as ``transformers`` tokenizes a rendered chat. A completion ends with EOS, a target.

    Returns:
        ``((train tokens, val tokens), (train documents, val documents), (train mask, val mask), (train lengths,
        val lengths), skipped)``.
    """
    pieces = [plan.pieces(record) for record, _ in chunk]
    ids = codec.encode_batch([text for p in pieces for text, _ in p], special=plan.format == "chat")
    tail = np.asarray([] if plan.format == "chat" else [plan.eos_id], dtype=dtype)
    tokens, masks, lengths, skipped, i = ([], []), ([], []), ([], []), 0, 0
    for (_, is_val), p in zip(chunk, pieces):
        doc = [np.asarray(ids[i + k], dtype=dtype) for k in range(len(p))] + [tail]
        mask = [np.full(len(d), target, np.uint8) for d, (_, target) in zip(doc, p)] + [np.ones(len(tail), np.uint8)]
        i += len(p)
        doc, mask = np.concatenate(doc), np.concatenate(mask)
        if not mask.any():
            skipped += 1
            continue
        tokens[is_val].append(doc)
        masks[is_val].append(mask)
        lengths[is_val].append(len(doc))

    def cat(parts, dt):
        return np.concatenate(parts) if parts else np.zeros(0, dt)

    return (
        (cat(tokens[0], dtype), cat(tokens[1], dtype)),
        (len(lengths[0]), len(lengths[1])),
        (cat(masks[0], np.uint8), cat(masks[1], np.uint8)),
        (np.asarray(lengths[0], np.int64), np.asarray(lengths[1], np.int64)),
        skipped,
    )


class Extras:
    """The files instruction data has besides train.bin and val.bin, written as the chunks come: the masks, then
    the document offsets (``finish``)."""

    def __init__(self, out: Path):
        self.out = out
        self.masks = [open(out / f"{name}.mask.bin", "wb") for name in ("train", "val")]
        self.lengths: tuple[list, list] = ([], [])
        self.targets = [0, 0]
        self.skipped = 0
        self.lengths_by_split: list[np.ndarray] = []

    def __enter__(self) -> Extras:
        return self

    def __exit__(self, *exc) -> None:
        for f in self.masks:
            f.close()

    def add(self, masks: tuple[np.ndarray, np.ndarray], lengths: tuple[np.ndarray, np.ndarray], skipped: int):
        for s in (0, 1):
            masks[s].tofile(self.masks[s])
            self.targets[s] += int(masks[s].sum())
            self.lengths[s].append(lengths[s])
        self.skipped += skipped

    def finish(self) -> None:
        """Write ``<split>.docs.npy``; ``lengths_by_split`` then holds the train and val document lengths."""
        for s, name in enumerate(("train", "val")):
            lengths = np.concatenate(self.lengths[s]) if self.lengths[s] else np.zeros(0, np.int64)
            np.save(self.out / f"{name}.docs.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
            self.lengths_by_split.append(lengths)


def meta_fields(plan: Plan, extras: Extras) -> dict:
    """What meta.json says of instruction data besides the pretraining keys (``format`` replaces theirs)."""
    train_lengths = extras.lengths_by_split[0]
    fields = {
        "format": plan.format,
        "train_on": plan.train_on,
        "targets": {"train": extras.targets[0], "val": extras.targets[1]},
        "skipped": extras.skipped,
        "document_tokens": {
            "min": int(train_lengths.min()),
            "median": float(np.median(train_lengths)),
            "max": int(train_lengths.max()),
        },
    }
    if plan.format == "chat":
        fields["chat_template"] = chat.TEMPLATE_FILE
        fields["chat_template_variables"] = plan.variables
    return fields


def summary(meta: dict, lengths: np.ndarray, seq_len: int | None) -> list[str]:
    """The summary's lines on instruction data: targets, document lengths, skipped records, long documents."""
    tokens, targets = sum(meta["tokens"].values()), sum(meta["targets"].values())
    d = meta["document_tokens"]
    lines = [
        f"{meta['format']} data, --train-on {meta['train_on']}: {targets:,} target tokens ({targets / tokens:.1%} of "
        f"tokens); document tokens min {d['min']:,}, median {d['median']:,.0f}, max {d['max']:,} (train)"
    ]
    if meta["skipped"]:
        n = meta["skipped"]
        lines.append(
            f"skipped {n:,} record{'s' * (n != 1)} without a target token (a chat without an assistant turn, or empty)"
        )
    if seq_len is not None:
        long = int((lengths > seq_len).sum())
        split = f"; they are split into pieces of {seq_len} at training" if long else ""
        lines.append(f"{long:,} of {len(lengths):,} documents are longer than --seq-len {seq_len} tokens{split}")
    return lines


# ---- stdlib:functions ----------------------------------------------------------------------------------------


def stdlib_functions(workers: int = 1) -> list[tuple[str, int, list[dict]]]:
    """Chat records made from this Python's standard library, offline: for each top-level function or method of a
    top-level class that has a docstring, the user gives its signature and docstring and the assistant its body.

    Args:
        workers: processes parsing the files.

    Returns:
        ``(key, index, messages)`` per function in file order: ``key`` is ``<relative path>:<qualified name>``,
        ``index`` counts earlier functions of the same key (a name defined twice).
    """
    import sysconfig

    from trainer.data import stdlib_files

    root = Path(sysconfig.get_paths()["stdlib"])
    files = [(f, f.relative_to(root).as_posix()) for f in stdlib_files()]
    if workers == 1:
        found = list(map(_functions_in, files))
    else:
        ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
        with ctx.Pool(min(workers, len(files))) as pool:
            found = pool.map(_functions_in, files, chunksize=8)
    return [record for records in found for record in records]


def _functions_in(file: tuple[Path, str]) -> list[tuple[str, int, list[dict]]]:
    path, rel = file
    source = path.read_text(encoding="utf-8", errors="replace")
    lines = source.splitlines(keepends=True)
    enabled = gc.isenabled()
    gc.disable()  # the collector would walk the new nodes again and again: parsing takes half the time without it
    try:
        tree = ast.parse(source)
    finally:
        if enabled:
            gc.enable()
    defs = (ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = []
    for node in tree.body:
        if isinstance(node, defs):
            nodes.append((node.name, node))
        elif isinstance(node, ast.ClassDef):
            nodes += [(f"{node.name}.{m.name}", m) for m in node.body if isinstance(m, defs)]
    seen, out = Counter(), []
    for name, node in nodes:
        messages = _function_messages(node, lines)
        if messages is not None:
            key = f"{rel}:{name}"
            out.append((key, seen[key], messages))
            seen[key] += 1
    return out


def _function_messages(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> list[dict] | None:
    """The user's signature and docstring and the assistant's body (dedented, docstring left out); None for a
    function without a docstring, with nothing else in its body, or a body longer than ``MAX_BODY_CHARS``."""
    doc = ast.get_docstring(node)
    if not doc or len(node.body) < 2 or node.body[1].lineno <= node.body[0].end_lineno:
        return None  # no docstring, nothing after it, or code on the docstring's last line
    indent = node.body[1].col_offset  # a byte offset, but indentation is ASCII
    body = "".join(
        "\n" if not line.strip() else line[indent:] if line[:indent].isspace() else line
        for line in lines[node.body[0].end_lineno : node.end_lineno]
    )
    body = body.lstrip("\n").rstrip()
    if not body or len(body) > MAX_BODY_CHARS:
        return None
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    signature = f"{prefix} {node.name}({ast.unparse(node.args)}){returns}:"
    return [{"role": "user", "content": f"{signature}\n{doc}"}, {"role": "assistant", "content": body}]
