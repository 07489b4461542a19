"""Context parallel: each sequence split along its length over the mesh's ``cp`` ranks, attention computed as a
ring (torch's context parallel: ``_ContextParallel`` on the attention call, its SDPA dispatched to ring attention).

- **The data.** Each rank reads the same sequences as the other ranks of its ``cp`` group and keeps its slices of
  them: with causal attention the tokens late in a sequence attend to more keys, so the sequence is cut into
  ``2 x cp`` chunks and rank ``r`` keeps chunks ``r`` and ``2 cp - 1 - r`` (torch's head-tail load balancer, whose
  order :func:`positions_of` takes), with their positions, which the model's position embedding or RoPE reads.
- **The attention.** Each attention call is a module (the built-in GPT's ``CausalSDPA``; in a Hugging Face model,
  a ``CausalSDPA`` each attention layer gets, called by the attention function :func:`attention_function`
  registers) that torch's ``_ContextParallel`` style wraps: its query, key and value become sequence shards and
  the call becomes ring attention over the ``cp`` ranks, causal with the load balancer's order.
- **The loss and the gradients.** Each rank's loss is the mean over its tokens, all ranks hold as many, and FSDP
  averages the gradients over ``shard x cp``: the mean over the sequence.

Ring attention is torch's for CUDA's SDPA kernels (flash, efficient, cuDNN): context parallel runs on GPUs. The
compile layer's ``causal_attention`` substitution steps aside (ring attention reads ``is_causal`` without a mask,
which the attention here passes), and a model whose attention is not causal over the whole sequence (sliding
windows) is refused.
"""

from __future__ import annotations

import numpy as np
import torch.nn as nn

from trainer.distributed.mesh import LayoutError

ATTENTION = "trainer_cp"
"""The name of the Hugging Face attention function (and mask function) context parallel registers."""


def positions_of(seq_len: int, cp: int, cp_rank: int) -> np.ndarray:
    """The positions of a sequence of ``seq_len`` tokens that context-parallel rank ``cp_rank`` of ``cp`` holds, in
    the order it holds them: torch's head-tail load balancer's order, cut into ``cp`` equal parts."""
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

    order = _HeadTailLoadBalancer(seq_len, cp, "cpu")._generate_indices().reshape(-1)  # (T,), head-tail order
    return order.chunk(cp)[cp_rank].numpy()


def check_model(model: nn.Module) -> None:
    """Refuse a model context parallel cannot run: one whose forward takes no positions, or whose attention is not
    causal over the whole sequence.

    Raises:
        LayoutError: naming why.
    """
    from trainer.models.gpt import GPT
    from trainer.models.hf import HFCausalLM

    if isinstance(model, GPT):
        return
    if not isinstance(model, HFCausalLM):
        raise LayoutError(
            f"distributed.cp: {type(model).__name__} is a model.target model; context parallel needs the positions "
            "of each rank's tokens passed to the model and its attention run through trainer's, which the built-in "
            "GPT and Hugging Face models take; set distributed.cp=1"
        )
    c = model.hf.config
    window = getattr(c, "sliding_window", None)
    layers = set(getattr(c, "layer_types", None) or ["full_attention"])
    if (window and getattr(c, "use_sliding_window", True)) or layers - {"full_attention"}:
        raise LayoutError(
            f"distributed.cp: {type(c).__name__} has attention that is not causal over the whole sequence (sliding "
            f"window {window}, layer types {sorted(layers)}); ring attention here is causal only; set "
            "distributed.cp=1"
        )


def apply_cp(model: nn.Module, cp_mesh) -> str:
    """Make every attention call of ``model`` ring attention over ``cp_mesh``, in place; the log's line.

    Raises:
        LayoutError: a model context parallel cannot run (:func:`check_model`).
    """
    from torch.distributed.tensor.experimental._attention import (
        _ContextParallel,
        _cp_options,
        _enable_context_parallel_dispatcher,
    )
    from torch.distributed.tensor.parallel import parallelize_module

    from trainer.models.gpt import CausalSDPA
    from trainer.models.hf import HFCausalLM

    check_model(model)
    if isinstance(model, HFCausalLM):
        _attend_through_modules(model)
    calls = [m for m in model.modules() if isinstance(m, CausalSDPA)]
    style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA)
    for call in calls:
        parallelize_module(call, cp_mesh, style)
    # DTensor's SDPA on sequence shards dispatched to ring attention (without it, DTensor would gather the keys and
    # values and mask the local queries as if they began the sequence); the ring's causal blocks follow the
    # head-tail order the data was sliced in (positions_of): torch reads this flag, which its own buffer sharding
    # sets. Both pinned by tests/test_mesh.py.
    _enable_context_parallel_dispatcher()
    _cp_options.enable_load_balance = True
    return f"context parallel over {cp_mesh.size()} ranks: {len(calls)} attention calls as ring attention"


def _attend_through_modules(model) -> None:
    """A Hugging Face model's attention through a :class:`~trainer.models.gpt.CausalSDPA` of each attention layer
    (which context parallel wraps), by an attention function of its own: causal, no mask (none is built), keys and
    values repeated to every query head as transformers' SDPA path does."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import repeat_kv

    from trainer.models.gpt import CausalSDPA

    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        groups = getattr(module, "num_key_value_groups", 1)
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # (B, H, T, D)
        out = module.trainer_sdpa(query, key, value, dropout_p=dropout, scale=scaling)
        return out.transpose(1, 2).contiguous(), None  # (B, T, H, D), as transformers' attention functions

    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, lambda *args, **kwargs: None)  # causal by is_causal: no mask
    hf = model.hf
    for module in hf.modules():
        if hasattr(module, "num_key_value_groups") and hasattr(module, "config"):  # an attention layer
            module.trainer_sdpa = CausalSDPA()
    hf.config._attn_implementation = ATTENTION
    for sub in hf.modules():  # transformers reads the implementation from each submodule's config
        if hasattr(sub, "config") and hasattr(sub.config, "_attn_implementation"):
            sub.config._attn_implementation = ATTENTION


def context_positions(mesh, rank: int, seq_len: int) -> np.ndarray | None:
    """The positions this rank holds of each sequence under the mesh's context parallel; None without it."""
    if mesh.cp == 1:
        return None
    return positions_of(seq_len, mesh.cp, mesh.coordinate(rank)["cp"])
