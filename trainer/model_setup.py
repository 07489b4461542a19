"""The run's model from its config: built (the built-in GPT, ``model.target``'s, ``model.hf``'s), its master weights
and fp8 layers set, and checked before anything trains: trainable parameters, the data's sequences and token ids,
the attention kernel the device can run. :func:`trainer.build.make_model` puts these together."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from trainer import console
from trainer import plan as plan_rules
from trainer.config import Config, ConfigError


def build_model_of(cfg: Config, vocab_size: int, pretrained: bool, attention: str | None = None) -> nn.Module:
    """The config's model, built where the default device says, without the checks of :func:`make_model`;
    ``attention`` in place of ``model.attention`` if given."""
    from trainer.models import build_model

    m = cfg.model
    return build_model(
        preset=m.preset,
        vocab_size=vocab_size,
        seq_len=cfg.data.seq_len,
        n_layer=m.n_layer,
        n_head=m.n_head,
        n_embd=m.n_embd,
        dropout=m.dropout,
        bias=m.bias,
        attention=attention or m.attention,
        target=m.target,
        kwargs=dict(m.kwargs),
        hf=m.hf,
        hf_overrides=dict(m.hf_overrides),
        pretrained=pretrained,
    )


def master_weights(model: nn.Module, cfg: Config) -> nn.Module:
    """``model`` with its floating-point parameters in ``optim.master_weights``'s dtype: bf16 casts them once
    (buffers, such as rotary tables, are kept); fp32 leaves them as built."""
    if cfg.optim.master_weights == "bf16":
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(torch.bfloat16)
    return model


def fp8_all_gather(plan: plan_rules.Plan) -> bool:
    """Whether fp8 weights are all-gathered in float8: fsdp on several ranks with the tensorwise recipe."""
    return plan.precision == "fp8" and plan.strategy.fsdp and plan.cfg.train.fp8_recipe == "tensorwise"


def maybe_fp8(model: nn.Module, plan: plan_rules.Plan) -> nn.Module:
    """``model`` with its linears converted to float8 training under ``train.precision=fp8`` (the rule:
    :mod:`trainer.precision.fp8`); says how many, and why the others are not."""
    cfg = plan.cfg
    if plan.precision != "fp8":
        return model
    from trainer.precision import fp8

    all_gather = fp8_all_gather(plan)
    conversion = fp8.convert(model, cfg.train.fp8_recipe, fsdp_all_gather=all_gather)
    console.info(conversion.describe() + ("; weights all-gathered in float8" if all_gather else ""))
    return model


def model_source(cfg: Config) -> str:
    """The config's model in words, by the key that names it: ``model.hf NAME``, ``model.target PATH`` or the
    built-in GPT."""
    m = cfg.model
    return f"model.hf {m.hf}" if m.hf else f"model.target {m.target}" if m.target else "the built-in GPT"


def check_trainable(model: nn.Module, cfg: Config) -> nn.Module:
    """``model``, once it has a parameter to train: without one the first backward would stop with torch's
    ``element 0 of tensors does not require grad`` (a loss computed from no parameter), or every step would update
    nothing.

    Raises:
        ValueError: no parameter, or none with ``requires_grad`` (exit 2).
    """
    params = list(model.parameters())
    if any(p.requires_grad for p in params):
        return model
    if params:
        n = sum(p.numel() for p in params)
        what = f"its {len(params)} parameters ({n:,} values) all have" if len(params) > 1 else "its one parameter has"
        what += " requires_grad=False"
    else:
        what = "it has no parameters"
    raise _nothing_to_train(f"{model_source(cfg)} has no trainable parameters ({what})")


def _nothing_to_train(problem: str) -> ValueError:
    return ValueError(
        f"{problem}: training would have nothing to update. Return a model whose forward(idx, targets) computes the "
        "loss from parameters that require grad (nn.Parameter, nn.Linear, nn.Embedding; not frozen with "
        "requires_grad_(False) or detach())"
    )


def check_fits_data(model: nn.Module, cfg: Config, vocab_size: int) -> nn.Module:
    """``model``, once one meta-device forward (:func:`trainer.models.fit_check.check_model_fits`) shows it takes
    sequences of ``data.seq_len`` tokens with ids below ``vocab_size``, and returns a loss that trains a parameter. A
    model trained from scratch whose token table is more than 4x the data's vocabulary gets one warning naming the
    share of the model's parameters its embedding and head hold (:func:`vocabulary_parameters`).

    Raises:
        ValueError: a table shorter than the data needs, the model's own refusal of the length, or a loss that no
            parameter requiring grad reaches (exit 2).
    """
    from trainer.models.fit_check import check_model_fits

    m = cfg.model
    fit = check_model_fits(model, cfg.data.seq_len, vocab_size)
    source = model_source(cfg)
    resize = "model.hf_overrides" if m.hf else "model.kwargs" if m.target else "model"
    if fit.problems:
        kinds = {kind for kind, _ in fit.problems}
        ways = ["lower data.seq_len, or give the model more positions (" + resize + ")"] if kinds - {"tokens"} else []
        ways += (
            [
                f"use data tokenized for this model, or give it a vocabulary of at least {vocab_size} tokens "
                f"({resize}.vocab_size)"
            ]
            if "tokens" in kinds
            else []
        )
        lines = "; ".join(line for _, line in fit.problems)
        raise ValueError(f"{source} does not fit the data: {lines}. To fix: {'; '.join(ways)}")
    if fit.trains is False:
        raise _nothing_to_train(
            f"{source} has no trainable parameters in its loss (the loss its forward returns does not require grad: "
            "a constant, or computed from frozen or detached tensors only)"
        )
    rows = fit.token_table
    if rows is not None and rows > 4 * vocab_size and not (m.hf and m.pretrained):
        grows, total = vocabulary_parameters(model, fit.token_table_name, rows)
        share = (
            f": its embedding and head hold {_params(grows)} of its {_params(total)} parameters ({grows / total:.0%}), "
            f"where the data's vocabulary needs {_params(round(grows * vocab_size / rows))}. The head's matmul and "
            "the optimizer's work and memory grow with them"
            if grows and total
            else ""
        )
        console.warn(
            f"{source} has a {rows:,}-token vocabulary for data of {vocab_size:,} tokens{share}. "
            f"Set {resize}.vocab_size={vocab_size} (or a multiple of 64 above it)"
        )
    return model


def vocabulary_parameters(model: nn.Module, table: str | None, rows: int) -> tuple[int, int]:
    """``(parameters that grow with the vocabulary, all parameters)`` of ``model``: the token table (the parameter
    named ``table``) and the LM head (the last ``nn.Linear`` with ``rows`` outputs, its bias too), once each where
    the two are tied."""
    params = dict(model.named_parameters())
    grows = {id(params[table]): params[table].numel()} if table in params else {}
    heads = [mod for mod in model.modules() if isinstance(mod, nn.Linear) and mod.out_features == rows]
    for p in heads[-1].parameters(recurse=False) if heads else ():
        grows[id(p)] = p.numel()
    return sum(grows.values()), sum(p.numel() for p in model.parameters())


def _params(n: int) -> str:
    """A count of parameters: ``32.80M``, or ``65,536`` below 100K."""
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n:,}"


def check_attention(cfg: Config, device: torch.device, dtype) -> None:
    """Fail at startup, with the key, when ``model.attention`` names a kernel this device cannot run.

    torch checks a backend's constraints (device, dtype, head size) only when attention first runs, and
    inside a compiled graph that is the first training step; a probe of the model's head size and dtype
    answers before anything is compiled.
    """
    name = cfg.model.attention
    if name == "auto":
        return
    from torch.nn.attention import sdpa_kernel

    from trainer.distributed.fsdp import DTYPES
    from trainer.models import GPTConfig, gpt_shape
    from trainer.models.gpt import sdpa_backend

    m = cfg.model
    shape = {**vars(GPTConfig()), **gpt_shape(m.preset, n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd)}
    n_head = shape["n_head"]
    head_dim = shape["n_embd"] // n_head
    d = cfg.distributed
    if d.strategy == "fsdp" and d.param_dtype != "auto":  # FSDP computes in its parameter dtype
        dtype = DTYPES[d.param_dtype]
    # The model's shape, sequence length, dropout and compute dtype: each can rule a kernel out.
    q = torch.zeros(1, n_head, cfg.data.seq_len, head_dim, device=device, dtype=dtype or torch.float32)
    q.requires_grad_()
    try:
        with warnings.catch_warnings(record=True) as said, sdpa_kernel(sdpa_backend(name)):
            warnings.simplefilter("always")
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=m.dropout, is_causal=True)
            out.sum().backward()
    except RuntimeError as e:
        # torch gives its reasons as warnings ("... not used because ...") and then "No available kernel".
        reasons = [str(w.message).strip().splitlines()[0] for w in said if "because" in str(w.message)]
        reasons = reasons or [str(e).strip().splitlines()[0]]
        first = "; ".join(reasons[:2])
        raise ConfigError(
            f"model.attention: '{name}' cannot run on {device} with {str(q.dtype).removeprefix('torch.')} and "
            f"head size {head_dim} ({first}); use auto"
        ) from None
