"""The model's repeated blocks (its decoder layers): what ``compile.scope: blocks`` compiles one by one, what
activation checkpointing wraps, what FSDP shards in units and the bucket plan packs whole."""

from __future__ import annotations

import torch.nn as nn


def find_blocks(model: nn.Module, path: str | None = None) -> tuple[str, nn.ModuleList]:
    """The repeated blocks: ``path`` if given, else the largest ModuleList whose children share one class.

    Raises:
        ValueError: ``path`` names no ModuleList, or the model has no repeated blocks.
    """
    if path is not None:
        try:
            blocks = model.get_submodule(path)
        except AttributeError:
            raise ValueError(f"compile.blocks: the model has no submodule '{path}'") from None
        if not isinstance(blocks, nn.ModuleList):
            raise ValueError(f"compile.blocks: '{path}' is a {type(blocks).__name__}, expected an nn.ModuleList")
        return path, blocks
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0 and len({type(b) for b in mod}) == 1:
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        raise ValueError(
            "compile.scope: blocks found no nn.ModuleList of one block class in the model; "
            "name the blocks with compile.blocks=<path> or use compile.scope=model"
        )
    return best
