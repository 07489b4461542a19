"""Capture with torch.compile: the whole model, or each repeated block once.

``scope: blocks`` compiles every block of the largest ``nn.ModuleList`` of one block class
(nanoGPT's ``transformer.h``) in place with ``nn.Module.compile``, so state-dict keys do not
change (no ``_orig_mod.``) and, because Dynamo treats a block's parameters as graph inputs,
N identical blocks share one compiled graph.
"""

from __future__ import annotations

import torch
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


def compile_kwargs(backend: str, mode: str, fullgraph: bool, dynamic: bool | None) -> dict:
    kwargs = dict(backend=backend, fullgraph=fullgraph, dynamic=dynamic)
    if mode != "default":
        if backend != "inductor":
            raise ValueError(f"compile.mode: '{mode}' needs compile.backend=inductor (got '{backend}')")
        kwargs["mode"] = mode
    return kwargs


def apply_compile(model: nn.Module, cfg, say=print, backend=None, hooks_outside: bool = False) -> nn.Module:
    """Compile ``model`` as ``cfg`` (the ``compile`` config section) says; returns the module to call.

    ``hooks_outside`` (``scope: blocks`` only) compiles each block's ``forward`` instead of its
    ``__call__``, so module hooks (FSDP's) run outside the graph. ``backend``, a Dynamo backend
    callable, replaces ``cfg.backend``/``cfg.mode`` (the distributed layer passes its graph
    splitter, which applies them to each piece).

    With ``scope: model`` the returned module is the ``torch.compile`` wrapper (the original is
    its ``_orig_mod``); with ``scope: blocks`` the model itself, its blocks compiled in place and,
    with ``compile.loss``, its ``head_loss(x, targets)`` method compiled as one more graph.
    """
    kwargs = compile_kwargs(cfg.backend, cfg.mode, cfg.fullgraph, cfg.dynamic)
    if backend is not None:
        kwargs.pop("mode", None)
        kwargs["backend"] = backend
    if cfg.scope == "model":
        if not cfg.loss:
            say("compile.loss=false has no effect with compile.scope=model: the loss is inside the model's graph")
        return torch.compile(model, **kwargs)
    _, blocks = find_blocks(model, cfg.blocks)
    for block in blocks:
        if hooks_outside:
            block.forward = torch.compile(block.forward, **kwargs)  # an instance attribute: no state-dict change
        else:
            block.compile(**kwargs)
    if cfg.loss:
        head_loss = getattr(model, "head_loss", None)
        if callable(head_loss):
            model.head_loss = torch.compile(head_loss, **kwargs)  # an instance attribute: no state-dict change
        else:
            say(
                "compile.loss: the model has no head_loss(x, targets) method, so under compile.scope=blocks its "
                "loss runs eagerly; use compile.scope=model to compile it"
            )
    return model
