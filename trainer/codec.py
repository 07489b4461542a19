"""Tokenizers as the trainer uses them: text to token ids and back.

A ``Codec`` turns text into ids (``encode``, ``encode_batch``) and ids into text (``decode``), and knows its
vocabulary size and end-of-text id. Three kinds exist:

- bytes: the UTF-8 bytes of the text (vocabulary 256, no EOS), what the embedded corpus and a text file use;
- a Hugging Face ``tokenizers`` tokenizer: a ``tokenizer.json``, a model directory holding one, or a byte-level
  BPE trained here by ``train_bpe`` (the ``bpe:N`` spec of ``trainer prepare``);
- a ``tiktoken`` encoding (``tiktoken:gpt2``, ``tiktoken:cl100k_base``, ``tiktoken:o200k_base``).

``load_tokenizer(spec)`` reads a spec, ``codec_for_data(path)`` finds the codec a run's data was written with.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
BYTE_VOCAB = 256
TIKTOKEN_NAMES = ("gpt2", "r50k_base", "p50k_base", "cl100k_base", "o200k_base")
# End-of-text tokens of common tokenizer.json files, likeliest first (GPT-2, Llama 3, Llama 2 / Mistral, Gemma).
_EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")


class Codec:
    """Text to token ids and back.

    Attributes:
        name: the spec it came from (``bytes``, ``bpe:8192``, a path, ``tiktoken:gpt2``).
        vocab_size: one more than the largest id it produces.
        eos_id: the end-of-text id written after each document, or None (bytes).
        tokenizer: the ``tokenizers.Tokenizer`` behind it, or None where it is not one.
    """

    name: str
    vocab_size: int
    eos_id: int | None
    tokenizer = None

    def encode_batch(self, texts: list[str], special: bool = False) -> list[list[int]]:
        """The ids of each text, no special tokens added.

        Args:
            texts: the texts.
            special: read a special token's string in the text (``<|im_end|>``) as that token, as a rendered chat
                template is read; by default it is split like any other text.
        """
        raise NotImplementedError

    def encode(self, text: str, special: bool = False) -> list[int]:
        """The ids of ``text``, no special tokens added (``special`` as for ``encode_batch``)."""
        return self.encode_batch([text], special)[0]

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``; bytes that are not valid UTF-8 become U+FFFD."""
        raise NotImplementedError

    def save(self, path: str | Path) -> None:
        """Write the tokenizer as a Hugging Face ``tokenizer.json`` (only a ``tokenizers`` codec can)."""
        if self.tokenizer is None:
            raise TypeError(f"the {self.name} codec is not a tokenizers tokenizer and has no tokenizer.json form")
        self.tokenizer.save(str(path))

    def __repr__(self) -> str:
        return f"Codec({self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class ByteCodec(Codec):
    """The UTF-8 bytes of the text: vocabulary 256, no EOS."""

    name, vocab_size, eos_id = "bytes", BYTE_VOCAB, None

    def encode_batch(self, texts: list[str], special: bool = False) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        # Ids past the byte range (a model with a padded vocabulary can sample them) decode as U+FFFD.
        data = bytes(i if 0 <= i < BYTE_VOCAB else 0xFF for i in ids)
        return data.decode("utf-8", errors="replace")


class TokenizersCodec(Codec):
    """A Hugging Face ``tokenizers.Tokenizer``.

    Text is encoded as plain text: a special token's string inside a document (``<|endoftext|>`` in a file
    about tokenizers) is split like any other text, so only the EOS written between documents is EOS; only a
    rendered chat template is encoded with ``special=True``.
    """

    def __init__(self, tokenizer, name: str, eos_id: int | None):
        tokenizer.encode_special_tokens = True
        self.tokenizer, self.name, self.eos_id = tokenizer, name, eos_id
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0

    def encode_batch(self, texts: list[str], special: bool = False) -> list[list[int]]:
        self.tokenizer.encode_special_tokens = not special
        try:
            return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
        finally:
            self.tokenizer.encode_special_tokens = True

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


