"""A GPT in the shape of nanoGPT: learned positions, pre-LN blocks, causal SDPA attention, tied head.

Plain PyTorch: trainer's Triton kernels reach it as they reach any model, through the compile layer's graph
substitution (:mod:`trainer.compile.passes`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainer.models.presets import PRESETS  # noqa: F401 - re-exported


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    attention: str = "auto"  # SDPA backend: auto (torch picks) | flash | cudnn | efficient | math


def sdpa_backend(name: str):
    """The ``torch.nn.attention.SDPBackend`` for a ``model.attention`` name; None for auto."""
    if name == "auto":
        return None
    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]


class CausalSDPA(nn.Module):
    """Causal ``scaled_dot_product_attention`` as a module of its own, so that context parallel can wrap it (torch's
    ``_ContextParallel`` style turns its query, key and value into sequence shards and its call into ring
    attention: :mod:`trainer.distributed.cp`). ``backend``: a ``model.attention`` name (auto: torch's choice)."""

    def __init__(self, backend: str = "auto"):
        super().__init__()
        self.backend = sdpa_backend(backend)

    def forward(self, q, k, v, dropout_p: float = 0.0, scale: float | None = None):
        if self.backend is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)
        with sdpa_kernel(self.backend):  # traced by Dynamo: the choice is made at trace time
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)


class CausalSelfAttention(nn.Module):
    """Causal self-attention whose one projection ``c_qkv`` gives each head's query, key and value side by side
    (its output rows head-major: head 0's q, k, v, then head 1's), so that splitting the projection's rows into
    equal parts splits the heads: tensor parallel shards it as any column-parallel linear, and each rank computes
    its heads' attention (:mod:`trainer.distributed.tp`). A checkpoint of nanoGPT's layout (``c_attn``: every
    query, then every key, then every value) loads into it, its rows reordered."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.c_qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.sdpa = CausalSDPA(cfg.attention)
        self._register_load_state_dict_pre_hook(self._from_nanogpt_layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.c_qkv(x).view(B, T, -1, 3, self.head_dim)  # (B, T, nh, 3, hs): nh of this rank's heads
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))  # (B, nh, T, hs)
        y = self.sdpa(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hs)
        return self.resid_dropout(self.c_proj(y))

    def _from_nanogpt_layout(self, state_dict, prefix, *args) -> None:
        """A state dict with ``c_attn`` (rows q | k | v, each head by head) loads as ``c_qkv`` (head by head, each
        q, k, v): the same model."""
        for kind in ("weight", "bias"):
            old = state_dict.pop(f"{prefix}c_attn.{kind}", None)
            if old is not None:
                rows = old.view(3, self.n_head, self.head_dim, *old.shape[1:])  # (3, nh, hs[, C])
                state_dict[f"{prefix}c_qkv.{kind}"] = rows.transpose(0, 1).reshape(old.shape)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 style decoder. ``forward(idx, targets)`` returns the mean loss; without targets, the logits."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``positions``: each token's position in its sequence, (B, T) (context parallel gives a rank's slices of
        the sequence); None: 0 .. T-1."""
        B, T = idx.shape  # (B, T)
        assert T <= self.cfg.block_size, f"sequence length {T} > block_size {self.cfg.block_size}"
        pos = torch.arange(T, device=idx.device) if positions is None else positions
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        if targets is None:
            return self.lm_head(self.transformer.ln_f(x))  # (B, T, V)
        return self.head_loss(x, targets)

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Final norm, tied head and mean cross-entropy: (B, T, C), (B, T) -> scalar.

        Its own method so that ``compile.scope: blocks`` can compile it as one more graph
        (``compile.loss``): the (B*T, V) logits are the largest tensors of the step.
        """
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, V)
        B, T, V = logits.shape
        return F.cross_entropy(logits.view(B * T, V).float(), targets.reshape(B * T), ignore_index=-100)

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward), as in the PaLM appendix / nanoGPT: 6N + 12·L·C·T."""
        T = seq_len or self.cfg.block_size
        return 6 * self.num_params() + 12 * self.cfg.n_layer * self.cfg.n_embd * T
