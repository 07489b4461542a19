"""``trainer prepare``: tokenize text into a data directory (train.bin, val.bin, meta.json, tokenizer.json).

Documents come from text files (one document per file), directories of them, ``.jsonl`` (one per line),
``.parquet`` (one per row), a Hugging Face dataset, or, with no source, the embedded corpus (the standard
library's files). Each document goes to val.bin or train.bin by a hash of its (source, index), so the split
is the same for any worker count; its tokens are followed by the tokenizer's EOS.

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

from trainer import console
from trainer.codec import Codec, load_tokenizer, parse_bpe, train_bpe
from trainer.io import pid_alive

META_FORMAT = 1
CHUNK_CHARS = 1 << 20  # text per worker task: large enough to amortize the pickling, small enough to stream
_IN_FLIGHT_PER_WORKER = 2


@dataclass
class Part:
    """One readable unit of a source: a file, a Hugging Face dataset, or one file of the embedded corpus.

    ``key`` names its documents in the split hash; ``kind`` is text, jsonl, parquet, hf or stdlib.
    """

    key: str
    kind: str
    path: Path | None = None
    dataset: object = None


@dataclass
class Source:
    """A SOURCE argument (or the embedded corpus) and the parts it reads."""

    path: str
    parts: list[Part]


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
    codec = None if bpe_size else _check_eos(load_tokenizer(args.tokenizer), args.tokenizer)
    sources = resolve_sources(args.sources, args.field, out)
    split = plan_split(sources, args.val_fraction)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    _remove_stale_tmp(out)
    tmp.mkdir(parents=True)
    try:
        with _progress() as progress:
            if bpe_size:
                codec = _train(sources, split, bpe_size, args.field, progress)
            stats = tokenize(sources, split, codec, args.field, tmp, workers, progress)
        meta = _meta(args, codec, stats, sources, split)
        _write_meta(tmp, codec, meta)
        _commit(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _summary(meta, time.perf_counter() - start, out)
    return 0


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


# ---- sources -----------------------------------------------------------------------------------------------


def resolve_sources(specs: list[str], field: str, out: Path | None = None) -> list[Source]:
    """The sources of the SOURCE arguments (none: the embedded corpus), checked before any work starts.

    A directory's walk leaves out ``out`` (and its temporary siblings), the directory being written.

    Raises:
        FileNotFoundError: a source that does not exist.
        ValueError: an empty directory, a missing --field, or a format whose package is not installed.
    """
    if not specs:
        return [_stdlib_source()]
    return [_resolve(spec, field, out) for spec in specs]


def _stdlib_source() -> Source:
    import sysconfig

    from trainer.data import stdlib_files

    root = Path(sysconfig.get_paths()["stdlib"])
    parts = [Part(f.relative_to(root).as_posix(), "stdlib", f) for f in stdlib_files()]
    return Source(str(root), parts)


def _resolve(spec: str, field: str, out: Path | None) -> Source:
    if spec.startswith("hf:"):
        return Source(spec, [_hf_part(spec, spec[3:], field)])
    p = Path(spec)
    if not p.exists():
        raise FileNotFoundError(f"source {spec}: no such file or directory")
    if p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file()):
        return Source(spec, [_hf_part(spec, str(p), field)])
    if p.is_file():
        parts = [Part(p.name, _kind(p), p)]
    else:  # keys relative to the directory: the split does not depend on where it is or how it is spelt
        parts = [Part(f"{p.resolve().name}/{f.relative_to(p).as_posix()}", _kind(f), f) for f in _files_under(p, out)]
    if not parts:
        raise ValueError(f"source {spec}: the directory holds no files")
    for part in parts:
        _check_field(part, field)
    return Source(spec, parts)


def _files_under(d: Path, out: Path | None) -> list[Path]:
    """The files under ``d``, recursively, sorted; hidden files and directories and ``out`` left out."""
    files = []
    for dirpath, dirnames, filenames in os.walk(d):
        dirnames[:] = sorted(n for n in dirnames if not n.startswith(".") and not _is_out(Path(dirpath) / n, out))
        files.extend(Path(dirpath) / n for n in sorted(filenames) if not n.startswith("."))
    return sorted(files)


def _is_out(d: Path, out: Path | None) -> bool:
    """Whether ``d`` is the output directory or one of its ``.tmp-<pid>``/``.old-<pid>`` siblings."""
    if out is None or d.resolve().parent != out.resolve().parent:
        return False
    return d.name == out.name or d.name.startswith((f"{out.name}.tmp-", f"{out.name}.old-"))


def _kind(f: Path) -> str:
    return {".jsonl": "jsonl", ".parquet": "parquet"}.get(f.suffix.lower(), "text")


def _check_field(part: Part, field: str) -> None:
    if part.kind == "parquet":
        names = _parquet(part.path).schema_arrow.names
    elif part.kind == "jsonl":
        first = next((r for _, r in _jsonl_records(part.path) if r is not None), None)
        names = list(first) if first is not None else [field]
    else:
        return
    if field not in names:
        raise ValueError(f"source {part.path}: no field {field!r} (fields: {', '.join(names)}); pass --field NAME")


def _parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"source {path}: reading .parquet needs pyarrow (pip install pyarrow, or pip install -e '.[data]')"
        ) from None
    return pq.ParquetFile(path)


def _hf_part(spec: str, name: str, field: str) -> Part:
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"source {spec}: reading a Hugging Face dataset needs the datasets package (pip install datasets, or "
            "pip install -e '.[data]') and, for hf:NAME, the network"
        ) from None
    try:
        ds = datasets.load_from_disk(name) if Path(name).is_dir() else datasets.load_dataset(name, split="train")
    except Exception as e:  # datasets raises many types (hub, network, format); all mean this source is unusable
        raise ValueError(f"source {spec}: could not load the dataset ({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(f"source {spec}: the dataset has no train split (splits: {', '.join(ds)})")
        ds = ds["train"]
    if field not in ds.column_names:
        raise ValueError(f"source {spec}: no field {field!r} (fields: {', '.join(ds.column_names)}); pass --field NAME")
    return Part(Path(name).name if Path(name).is_dir() else spec, "hf", dataset=ds)


def _jsonl_records(path: Path) -> Iterator[tuple[int, dict | None]]:
    """``(line index, object)`` per line of a .jsonl; None for a blank line."""
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            if not line.strip():
                yield i, None
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"source {path}: line {i + 1} is not JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"source {path}: line {i + 1} is not a JSON object")
            yield i, obj


def _count(part: Part) -> int:
    """How many records (documents, blank ones included) ``part`` holds."""
    if part.kind == "jsonl":
        with open(part.path, "rb") as f:
            return sum(1 for _ in f)
    if part.kind == "parquet":
        return _parquet(part.path).metadata.num_rows
    if part.kind == "hf":
        return len(part.dataset)
    return 1


def _documents(part: Part, field: str) -> Iterator[tuple[int, str]]:
    """``(index, text)`` per record of ``part``; an empty text is a record without a document."""
    if part.kind == "stdlib":
        yield 0, part.path.read_text(encoding="utf-8", errors="replace")
    elif part.kind == "text":
        try:
            yield 0, part.path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"source {part.path}: not UTF-8 text (byte {e.start}); prepare reads text") from None
    elif part.kind == "jsonl":
        for i, obj in _jsonl_records(part.path):
            yield i, "" if obj is None else _text(obj, field, f"{part.path} line {i + 1}")
    elif part.kind == "parquet":
        batches = _parquet(part.path).iter_batches(batch_size=1024, columns=[field])
        texts = (text for batch in batches for text in batch.column(0).to_pylist())
        for i, text in enumerate(texts):
            yield i, _text({field: text}, field, f"{part.path} row {i}")
    else:
        for i, row in enumerate(part.dataset):
            yield i, _text(row, field, f"{part.key} row {i}")


def _text(record: dict, field: str, where: str) -> str:
    """The text of ``record[field]``; a null is empty."""
    if field not in record:
        raise ValueError(f"source {where}: no field {field!r} (fields: {', '.join(record)}); pass --field NAME")
    text = record[field]
    if text is not None and not isinstance(text, str):
        raise ValueError(f"source {where}: field {field!r} holds a {type(text).__name__}, not text")
    return text or ""


def _source_sha256(source: Source) -> str:
    """The sha256 of a file source's bytes; of its files' keys and sha256s for a directory; of a dataset's
    fingerprint."""
    if source.parts[0].kind == "hf":
        return hashlib.sha256(source.parts[0].dataset._fingerprint.encode()).hexdigest()
    if Path(source.path).is_file():
        return _file_sha256(source.parts[0].path)
    h = hashlib.sha256()
    for part in source.parts:
        h.update(f"{part.key}\0{_file_sha256(part.path)}\n".encode())
    return h.hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
            for i in range(_count(part)):
                h = _key_hash(part.key, i)
                seen[h < fraction] = True
                if all(seen):
                    return Split(fraction)
                keys.append((h, part.key, i))
    keys.sort()
    if len(keys) < 2:
        return Split(fraction, {k[1:]: False for k in keys})
    return Split(fraction, {keys[0][1:]: True, keys[-1][1:]: False})


def _iter_documents(sources: list[Source], split: Split, field: str) -> Iterator[tuple[str, bool]]:
    """``(text, is_val)`` per non-empty document, in source order."""
    for source in sources:
        for part in source.parts:
            for i, text in _documents(part, field):
                if text:
                    yield text, split.is_val(part.key, i)


# ---- tokenizing --------------------------------------------------------------------------------------------


def _train(sources: list[Source], split: Split, vocab_size: int, field: str, progress) -> Codec:
    """``bpe:vocab_size`` trained on the train documents."""
    task = progress.add_task(f"training bpe:{vocab_size}", total=None, docs=0, tokens=0, rate="")

    def texts():
        for n, (text, is_val) in enumerate(_iter_documents(sources, split, field), 1):
            progress.update(task, docs=n)
            if not is_val:
                yield text

    codec = train_bpe(texts(), vocab_size)
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
    """What ``tokenize`` wrote: the token dtype's name, and tokens and documents per split."""

    dtype: str
    tokens: dict[str, int]
    documents: dict[str, int]


