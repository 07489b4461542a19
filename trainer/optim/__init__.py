"""Optimizers: one factory, the compiled drop-in, trainer's in Triton, and the sharded one.

Usable in any training loop, without ``trainer fit``::

    from trainer.optim import build_optimizer, param_groups
    opt = build_optimizer(param_groups(model, 0.1), name="adamw", impl="auto", lr=3e-4, max_grad_norm=1.0)

- :mod:`~trainer.optim.factory`: :func:`build_optimizer` (torch's, compiled, trainer's Triton ones or sharded) and
  :func:`param_groups`;
- :mod:`~trainer.optim.compiled`: :func:`compile_optimizer`, any torch optimizer with its step compiled;
- the Triton optimizers over flat buffers: :mod:`~trainer.optim.optimizers` (``TritonAdamW``, ``TritonAdam``,
  ``TritonSGD``) on :mod:`~trainer.optim.flat` and :mod:`~trainer.optim.flat_group`, their update kernels
  (:mod:`~trainer.optim.adamw`, :mod:`~trainer.optim.sgd`, :mod:`~trainer.optim.grad_table`) and the gradient
  norm (:mod:`~trainer.optim.grad_norm`);
- :mod:`~trainer.optim.zero`: the optimizer state sharded over ddp's bucket plan.
"""

_EXPORTS = {
    "build_optimizer": "trainer.optim.factory",
    "param_groups": "trainer.optim.factory",
    "compile_optimizer": "trainer.optim.compiled",
    "TritonAdamW": "trainer.optim.optimizers",
    "TritonAdam": "trainer.optim.optimizers",
    "TritonSGD": "trainer.optim.optimizers",
}


def __getattr__(name):
    # Lazy, so importing the package decorates no Triton kernel: under TRITON_INTERPRET=1 the variable must be set
    # before they are.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)


__all__ = list(_EXPORTS)
