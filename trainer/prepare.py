"""``trainer prepare``: tokenize text into a data directory (train.bin, val.bin, meta.json, tokenizer.json).

Documents come from text files (one document per file), directories of them, ``.jsonl`` (one per line),
``.parquet`` (one per row), a Hugging Face dataset, or, with no source, the embedded corpus (the standard
library's files). Each document goes to val.bin or train.bin by a hash of its (source, index), so the split
is the same for any worker count; its tokens are followed by the tokenizer's EOS.

Records with ``messages`` (chat) or ``prompt`` and ``completion`` are instruction data, written with a loss mask
and document offsets besides (:mod:`trainer.instruct`); ``stdlib:functions`` is an embedded source of them.

Everything is written into a sibling ``DIR.tmp-<pid>`` and renamed into place at the end, so a prepare that
is killed leaves nothing under DIR.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer import chat, console, instruct
from trainer.codec import Codec, load_tokenizer, parse_bpe, train_bpe
from trainer.io import pid_alive
from trainer.sources import Source, common_format, documents, record_keys, resolve_sources, rows, source_sha256

META_FORMAT = 1
CHUNK_CHARS = 1 << 20  # text per worker task: large enough to amortize the pickling, small enough to stream
_IN_FLIGHT_PER_WORKER = 2


def main(args) -> int:
    """Run ``trainer prepare`` with the parsed CLI arguments; returns the exit status.

    Raises:
        ValueError, FileNotFoundError: a bad source, field, tokenizer or --out.
    """
    start = time.perf_counter()
    out = Path(os.path.abspath(args.out))
    _check_out(out, args.force)
    workers = (os.cpu_count() or 1) if args.workers is None else args.workers  # the parser checked the flags' ranges
    bpe_size = parse_bpe(args.tokenizer)
    codec = None if bpe_size else load_tokenizer(args.tokenizer)
    sources = resolve_sources(args.sources, args.field, out, args.format, workers)
    plan = _plan(args, common_format(sources))
    if codec is not None and (plan is None or plan.format == "completion"):  # EOS ends a text or a completion
        _check_eos(codec, args.tokenizer)
    split = plan_split(sources, args.val_fraction)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    _remove_stale_tmp(out)
    tmp.mkdir(parents=True)
    try:
        with _progress() as progress:
            if bpe_size:
                codec = _train(sources, split, bpe_size, args.field, progress, plan)
            if plan is not None:
                _complete_plan(plan, codec)
            stats = tokenize(sources, split, codec, args.field, tmp, workers, progress, plan)
        meta = _meta(args, codec, stats, sources, split, plan)
        _write_meta(tmp, codec, meta, plan)
        _commit(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _summary(meta, time.perf_counter() - start, out, stats, args.seq_len)
    return 0


def _plan(args, fmt: str | None) -> instruct.Plan | None:
    """How instruction records become tokens; None for text. Flags that cannot take effect are named once."""
    text = fmt in (None, "text")
    unused = {"--train-on": text and args.train_on, "--seq-len": text and args.seq_len}
    unused["--chat-template"] = fmt != "chat" and args.chat_template
    for flag, value in unused.items():
        if value:
            console.warn(f"{flag} has no effect on {fmt or 'text'} data")
    if text:
        return None
    template, variables = chat.load_template(args.tokenizer, args.chat_template) if fmt == "chat" else (None, {})
    if template is not None:
        chat.compile_template(template)  # a template that does not parse fails here, before any work
    return instruct.Plan(fmt, args.train_on or "completion", template, variables)


def _complete_plan(plan: instruct.Plan, codec: Codec) -> None:
    """What the plan takes from the codec: the EOS id, and the EOS string where the tokenizer's config named none."""
    plan.eos_id = codec.eos_id
    if "eos_token" not in plan.variables and codec.eos_id is not None and codec.tokenizer is not None:
        plan.variables["eos_token"] = codec.tokenizer.id_to_token(codec.eos_id)


# ---- the output directory ----------------------------------------------------------------------------------


