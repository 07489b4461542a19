"""The compile layer: capture, compiled autograd, the compiled optimizer and trainer's Triton kernels.

``compile_optimizer`` works on its own, in any training loop::

    from trainer.compile import compile_optimizer
    opt = compile_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))
"""


def __getattr__(name):
    # Lazy, so `import trainer.compile` does not import Triton or Inductor until needed.
    if name == "compile_optimizer":
        from trainer.compile.optimizer import compile_optimizer

        return compile_optimizer
    raise AttributeError(name)


__all__ = ["compile_optimizer"]
