"""A GPT in the shape of nanoGPT: learned positions, pre-LN blocks, causal SDPA attention, tied head."""

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
    fused_loss: bool = False
    cross_entropy: str = "torch"  # torch (F.cross_entropy) | triton (ours, logit gradients in the forward)
    attention: str = "auto"  # SDPA backend: auto (torch picks) | flash | cudnn | efficient | math
    layer_norm: str = "torch"  # torch (nn.LayerNorm, the residual adds by autograd) | triton (add + norm fused)


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


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.backend = sdpa_backend(cfg.attention)

    def forward(self, x: torch.Tensor, proj_bias: bool = True) -> torch.Tensor:
        """Attention's output; ``proj_bias=False`` leaves c_proj's bias out (the caller adds it)."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        if self.backend is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            with sdpa_kernel(self.backend):  # traced by Dynamo: the choice is made at trace time
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        if not proj_bias:
            return self.resid_dropout(F.linear(y, self.c_proj.weight))
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


def _norm(
    ln: nn.LayerNorm, x: torch.Tensor, pending: torch.Tensor | None, pending_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + pending, ln(x + pending))`` in one Triton kernel (``model.layer_norm: triton``), the
    increment's bias (if any) added there too; no pending increment: ``(x, ln(x))``."""
    from trainer.compile.kernels.add_layer_norm import add_layer_norm, layer_norm

    if pending is None:
        return x, layer_norm(x, ln.weight, ln.bias, ln.eps)
    return add_layer_norm(x, pending, ln.weight, ln.bias, ln.eps, inc_bias=pending_bias)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.fused_norm = cfg.layer_norm == "triton"
        # With the fused norm (and no dropout between the projection and the add), ln_2's kernel adds
        # attn.c_proj's bias and its backward sums the bias gradient: one reduction over the (tokens x width)
        # gradient fewer per block. (The MLP's c_proj bias stays in its matmul: its add belongs to the next
        # block's norm, and a parameter read outside its own block would cross DDP's graph pieces and FSDP's units.)
        self.fold_attn_bias = self.fused_norm and cfg.dropout == 0.0

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None = None):
        """``x + attn(ln_1(x))``, then ``+ mlp(ln_2(.))``. With ``model.layer_norm: triton`` each residual add is
        done by the norm that reads its sum: the block takes and returns ``(x, pending)``, the residual stream
        and the increment still to add to it (the next block's ln_1 or the head's ln_f adds it)."""
        if not self.fused_norm:
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))
        x, h = _norm(self.ln_1, x, pending)
        fold = self.fold_attn_bias
        x, h = _norm(self.ln_2, x, self.attn(h, proj_bias=not fold), self.attn.c_proj.bias if fold else None)
        return x, self.mlp(h)


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

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape  # (B, T)
        assert T <= self.cfg.block_size, f"sequence length {T} > block_size {self.cfg.block_size}"
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        pending = None  # with model.layer_norm: triton, the last branch output not yet added to x
        for block in self.transformer.h:
            if self.cfg.layer_norm == "triton":
                x, pending = block(x, pending)
            else:
                x = block(x)
        if targets is None:
            return self.lm_head(self.final_norm(x, pending))  # (B, T, V)
        return self.head_loss(x, targets, pending)

    def final_norm(self, x: torch.Tensor, pending: torch.Tensor | None = None) -> torch.Tensor:
        """``ln_f(x + pending)``."""
        if self.cfg.layer_norm == "triton":
            return _norm(self.transformer.ln_f, x, pending)[1]
        return self.transformer.ln_f(x if pending is None else x + pending)

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor, pending: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm, tied head and mean cross-entropy: (B, T, C), (B, T) -> scalar.

        Its own method so that ``compile.scope: blocks`` can compile it as one more graph
        (``compile.loss``): the (B*T, V) logits are the largest tensors of the step.
        """
        x = self.final_norm(x, pending)
        B, T, C = x.shape
        if self.cfg.fused_loss or self.cfg.cross_entropy == "triton":
            from trainer.compile.kernels.linear_cross_entropy import linear_cross_entropy

            # fused: chunked, never the whole logits; triton: the whole logits, their gradient saved.
            saved = not self.cfg.fused_loss
            return linear_cross_entropy(
                x.reshape(B * T, C), self.lm_head.weight, targets.reshape(B * T), save_logit_grads=saved
            )
        logits = self.lm_head(x)  # (B, T, V)
        return F.cross_entropy(logits.view(B * T, -1).float(), targets.reshape(B * T), ignore_index=-100)

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward), as in the PaLM appendix / nanoGPT: 6N + 12·L·C·T."""
        T = seq_len or self.cfg.block_size
        return 6 * self.num_params() + 12 * self.cfg.n_layer * self.cfg.n_embd * T
