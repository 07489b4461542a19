"""The models the step benchmark compares on: built-in GPTs, a user's nanoGPT-shaped GPT, Hugging Face models.

Each is built the same way for the user loop and for ``trainer fit``: :func:`build` makes the module a user would
train, :func:`overrides` the config keys that make ``trainer fit`` train the same one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.nn as nn

NANOGPT_124M = dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=1024)
HF_GPT2_124M = dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
HF_LLAMA_1B = dict(  # Llama-3.2-1B's shape (1.24B parameters)
    model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_theta=500000.0, tie_word_embeddings=True, hidden_act="silu",
)  # fmt: skip
HF_LLAMA_8B = dict(  # Llama-3-8B's shape (8.03B parameters)
    model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_theta=500000.0, tie_word_embeddings=False, hidden_act="silu",
)  # fmt: skip

HF_QWEN3_06B = dict(  # Qwen3-0.6B's shape (0.6B parameters, 28 layers, tied embeddings)
    model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_theta=1000000.0, tie_word_embeddings=True, hidden_act="silu",
)  # fmt: skip

MODELS = {
    "gpt2-small": {"kind": "builtin", "preset": "gpt2-small", "vocab": 50304, "seq": 1024, "batch": 16},
    "gpt2-medium": {"kind": "builtin", "preset": "gpt2-medium", "vocab": 50304, "seq": 1024, "batch": 16},
    "nanogpt-124m": {
        "kind": "target",
        "target": "scripts.nanogpt_model:make",
        "kwargs": NANOGPT_124M,
        "seq": 1024,
        "batch": 16,
        "layers": 12,
        "width": 768,
    },  # fmt: skip
    "hf-gpt2-124m": {"kind": "hf", "config": HF_GPT2_124M, "seq": 1024, "batch": 16},
    "hf-llama-1b": {"kind": "hf", "config": HF_LLAMA_1B, "seq": 2048, "batch": 4},
    "hf-llama-8b": {"kind": "hf", "config": HF_LLAMA_8B, "seq": 2048, "batch": 2},
    "hf-qwen3-0.6b": {"kind": "hf", "config": HF_QWEN3_06B, "seq": 2048, "batch": 4},
}


def spec(name: str) -> dict:
    if name not in MODELS:
        raise SystemExit(f"--models: unknown model '{name}' (known: {', '.join(MODELS)})")
    return MODELS[name]


def hf_dir(name: str, root: str | Path) -> Path:
    """A directory holding the model's config.json (what ``model.hf`` reads), under ``root``."""
    path = Path(root) / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(spec(name)["config"]))
    return path


def overrides(name: str, root: str | Path) -> list[str]:
    """The ``trainer fit`` overrides that train ``name``."""
    s = spec(name)
    if s["kind"] == "builtin":
        return [f"model.preset={s['preset']}", f"data.vocab_size={s['vocab']}"]
    if s["kind"] == "target":
        kwargs = "{" + ", ".join(f"{k}: {v}" for k, v in s["kwargs"].items()) + "}"
        return ["model.preset=null", f"model.target={s['target']}", f"model.kwargs={kwargs}", "data.vocab_size=null"]
    return ["model.preset=null", f"model.hf={hf_dir(name, root)}", "data.vocab_size=null"]  # the bytes fit


def build(name: str, root: str | Path, seq: int) -> nn.Module:
    """The module a user trains, on the CPU (seeded by the caller)."""
    s = spec(name)
    if s["kind"] == "builtin":
        from trainer.models import build_model

        return build_model(preset=s["preset"], vocab_size=s["vocab"], seq_len=seq)
    if s["kind"] == "target":
        from scripts.nanogpt_model import make

        return make(**s["kwargs"])
    from trainer.models.hf import build_hf_model

    return build_hf_model(str(hf_dir(name, root)))


def flops_per_token(name: str, model: nn.Module, seq: int) -> float:
    """Training FLOPs per token with attention counted: the model's own count, or 6N + 12·L·C·T."""
    fn = getattr(model, "flops_per_token", None)
    if callable(fn):
        return float(fn(seq))
    s = spec(name)
    n = sum(p.numel() for p in model.parameters())
    return 6.0 * n + 12.0 * s["layers"] * s["width"] * seq


__all__ = ["MODELS", "build", "flops_per_token", "hf_dir", "overrides", "spec"]
