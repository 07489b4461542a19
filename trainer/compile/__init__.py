"""The compile layer: capture (:mod:`~trainer.compile.capture`), trainer's Triton kernels substituted into the
captured graphs (:mod:`~trainer.compile.passes`), compiled autograd, the graphed step, the compile report, cache and
debugging aids.

``compile_optimizer`` (:mod:`trainer.optim.compiled`) works on its own, in any training loop::

    from trainer.compile import compile_optimizer
    opt = compile_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))
"""


def __getattr__(name):
    # Lazy, so `import trainer.compile` does not import Triton or Inductor until needed.
    if name == "compile_optimizer":
        from trainer.optim.compiled import compile_optimizer

        return compile_optimizer
    raise AttributeError(name)


__all__ = ["compile_optimizer"]
