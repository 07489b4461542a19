"""Capture with torch.compile: the whole model, or each repeated block once.

``scope: blocks`` compiles every block of the largest ``nn.ModuleList`` of one block class
(nanoGPT's ``transformer.h``) in place with ``nn.Module.compile``, so state-dict keys do not
change (no ``_orig_mod.``) and, because Dynamo treats a block's parameters as graph inputs,
N identical blocks share one compiled graph.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

from trainer import console

# Inductor options the trainer sets unless compile.inductor_options says otherwise; each one measured. Options
# passed this way win over torch._inductor.config and its TORCHINDUCTOR_* environment variables.
DEFAULT_INDUCTOR_OPTIONS = {
    # Off: Inductor's "mix-order" reduction (torch >= 2.10) fuses each LayerNorm's weight/bias gradient reduction
    # into the input-gradient kernel plus a small per-column reduction kernel; the whole step is no faster with it,
    # with Inductor's LayerNorms or with trainer's add_layer_norm (docs/performance.md, "Tried and not kept").
    "triton.mix_order_reduction": False,
}


@functools.cache
def inductor_option_names() -> frozenset[str]:
    """This torch's Inductor options, dotted (``torch._inductor.config``)."""
    from torch._inductor import config

    return frozenset(config.get_config_copy())


