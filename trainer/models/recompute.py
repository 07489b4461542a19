"""Activation checkpointing: recompute the repeated blocks' activations in the backward instead of keeping them.

The blocks are the ones ``compile.scope: blocks`` compiles and FSDP shards (:func:`trainer.models.blocks.find_blocks`:
the built-in GPT's ``transformer.h``, a nanoGPT-shaped model's, Hugging Face GPT-2's ``hf.transformer.h`` and Llama's
``hf.model.layers``). Each chosen block's ``forward`` is replaced by an instance attribute that runs the class's
forward under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. Nothing is added to the module tree, so
state-dict keys do not change (a checkpoint loads into a model with or without it), and module hooks (FSDP's
all-gather) stay on ``__call__``, outside the recomputed region: the recompute calls the forward, not the module.

Modes:

- ``full``: keep only each block's input; the whole block runs again in the backward.
- ``selective``: torch's selective checkpointing (``create_selective_checkpoint_contexts``) with :func:`policy`:
  keep the outputs of the matmuls and of attention, recompute the cheap ops between them (norms, activations,
  residual adds, views): much of the activation memory, little of the FLOPs.

Under ``torch.compile`` Dynamo turns each checkpoint into a ``tag_activation_checkpoint`` region and AOTAutograd's
partitioner puts the recompute into the backward graph, as :func:`policy` (for ``full``: recompute everything) says;
eagerly, autograd's saved-tensor hooks do it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "full", "selective")


def _aten(*names: str) -> frozenset:
    """The ``.default`` overloads of these aten ops that this torch has (the SDPA variants differ by build)."""
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


SAVED_OPS = _aten(
    "mm",
    "addmm",
    "bmm",
    "linear",  # linear is composite, decomposed to (add)mm before dispatch; kept in case
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_mm",
    "max",  # train.precision=fp8: the float8 matmuls, and the amaxes their scales come from
)
"""What ``selective`` keeps: the matmuls' and attention's outputs (attention's include its logsumexp, which its
backward reads); under fp8 the float8 matmuls' outputs and the amax reductions (scalars) of the dynamic scales."""


def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """``selective``'s policy (a ``create_selective_checkpoint_contexts`` policy function): save the outputs of
    :data:`SAVED_OPS`, recompute everything else. Called with the same ops in the forward and in the recompute."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# One context factory for every block: under torch.compile Dynamo guards on it as a constant, so blocks that
# share one compiled graph (compile.scope=blocks) must share it too.
_SELECTIVE = functools.partial(create_selective_checkpoint_contexts, policy)


def _checkpointed(forward, mode: str):
    """``forward`` (a bound method) run under checkpointing as ``mode`` says."""
    extra = {"context_fn": _SELECTIVE} if mode == "selective" else {}

    @functools.wraps(forward)  # __wrapped__ keeps the signature visible (Hugging Face inspects it)
    def checkpointed_forward(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    checkpointed_forward.recompute = mode
    return checkpointed_forward


def chosen(n_blocks: int, every_n: int) -> list[int]:
    """The indices of the blocks checkpointed with ``train.checkpoint_every_n=every_n``: those with
    ``i % every_n == 0``, so the first block always is (0, n, 2n, ...)."""
    return [i for i in range(n_blocks) if i % every_n == 0]


def apply_activation_checkpointing(model: nn.Module, mode: str, every_n: int = 1, blocks: str | None = None) -> str:
    """Checkpoint ``model``'s repeated blocks in place (see the module docstring); returns a one-line description,
    e.g. ``"full, 12 of 12 blocks"``.

    Idempotent: a block already checkpointed in ``mode`` is left as it is, so this may run again on a model whose
    blocks were compiled around their checkpointed forward (FSDP compiles ``block.forward``).

    Args:
        model: the unwrapped model (not compiled, not DDP-wrapped; FSDP-sharded is fine).
        mode: ``"full"`` or ``"selective"`` (``"none"`` does nothing and returns "").
        every_n: checkpoint the blocks ``i`` with ``i % every_n == 0`` only.
        blocks: ``compile.blocks``: the attribute path of the blocks, or None to find them.

    Raises:
        ValueError: the model has no repeated blocks to find (or ``blocks`` names none).
    """
    assert mode in MODES, mode
    if mode == "none":
        return ""
    from trainer.models.blocks import find_blocks

    try:
        path, block_list = find_blocks(model, blocks)
    except ValueError:
        if blocks is not None:
            raise  # compile.blocks names no ModuleList: find_blocks says which key and why
        raise ValueError(
            f"train.activation_checkpointing={mode}: the model has no repeated blocks to checkpoint (no nn.ModuleList "
            "of one block class); set compile.blocks=<path of the nn.ModuleList of its blocks>, or "
            "train.activation_checkpointing=none"
        ) from None
    picked = chosen(len(block_list), every_n)
    for i in picked:
        block = block_list[i]
        current = mode_of(block)
        if current == mode:
            continue
        assert current is None, f"{path}.{i} is already checkpointed ({current})"
        assert "forward" not in block.__dict__, f"{path}.{i}.forward is replaced already (compiled?): checkpoint first"
        block.forward = _checkpointed(block.forward, mode)  # an instance attribute: no state-dict change
    return f"{mode}, {len(picked)} of {len(block_list)} blocks"


def checkpointed(forward) -> Callable | None:
    """The checkpointed forward ``forward`` is, or wraps as ``torch.compile``'s wrapper; None if neither (a block's
    forward set by :func:`apply_activation_checkpointing`, perhaps compiled since: FSDP compiles ``block.forward``)."""
    forward = getattr(forward, "_torchdynamo_orig_callable", forward)  # torch.compile(fn) keeps fn there
    return forward if getattr(forward, "recompute", None) else None


def mode_of(block: nn.Module) -> str | None:
    """How ``block`` is checkpointed (``"full"``, ``"selective"``), or None."""
    forward = checkpointed(block.__dict__.get("forward"))
    return forward.recompute if forward is not None else None
