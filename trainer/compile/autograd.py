"""Compiled autograd: the whole backward, hooks included, captured and compiled as one graph.

Plain ``torch.compile`` gives one AOTAutograd backward graph per forward graph: a graph
break in the forward splits the backward too, and tensor hooks and post-accumulate-grad
hooks (the distributed layer's reduction) run eagerly between the pieces. Under compiled
autograd the autograd engine's graph is traced at ``backward()`` time into one FX graph —
each AOT backward inlined, each hook a ``call_hook`` node Dynamo inlines — and compiled.

For your own loop::

    from trainer.compile.autograd import compiled_autograd
    model = torch.compile(model)
    with compiled_autograd():
        loss = model(x, y)
        loss.backward()

Both the forward and the backward belong inside the context, as upstream asks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def make_compiler(
    backend: str = "inductor", *, mode: str | None = None, dynamic: bool = False, fullgraph=True, options=None
):
    """The function compiled autograd hands each captured backward graph to."""
    from trainer.compile.capture import compile_kwargs

    kwargs = compile_kwargs(backend, mode or "default", fullgraph, dynamic, options)

    def compiler_fn(gm: torch.fx.GraphModule):
        return torch.compile(gm, **kwargs)

    return compiler_fn


@contextlib.contextmanager
def compiled_autograd(
    backend: str = "inductor",
    *,
    mode: str | None = None,
    dynamic: bool = False,
    fullgraph: bool = True,
    options: dict | None = None,
) -> Iterator[None]:
    """Run ``backward()`` calls inside this context through compiled autograd.

    Args:
        backend: the torch.compile backend for the backward graph.
        mode: torch.compile mode for the backward graph (inductor only).
        dynamic: treat sizes in the autograd graph as dynamic. Upstream's default is True, which
            compiles the backward for symbolic shapes; a training step has static shapes, so we
            default to False and get the same specialised kernels as the forward.
        fullgraph: fail rather than split the backward graph.
        options: Inductor options (``compile.inductor_options``), over the trainer's defaults.
    """
    from torch._dynamo import compiled_autograd as ca

    compiler = make_compiler(backend, mode=mode, dynamic=dynamic, fullgraph=fullgraph, options=options)
    with ca._enable(compiler, dynamic=dynamic):
        yield


def captures() -> int:
    """How many backward graphs compiled autograd has captured in this process (Dynamo's counter)."""
    from torch._dynamo.utils import counters

    return int(counters["compiled_autograd"]["captures"])