def flat_options(options: dict | None, prefix: str = "") -> dict:
    """``{"triton": {"cudagraphs": False}}`` (how OmegaConf reads ``compile.inductor_options.triton.cudagraphs=false``)
    as ``{"triton.cudagraphs": False}``; dotted keys pass through, and so does a dict that is an option's value."""
    flat = {}
    for key, value in (options or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name not in inductor_option_names():
            flat.update(flat_options(value, prefix=f"{name}."))
        else:
            flat[name] = value
    return flat


def _bad_option_type(key: str, value) -> str | None:
    """The type Inductor expects for ``key`` when ``value`` is not of it (what ``torch.compile(options=...)`` would
    refuse, and ``compile_fx(config_patches=...)`` would take silently), else None."""
    from torch._inductor import config

    get_type = getattr(config, "get_type", None)
    expected = get_type(key) if get_type is not None else None
    if not isinstance(expected, type) or expected is type(None):
        return None  # typing constructs (dict[str, ...], Optional[...]) and unknown types: not checked here
    if isinstance(value, expected) and not (expected is int and isinstance(value, bool)):
        return None
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return None
    return expected.__name__


def check_inductor_options(backend: str, options: dict | None) -> None:
    """Raise ValueError (its message starts with the offending ``compile.*`` key) unless ``options`` are Inductor
    options of this torch, of the right types, for the inductor backend."""
    if not options:
        return
    if backend != "inductor":
        raise ValueError(f"compile.inductor_options: needs compile.backend=inductor (got '{backend}')")
    names = inductor_option_names()
    for key, value in flat_options(options).items():
        if key not in names:
            near = difflib.get_close_matches(key, list(names), n=1, cutoff=0.6)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ValueError(f"compile.inductor_options.{key}: not an Inductor option of this torch{hint}")
        expected = _bad_option_type(key, value)
        if expected:
            raise ValueError(f"compile.inductor_options.{key}: expected a {expected}, got {value!r}")


def inductor_options(mode: str = "default", user: dict | None = None, dynamic: bool | None = None) -> dict:
    """The Inductor options a graph is compiled with: ``mode``'s, then the trainer's measured defaults (those this
    torch has), then ``user``'s (``compile.inductor_options``), later wins."""
    from torch._inductor import list_mode_options

    options = dict(list_mode_options(mode, dynamic)) if mode != "default" else {}
    options.update({k: v for k, v in DEFAULT_INDUCTOR_OPTIONS.items() if k in inductor_option_names()})
    options.update(flat_options(user))
    return options


KERNEL_OPS = (
    "add_layer_norm",
    "add_layer_norm_backward",
    "add_rms_norm",
    "add_rms_norm_backward",
    "linear_cross_entropy",
    "linear_cross_entropy_saved",
)
"""trainer's ``torch.library`` ops (``trainer::<name>``), for :func:`register_kernel_fallbacks`."""


def register_kernel_fallbacks() -> list[str]:
    """Register trainer ops with Inductor as fallback kernels up front, the way Inductor registers an op it has no
    lowering for the first time it meets it (an "implicit fallback": same layout constraint); returns the names
    registered now.

    Why: torch 2.11 writes the op's arguments into a log message when it creates an implicit fallback, whether
    or not the message is logged, and the text of an argument doubles with every ``trainer::`` op it depends on
    (each printed with all of its inputs). The gpt2-small loss op, first met after 25 add_layer_norm ops, kept
    the forward's compile busy for minutes on an H100 (a 2-layer model compiled in 17 s). torch 2.13 formats
    the message lazily. Where Inductor's internals moved, nothing is registered and Inductor does it itself.
    """
    import trainer.ops.add_layer_norm  # noqa: F401 - defines the ops
    import trainer.ops.add_rms_norm  # noqa: F401
    import trainer.ops.linear_cross_entropy  # noqa: F401

    try:
        from torch._inductor.lowering import lowerings, make_fallback, tag_to_layout_constraint
        from torch._library.utils import get_layout_constraint_tag
    except ImportError:
        return []
    done = []
    for name in KERNEL_OPS:
        op = getattr(torch.ops.trainer, name).default
        if op in lowerings:
            continue
        tag = get_layout_constraint_tag(op, with_default=True)  # a custom op: its tag, or Inductor's default
        make_fallback(op, layout_constraint=tag_to_layout_constraint(tag), warn=False)
        done.append(name)
    return done


def compile_kwargs(
    backend: str,
    mode: str,
    fullgraph: bool,
    dynamic: bool | None,
    options: dict | None = None,
    kernels: Iterable[str] = (),
) -> dict:
    """``torch.compile``'s keyword arguments; with Inductor, ``mode`` goes in as its options (:func:`inductor_options`),
    so the trainer's defaults and the user's options combine with any mode. With ``kernels`` (names of
    :data:`trainer.compile.passes.KERNEL_NAMES`), the backend is :func:`inner_backend`: trainer's kernels
    substituted first."""
    kwargs = dict(backend=backend, fullgraph=fullgraph, dynamic=dynamic)
    if backend != "inductor":
        if mode != "default":
            raise ValueError(f"compile.mode: '{mode}' needs compile.backend=inductor (got '{backend}')")
        check_inductor_options(backend, options)
    else:
        kwargs["options"] = inductor_options(mode, options, dynamic)
        register_kernel_fallbacks()
    if kernels:
        kwargs["backend"] = inner_backend(backend, mode, options, kernels, dynamic)
        kwargs.pop("options", None)  # inside the backend
    return kwargs


def inner_backend(
    backend: str,
    mode: str = "default",
    options: dict | None = None,
    kernels: Iterable[str] = (),
    dynamic: bool | None = None,
) -> Callable:
    """A Dynamo backend callable: ``backend`` by name (Inductor with ``mode``'s options, the trainer's defaults and
    ``options``), with trainer's ``kernels`` substituted into each graph before it (:mod:`trainer.compile.passes`).
    The distributed layer's graph splitter hands each piece to it."""
    from trainer.compile.passes.substitute import substituting

    patches = compile_kwargs(backend, mode, False, dynamic, options).get("options")  # checks them
    if backend == "inductor":
        from torch._inductor.compile_fx import compile_fx

        if kernels:  # the passes' functions in the graph, which AOTAutograd's cache would otherwise leave out
            from trainer.compile.passes.substitute import cache_marks

            patches = dict(patches or {})
            marks = {**patches.get("unsafe_marked_cacheable_functions", {}), **cache_marks()}
            patches["unsafe_marked_cacheable_functions"] = marks
        inner = functools.partial(compile_fx, config_patches=patches)
    else:
        inner = torch._dynamo.lookup_backend(backend)
    return substituting(inner, kernels)


def resolve_kernels(value, device_type: str) -> list[str]:
    """``compile.kernels`` as the list of kernel names it means on ``device_type`` (auto: all on CUDA, none
    elsewhere)."""
    from trainer.compile.passes import KERNEL_NAMES

    if value == "auto":
        return list(KERNEL_NAMES) if device_type == "cuda" else []
    if value == "all":
        return list(KERNEL_NAMES)
    if value == "none":
        return []
    return [k for k in KERNEL_NAMES if k in value]


class LossOnly(nn.Module):
    """What the trainer calls: the model's forward and the loss picked from its output, so that whatever else the
    model returns (nanoGPT's logits) is dead in the compiled graph."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx, targets, *positions):
        from trainer.models import loss_of

        return loss_of(self.model(idx, targets, *positions))  # positions: context parallel's


def apply_compile(
    model: nn.Module,
    cfg,
    say=None,
    backend=None,
    hooks_outside: bool = False,
    kernels: Iterable[str] = (),
    no_mask: bool = False,
) -> nn.Module:
    """Compile ``model`` as ``cfg`` (the ``compile`` config section: its capture options) says; returns the module to
    call.

    ``kernels``: the names of trainer's kernels to substitute into each graph (``compile.kernels`` as the plan
    resolved it: :attr:`trainer.plan.Plan.kernels`; none by default). ``no_mask``: the blocks must get no attention
    mask made between them (a graphed step's; a ``ValueError`` naming ``compile.scope`` where they would).
    ``hooks_outside`` (``scope: blocks`` only) compiles each block's ``forward`` instead of its ``__call__``, so
    module hooks (FSDP's) run outside the graph.
    ``backend``, a Dynamo backend callable, replaces ``cfg.backend``/``cfg.mode`` and ``kernels`` (the distributed
    layer passes its graph splitter, which applies them to each piece).

    With ``scope: model`` the returned module is the ``torch.compile`` wrapper of :class:`LossOnly` around the
    model (which returns the loss alone); with ``scope: blocks`` the model itself, its blocks compiled in place and,
    with ``compile.loss``, its ``head_loss(x, targets)`` method compiled as one more graph. ``say`` gets the line
    for an option that cannot take effect (default: :func:`trainer.console.info`).
    """
    if cfg.scope not in ("model", "blocks"):
        raise ValueError(f"apply_compile: compile.scope as resolved (model or blocks), got {cfg.scope!r}")
    say = say or console.info
    kwargs = compile_kwargs(cfg.backend, cfg.mode, cfg.fullgraph, cfg.dynamic, dict(cfg.inductor_options), kernels)
    if backend is not None:
        kwargs.pop("options", None)  # the splitter applies them (and the kernels) to each piece
        kwargs["backend"] = backend
    if cfg.scope == "model":
        if not cfg.loss:
            say("compile.loss=false has no effect with compile.scope=model: the loss is inside the model's graph")
        return torch.compile(LossOnly(model), **kwargs)
    from trainer.models.blocks import find_blocks
    from trainer.models.hf import causal_sdpa_without_mask

    made = not causal_sdpa_without_mask(model)  # else transformers makes its mask between the blocks, a host sync
    if made and no_mask:  # the plan read the model's config as making none; the model built says otherwise
        raise ValueError(
            "compile.scope: this model.hf model makes its attention mask between the compiled blocks (its attention "
            "is not transformers' causal SDPA on whole sequences), which the graphed step cannot capture; set "
            "compile.scope=model or compile.cudagraphs=false"
        )
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
