"""The one optimizer factory: ``build_optimizer`` over parameter groups (:func:`param_groups` makes the fit loop's),
in torch's implementations, compiled (:func:`~trainer.optim.compiled.compile_optimizer`), trainer's in Triton
(:mod:`trainer.optim.optimizers`) or sharded over a bucket plan (:mod:`trainer.optim.zero`).

Plain arguments only, no config: the fit loop's call is ``trainer.build.make_optimizer``; any other training loop
calls this one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from trainer.optim.compiled import compile_optimizer

if TYPE_CHECKING:
    from trainer.distributed.buckets import BucketPlan

log = logging.getLogger(__name__)  # debugging detail; what the user should know goes through trainer.console


OPTIMIZER_NAMES = ("adamw", "adam", "sgd")
IMPLS = ("auto", "eager", "foreach", "fused", "compiled", "triton")


def resolve_impl(
    impl: str, device: torch.device | str, *, name: str = "adamw", sharded: bool = False, scaled: bool = False
) -> str:
    """The implementation ``impl='auto'`` stands for on ``device`` (other values pass through).

    CUDA, Adam(W): ``triton`` (gradients read where autograd left them, clipping inside the step),
    the fastest measured for a whole training step, on one GPU and under ddp, ahead of torch's ``fused``
    (docs/performance.md, "The optimizer step").
    Not for ``sharded`` parameters (FSDP's DTensors: ``triton`` updates their shards in place, but is not
    measured against torch's ``fused`` there) or ``scaled`` gradients (fp16's grad scaler, not measured with
    them), nor SGD (whose Triton kernel still reads flat gradient buffers): torch's ``fused`` there. Elsewhere:
    ``foreach``.
    """
    if impl not in IMPLS:
        raise ValueError(f"optim.impl: expected one of {', '.join(IMPLS)}, got {impl!r}")
    if impl != "auto":
        return impl
    if torch.device(device).type != "cuda":
        return "foreach"
    return "triton" if name in ("adamw", "adam") and not sharded and not scaled else "fused"


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: not on norms, biases or embeddings (tied heads count as embeddings)."""
    embedding_ids = {id(mod.weight) for mod in model.modules() if isinstance(mod, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 and id(p) not in embedding_ids else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _normalize_groups(param_groups: Iterable[Any], weight_decay: float) -> list[dict[str, Any]]:
    groups = list(param_groups)
    if not groups:
        raise ValueError("build_optimizer got no parameters")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    out = []
    for g in groups:
        g = dict(g)
        g["params"] = list(g["params"])
        g.setdefault("weight_decay", weight_decay)
        out.append(g)
    return out


def build_optimizer(
    param_groups: Iterable[Any],
    *,
    name: str = "adamw",
    impl: str = "auto",
    lr: float = 1e-3,
    betas: tuple[float, float] | list[float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float = 0.9,
    max_grad_norm: float = 0.0,
    device: torch.device | str | None = None,
    sharded: bool = False,
    scaled: bool = False,
    buckets: BucketPlan | None = None,
    stochastic_rounding: bool = False,
) -> torch.optim.Optimizer:
    """Build the optimizer for a training run.

    Args:
        param_groups: Param-group dicts (``[{'params': [...], 'weight_decay': 0.1}, ...]``; a
            group's own keys win) or an iterable of parameters.
        name: ``adamw`` | ``adam`` (L2 weight decay) | ``sgd`` (momentum, L2 weight decay).
        impl: ``auto`` (see :func:`resolve_impl`), ``eager`` (torch, per-tensor loop), ``foreach``
            (torch, multi-tensor), ``fused`` (torch, fused kernel), ``compiled``
            (:func:`compile_optimizer` on the foreach optimizer, Inductor) or ``triton`` (trainer's Triton kernels).
        lr: Learning rate.
        betas: Adam betas.
        eps: Adam epsilon.
        weight_decay: Default weight decay for groups that do not set one.
        momentum: SGD momentum.
        max_grad_norm: Global gradient-norm clip. Only ``triton`` applies it inside the step; for
            the others the caller clips (see ``clips_grad_norm``).
        device: Device the parameters will train on; defaults to the first parameter's.
        sharded: The parameters are FSDP's DTensors (``auto`` then picks torch's optimizer; ``triton`` updates
            each rank's shards where FSDP keeps them and all-reduces the clipping norm; ``compiled`` steps the
            DTensors as they are).
        scaled: An fp16 grad scaler unscales the gradients (``auto`` then picks torch's optimizer).
        buckets: A bucket plan to shard the optimizer state over
            (ddp's ``distributed.shard_optimizer``): a :class:`~trainer.optim.zero.ShardedOptimizer` that moves the
            parameters into the plan's flat buffers (build it before DDP's wrapper, which reduces over the plan),
            keeps this rank's shard of the state in an inner optimizer of ``impl`` (one of torch's: ``triton`` re-lays
            parameters out in buffers of its own) and clips to ``max_grad_norm`` itself.
        stochastic_rounding: bf16 master weights: ``triton``'s AdamW keeps bf16 states for bf16 parameters and
            stores both with stochastic rounding (an error for any other impl or name).

    Returns:
        A ``torch.optim.Optimizer`` with two extra attributes: ``clips_grad_norm`` (true when the
        optimizer clips to ``max_grad_norm`` itself, so the loop must not call
        ``clip_grad_norm_``; the pre-clip norm is then ``opt.last_grad_norm`` after each step, a
        device tensor) and ``impl`` (the resolved implementation).

    Raises:
        ValueError: For an unknown name or impl, or ``triton`` on a device it cannot run on.
    """
    if buckets is not None:
        from trainer.optim import zero

        hparams = dict(
            name=name, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum=momentum, device=device
        )
        inner = lambda segment_groups: build_optimizer(segment_groups, impl=impl, max_grad_norm=0.0, **hparams)
        return zero.ShardedOptimizer(list(param_groups), buckets, inner, max_grad_norm=max_grad_norm)
    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"optim.name: expected one of {', '.join(OPTIMIZER_NAMES)}, got {name!r}")
    groups = _normalize_groups(param_groups, weight_decay)
    if device is None:
        device = groups[0]["params"][0].device if groups[0]["params"] else torch.device("cpu")
    device = torch.device(device)
    resolved = resolve_impl(impl, device, name=name, sharded=sharded, scaled=scaled)
    betas = tuple(betas)
    if stochastic_rounding and (resolved != "triton" or name == "sgd"):
        raise ValueError(f"bf16 master weights need trainer's Triton AdamW or Adam, not {resolved} {name}")

    if resolved == "triton":
        if name == "sgd":
            from trainer.optim.optimizers import TritonSGD

            opt: torch.optim.Optimizer = TritonSGD(groups, lr=lr, momentum=momentum, max_grad_norm=max_grad_norm)
        else:
            from trainer.optim.optimizers import TritonAdamW

            # Gradients stay autograd's own tensors (read through an address table), not a flat buffer that
            # autograd would have to add into: see trainer/optim/grad_table.py.
            opt = TritonAdamW(
                groups,
                lr=lr,
                betas=betas,
                eps=eps,
                max_grad_norm=max_grad_norm,
                decoupled_weight_decay=name == "adamw",
                flat_grads=False,
                stochastic_rounding=stochastic_rounding,
            )
    else:
        flags = {"eager": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
        kwargs = flags.get(resolved, {"foreach": True})
        if name == "sgd":
            opt = torch.optim.SGD(groups, lr=lr, momentum=momentum, **kwargs)
        else:
            cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
            opt = cls(groups, lr=lr, betas=betas, eps=eps, **kwargs)
        if resolved == "compiled":
            opt = compile_optimizer(opt, backend="inductor")
        opt.before_graph_replay = opt.after_graph_replay = None  # torch's: made capturable for a graph instead
    opt.clips_grad_norm = resolved == "triton" and max_grad_norm > 0
    opt.impl = resolved
    log.debug("optimizer: %s (%s) on %s, clips grad norm itself: %s", name, resolved, device, opt.clips_grad_norm)
    return opt
