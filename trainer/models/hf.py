"""Hugging Face causal LMs as trainer models: ``model.hf``, ``model.hf_overrides``, ``model.pretrained``.

:class:`HFCausalLM` holds the transformers model as its one submodule ``hf``, so:

- its state-dict keys are the Hugging Face model's under ``hf.`` (:func:`save_pretrained` writes them without it);
- the repeated blocks are where transformers keeps them, ``hf.model.layers`` (Llama, Mistral, Qwen) or
  ``hf.transformer.h`` (GPT-2): :func:`trainer.models.blocks.find_blocks` finds them, and ``compile.blocks``
  names them by those paths;
- tied embeddings (GPT-2's ``wte`` and ``lm_head``) are one ``nn.Parameter`` that ``.to(device)`` and
  ``load_state_dict`` keep shared.

The loss is computed here, not by transformers: the trainer's targets are already shifted (``targets[t]`` is the
token after ``idx[t]``), and ``labels=`` would shift them again.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.shipped import shipped_path

INSTALL = "pip install -e '.[hf]'"
# Files of a local model directory that describe its tokenizer and generation: copied beside an export.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
)


class HFCausalLM(nn.Module):
    """A transformers causal LM under the user-model contract: ``forward(idx, targets)`` returns the scalar loss.

    Args:
        model: a transformers ``*ForCausalLM`` model (``base_model`` gives the hidden states, its output
            embeddings are the LM head).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.hf = model
        self.documents: str | None = None
        """Packed documents (:func:`use_document_mask`): ``flex``, ``dense`` or ``additive``, the mask that keeps them
        apart; the loss is then the mean over the targets that are not -100, 0 where there are none. None: one
        sequence per row."""
        head = model.get_output_embeddings()
        assert head is not None, f"{type(model).__name__} has no output embeddings (LM head)"
        # Names, not module references: a second reference would register the module twice (two state-dict keys).
        self._head_path = next(name for name, mod in model.named_modules() if mod is head)
        self._base_name = model.base_model_prefix

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, T) token ids and (B, T) next-token targets -> the mean cross-entropy; without targets, the logits.
        ``positions``: each token's position in its sequence, (B, T) (context parallel's slices; with packed
        ``documents``, restarting at 0 where each document starts); None: 0 .. T-1."""
        base = getattr(self.hf, self._base_name)
        mask = None if self.documents is None or positions is None else document_mask(positions, self.documents)
        h = base(input_ids=idx, position_ids=positions, attention_mask=mask, use_cache=False)[0]  # (B, T, C)
        if targets is None:
            return self.logits(h)  # (B, T, V)
        return self.head_loss(h, targets)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head over the last hidden state, with the model's own logit scaling: (B, T, C) -> (B, T, V)."""
        logits = self.hf.get_submodule(self._head_path)(h)
        cfg = self.hf.config
        if getattr(cfg, "logit_scale", None) is not None:  # Cohere multiplies its logits
            logits = logits * cfg.logit_scale
        if getattr(cfg, "logits_scaling", None) is not None:  # Granite divides them
            logits = logits / cfg.logits_scaling
        if getattr(cfg, "final_logit_softcapping", None) is not None:  # Gemma 2 and 3 soft-cap them
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def head_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """LM head and mean cross-entropy over the last hidden state: (B, T, C), (B, T) -> scalar.

        Its own method so that ``compile.scope: blocks`` compiles it as one more graph (``compile.loss``), and
        written as ``cross_entropy(linear(h, W), targets)`` in plain torch calls so that the compile layer's
        graph passes recognise the head and loss of any model.
        """
        logits = self.logits(h)  # (B, T, V)
        if self.documents is None:
            return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        # Masked targets: a micro-batch may hold none, where the mean would be 0 / 0 (and its gradient NaN).
        total = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), reduction="sum")
        return total / (targets != -100).sum().clamp(min=1)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), the nanoGPT / PaLM-appendix convention: 6N + 12·L·A·T.

        N counts every parameter except the embedding tables (``nn.Embedding``: token and learned position
        embeddings, which are lookups, not matmuls) plus the LM head's matmul (V x C), also when it is tied to the
        token embedding. The attention term is the score and value matmuls over the whole T x T square (not halved
        for the causal mask), forward and backward: L layers, A = heads x head size (the hidden size for most
        models), T = ``seq_len``. Sliding-window attention, MoE routing and logit soft-capping are not counted
        apart: for an MoE model N counts every expert, an upper bound.
        """
        cfg = self.hf.config
        embeddings = {id(m.weight) for m in self.hf.modules() if isinstance(m, nn.Embedding)}
        n = sum(p.numel() for p in self.hf.parameters() if id(p) not in embeddings)
        head = self.hf.get_submodule(self._head_path).weight
        if id(head) in embeddings:  # tied: the table is also the head's matrix
            n += head.numel()
        n_head = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
        return 6.0 * n + 12.0 * cfg.num_hidden_layers * n_head * head_dim * seq_len


def document_mask(positions: torch.Tensor, kind: str):
    """The mask of packed documents from their positions (B, T), which restart at 0 where a document starts: a token
    attends to the tokens of its own document up to itself. ``kind``: ``dense``, a (B, 1, T, T) boolean mask for
    SDPA; ``additive``, the same as 0 and the lowest float32 for transformers' eager attention, which adds its mask
    to the scores; ``flex``, FlexAttention's ``BlockMask``, whose kernel skips the blocks across documents."""
    doc = (positions == 0).cumsum(-1)  # (B, T): each token's document
    B, T = positions.shape
    if kind in ("dense", "additive"):
        causal = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()
        allowed = ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]  # (B, 1, T, T)
        if kind == "dense":
            return allowed
        return torch.zeros(allowed.shape, device=positions.device).masked_fill(~allowed, torch.finfo(torch.float32).min)
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document(b, h, q, kv):
        return (doc[b, q] == doc[b, kv]) & (q >= kv)

    make = create_block_mask if torch.compiler.is_compiling() else _compiled_block_mask()
    return make(same_document, B, None, T, T, device=positions.device)


