"""FSDP2: ``fully_shard`` per block and on the root, mixed precision, DCP checkpoints.

Order (torchtitan's, and the one that is correct with compile, see PYTORCH_NOTES): compile each
block in place, then ``fully_shard`` each block, then the root. The root is never compiled: FSDP's
hooks are ``dynamo.disable``-d, so a compiled root drops to eager; compiling per block keeps every
block's compute compiled and every block one all-gather and one reduce-scatter.

Checkpoints go through ``torch.distributed.checkpoint`` (DCP): each rank writes its shards, and a
load reshards to whatever the current world size is (or to whole tensors in one process).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def apply_fsdp(
    model: nn.Module,
    *,
    blocks: str | None,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    reshard_after_forward: bool,
) -> nn.Module:
    """Shard ``model`` in place: each block of the repeated blocks, then the root. Returns ``model``.

    Args:
        blocks: the repeated blocks' path (None: found, see :func:`trainer.compile.capture.find_blocks`).
        param_dtype: dtype parameters are gathered in for compute (None: as stored, fp32).
        reduce_dtype: dtype gradients are reduce-scattered in (None: ``param_dtype``).
        reshard_after_forward: free each block's gathered parameters after its forward (gathered
            again for the backward). The root keeps them: its backward comes first.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from trainer.compile.capture import find_blocks

    _, block_list = find_blocks(model, blocks)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in block_list:
        fully_shard(block, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=mp, reshard_after_forward=False)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def save_dcp(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Every rank writes its shards of the model and optimizer states under ``path`` (a directory)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))


def load_dcp(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Load a DCP checkpoint into ``model`` and ``opt``, resharded to this run's layout (any world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)  # the target layout (initialises empty optimizer state)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
