"""Built-in models and the user-model contract.

A user's model is ``model.target: "pkg.module:factory"`` with ``model.kwargs``; the factory
returns an ``nn.Module`` whose ``forward(idx, targets)`` returns the loss, or a tuple whose
last item is the loss (nanoGPT's ``(logits, loss)`` works unchanged). A Hugging Face causal LM is
``model.hf`` (:mod:`trainer.models.hf`), adapted to the same contract.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch
import torch.nn as nn

from trainer.models.gpt import GPT, PRESETS, GPTConfig

__all__ = ["GPT", "GPTConfig", "PRESETS", "build_model", "gpt_shape", "loss_of", "flops_per_token"]


def build_model(
    *,
    preset: str | None,
    vocab_size: int,
    seq_len: int,
    n_layer: int | None = None,
    n_head: int | None = None,
    n_embd: int | None = None,
    dropout: float = 0.0,
    bias: bool = True,
    attention: str = "auto",
    target: str | None = None,
    kwargs: dict | None = None,
    hf: str | None = None,
    hf_overrides: dict | None = None,
    pretrained: bool = False,
) -> nn.Module:
    """Build the built-in GPT (a preset, optionally resized), a user's model from ``target``, or a Hugging Face
    causal LM from ``hf`` (:func:`trainer.models.hf.build_hf_model`: its vocabulary must hold ``vocab_size``, its
    positions ``seq_len``; the GPT's shape arguments do not apply to it).

    Raises:
        ValueError: the target cannot be imported, is not callable, or returns no ``nn.Module``; the hf model
            cannot be loaded or does not fit the data.
        FileNotFoundError: ``hf`` names a directory that does not exist.
    """
    if hf is not None:
        from trainer.models.hf import build_hf_model

        return build_hf_model(hf, overrides=hf_overrides, pretrained=pretrained, vocab_size=vocab_size, seq_len=seq_len)
    if target is not None:
        return _build_user_model(target, kwargs or {})
    shape = gpt_shape(preset, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    cfg = GPTConfig(
        vocab_size=vocab_size,
        block_size=seq_len,
        dropout=dropout,
        bias=bias,
        attention=attention,
        **shape,
    )
    return GPT(cfg)


def gpt_shape(preset: str | None, **overrides: int | None) -> dict:
    """The built-in GPT's ``n_layer``/``n_head``/``n_embd``: the preset's, with the given non-None overrides."""
    shape = dict(PRESETS[preset]) if preset else {}
    shape.update({k: v for k, v in overrides.items() if v is not None})
    return shape


def import_target(module_name: str):
    """Import ``model.target``'s module as ``python -m trainer`` would, under any launcher: a module found in the
    working directory is imported from there first (the ``trainer`` console script and a script elsewhere do not
    put the working directory on ``sys.path``; without it a user's ``scripts/`` would lose to an installed
    ``scripts`` package, or not be found at all).

    Raises:
        ValueError: the module, or a module it imports, cannot be imported; for the module itself the message shows
            where Python looked.
    """
    cwd, top = os.getcwd(), module_name.partition(".")[0]
    here = os.path.isdir(os.path.join(cwd, top)) or os.path.isfile(os.path.join(cwd, f"{top}.py"))
    if here and cwd not in [os.path.abspath(p or ".") for p in sys.path]:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        if not (isinstance(e, ModuleNotFoundError) and e.name == top):  # found; it or what it imports failed
            raise ValueError(f"model.target: cannot import module '{module_name}': {e}") from None
        shown = ", ".join(p or "." for p in sys.path[:3])
        raise ValueError(
            f"model.target: cannot import module '{module_name}': {e}. Python looked in the working directory ({cwd}) "
            f"and sys.path ({shown}, ... {len(sys.path)} entries): run from the directory that holds {top}/ (or "
            f"{top}.py), or add that directory to the search path with PYTHONPATH=DIR"
        ) from None


def _build_user_model(target: str, kwargs: dict) -> nn.Module:
    module_name, _, attr = target.partition(":")
    module = import_target(module_name)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"model.target: '{module_name}' has no callable '{attr}'")
    try:
        model = factory(**kwargs)
    except torch.OutOfMemoryError:
        raise  # the caller builds the model on the host instead (trainer.build.make_model)
    except Exception as e:
        if isinstance(e, TypeError) and e.__traceback__.tb_next is None:  # raised by the call itself: the arguments
            raise ValueError(f"model.kwargs: {target} rejected its arguments: {e}") from None
        what = f"{type(e).__name__}: {' '.join(str(e).split())}" if str(e).strip() else type(e).__name__
        at = f"at {where}; " if (where := _raised_at(e)) else ""
        raise ValueError(
            f"model.target: the factory {target} raised {what} ({at}TRAINER_DEBUG=1 shows the traceback)"
        ) from e
    if not isinstance(model, nn.Module):
        raise ValueError(f"model.target: {target} returned {type(model).__name__}, expected an nn.Module")
    return model


def _raised_at(e: BaseException) -> str | None:
    """``FILE:LINE`` of the innermost frame of ``e``'s traceback in the user's code: neither trainer's, nor Python's
    or an installed package's (torch's own checks raise inside torch); the innermost frame where none is, None where
    the factory has no Python frame (a builtin)."""
    import sysconfig

    trainer_dir = os.path.dirname(os.path.dirname(__file__))
    dirs = [sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")] + [trainer_dir]
    library = tuple(os.path.join(os.path.realpath(d), "") for d in dirs)
    frames = [(tb.tb_frame.f_code.co_filename, tb.tb_lineno) for tb in _walk(e.__traceback__)][1:]  # not this call
    users = [f for f in frames if not os.path.realpath(f[0]).startswith(library)]
    if not (users or frames):
        return None
    file, line = (users or frames)[-1]
    return f"{file}:{line}"


def _walk(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def loss_of(output) -> torch.Tensor:
    """The loss from a model's output: the tensor itself, or the last item of a tuple."""
    if isinstance(output, (tuple, list)):
        output = output[-1]
    if not isinstance(output, torch.Tensor) or output.numel() != 1:
        raise ValueError("the model's forward(idx, targets) must return the scalar loss or a tuple ending in it")
    return output


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: the model's own ``flops_per_token`` if it has one, else 6 × parameters."""
    fn = getattr(model, "flops_per_token", None)
    if callable(fn):
        return float(fn(seq_len))
    return 6.0 * sum(p.numel() for p in model.parameters())
