"""The SOURCE arguments of ``trainer prepare``: what each names (files, directories, .jsonl, .parquet, Hugging Face
datasets, the embedded corpus, ``stdlib:functions``), the format of its records, and the records themselves.

A source is read twice or three times (the split, the ``bpe:N`` training, the tokenizing), each time in the same
order; a record is named by its part's key and its index there, which the split hashes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trainer import instruct


@dataclass
class Part:
    """One readable unit of a source: a file, a Hugging Face dataset, or one file of the embedded corpus.

    ``key`` names its documents in the split hash; ``kind`` is text, jsonl, parquet, hf, stdlib (a file of the
    embedded corpus) or functions (``stdlib:functions``, whose ``dataset`` is its ``(key, index, messages)``).
    """

    key: str
    kind: str
    path: Path | None = None
    dataset: object = None


@dataclass
class Source:
    """A SOURCE argument (or the embedded corpus), the parts it reads, and its records' format (None: it has none)."""

    path: str
    parts: list[Part]
    format: str | None = "text"


def resolve_sources(
    specs: list[str], field: str, out: Path | None = None, fmt: str = "text", workers: int = 1
) -> list[Source]:
    """The sources of the SOURCE arguments (none: the embedded corpus), checked before any work starts.

    A directory's walk leaves out ``out`` (and its temporary siblings), the directory being written.

    Args:
        specs: the SOURCE arguments.
        field: the text field (``--field``).
        out: the directory being written.
        fmt: ``--format``: text, chat, completion, or auto (each source's first record says).
        workers: processes parsing the standard library for ``stdlib:functions``.

    Raises:
        FileNotFoundError: a source that does not exist.
        ValueError: an empty directory, a missing field, a source that cannot be read as ``fmt`` or that mixes
            formats, or a format whose package is not installed.
    """
    if not specs:
        if fmt in instruct.INSTRUCTION_FORMATS:
            raise ValueError(f"--format {fmt}: the embedded corpus is text; name a {fmt} source (stdlib:functions)")
        return [_stdlib_source()]
    return [_resolve(spec, field, out, fmt, workers) for spec in specs]


def _stdlib_source() -> Source:
    import sysconfig

    from trainer.data import stdlib_files

    root = Path(sysconfig.get_paths()["stdlib"])
    parts = [Part(f.relative_to(root).as_posix(), "stdlib", f) for f in stdlib_files()]
    return Source(str(root), parts)


def _resolve(spec: str, field: str, out: Path | None, fmt: str, workers: int) -> Source:
    source = Source(spec, _parts(spec, out))
    source.format = _source_format(source, fmt, field)
    if source.parts[0].kind == "functions":
        source.parts[0].dataset = instruct.stdlib_functions(workers)
    return source


def _parts(spec: str, out: Path | None) -> list[Part]:
    if spec == instruct.FUNCTIONS:
        return [Part(spec, "functions")]
    if spec.startswith("stdlib:"):
        raise ValueError(f"source {spec}: no such embedded source (did you mean {instruct.FUNCTIONS}?)")
    if spec.startswith("hf:"):
        return [_hf_part(spec, spec[3:])]
    p = Path(spec)
    if not p.exists():
        raise FileNotFoundError(f"source {spec}: no such file or directory")
    if p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file()):
        return [_hf_part(spec, str(p))]
    if p.is_file():
        return [Part(p.name, _kind(p), p)]
    # keys relative to the directory: the split does not depend on where it is or how it is spelt
    parts = [Part(f"{p.resolve().name}/{f.relative_to(p).as_posix()}", _kind(f), f) for f in _files_under(p, out)]
    if not parts:
        raise ValueError(f"source {spec}: the directory holds no files")
    return parts


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