class TiktokenCodec(Codec):
    """A ``tiktoken`` encoding; its end-of-text token is EOS."""

    def __init__(self, encoding, name: str):
        self.encoding, self.name = encoding, name
        self.vocab_size, self.eos_id = encoding.n_vocab, encoding.eot_token

    def encode_batch(self, texts: list[str], special: bool = False) -> list[list[int]]:
        if special:
            return self.encoding.encode_batch(texts, num_threads=1, allowed_special="all", disallowed_special=())
        return self.encoding.encode_ordinary_batch(texts, num_threads=1)

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(list(ids), errors="replace")


def parse_bpe(spec: str) -> int | None:
    """The N of a ``bpe:N`` spec, or None when ``spec`` is not one.

    Raises:
        ValueError: N is not an integer, or is below 257 (256 bytes and the EOS token).
    """
    if not spec.startswith("bpe:"):
        return None
    n = spec[4:]
    if not n.isdigit():
        raise ValueError(f"tokenizer {spec}: expected bpe:N with N an integer vocabulary size, e.g. bpe:8192")
    if int(n) < BYTE_VOCAB + 1:
        raise ValueError(f"tokenizer {spec}: N must be at least 257 (the 256 bytes and the EOS token)")
    return int(n)


def train_bpe(texts: Iterable[str], vocab_size: int, special_tokens: tuple[str, ...] = ()) -> Codec:
    """Train a byte-level BPE (GPT-2's pre-tokenizer and decoder) on ``texts``, offline and deterministically.

    Args:
        texts: the training documents.
        vocab_size: the vocabulary size, ``<|endoftext|>`` (id 0, the EOS) and the 256 bytes included.
        special_tokens: further special tokens (a chat template's ``<|im_start|>``), ids 1, 2, ... in this order.

    Returns:
        A codec named ``bpe:<vocab_size>``; its vocabulary may come out smaller when the texts hold fewer merges.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(dict.fromkeys([EOS_TOKEN, *special_tokens])),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return TokenizersCodec(tok, f"bpe:{vocab_size}", tok.token_to_id(EOS_TOKEN))


def load_tokenizer(spec: str) -> Codec:
    """The codec named by ``spec``: a ``tokenizer.json``, a model directory holding one, or ``tiktoken:NAME``.

    Raises:
        ValueError: ``bpe:N`` (trained by ``trainer prepare``, not loaded), an unknown spec (with a did-you-mean),
            an unreadable tokenizer.json, a directory without one, or a tiktoken encoding that cannot be had.
        FileNotFoundError: a path that does not exist.
    """
    if spec.startswith("tiktoken:"):
        return _load_tiktoken(spec)
    if spec.startswith("bpe:"):
        parse_bpe(spec)
        raise ValueError(f"tokenizer {spec}: a bpe:N tokenizer is trained by `trainer prepare`, not loaded")
    p = Path(spec).expanduser()
    if p.is_dir():
        return _load_dir(p, spec)
    if p.is_file():
        return _load_json(p, spec, eos_name=None)
    if "/" in spec or spec.endswith(".json") or spec.startswith("."):
        raise FileNotFoundError(
            f"tokenizer {spec}: no such file or directory (Hugging Face Hub names are not downloaded: "
            "pass a local tokenizer.json or model directory)"
        )
    raise ValueError(
        f"tokenizer {spec!r}: unknown; expected bpe:N, tiktoken:NAME, or the path of a tokenizer.json or of a "
        f"model directory{_did_you_mean(spec)}"
    )


def _did_you_mean(spec: str) -> str:
    digits = "".join(c for c in spec if c.isdigit())
    candidates = [f"tiktoken:{n}" for n in TIKTOKEN_NAMES] + [f"bpe:{digits or 8192}"]
    if spec in TIKTOKEN_NAMES:
        return f" (did you mean tiktoken:{spec}?)"
    close = difflib.get_close_matches(spec.lower(), candidates, n=1, cutoff=0.5)
    if not close and spec.lower().startswith("bpe"):
        close = [f"bpe:{digits or 8192}"]
    return f" (did you mean {close[0]}?)" if close else ""


def _load_dir(d: Path, spec: str) -> Codec:
    f = d / "tokenizer.json"
    if not f.is_file():
        raise ValueError(
            f"tokenizer {spec}: the directory holds no tokenizer.json (only fast Hugging Face tokenizers are read; "
            "save one with AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))"
        )
    return _load_json(f, spec, eos_name=_config_eos(d))


def _config_eos(d: Path) -> str | None:
    """The ``eos_token`` of a model directory's tokenizer_config.json, if it names one."""
    cfg = d / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    eos = json.loads(cfg.read_text()).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


