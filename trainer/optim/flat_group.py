"""Flat groups: parameters and gradients of one dtype and device in contiguous storage.

A :class:`FlatGroup` copies its parameters into one 1-D buffer and re-points each ``p.data`` at a
view of it; gradients get a second buffer and ``p.grad`` becomes a view of that. Autograd then
accumulates straight into the flat gradient buffer (``AccumulateGrad`` adds in place into an
existing ``.grad``), so an optimizer kernel can update every parameter of the group in one launch
over three or four flat buffers, with no per-step gather or scatter. The distributed layer's
gradient buckets are FlatGroups too: a bucket is one flat gradient buffer to reduce.

Every parameter starts at a multiple of ``ALIGN_BYTES`` and ``numel`` is a multiple of 16
elements, so Triton specialises the kernels for 16-byte-aligned pointers and a length divisible
by 16, and the streaming loads and stores compile to 16-byte vector accesses.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch

from trainer.optim.grad_table import local_tensor

# Each parameter starts on a 64-byte (and 16-element) boundary of its flat buffer, so the views keep
# the 16-byte alignment that cuBLAS, vectorised kernels and Inductor's alignment assumptions want.
ALIGN_BYTES = 64


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def group_by_dtype_and_device(params: Iterable[torch.Tensor]) -> dict[tuple[torch.dtype, torch.device], list]:
    """Split ``params`` by (dtype, device), keeping their order; one FlatGroup is built per key."""
    groups: dict[tuple[torch.dtype, torch.device], list] = defaultdict(list)
    for p in params:
        groups[(p.dtype, p.device)].append(p)
    return dict(groups)


class FlatGroup:
    """Parameters of one dtype and device living in one flat buffer, gradients in another.

    Args:
        params: Leaf tensors (usually ``nn.Parameter``) of a single dtype and device. Their data is
            copied into the flat buffer and ``p.data`` re-pointed at a view of it; their current
            ``.grad`` (if any) is copied into the flat gradient buffer and ``p.grad`` re-pointed.
        flat_grads: False leaves gradients alone (no gradient buffer; ``grad`` and ``grads`` are None, and
            ``sync_grads`` / ``zero_grad`` do not apply): for kernels that read them where autograd put them
            (:mod:`trainer.optim.grad_table`).
        flat_params: False leaves the parameters where they are too (no parameter buffer: ``param`` is None), for
            kernels that update them there; needs ``flat_grads=False``. The layout then follows each parameter's
            local tensor (a ``DTensor``'s shard on this rank), and a "flat state buffer" is a list of tensors,
            one per parameter (:meth:`zeros`), for kernels that read them through address tables.
        align: Each parameter's start, in elements (default: 64 bytes and at least 16 elements).

    Attributes:
        params: The parameters, in order.
        param: The flat parameter buffer, shape ``(numel,)`` (None with ``flat_params=False``).
        grad: The flat gradient buffer, shape ``(numel,)``, same dtype as the parameters.
        grads: ``p.grad`` views into ``grad``, one per parameter.
        offsets: Start of each parameter in the flat buffers.
        numel: Length of the flat buffers (parameters plus alignment padding; padding stays zero).
        dtype: Dtype of parameters and gradients.
        device: Device of every buffer.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        *,
        flat_grads: bool = True,
        flat_params: bool = True,
        align: int | None = None,
    ):
        params = list(params)
        if not params:
            raise ValueError("FlatGroup needs at least one parameter")
        assert flat_params or not flat_grads, "parameters left in place need their gradients left in place too"
        dtype, device = params[0].dtype, params[0].device
        for p in params:
            if p.dtype != dtype or p.device != device:
                raise ValueError(
                    f"FlatGroup parameters must share one dtype and device; got {p.dtype} on {p.device} "
                    f"next to {dtype} on {device} (split them with group_by_dtype_and_device)"
                )
        if len({id(p) for p in params}) != len(params):
            raise ValueError("FlatGroup got the same parameter twice")
        align = align or max(16, ALIGN_BYTES // params[0].element_size())  # elements
        self.shapes = [local_tensor(p).shape for p in params]  # a DTensor's: its local shard's
        self.offsets: list[int] = []
        numel = 0
        for shape in self.shapes:
            self.offsets.append(numel)
            numel = _round_up(numel + shape.numel(), align)
        self.params = params
        self.numel = numel
        self.dtype = dtype
        self.device = device
        self.flat_params = flat_params
        self.param = torch.zeros(numel, dtype=dtype, device=device) if flat_params else None
        self.grad = torch.zeros(numel, dtype=dtype, device=device) if flat_grads else None
        self.grads = None
        if not flat_params:
            self._data_ptrs = [local_tensor(p).data_ptr() for p in params]
            return
        with torch.no_grad():
            for p, view in zip(params, self.views(self.param)):
                view.copy_(p)
                p.data = view
            if flat_grads:
                self.grads = self.views(self.grad)
                for p, view in zip(params, self.grads):
                    if p.grad is not None:
                        view.copy_(p.grad)
                    p.grad = view
        self._data_ptrs = [p.data_ptr() for p in params]

    def views(self, flat: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
        """Views of a flat buffer laid out like this group, shaped like each parameter (a list: itself)."""
        if isinstance(flat, list):
            return flat
        assert flat.shape == (self.numel,), (flat.shape, self.numel)
        return [flat[o : o + shape.numel()].view(shape) for shape, o in zip(self.shapes, self.offsets)]

    def zeros(self, dtype: torch.dtype | None = None) -> torch.Tensor | list[torch.Tensor]:
        """A new zero flat buffer with this group's layout (for optimizer states); with ``flat_params=False``, a
        zero tensor per parameter, shaped like its local tensor."""
        dtype = dtype or self.dtype
        if not self.flat_params:
            return [torch.zeros(shape, dtype=dtype, device=self.device) for shape in self.shapes]
        return torch.zeros(self.numel, dtype=dtype, device=self.device)

    def owns_params(self) -> bool:
        """Whether every parameter still lives in ``self.param`` (``model.to()`` would move them out); with
        ``flat_params=False``, whether each still lives where it did when the group was built."""
        return all(local_tensor(p).data_ptr() == ptr for p, ptr in zip(self.params, self._data_ptrs))

    def sync_grads(self) -> None:
        """Make every ``p.grad`` the view into ``self.grad`` again, copying a replaced gradient in.

        Autograd accumulates in place into an existing ``.grad``, so this is a no-op on the normal
        path; it matters after ``model.zero_grad()`` (which sets ``.grad`` to ``None``) or after
        code assigns ``p.grad``. ``None`` becomes zeros.
        """
        for p, view in zip(self.params, self.grads):
            g = p.grad
            if g is view:
                continue
            if g is None:
                view.zero_()
            else:
                view.copy_(g)
            p.grad = view

    def zero_grad(self) -> None:
        """Zero the flat gradient buffer in place (one memset) and re-point any replaced ``.grad``."""
        self.grad.zero_()
        for p, view in zip(self.params, self.grads):
            if p.grad is not view:
                p.grad = view

    def __repr__(self) -> str:
        return f"FlatGroup({len(self.params)} tensors, numel={self.numel}, dtype={self.dtype}, device={self.device})"