def _source_format(source: Source, fmt: str, field: str) -> str | None:
    """The format of the source's records (``fmt``, or the one its parts' first records say under auto), checked
    against the fields each part has; None where no part holds a record.

    Raises:
        ValueError: a part that cannot be read as the format, or parts of different formats.
    """
    found: dict[str, Part] = {}
    for part in source.parts:
        names = _fields(part)
        own = {"text": "text", "stdlib": "text", "functions": "chat"}.get(part.kind) or instruct.detect(names)
        want = own if fmt == "auto" else fmt
        where = part.path or source.path
        if want is None:
            continue
        if own is not None and own != want and part.kind in ("text", "stdlib", "functions"):
            raise ValueError(
                f"source {where}: holds {own}, not {want} records; --format {want} reads .jsonl, .parquet and "
                f"datasets{' and stdlib:functions' if want == 'chat' else ''}"
            )
        if want == "text" and names is not None and field not in names:
            hint = " (a prompt without a completion: give each record one, for --format completion)"
            raise ValueError(
                f"source {where}: no field {field!r} (fields: {', '.join(names)}); pass --field NAME"
                + (hint if "prompt" in names else "")
            )
        if want != "text":
            instruct.check_fields(names, want, where)
        found.setdefault(want, part)
    if len(found) > 1:
        (a, pa), (b, pb) = list(found.items())[:2]
        raise ValueError(
            f"source {source.path}: holds {a} records ({pa.path}) and {b} records ({pb.path}); "
            "prepare one format at a time"
        )
    return next(iter(found), None)


def _fields(part: Part) -> list[str] | None:
    """The fields of a part's first record; None for a text file, a part without records, or stdlib:functions."""
    if part.kind == "parquet":
        return _parquet(part.path).schema_arrow.names
    if part.kind == "jsonl":
        first = next((r for _, r in _jsonl_records(part.path) if r is not None), None)
        return list(first) if first is not None else None
    if part.kind == "hf":
        return list(part.dataset.column_names)
    return None


def common_format(sources: list[Source]) -> str | None:
    """The one format of all sources (None: none holds a record).

    Raises:
        ValueError: sources of different formats, naming the first that differs.
    """
    known = [s for s in sources if s.format is not None]
    for s in known[1:]:
        if s.format != known[0].format:
            raise ValueError(
                f"source {s.path}: holds {s.format} records but source {known[0].path} holds {known[0].format}; "
                "prepare one format at a time"
            )
    return known[0].format if known else None


def _parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"source {path}: reading .parquet needs pyarrow (pip install pyarrow, or pip install -e '.[data]')"
        ) from None
    return pq.ParquetFile(path)


def _hf_part(spec: str, name: str) -> Part:
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


def documents(part: Part, field: str) -> Iterator[tuple[int, str]]:
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


def rows(part: Part, fmt: str) -> Iterator[tuple[str, int, dict | None, str]]:
    """``(key, index, row, where)`` per record of an instruction part; a blank .jsonl line's row is None."""
    if part.kind == "functions":
        for key, i, messages in part.dataset:
            yield key, i, {"messages": messages}, f"{part.key} {key}"
    elif part.kind == "jsonl":
        for i, obj in _jsonl_records(part.path):
            yield part.key, i, obj, f"{part.path} line {i + 1}"
    elif part.kind == "parquet":
        batches = _parquet(part.path).iter_batches(batch_size=1024, columns=instruct.columns(fmt))
        for i, row in enumerate(row for batch in batches for row in batch.to_pylist()):
            yield part.key, i, row, f"{part.path} row {i}"
    else:
        for i, row in enumerate(part.dataset):
            yield part.key, i, row, f"{part.key} row {i}"


def _text(record: dict, field: str, where: str) -> str:
    """The text of ``record[field]``; a null is empty."""
    if field not in record:
        raise ValueError(f"source {where}: no field {field!r} (fields: {', '.join(record)}); pass --field NAME")
    text = record[field]
    if text is not None and not isinstance(text, str):
        raise ValueError(f"source {where}: field {field!r} holds a {type(text).__name__}, not text")
    return text or ""


def source_sha256(source: Source) -> str:
    """The sha256 of a file source's bytes; of its files' keys and sha256s for a directory; of a dataset's
    fingerprint."""
    if source.parts[0].kind == "hf":
        return hashlib.sha256(source.parts[0].dataset._fingerprint.encode()).hexdigest()
    if source.parts[0].kind == "functions":
        return hashlib.sha256(json.dumps(source.parts[0].dataset).encode()).hexdigest()
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


def record_keys(part: Part) -> Iterator[tuple[str, int]]:
    """The split keys of a part's records."""
    if part.kind == "functions":
        return ((key, i) for key, i, _ in part.dataset)
    return ((part.key, i) for i in range(_count(part)))