def _check_out(out: Path, force: bool) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--out {out}: is a file; name a directory to write")
    if (out / "meta.json").is_file():
        if not force:
            raise ValueError(f"--out {out}: already holds a prepared corpus (meta.json); pass --force to replace it")
    elif any(out.iterdir()):
        raise ValueError(f"--out {out}: is not empty and holds no meta.json; name a new or empty directory")


def _remove_stale_tmp(out: Path) -> None:
    """Delete the ``DIR.tmp-<pid>`` left by a prepare that was killed (its process no longer runs)."""
    for d in out.parent.glob(f"{out.name}.tmp-*") if out.parent.is_dir() else []:
        pid = d.name.rpartition("-")[2]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def _commit(tmp: Path, out: Path) -> None:
    """Move ``tmp`` to ``out``; an existing ``out`` (checked by ``_check_out``) is replaced."""
    old = None
    if out.exists() and any(out.iterdir()):
        old = out.with_name(f"{out.name}.old-{os.getpid()}")
        out.rename(old)
    os.replace(tmp, out)  # onto a missing or empty directory: atomic
    if old is not None:
        shutil.rmtree(old)


# ---- the split ---------------------------------------------------------------------------------------------


@dataclass
class Split:
    """Which documents go to val.bin: those whose key hashes below the fraction, except where ``forced`` says."""

    fraction: float
    forced: dict[tuple[str, int], bool] = dataclasses.field(default_factory=dict)

    def is_val(self, key: str, index: int) -> bool:
        forced = self.forced.get((key, index))
        return _key_hash(key, index) < self.fraction if forced is None else forced


