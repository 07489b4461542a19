"""Models built without initialising their parameters, for a run whose checkpoint overwrites every one of them.

A resume loads the checkpoint's model state strictly (every parameter and persistent buffer named, or it stops), so
the random initialisation a model's ``__init__`` draws (about ten nanoseconds a parameter on a CPU core: 11 s for a
1B model), or the pretrained weights it would read, is thrown away. :func:`build_without_init` builds the model
with each parameter registered on the meta device (:func:`parameters_on_meta`: the initialisation of a meta tensor
does nothing), then gives each one uninitialised memory on the device it was created on, ties kept.

Buffers are not on the meta device: a model computes them in its ``__init__`` as usual, which matters for those a
checkpoint does not hold (non-persistent buffers: the rotary ``inv_freq`` of a Hugging Face Llama, with its
``original_inv_freq`` kept as a plain attribute). A model that computes a buffer or a tensor attribute from a
parameter would leave it on the meta device: it is then built again, initialised (see
:func:`build_without_init`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn


@contextlib.contextmanager
def parameters_on_meta(created_on: dict[int, tuple[nn.Parameter, torch.device]] | None = None) -> Iterator[None]:
    """A context in which every parameter a module registers moves to the meta device: a model built inside has
    its structure and no parameter memory. Its buffers, and tensors kept as plain attributes, are built as usual
    (a rotary table computed from the config, say): code that reads them while building still works, and a plain
    attribute keeps its value.

    Args:
        created_on: if given, filled with ``id(meta parameter) -> (it, the device it was created on)``.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            on_meta = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            on_meta.__dict__.update(param.__dict__)  # attributes a model set on it
            module._parameters[name] = on_meta
            if created_on is not None:
                created_on[id(on_meta)] = (on_meta, param.device)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_without_init(build: Callable[[], nn.Module]) -> tuple[nn.Module | None, str | None]:
    """``build()``'s model with every parameter uninitialised (``torch.empty``) on the device it was created on.

    Returns:
        ``(model, None)``; or ``(None, why)`` where the model cannot be built so: ``build`` failed with its
        parameters on the meta device (an ``__init__`` that reads a parameter's value), or left a buffer or a tensor
        attribute there (computed from a parameter). The caller then builds it as usual.
    """
    created_on: dict[int, tuple[nn.Parameter, torch.device]] = {}
    try:
        with parameters_on_meta(created_on):
            model = build()
    except torch.OutOfMemoryError:
        raise  # the caller builds it on the host
    except Exception as e:  # noqa: BLE001 - built again as usual, where a config's error fails again and is said
        return None, f"it cannot be built with its parameters on the meta device ({type(e).__name__}: {e})"
    if left := left_on_meta(model):
        return None, f"{left} is computed from a parameter while the model is built"
    empty: dict[int, nn.Parameter] = {}  # one tensor for a parameter registered twice (tied embeddings)
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None or not p.is_meta:
                continue
            if id(p) not in empty:
                device = created_on.get(id(p), (None, torch.get_default_device()))[1]
                new = type(p)(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
                empty[id(p)] = new
            module._parameters[name] = empty[id(p)]
    return model, None


def left_on_meta(model: nn.Module) -> str | None:
    """The name of a buffer or tensor attribute of ``model`` (its own or a submodule's) on the meta device, or
    None. Parameters are not looked at."""
    for prefix, module in model.named_modules():
        tensors = {**module._buffers, **{k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}}
        for name, t in tensors.items():
            if t is not None and t.is_meta:
                return f"{prefix}.{name}" if prefix else name
    return None
