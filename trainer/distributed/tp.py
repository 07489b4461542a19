"""Tensor parallel: each block's matmuls split over the mesh's ``tp`` ranks with torch's ``parallelize_module``.

The plan is the model's own:

- a Hugging Face model's ``config.base_model_tp_plan`` (Llama, Mistral, Qwen2 and most decoders publish one): its
  ``colwise`` and ``rowwise`` entries become torch's ``ColwiseParallel`` and ``RowwiseParallel``;
- the built-in GPT's (:data:`GPT_PLAN`): its head-major ``c_qkv`` and the MLP's first linear column-wise, both
  output projections row-wise;
- a ``model.target`` model's ``tp_plan`` attribute, in the Hugging Face form (``{"h.*.mlp.fc": "colwise", ...}``,
  paths from the model's root).

A column-parallel linear's output is this rank's heads (or MLP columns) as a plain tensor, which the model's
attention reshapes by ``-1`` heads; the row-parallel projection after it all-reduces its partial sums, so between
blocks the activations are whole on every rank. The norms, the embeddings and the LM head are replicated: every
kernel trainer substitutes into the compiled blocks (residual add + norm, attention, the fused loss) sees plain
tensors and holds under tensor parallel. Sequence parallel (the norms on a slice of the sequence) is not applied:
it would hand the norm kernels DTensors.

Parameters are distributed without communication (``src_data_rank=None``): rank 0 holds the built model and the
other ranks meta tensors until FSDP's materialization fills every shard from rank 0's values
(:func:`trainer.distributed.fsdp.materialize_from_rank0`).
"""

from __future__ import annotations

import torch.nn as nn

from trainer.distributed.mesh import LayoutError

GPT_PLAN = {
    "transformer.h.*.attn.c_qkv": "colwise",
    "transformer.h.*.attn.c_proj": "rowwise",
    "transformer.h.*.mlp.c_fc": "colwise",
    "transformer.h.*.mlp.c_proj": "rowwise",
}
"""The built-in GPT's tensor-parallel plan (:class:`trainer.models.gpt.GPT`)."""

STYLES = ("colwise", "rowwise")
"""The Hugging Face plan entries mapped onto torch's styles; a plan with others is refused, naming them."""
REPLICATED = ("embedding_rowwise",)
"""Plan entries left replicated (the embeddings, as the LM head: what the fused loss and the norms read whole)."""


def model_plan(model: nn.Module) -> tuple[dict[str, str], str]:
    """``model``'s tensor-parallel plan, by module path from its root (``*`` for any index), and where it came from.

    Raises:
        LayoutError: the model publishes no plan, or one with entries other than colwise and rowwise.
    """
    from trainer.models.gpt import GPT
    from trainer.models.hf import HFCausalLM

    if isinstance(model, GPT):
        plan, source = dict(GPT_PLAN), "the built-in GPT's plan"
    elif isinstance(model, HFCausalLM):
        hf = model.hf
        base = getattr(hf.config, "base_model_tp_plan", None) or {}
        prefix = f"hf.{hf.base_model_prefix}."
        plan, source = {prefix + k: v for k, v in base.items()}, f"{type(hf.config).__name__}.base_model_tp_plan"
    else:
        plan, source = dict(getattr(model, "tp_plan", None) or {}), f"{type(model).__name__}.tp_plan"
    if not plan:
        raise LayoutError(
            f"distributed.tp: {type(model).__name__} publishes no tensor-parallel plan ({source} is empty); a "
            "model.target model gives one as a tp_plan attribute, e.g. {'h.*.mlp.fc': 'colwise', 'h.*.mlp.proj': "
            "'rowwise'}; or set distributed.tp=1"
        )
    plan = {k: v for k, v in plan.items() if v not in REPLICATED}
    other = sorted({f"{k}: {v}" for k, v in plan.items() if v not in STYLES})
    if other:
        raise LayoutError(
            f"distributed.tp: {source} has entries trainer does not map onto torch's tensor-parallel styles "
            f"(it maps {', '.join(STYLES)}): {'; '.join(other)}; set distributed.tp=1"
        )
    return plan, source


def check_heads(model: nn.Module, tp: int) -> None:
    """Refuse a ``tp`` that does not divide the model's attention heads or key/value heads (each rank computes
    whole heads).

    Raises:
        LayoutError: naming the heads and ``tp``.
    """
    from trainer.models.gpt import GPT
    from trainer.models.hf import HFCausalLM

    if isinstance(model, GPT):
        heads = {"model.n_head": model.cfg.n_head}
    elif isinstance(model, HFCausalLM):
        c = model.hf.config
        heads = {"num_attention_heads": getattr(c, "num_attention_heads", None)}
        heads["num_key_value_heads"] = getattr(c, "num_key_value_heads", None) or heads["num_attention_heads"]
    else:
        return  # a model.target model's plan is its own to make consistent
    for name, n in heads.items():
        if n is not None and n % tp:
            raise LayoutError(
                f"distributed.tp={tp} does not divide the model's {name} ({n}): each rank computes whole heads; "
                f"use a distributed.tp that divides {n}"
            )


def apply_tp(model: nn.Module, tp_mesh) -> str:
    """Split ``model``'s layers over ``tp_mesh`` in place, by its plan (:func:`model_plan`). Returns a line for
    the log: how many linears went which way, and the plan's source.

    Raises:
        LayoutError: no plan, an entry trainer does not map, heads that ``tp`` does not divide, or a plan entry
            that matches no module.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan, source = model_plan(model)
    check_heads(model, tp_mesh.size())
    modules = dict(model.named_modules())
    matched = {k: [n for n in modules if _matches(k, n)] for k in plan}
    if unmatched := [k for k, found in matched.items() if not found]:
        raise LayoutError(f"distributed.tp: {source} names modules the model does not have: {', '.join(unmatched)}")
    styles, float8 = {}, 0
    for key, kind in plan.items():
        if all(_is_float8(modules[n]) for n in matched[key]):  # train.precision=fp8: torchao's styles, as torchtitan
            from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

            styles[key] = {"colwise": Float8ColwiseParallel, "rowwise": Float8RowwiseParallel}[kind]()
            float8 += len(matched[key])
        else:
            styles[key] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}[kind]()
    parallelize_module(model, tp_mesh, styles, src_data_rank=None)
    counts = {s: sum(len(matched[k]) for k, v in plan.items() if v == s) for s in STYLES}
    fp8 = f" ({float8} in float8, with torchao's styles)" if float8 else ""
    return (
        f"tensor parallel over {tp_mesh.size()} ranks ({source}): {counts['colwise']} linears column-wise, "
        f"{counts['rowwise']} row-wise{fp8}; norms, embeddings and the LM head replicated"
    )


def _is_float8(module: nn.Module) -> bool:
    """Whether ``module`` is a torchao float8 linear (``train.precision=fp8`` converted it)."""
    return type(module).__name__ == "Float8Linear"


def module_matches(plan: dict[str, str], name: str) -> bool:
    """Whether module path ``name`` is one ``plan`` splits."""
    return any(_matches(k, name) for k in plan)


def _matches(pattern: str, name: str) -> bool:
    """Whether module path ``name`` matches plan key ``pattern`` (``*`` stands for one path component), as
    ``parallelize_module`` reads it."""
    a, b = pattern.split("."), name.split(".")
    return len(a) == len(b) and all(p in ("*", n) for p, n in zip(a, b))