def _key_hash(key: str, index: int) -> float:
    """A stable hash of a document's (source, index) in [0, 1)."""
    digest = hashlib.blake2b(f"{key}\0{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def plan_split(sources: list[Source], fraction: float) -> Split:
    """The split by key hash, where it gives both splits a record. Otherwise (a corpus of a few documents) the
    lowest key goes to val and the highest to train; a single record goes to train."""
    if fraction == 0:
        return Split(0.0)
    keys = []
    seen = [False, False]  # train, val
    for source in sources:
        for part in source.parts:
            for key, i in record_keys(part):
                h = _key_hash(key, i)
                seen[h < fraction] = True
                if all(seen):
                    return Split(fraction)
                keys.append((h, key, i))
    keys.sort()
    if len(keys) < 2:
        return Split(fraction, {k[1:]: False for k in keys})
    return Split(fraction, {keys[0][1:]: True, keys[-1][1:]: False})


def _iter_records(sources: list[Source], split: Split, fmt: str) -> Iterator[tuple[instruct.Record, bool]]:
    """``(record, is_val)`` per instruction record, in source order."""
    for source in sources:
        for part in source.parts:
            for key, i, row, where in rows(part, fmt):
                if row is not None:
                    yield instruct.parse(row, fmt, where), split.is_val(key, i)


def _iter_documents(sources: list[Source], split: Split, field: str) -> Iterator[tuple[str, bool]]:
    """``(text, is_val)`` per non-empty document, in source order."""
    for source in sources:
        for part in source.parts:
            for i, text in documents(part, field):
                if text:
                    yield text, split.is_val(part.key, i)


# ---- tokenizing --------------------------------------------------------------------------------------------


def _train(sources: list[Source], split: Split, vocab_size: int, field: str, progress, plan=None) -> Codec:
    """``bpe:vocab_size`` trained on the train documents; a chat template's ``<|...|>`` markers are special tokens."""
    task = progress.add_task(f"training bpe:{vocab_size}", total=None, docs=0, tokens=0, rate="")
    if plan is None:
        docs = _iter_documents(sources, split, field)
    else:
        records = _iter_records(sources, split, plan.format)
        docs = ((plan.text(r), is_val) for r, is_val in records if plan.has_target(r))

    def texts():
        for n, (text, is_val) in enumerate(docs, 1):
            progress.update(task, docs=n)
            if not is_val:
                yield text

    special = instruct.template_tokens(plan.template) if plan is not None and plan.template else ()
    codec = train_bpe(texts(), vocab_size, special)
    progress.update(task, total=1, completed=1)
    return codec


def _check_eos(codec: Codec, spec: str) -> Codec:
    if codec.eos_id is None:
        raise ValueError(
            f"--tokenizer {spec}: the tokenizer has no end-of-text token (<|endoftext|>, </s>, <eos>, ...) to put "
            "between documents; add one to its tokenizer.json, or name it as eos_token in tokenizer_config.json"
        )
    return codec


@dataclass
class Stats:
    """What ``tokenize`` wrote: the token dtype's name, tokens and documents per split, and for instruction data
    its masks' and offsets' writer (target counts, document lengths, skipped records)."""

    dtype: str
    tokens: dict[str, int]
    documents: dict[str, int]
    extras: instruct.Extras | None = None


def tokenize(sources, split: Split, codec: Codec, field: str, out: Path, workers: int, progress, plan=None) -> Stats:
    """Encode every document into ``out/train.bin`` and ``out/val.bin``, EOS after each, in source order.

    Documents go to ``workers`` processes in chunks; results are written in submission order, so the files do
    not depend on the worker count. With a ``plan`` (instruction data) the documents are its records, written with
    their masks and offsets (:mod:`trainer.instruct`), and only a completion is followed by EOS.
    """
    wide = codec.vocab_size > 1 << 16
    dtype = np.dtype("<u4" if wide else "<u2")  # little-endian, as nanoGPT writes
    stats = Stats("uint32" if wide else "uint16", {"train": 0, "val": 0}, {"train": 0, "val": 0})
    task = progress.add_task("tokenizing", total=None, docs=0, tokens=0, rate="")
    t0 = time.perf_counter()
    docs = _iter_documents(sources, split, field) if plan is None else _iter_records(sources, split, plan.format)
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(open(out / f"{name}.bin", "wb")) for name in ("train", "val")]
        extras = stats.extras = None if plan is None else stack.enter_context(instruct.Extras(out))
        encode = stack.enter_context(_encoder(codec, dtype, workers, plan))
        for arrays, counts, *more in encode(_chunks(docs)):
            if extras is not None:
                extras.add(*more)
            for name, f, arr, n in zip(("train", "val"), files, arrays, counts):
                arr.tofile(f)
                stats.tokens[name] += len(arr)
                stats.documents[name] += n
            done = sum(stats.tokens.values())
            rate = f"{done / max(time.perf_counter() - t0, 1e-9):,.0f} tokens/s"
            progress.update(task, docs=sum(stats.documents.values()), tokens=done, rate=rate)
        if extras is not None:
            extras.finish()
    where = ", ".join(s.path for s in sources)
    if not sum(stats.documents.values()):
        if extras is not None and extras.skipped:
            raise ValueError(
                f"source {where}: holds no document with a target token ({extras.skipped} records without one under "
                f"--train-on {plan.train_on}); give the chats assistant turns"
            )
        raise ValueError(f"source {where}: holds no documents (every text is empty)")
    if not stats.documents["train"]:
        raise ValueError(f"source {where}: every document fell in val.bin; lower --val-fraction")
    return stats


def _chunks(docs: Iterator[tuple]) -> Iterator[list[tuple]]:
    """Consecutive documents (texts or instruction records) in lists of about ``CHUNK_CHARS`` characters."""
    chunk, size = [], 0
    for doc in docs:
        chunk.append(doc)
        # A record's characters cost several times a text's (rendered and tokenized piece by piece): smaller chunks
        # keep the workers evenly busy.
        size += len(doc[0]) if isinstance(doc[0], str) else 4 * doc[0].chars
        if size >= CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


_WORKER: tuple[Codec, np.dtype, instruct.Plan | None] | None = None  # what _encode_chunk uses, in each worker