def _load_json(f: Path, spec: str, eos_name: str | None, eos_id: int | None = None) -> Codec:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(f))
    except Exception as e:  # the Rust side raises a bare Exception for malformed files
        raise ValueError(f"tokenizer {spec}: {f} is not a Hugging Face tokenizer.json ({e})") from None
    if eos_id is None:
        names = [eos_name] if eos_name else list(_EOS_CANDIDATES)
        eos_id = next((tok.token_to_id(n) for n in names if tok.token_to_id(n) is not None), None)
    return TokenizersCodec(tok, spec, eos_id)


def _load_tiktoken(spec: str) -> Codec:
    name = spec.partition(":")[2]
    hint = "use bpe:N (trained on the sources, offline) or a local tokenizer.json instead"
    try:
        import tiktoken
    except ImportError:
        raise ValueError(
            f"tokenizer {spec}: needs the tiktoken package (pip install tiktoken, or pip install -e '.[data]') "
            f"and its encoding files, downloaded on first use; {hint}"
        ) from None
    known = tiktoken.list_encoding_names()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        mean = f" (did you mean tiktoken:{close[0]}?)" if close else ""
        raise ValueError(f"tokenizer {spec}: unknown tiktoken encoding; known: {', '.join(known)}{mean}")
    try:
        encoding = tiktoken.get_encoding(name)
    except Exception as e:  # network errors come from requests/urllib, whichever tiktoken uses
        raise ValueError(
            f"tokenizer {spec}: could not fetch the tiktoken encoding files ({type(e).__name__}: {e}); "
            "tiktoken downloads them on first use and caches them (TIKTOKEN_CACHE_DIR); " + hint
        ) from None
    return TiktokenCodec(encoding, spec)


def codec_for_data(path: str | None) -> Codec:
    """The codec of a run's ``data.path``.

    Args:
        path: None (the embedded corpus), a text file, or a directory written by ``trainer prepare``
            (or its ``train.bin``/``val.bin``).

    Returns:
        Bytes for the embedded corpus and a text file; the prepared directory's tokenizer otherwise.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a ``.bin`` with no meta.json beside it, or a directory that ``trainer prepare`` did not write.
    """
    if path is None:
        return ByteCodec()
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"data.path: no such file or directory: {path}")
    if p.is_file() and p.suffix == ".bin":
        if not (p.parent / "meta.json").is_file():
            raise ValueError(
                f"data.path {path}: no tokenizer is recorded for this token file (no meta.json beside it); "
                "write the data with `trainer prepare` to keep its tokenizer"
            )
        p = p.parent
    if p.is_file():
        return ByteCodec()
    return _prepared_codec(p)


def data_eos(path: str | None) -> tuple[str, int | None]:
    """What a run's ``data.path`` says of its special tokens, without loading its tokenizer: ``("bytes", None)``
    for the embedded corpus and a text file (bytes have none), ``("prepared", eos_id)`` for data ``trainer
    prepare`` wrote (meta.json's ``eos_id``; None where its tokenizer has no end-of-text token), ``("unknown",
    None)`` for a token file without meta.json, or data that is no longer there."""
    p = None if path is None else Path(path)
    if p is None or (p.is_file() and p.suffix != ".bin"):
        return "bytes", None
    meta = (p if p.is_dir() else p.parent) / "meta.json"
    try:
        eos = json.loads(meta.read_text()).get("eos_id")
    except (OSError, ValueError, AttributeError):  # none, unreadable, or not a JSON object
        return "unknown", None
    return "prepared", eos if isinstance(eos, int) else None


def _prepared_codec(d: Path) -> Codec:
    meta_file = d / "meta.json"
    if not meta_file.is_file():
        raise ValueError(f"data.path {d}: not a directory written by `trainer prepare` (no meta.json)")
    meta = json.loads(meta_file.read_text())
    spec = meta.get("tokenizer", str(d))
    if (d / "tokenizer.json").is_file():
        return _load_json(d / "tokenizer.json", spec, eos_name=None, eos_id=meta.get("eos_id"))
    if spec.startswith("tiktoken:"):
        return _load_tiktoken(spec)
    raise ValueError(f"data.path {d}: meta.json names tokenizer {spec!r} but the directory holds no tokenizer.json")