def tokenize(sources, split: Split, codec: Codec, field: str, out: Path, workers: int, progress) -> Stats:
    """Encode every document into ``out/train.bin`` and ``out/val.bin``, EOS after each, in source order.

    Documents go to ``workers`` processes in chunks; results are written in submission order, so the files do
    not depend on the worker count.
    """
    wide = codec.vocab_size > 1 << 16
    dtype = np.dtype("<u4" if wide else "<u2")  # little-endian, as nanoGPT writes
    stats = Stats("uint32" if wide else "uint16", {"train": 0, "val": 0}, {"train": 0, "val": 0})
    task = progress.add_task("tokenizing", total=None, docs=0, tokens=0, rate="")
    t0 = time.perf_counter()
    chunks = _chunks(_iter_documents(sources, split, field))
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(open(out / f"{name}.bin", "wb")) for name in ("train", "val")]
        encode = stack.enter_context(_encoder(codec, dtype, workers))
        for arrays, counts in encode(chunks):
            for name, f, arr, n in zip(("train", "val"), files, arrays, counts):
                arr.tofile(f)
                stats.tokens[name] += len(arr)
                stats.documents[name] += n
            done = sum(stats.tokens.values())
            rate = f"{done / max(time.perf_counter() - t0, 1e-9):,.0f} tokens/s"
            progress.update(task, docs=sum(stats.documents.values()), tokens=done, rate=rate)
    where = ", ".join(s.path for s in sources)
    if not sum(stats.documents.values()):
        raise ValueError(f"source {where}: holds no documents (every text is empty)")
    if not stats.documents["train"]:
        raise ValueError(f"source {where}: every document fell in val.bin; lower --val-fraction")
    return stats