def _init_worker(codec: Codec, dtype: np.dtype, pool: bool = False, plan: instruct.Plan | None = None) -> None:
    global _WORKER
    _WORKER = (codec, dtype, plan)
    if pool:  # Ctrl-C reaches the whole process group: the parent stops the pool, the workers stay quiet
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _encode_chunk(chunk: list[tuple]) -> tuple:
    """The chunk's train and val tokens (EOS after each document) and document counts; for instruction records also
    their masks, document lengths and skipped count (``instruct.encode_records``)."""
    codec, dtype, plan = _WORKER
    if plan is not None:
        return instruct.encode_records(chunk, codec, dtype, plan)
    ids = codec.encode_batch([text for text, _ in chunk])
    parts = ([], [])
    for (_, is_val), doc in zip(chunk, ids):
        parts[is_val].append(np.asarray(doc, dtype=dtype))
        parts[is_val].append(np.asarray([codec.eos_id], dtype=dtype))
    arrays = tuple(np.concatenate(p) if p else np.zeros(0, dtype) for p in parts)
    return arrays, (len(parts[0]) // 2, len(parts[1]) // 2)


@contextlib.contextmanager
def _encoder(codec: Codec, dtype: np.dtype, workers: int, plan: instruct.Plan | None = None):
    """A function from chunks to their encoded results, in order: in this process, or in a pool."""
    if workers == 1:
        _init_worker(codec, dtype, plan=plan)
        yield lambda chunks: map(_encode_chunk, chunks)
        return
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    # Each worker encodes on one thread. Set before forking, this also keeps tokenizers from warning that the
    # parent already used its thread pool (training the BPE).
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(codec, dtype, True, plan))
    finally:
        _restore_env("TOKENIZERS_PARALLELISM", saved)
    try:
        yield lambda chunks: _ordered(pool, chunks, workers * _IN_FLIGHT_PER_WORKER)
    finally:
        pool.terminate()
        pool.join()


def _restore_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def _ordered(pool, chunks, window: int):
    """Pool results in submission order, with at most ``window`` chunks in flight (Pool.imap would read the
    whole corpus into its queue)."""
    pending = deque()
    for chunk in chunks:
        pending.append(pool.apply_async(_encode_chunk, (chunk,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


# ---- meta.json and the summary -----------------------------------------------------------------------------


def _meta(args, codec: Codec, stats: Stats, sources: list[Source], split: Split, plan=None) -> dict:
    meta = {
        "format": META_FORMAT,
        "tokenizer": args.tokenizer,
        "vocab_size": codec.vocab_size,
        "eos_id": codec.eos_id,
        "dtype": stats.dtype,
        "tokens": stats.tokens,
        "documents": stats.documents,
        "sources": [{"path": s.path, "sha256": source_sha256(s)} for s in sources],
        "field": args.field,
        "val_fraction": split.fraction,
    }
    if plan is not None:  # instruction data: "format" names it (chat, completion), the other keys are kept
        meta.update(instruct.meta_fields(plan, stats.extras))
    return meta


def _write_meta(tmp: Path, codec: Codec, meta: dict, plan=None) -> None:
    if codec.tokenizer is not None:
        codec.save(tmp / "tokenizer.json")
    if plan is not None and plan.template is not None:
        (tmp / chat.TEMPLATE_FILE).write_text(plan.template, encoding="utf-8")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


@contextlib.contextmanager
def _progress():
    """A rich progress display on a terminal; nothing otherwise."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[docs]:,} documents"),
        TextColumn("{task.fields[tokens]:,} tokens"),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, disable=not sys.stdout.isatty()) as progress:
        yield progress


def _summary(meta: dict, seconds: float, out: Path, stats: Stats, seq_len: int | None = None) -> None:
    docs, tokens = sum(meta["documents"].values()), sum(meta["tokens"].values())
    console.info(
        f"prepared {docs:,} documents ({meta['documents']['val']:,} val), {tokens:,} tokens "
        f"({meta['tokens']['val']:,} val) in {seconds:.1f} s ({tokens / max(seconds, 1e-9):,.0f} tokens/s): {out}"
    )
    if meta["documents"]["val"] == 0:
        why = "--val-fraction 0" if meta["val_fraction"] == 0 else "the corpus is one document"
        console.warn(f"val.bin is empty ({why}); `trainer fit` evaluates on it: give several documents")
    if stats.extras is not None:
        for line in instruct.summary(meta, np.concatenate(stats.extras.lengths_by_split), seq_len):
            console.info(line)
