"""``train.precision: fp8``: float8 matmuls in the linear layers that gain from them, through torchao's float8
training (``pip install -e '.[fp8]'``); everything else runs under bf16 autocast as ``bf16`` does.

Which linears are converted is decided here, by one rule (:func:`why_not`), for any model:

- an ``nn.Linear`` whose input and output widths are multiples of 16 (the float8 matmul needs them);
- not the LM head (the linear whose outputs are the vocabulary: tied to, or as wide as, the largest embedding, or
  a Hugging Face model's output embeddings): its fused loss kernel reads the bf16 head, and its logits are where
  float8's rounding would show;
- large enough to gain: ``in * out / (in + out) >= 1024``. A float8 matmul takes about half the time of a bf16
  one, and the casts it adds (the input, the weight, the output gradient, each read in bf16 and written in float8)
  cost time in proportion to ``in + out`` per token. Halving ``2 * in * out`` FLOPs at 989 TFLOP/s saves more than
  about 9 bytes per element of ``in + out`` cost at 3.35 TB/s (an H100) when the ratio above passes about 900:
  Llama-3.2-1B's key and value projections (2048 -> 512, 410) stay in bf16, its query, output and MLP
  projections (1024 and more) convert; GPT-2 124M (768 wide, at most 614) converts nothing.

Recipes (``train.fp8_recipe``): ``tensorwise`` (one scale per tensor; under FSDP2 the weights are all-gathered in
float8, their scales computed for all of them in one all-reduce after each optimizer step) and ``rowwise`` (a scale
per row, finer, and slower on an H100).

The parameters stay what they were (fp32, the same names), so checkpoints are the same as bf16's: a bf16 run
resumes in fp8 and back.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field

import torch
import torch.nn as nn

INSTALL = "pip install -e '.[fp8]'"
RECIPES = ("tensorwise", "rowwise")
MIN_RATIO = 1024
"""``in * out / (in + out)`` at or above which a linear converts (see the module docstring)."""
EMULATE_ENV = "TRAINER_FP8_EMULATE"
"""Set to 1, fp8 runs where float8 tensor cores are missing, the float8 matmuls emulated in higher precision by
torchao: for the CPU tests, never for speed."""


@dataclass
class Conversion:
    """What :func:`convert` did: the recipe, the linears converted, and the ones left out with the reason."""

    recipe: str
    converted: list[str] = field(default_factory=list)
    left_out: list[tuple[str, str]] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "recipe": self.recipe,
            "converted": self.converted,
            "left_out": [{"name": n, "why": w} for n, w in self.left_out],
        }

    def describe(self) -> str:
        """One line for the startup output."""
        n = len(self.converted) + len(self.left_out)
        reasons = collections.Counter(why.split(":")[0] for _, why in self.left_out)  # the category before the sizes
        line = f"fp8 ({self.recipe}): {len(self.converted)} of {n} linears in float8"
        if reasons:
            line += "; bf16 " + "; ".join(f"{why}: {count}" for why, count in reasons.items())
        return line


def emulated() -> bool:
    return os.environ.get(EMULATE_ENV) == "1"


def check_available(device: torch.device) -> None:
    """Raise a user error unless fp8 can run on ``device``: torchao installed, a CUDA GPU with float8 tensor cores
    (compute capability 8.9: Ada, Hopper and later). Never a silent fallback to bf16.

    Raises:
        ValueError: naming ``train.precision`` and what is missing.
    """
    if not emulated():
        if device.type != "cuda":
            raise ValueError(
                f"train.precision: fp8 needs a CUDA GPU with float8 tensor cores (compute capability "
                f"8.9 or later), and this run is on {device.type}; use train.precision=bf16"
            )
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(
                f"train.precision: fp8 needs float8 tensor cores (compute capability 8.9 or later: Ada, "
                f"Hopper, Blackwell); {torch.cuda.get_device_name(device)} is {major}.{minor}; use "
                "train.precision=bf16"
            )
    _torchao()


def _torchao():
    """``torchao.float8``, imported without its import-time log lines (kernels for other GPUs it cannot load, an
    enum it registers with torch.compile), which say nothing about this run."""
    import logging

    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    except ImportError:
        raise ValueError(f"train.precision: fp8 needs torchao; install it with: {INSTALL}") from None
    finally:
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)
    return float8


def head_names(model: nn.Module) -> set[str]:
    """Module names of the LM head: a Hugging Face model's output embeddings, a linear sharing its weight with an
    ``nn.Embedding``, or a linear as wide as the largest embedding (the token table)."""
    tables = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    hf = getattr(model, "hf", None)
    out = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    widest = max((t.num_embeddings for t in tables), default=None)
    tied = {id(t.weight) for t in tables}
    return {
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and (m is out or id(m.weight) in tied or m.out_features == widest)
    }


def why_not(name: str, linear: nn.Linear, heads: set[str]) -> str | None:
    """Why ``linear`` stays in bf16 (a short reason, its first word a category), or None to convert it."""
    k, n = linear.in_features, linear.out_features
    if name in heads:
        return "the LM head"
    if k % 16 or n % 16:
        return f"not a multiple of 16: {k} -> {n}"
    if k * n / (k + n) < MIN_RATIO:
        return f"too small to gain: {k} -> {n}"
    return None


def _plan(model: nn.Module, recipe: str, converted=lambda m: False) -> Conversion:
    heads, result = head_names(model), Conversion(recipe)
    for name, m in model.named_modules():
        if converted(m):
            result.converted.append(name)
        elif type(m) is nn.Linear:
            why = why_not(name, m, heads)
            (result.converted.append(name) if why is None else result.left_out.append((name, why)))
    return result


def convert(model: nn.Module, recipe: str, *, fsdp_all_gather: bool = False) -> Conversion:
    """Swap the linears :func:`why_not` passes for torchao's ``Float8Linear``, in place.

    Args:
        model: the built model (before compile, before ``fully_shard``, before the optimizer exists).
        recipe: ``tensorwise`` or ``rowwise``.
        fsdp_all_gather: under FSDP2 with ``tensorwise``: all-gather the weights in float8 (half the bytes);
            :func:`after_optimizer_step` must then run after each step.

    Returns:
        The :class:`Conversion`: names converted, names left out with the reason.
    """
    import dataclasses

    float8 = _torchao()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, enable_fsdp_float8_all_gather=fsdp_all_gather, emulate=emulated())
    result = _plan(model, recipe)
    chosen = set(result.converted)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn in chosen)
    return result


def conversion_of(model: nn.Module, recipe: str) -> Conversion:
    """The :class:`Conversion` a converted model shows: its ``Float8Linear`` layers, and why the others are not."""
    from torchao.float8.float8_linear import Float8Linear

    return _plan(model, recipe, converted=lambda m: isinstance(m, Float8Linear))


def after_optimizer_step(model: nn.Module):
    """A step post-hook (``optimizer.register_step_post_hook``) for float8 all-gather under FSDP2: every float8
    weight's scale for the next all-gather, from one all-reduce of their amaxes."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def hook(optimizer, args, kwargs):
        precompute_float8_dynamic_scale_for_fsdp(model)

    return hook