def _chunks(docs: Iterator[tuple[str, bool]]) -> Iterator[list[tuple[str, bool]]]:
    """Consecutive documents in lists of about ``CHUNK_CHARS`` characters."""
    chunk, size = [], 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc[0])
        if size >= CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


_WORKER: tuple[Codec, np.dtype] | None = None  # what _encode_chunk uses, in each worker (or this process)


def _init_worker(codec: Codec, dtype: np.dtype, pool: bool = False) -> None:
    global _WORKER
    _WORKER = (codec, dtype)
    if pool:  # Ctrl-C reaches the whole process group: the parent stops the pool, the workers stay quiet
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _encode_chunk(chunk: list[tuple[str, bool]]) -> tuple[tuple[np.ndarray, np.ndarray], tuple[int, int]]:
    """The chunk's train and val tokens (EOS after each document) and document counts."""
    codec, dtype = _WORKER
    ids = codec.encode_batch([text for text, _ in chunk])
    parts = ([], [])
    for (_, is_val), doc in zip(chunk, ids):
        parts[is_val].append(np.asarray(doc, dtype=dtype))
        parts[is_val].append(np.asarray([codec.eos_id], dtype=dtype))
    arrays = tuple(np.concatenate(p) if p else np.zeros(0, dtype) for p in parts)
    return arrays, (len(parts[0]) // 2, len(parts[1]) // 2)


@contextlib.contextmanager
def _encoder(codec: Codec, dtype: np.dtype, workers: int):
    """A function from chunks to their encoded results, in order: in this process, or in a pool."""
    if workers == 1:
        _init_worker(codec, dtype)
        yield lambda chunks: map(_encode_chunk, chunks)
        return
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    # Each worker encodes on one thread. Set before forking, this also keeps tokenizers from warning that the
    # parent already used its thread pool (training the BPE).
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(codec, dtype, True))
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


def _meta(args, codec: Codec, stats: Stats, sources: list[Source], split: Split) -> dict:
    return {
        "format": META_FORMAT,
        "tokenizer": args.tokenizer,
        "vocab_size": codec.vocab_size,
        "eos_id": codec.eos_id,
        "dtype": stats.dtype,
        "tokens": stats.tokens,
        "documents": stats.documents,
        "sources": [{"path": s.path, "sha256": _source_sha256(s)} for s in sources],
        "field": args.field,
        "val_fraction": split.fraction,
    }


def _write_meta(tmp: Path, codec: Codec, meta: dict) -> None:
    if codec.tokenizer is not None:
        codec.save(tmp / "tokenizer.json")
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


def _summary(meta: dict, seconds: float, out: Path) -> None:
    docs, tokens = sum(meta["documents"].values()), sum(meta["tokens"].values())
    console.info(
        f"prepared {docs:,} documents ({meta['documents']['val']:,} val), {tokens:,} tokens "
        f"({meta['tokens']['val']:,} val) in {seconds:.1f} s ({tokens / max(seconds, 1e-9):,.0f} tokens/s): {out}"
    )
    if meta["documents"]["val"] == 0:
        why = "--val-fraction 0" if meta["val_fraction"] == 0 else "the corpus is one document"
        console.warn(f"val.bin is empty ({why}); `trainer fit` evaluates on it: give several documents")
