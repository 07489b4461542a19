"""A small language model for the fp8 tests (``model.target: tests.fp8_model:make``): in its one block, a linear
wide enough for float8 (2048 -> 2048) between two too small to gain (64 <-> 2048); a head tied to the token
embedding."""

import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim: int, width: int):
        super().__init__()
        self.up, self.wide, self.down = nn.Linear(dim, width), nn.Linear(width, width), nn.Linear(width, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.wide(F.gelu(self.up(x)))))


class Wide(nn.Module):
    def __init__(self, vocab_size: int = 256, dim: int = 64, width: int = 2048):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList([Block(dim, width)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.wte.weight
        nn.init.normal_(self.wte.weight, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx)  # (B, T, dim)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))  # (B, T, vocab)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def make(**kwargs) -> Wide:
    return Wide(**kwargs)
