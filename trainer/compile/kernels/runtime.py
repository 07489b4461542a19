"""Where trainer's Triton kernels run and what they compute in: the helpers every kernel module shares.

The kernels are layered; a module imports only from the layers above its own:

1. primitives: this module, :mod:`~trainer.compile.kernels.grad_norm` (the sum-of-squares kernels) and
   :mod:`~trainer.compile.kernels.rows` (what the row-norm backwards share);
2. kernels: :mod:`~trainer.compile.kernels.adamw` and :mod:`~trainer.compile.kernels.sgd` (updates of flat
   buffers), :mod:`~trainer.compile.kernels.grad_table` (AdamW and the norm through gradient addresses),
   :mod:`~trainer.compile.kernels.add_layer_norm`, :mod:`~trainer.compile.kernels.add_rms_norm` and
   :mod:`~trainer.compile.kernels.linear_cross_entropy` (model ops);
3. flat buffers: :mod:`~trainer.compile.kernels.flat_group` (``FlatGroup``), :mod:`~trainer.compile.kernels.flat`
   (``FlatOptimizer``) and :mod:`~trainer.compile.kernels.optimizers` (``TritonAdamW``, ``TritonAdam``, ``TritonSGD``).

``tests/test_layout.py`` keeps it so.
"""

from __future__ import annotations

from typing import Any

import torch


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def interpreted(kernel: Any) -> bool:
    """Whether ``kernel`` (a ``@triton.jit`` function) runs in the Triton interpreter.

    Triton chooses when it decorates: ``TRITON_INTERPRET=1`` must have been set when the kernel's module was
    imported and also when ``triton`` itself was first imported (it decorates its own ``tl.sum``/``tl.max``
    then); set in between, the kernel can run nowhere on CPU.
    """
    import triton.language as tl

    return all(type(f).__name__ == "InterpretedFunction" for f in (kernel, tl.sum))


def triton_can_run(device: torch.device, kernel: Any) -> bool:
    """Whether ``kernel`` (a ``@triton.jit`` function) can run on tensors of ``device``: CUDA always can, CPU
    tensors only under the interpreter (:func:`interpreted`)."""
    return device.type == "cuda" or (device.type == "cpu" and interpreted(kernel))


def autocast_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype trainer's ops compute in for ``x``: the autocast dtype while autocast is on for x's device type, else
    x's own (what the matmul that follows would read)."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


def check_flat_args(
    param: torch.Tensor, grad: torch.Tensor, states: list[torch.Tensor], step: torch.Tensor, hparams, n_hparams: int
) -> None:
    """Raise ValueError unless an optimizer kernel's flat buffers agree: contiguous, one device and length, the
    gradient in the parameters' dtype, fp32 states, a one-element fp32 step and ``n_hparams`` float64 scalars."""
    for name, t in [("param", param), ("grad", grad)] + [(f"state {i}", s) for i, s in enumerate(states)]:
        if t.device != param.device or not t.is_contiguous() or t.numel() != param.numel():
            raise ValueError(
                f"{name}: expected a contiguous tensor of {param.numel()} elements on {param.device}, "
                f"got {tuple(t.shape)} on {t.device} (contiguous={t.is_contiguous()})"
            )
    if grad.dtype != param.dtype or any(s.dtype != torch.float32 for s in states):
        raise ValueError(f"grad must have the param dtype ({param.dtype}) and states must be float32")
    if step.dtype != torch.float32 or step.numel() != 1 or step.device != param.device:
        raise ValueError("step must be a one-element float32 tensor on the param device")
    if hparams.dtype != torch.float64 or hparams.numel() != n_hparams or hparams.device != param.device:
        raise ValueError(f"hparams must be a float64 tensor of {n_hparams} elements on the param device")