@functools.cache
def _compiled_block_mask():
    """``create_block_mask`` compiled on its own, for a forward outside a compiled graph (``compile.scope: blocks``,
    eager): evaluated eagerly it would call the mask on every one of the B x T x T pairs."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def use_document_mask(model: nn.Module, kind: str, seq_len: int) -> str | None:
    """Make ``model`` (an :class:`HFCausalLM`) keep packed documents apart (:func:`document_mask`): ``flex`` switches
    its attention to FlexAttention; ``dense`` is SDPA's boolean mask, or the additive mask where the model runs
    transformers' eager attention. Returns why the kind differs from the one asked for (no FlexAttention here);
    None otherwise.

    Raises:
        ValueError: a model with sliding-window attention narrower than ``seq_len`` (``data.seq_len``): a mask
            given to transformers replaces its sliding-window masks, so a long document would see past the window.
    """
    assert isinstance(model, HFCausalLM), f"a document mask needs a Hugging Face model, not {type(model).__name__}"
    config = model.hf.config
    window = getattr(config, "sliding_window", None)
    sliding = getattr(config, "use_sliding_window", True) and (
        "sliding_attention" in (getattr(config, "layer_types", None) or ["sliding_attention"])
    )
    if window and sliding and window < seq_len:
        raise ValueError(
            f"data.seq_len: {seq_len}, but {type(model.hf).__name__} attends within a sliding window of {window} "
            f"tokens, which the mask of packed documents does not apply; set data.seq_len to at most {window}"
        )
    why = None
    if kind == "flex":
        try:
            model.hf.set_attn_implementation("flex_attention")
        except (ValueError, ImportError, AttributeError) as e:
            why = f"{type(model.hf).__name__} has no FlexAttention here ({_first_line(e)}); the document mask is dense"
            kind = "dense"
    if kind == "dense" and getattr(config, "_attn_implementation", "sdpa") != "sdpa":
        kind = "additive"  # eager attention adds its mask to the scores: a boolean one would add 1 and 0
    model.documents = kind
    return why


@contextlib.contextmanager
def dense_documents(model: nn.Module):
    """Within: ``model`` (an :class:`HFCausalLM` under FlexAttention's document mask) runs SDPA with the dense mask
    instead, its FlexAttention restored after. The evaluation runs so: torch 2.11's compiled inference graph of a
    model with FlexAttention inside stops on an H200 with an illegal memory access."""
    kind = model.documents
    if kind != "flex":
        yield
        return
    model.hf.set_attn_implementation("sdpa")
    model.documents = "dense"
    try:
        yield
    finally:
        model.hf.set_attn_implementation("flex_attention")
        model.documents = kind


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ValueError(f"model.hf: needs the transformers package; install it with: {INSTALL}") from None
    return transformers


def _first_line(e: BaseException) -> str:
    return next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)


def _source(name: str) -> tuple[str, bool]:
    """``(what transformers reads, whether it is a local directory)`` for ``model.hf``; a ``configs/...`` path that
    is not in the working directory is a shipped model directory (:func:`trainer.shipped.shipped_path`)."""
    path = Path(name).expanduser()
    path = path if path.exists() else shipped_path(name) or path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.hf: {path} holds no config.json; expected a Hugging Face model directory")
        return str(path), True
    if path.exists():
        raise ValueError(f"model.hf: {path} is a file; expected a directory holding config.json, or a hub name")
    if name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name:  # a path, not "org/name"
        raise FileNotFoundError(f"model.hf: no such directory: {name}")
    return name, False


def load_hf_config(name: str, overrides: dict[str, Any] | None = None):
    """The transformers config of ``model.hf`` (a local directory or a hub name) with ``model.hf_overrides``.

    Raises:
        ValueError, FileNotFoundError: no transformers, a missing directory, a hub name that cannot be fetched,
            an override that names no field of the config.
    """
    transformers = _transformers()
    source, local = _source(name)
    try:
        config = transformers.AutoConfig.from_pretrained(source)
    except OSError as e:
        if local:
            raise ValueError(f"model.hf: cannot read {source}/config.json: {_first_line(e)}") from None
        raise ValueError(
            f"model.hf: '{name}' is no local directory and cannot be fetched from the Hugging Face hub "
            f"({_first_line(e).rstrip('.')}). Download it on a machine with network access (e.g. `hf download {name} "
            "--local-dir DIR`), copy DIR here and pass the local directory: model.hf=DIR"
        ) from None
    except ValueError as e:  # e.g. an unknown model_type
        raise ValueError(f"model.hf: {source}: {_first_line(e)}") from None
    for key, value in (overrides or {}).items():
        if not hasattr(config, key):
            import difflib

            near = difflib.get_close_matches(key, list(config.to_dict()), n=1, cutoff=0.6)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ValueError(f"model.hf_overrides.{key}: not a field of {type(config).__name__}{hint}")
        setattr(config, key, value)
    return config


def build_hf_model(
    name: str,
    *,
    overrides: dict[str, Any] | None = None,
    pretrained: bool = False,
    vocab_size: int | None = None,
    seq_len: int | None = None,
) -> HFCausalLM:
    """The :class:`HFCausalLM` of ``model.hf``: its weights (``pretrained``) or a random init from its config.

    The parameters are fp32 whatever the checkpoint's dtype (the trainer's precision is autocast's), attention is
    torch's scaled-dot-product attention (``sdpa``), or transformers' eager attention for an architecture that
    has no sdpa in the installed transformers (:func:`attention_of` tells).

    Args:
        name: a local directory holding config.json (and the weights for ``pretrained``), or a hub name.
        overrides: config fields to change (``model.hf_overrides``).
        pretrained: load the weights (``from_pretrained``), else initialise from the config (``from_config``).
        vocab_size: the data's vocabulary; it must fit the model's (None: not checked).
        seq_len: the training sequence length; at most the model's positions where it has a limit (None: not checked).

    Raises:
        ValueError, FileNotFoundError: a user error, naming the key to change.
    """
    transformers = _transformers()
    config = load_hf_config(name, overrides)
    if vocab_size is not None and vocab_size > config.vocab_size:
        raise ValueError(
            f"data.vocab_size: the data's vocabulary ({vocab_size} tokens) is larger than model.hf's "
            f"({config.vocab_size}, vocab_size in its config): the embedding would not cover every token id. Use data "
            "tokenized for this model, or a larger model.hf_overrides.vocab_size (with model.pretrained=false)"
        )
    positions = getattr(config, "max_position_embeddings", None)  # GPT-2's n_positions, through its attribute map
    if seq_len is not None and positions is not None and seq_len > positions:
        raise ValueError(
            f"data.seq_len: {seq_len} is longer than model.hf's context ({positions} positions, "
            "max_position_embeddings or n_positions in its config); lower data.seq_len"
        )
    kwargs = dict(attn_implementation="sdpa", **_dtype_kwarg(transformers, torch.float32))
    try:
        model = _instantiate(transformers, name, config, pretrained, kwargs)
    except _NoSDPA:  # the startup line says so (trainer.describe.describe_run)
        model = _instantiate(transformers, name, config, pretrained, dict(kwargs, attn_implementation="eager"))
    return HFCausalLM(model)


class _NoSDPA(Exception):
    """transformers has no sdpa attention for this architecture."""


def _instantiate(transformers, name: str, config, pretrained: bool, kwargs: dict) -> nn.Module:
    """``from_pretrained`` or ``from_config``, its failures as user errors naming the key to change."""
    auto = transformers.AutoModelForCausalLM
    try:
        if pretrained:
            return auto.from_pretrained(_source(name)[0], config=config, **kwargs)
        return auto.from_config(config, **kwargs)
    except OSError as e:  # no weights in the directory, or none to download
        raise ValueError(
            f"model.pretrained: cannot load the weights of '{name}': {_first_line(e)}; set model.pretrained=false "
            "to initialise the model at random from its config"
        ) from None
    except ValueError as e:  # not a causal LM, or no sdpa for this architecture
        if kwargs.get("attn_implementation") == "sdpa" and "scaled_dot_product_attention" in str(e):
            raise _NoSDPA from None
        raise ValueError(f"model.hf: {name}: {_first_line(e)}") from None
    except RuntimeError as e:  # the weights' shapes do not fit a config changed by model.hf_overrides
        raise ValueError(
            f"model.hf_overrides: the weights of '{name}' do not fit the changed config: {_first_line(e)}"
        ) from None
    except AssertionError as e:  # a config whose fields disagree (torch's modules assert on their arguments)
        what = f"AssertionError: {_first_line(e)}" if str(e) else "AssertionError"
        raise ValueError(
            f"model.hf: {name}: {type(config).__name__} cannot be built from this config ({what}); check the "
            "fields model.hf_overrides changes (a token id past vocab_size, say)"
        ) from e


def attention_of(model: nn.Module) -> str | None:
    """The attention implementation of a Hugging Face model (``sdpa`` or ``eager``); None for other models."""
    config = getattr(getattr(model, "hf", None), "config", None)
    name = getattr(config, "_attn_implementation", None) if isinstance(model, HFCausalLM) else None
    return "sdpa" if name == CAUSAL_SDPA else name


# transformers' SDPA attention under a name it has no mask function for (:func:`causal_sdpa_without_mask`).
CAUSAL_SDPA = "trainer_causal_sdpa"
# The architectures whose only mask is create_causal_mask's and whose attention takes any registered function:
# their logits under CAUSAL_SDPA are transformers' SDPA path's (tests/test_hf.py checks a tiny model of each).
# Others keep transformers' masks: Falcon branches on the name "sdpa" (its other path adds the mask), Doge adds a
# mask of its own to the causal one, DeepSeek-V3.2 indexes the mask.
CAUSAL_SDPA_MODELS = frozenset(
    {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "phi", "phi3", "olmo", "granite", "starcoder2", "gpt2",
     "gpt_neox"}
)  # fmt: skip


def mask_between_blocks(config, documents: bool) -> str | None:
    """Why a Hugging Face model of ``config`` makes an attention mask in eager code between its blocks each forward
    (the blocks compiled one by one, ``compile.scope: blocks``); None where :func:`causal_sdpa_without_mask` leaves
    it none to make: an architecture of :data:`CAUSAL_SDPA_MODELS`, whole causal sequences (``documents``: packed
    documents, which keep their mask), no sliding window, no chunked attention."""
    if documents:
        return "packed documents keep transformers' document mask"
    kind = getattr(config, "model_type", None)
    if kind not in CAUSAL_SDPA_MODELS:
        return f"transformers makes the attention mask of a {kind} model"
    window = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if window or kinds != {"full_attention"} or getattr(config, "attention_chunk_size", None):
        return "its sliding-window or chunked attention keeps transformers' mask"
    return None


def causal_sdpa_without_mask(model: nn.Module) -> bool:
    """Build no attention mask for a Hugging Face model on SDPA that trains on whole causal sequences: SDPA then runs
    with ``is_causal``. Returns whether it applied: an :class:`HFCausalLM` of an architecture in
    :data:`CAUSAL_SDPA_MODELS` on ``sdpa`` with no packed documents, every attention layer causal, no sliding window
    and no chunked attention (its forward passes no padding mask and no cache).

    The attention becomes transformers' own SDPA function under a name transformers has no mask function for, so
    ``create_causal_mask`` returns None at once. Otherwise, between compiled blocks (``compile.scope: blocks``, and
    fsdp, which compiles the blocks) the mask is made in eager code each forward: transformers first looks for packed
    sequences in the positions, reading a device tensor on the host (a sync every forward), and while a CUDA graph is
    captured it takes itself for tracing and makes a dense ``(B, 1, T, T)`` mask instead, a new input of every block.
    """
    hf = getattr(model, "hf", None)
    if not isinstance(model, HFCausalLM) or attention_of(model) != "sdpa":
        return False
    configs = [m.config for m in hf.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")]
    if any(mask_between_blocks(c, model.documents is not None) for c in [hf.config, *configs]):
        return False
    if not all(getattr(m, "is_causal", True) for m in hf.modules() if hasattr(m, "num_key_value_groups")):
        return False
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    for config in configs:  # transformers reads the implementation from each submodule's config
        if config._attn_implementation == "sdpa":
            config._attn_implementation = CAUSAL_SDPA
    return True


def _dtype_kwarg(transformers, dtype: torch.dtype) -> dict:
    """transformers >= 4.56 names the argument ``dtype`` and warns on ``torch_dtype``, which older ones need."""
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def fit_special_ids(model: HFCausalLM, vocab_size: int, data: str, eos_id: int | None) -> str | None:
    """Give ``model``'s config (and generation config) the special token ids of the data it was trained on, for an
    export: a config from another tokenizer keeps its ids (Llama 3's bos 128000 and eos 128001) whatever vocabulary
    ``model.hf_overrides`` gave the model. Returns the line that says what changed, None where nothing did.

    Args:
        vocab_size: the trained vocabulary (the data's); an id at or past it names no token the model learned.
        data: ``bytes`` (no special tokens: every id None), ``prepared`` (``eos_id`` is its end-of-text token) or
            ``unknown`` (ids the vocabulary holds are kept).
        eos_id: the data's end-of-text id (``trainer prepare``'s meta.json), None where it has none.
    """

    def holds(value) -> bool:  # eos_token_id may be a list
        values = value if isinstance(value, list) else [value]
        return all(isinstance(v, int) and 0 <= v < vocab_size for v in values)

    config = model.hf.config
    old = {key: getattr(config, key, None) for key in SPECIAL_IDS}
    new = {}
    for key, value in old.items():
        if data == "bytes":
            new[key] = None
        elif key == "eos_token_id" and eos_id is not None:
            new[key] = eos_id
        else:
            new[key] = value if value is None or holds(value) else eos_id
    changed = [f"{key} {old[key]} -> {new[key]}" for key in SPECIAL_IDS if new[key] != old[key]]
    if not changed:
        return None
    generation = getattr(model.hf, "generation_config", None)
    for key, value in new.items():
        setattr(config, key, value)
        if generation is not None:
            setattr(generation, key, value)
    why = {
        "bytes": "the data is bytes, which have no special tokens",
        "prepared": f"the data's end-of-text token is {eos_id}" if eos_id is not None else "the data has none",
        "unknown": "the data's special tokens are not known: a token file without meta.json, or no data at data.path",
    }[data]
    return f"export: special token ids of the trained {vocab_size}-token vocabulary ({why}): {', '.join(changed)}"


def save_pretrained(model: HFCausalLM, out_dir: str | Path, source: str | None = None) -> Path:
    """Write ``model`` as a Hugging Face model directory that ``AutoModelForCausalLM.from_pretrained`` loads (the
    weights without the adapter's ``hf.`` prefix, and config.json); with ``source`` a local directory, its tokenizer
    and generation files are copied beside them."""
    out = Path(out_dir)
    model.hf.save_pretrained(out)
    src = Path(source).expanduser() if source else None
    if src is not None and src.is_dir():
        for name in TOKENIZER_FILES:
            if (src / name).is_file() and not (out / name).exists():
                shutil.copy2(src / name, out / name)
    return out
