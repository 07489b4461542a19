"""Does the model fit the data? One forward on the meta device, before the first step, answers it.

The forward takes one sequence of ``data.seq_len`` tokens whose ids reach the data's largest, with every parameter
and buffer swapped for a meta tensor (``torch.func.functional_call``): no memory, no arithmetic, so the check costs
the same for a 0.8M model and an 8B one. Meta tensors carry no values, so a dispatch mode follows the two kinds of
index a language model looks up, through the ops that carry them (views, casts, adding a constant):

- the token ids, whose largest is the data's vocabulary minus one;
- positions made by ``torch.arange``, whose largest is the sequence length minus one.

An ``embedding`` or an indexing op whose table is shorter than the largest index it is given is what a CPU would
stop on with ``IndexError: index out of range in self`` (and a GPU with a device-side assert that ends the
process): it is reported here as a user error naming the table, its size and the data's need. A model that checks
its length itself (nanoGPT's ``assert t <= block_size``) fails the meta forward with its own message, which is
reported the same way.

The forward runs with gradients recorded (on meta they cost nothing either), each parameter requiring grad as the
model's does: a loss that does not require grad is one no parameter trains (a constant, or a model frozen in part
through ``detach``), which the first backward would stop on with ``element 0 of tensors does not require grad``.

A value the forward reads (``.item()``) is answered as one fresh sequence would answer it (see ``_ANSWER``). A model
whose forward cannot run on the meta device at all (a CPU tensor kept as a plain attribute) fails even at length 1:
then nothing is known and nothing is said.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten

# Ops whose output holds the values of their first tensor argument (a view, a copy, a cast, a broadcast).
_CARRY = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unsqueeze.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.expand.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.clone.default,
    aten._to_copy.default,
    aten.detach.default,
    aten.alias.default,
    aten.t.default,
    aten.transpose.int,
    aten.permute.default,
    aten.repeat.default,
    aten.flatten.using_ints,
    aten.lift_fresh.default,
    aten.contiguous.default,
    aten.expand_as.default,
    aten.view_as.default,
}
_ADD = {aten.add.Tensor, aten.add.Scalar}
# A value the forward reads (``.item()``, ``bool(t)``) has none on meta. It is answered as one sequence of fresh
# positions answers the tests models make of it (transformers asks whether the positions restart: no, True).
_ANSWER = {(False, True): True, (False, False): 0, (True, False): 0.0}


@dataclass(frozen=True)
class _Index:
    """What an integer tensor indexes with: its largest value and what it counts (``tokens`` or ``positions``)."""

    largest: int
    kind: str


@dataclass
class Fit:
    """What the meta forward found.

    Attributes:
        checked: the forward ran (False: the model cannot run on the meta device; nothing is known).
        token_table: rows of the table the token ids index (the model's vocabulary), if one was seen.
        token_table_name: that table's name among the model's parameters and buffers, if it is one of them.
        trains: the loss the forward returned requires grad (a parameter trains through it); None where the forward
            returned no tensor to tell.
        problems: ``(kind, line)`` each: a table shorter than the data needs (``tokens`` or ``positions``), or
            the model's own refusal of the length (``length``).
    """

    checked: bool = False
    token_table: int | None = None
    token_table_name: str | None = None
    trains: bool | None = None
    problems: list[tuple[str, str]] = field(default_factory=list)


class _FollowIndices(TorchDispatchMode):
    """Follows token ids and ``arange`` positions through the ops that carry them; records each table lookup."""

    def __init__(self, names: dict[int, str]):
        super().__init__()
        self.index = WeakIdKeyDictionary()  # tensor -> _Index
        self.names = names  # id(meta parameter or buffer) -> its name
        self.lookups: list[tuple[str, int, _Index]] = []  # (table name, rows, index)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default and args[0].is_meta:
            return _ANSWER[args[0].dtype.is_floating_point, args[0].dtype == torch.bool]
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet is aten.arange:
            self._arange(args, out)
        elif func in _CARRY and isinstance(args[0], torch.Tensor) and args[0] in self.index:
            self._mark(out, self.index[args[0]])
        elif func in _ADD:
            self._add(args, out)
        elif func is aten.embedding.default:
            self._lookup(args[0], 0, args[1])
        elif func is aten.index_select.default:
            self._lookup(args[0], args[1], args[2])
        elif func is aten.index.Tensor:
            for dim, ix in enumerate(args[1]):
                if ix is not None:
                    self._lookup(args[0], dim, ix)
        return out

    def _mark(self, out, index: _Index) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_floating_point():
                self.index[t] = index

    def _arange(self, args, out) -> None:
        ints = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
        if len(ints) != len(args) or not ints or out.numel() == 0:
            return  # a tensor or float bound: not a position range
        start, step = (0, 1) if len(ints) == 1 else (ints[0], ints[2] if len(ints) > 2 else 1)
        if step > 0:
            self._mark(out, _Index(start + (out.numel() - 1) * step, "positions"))

    def _add(self, args, out) -> None:
        known = [self.index[a] for a in args if isinstance(a, torch.Tensor) and a in self.index]
        others = [a for a in args if not (isinstance(a, torch.Tensor) and a in self.index)]
        if len(known) == 1 and all(isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in others):
            self._mark(out, _Index(known[0].largest + sum(others), known[0].kind))

    def _lookup(self, table, dim: int, ix) -> None:
        if isinstance(ix, torch.Tensor) and ix in self.index and dim < table.dim():
            name = self.names.get(id(table), "a table computed in the forward")
            self.lookups.append((name, table.shape[dim], self.index[ix]))


def _meta_forward(model: nn.Module, seq_len: int, vocab_size: int) -> tuple[_FollowIndices, bool | None]:
    """Run ``model`` on one meta sequence of ``seq_len`` token ids (largest ``vocab_size - 1``), with its parameters
    (requiring grad as the model's do) and buffers on meta; returns the mode that followed the indices and whether
    the loss requires grad (None: the forward returned no tensor). Raises what the forward raises."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    meta = {
        name: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
        for name, t in {**params, **buffers}.items()
    }
    names = {id(t): name for name, t in meta.items()}
    idx = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    targets = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    mode = _FollowIndices(names)
    mode.index[idx] = _Index(vocab_size - 1, "tokens")
    with mode, torch.enable_grad():
        out = torch.func.functional_call(model, meta, (idx, targets), strict=False)
    loss = out[-1] if isinstance(out, tuple | list) and out else out  # the contract: the loss, or a tuple ending in it
    return mode, loss.requires_grad if isinstance(loss, torch.Tensor) else None


def check_model_fits(model: nn.Module, seq_len: int, vocab_size: int) -> Fit:
    """Check that ``model`` can take sequences of ``seq_len`` tokens with ids below ``vocab_size``.

    Args:
        model: the built model, on any device (its values are not read); the trainer's ``forward(idx, targets)``.
        seq_len: ``data.seq_len``.
        vocab_size: the data's vocabulary (its largest token id plus one).

    Returns:
        A :class:`Fit`: the problems found (each a line naming the model's limit and the data's need), the rows of the
        table the token ids index, and whether the loss trains a parameter.
    """
    was_training = model.training
    model.eval()  # no dropout masks to draw; the shapes are the same
    try:
        try:
            mode, trains = _meta_forward(model, seq_len, vocab_size)
        except Exception as e:  # noqa: BLE001 - told apart below: the model's own limit, or no meta forward at all
            if seq_len == 1:
                return Fit()
            try:
                _meta_forward(model, 1, vocab_size)
            except Exception:  # noqa: BLE001 - it cannot run on meta: nothing is known
                return Fit()
            message = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
            what = f"{type(e).__name__}: {message}" if message else type(e).__name__
            line = f"the model cannot take a sequence of data.seq_len={seq_len} tokens, though it takes 1 ({what})"
            return Fit(checked=True, problems=[("length", line)])
    finally:
        model.train(was_training)
    fit = Fit(checked=True, trains=trains)
    for name, rows, index in mode.lookups:
        if index.kind == "tokens" and fit.token_table is None:
            fit.token_table, fit.token_table_name = rows, name
        if index.largest < rows:
            continue
        if index.kind == "tokens":
            line = (
                f"the model's token table {name} holds {rows} tokens; the data's vocabulary is {vocab_size} "
                f"(token ids up to {vocab_size - 1})"
            )
        else:
            line = f"the model's position table {name} holds {rows} positions; data.seq_len is {index.largest + 1}"
        fit.problems.append((index.kind, line))
    return fit
