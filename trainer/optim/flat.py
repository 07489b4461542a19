"""The flat-buffer optimizer: parameters, gradients and optimizer states of one dtype and device in contiguous
storage (:mod:`~trainer.optim.flat_group`'s groups), updated in one launch per group.

:class:`FlatOptimizer` is the ``torch.optim.Optimizer`` base of trainer's Triton optimizers
(:mod:`trainer.optim.optimizers`): it owns the flat groups, keeps ``state`` in torch's per-parameter
layout (views into the flat state buffers), and gives ``state_dict()`` / ``load_state_dict()`` that
interchange with ``torch.optim.AdamW`` / ``torch.optim.SGD`` checkpoints.

Semantics that differ from torch's optimizers, by design:

- A gradient of ``None`` counts as zero. ``zero_grad()`` zeroes the flat gradient buffers in place
  (``set_to_none`` is ignored: setting ``.grad`` to ``None`` would detach it from the buffer), and
  every parameter of a group steps together, so a parameter that received no gradient still gets
  weight decay and moment decay, as with ``zero_grad(set_to_none=False)`` in torch. Parameters with
  ``requires_grad=False`` at the first step are left out and never touched.
- Parameters are made contiguous (their shapes are kept).
- If something replaces a parameter's storage (``model.to(...)`` after the first step) the flat
  groups are rebuilt on the next step, states included; if something replaces ``p.grad`` (e.g.
  ``model.zero_grad()`` with ``set_to_none=True``), the new gradient is copied into the buffer.

FSDP2's parameters (``DTensor``, each rank holding a shard) are not moved: FSDP owns their storage and
all-gathers from it. The optimizer then updates each local shard where it lives and reads the gradients' local
shards where FSDP's reduce-scatter left them (both through address tables,
:mod:`~trainer.optim.grad_table`; still one launch per group). Its states are one tensor per parameter
shaped like the local shard, shown in ``state`` (and ``state_dict()``, hence DCP) as ``DTensor``s laid out like
their parameters, as torch's optimizers keep them. Not views of one flat buffer: torch (2.10 and later) gives a
``DTensor`` its local tensor's storage offset (https://github.com/pytorch/pytorch/pull/167597), and
``copy.deepcopy`` of a ``DTensor`` at a non-zero offset then fails ("invalid python storage"), so a user's
``deepcopy(opt.state_dict())`` would. The kernels read the states through tables too, so nothing is lost. The
clipping norm is the global one: the local sums of squares are all-reduced over the mesh dimensions the
parameters are sharded on, on the device.

Cost on the backward side: with ``.grad`` kept, autograd adds each new gradient into it
(``grad += new``: read, read, write) and ``zero_grad`` writes zeros, about 16 bytes per fp32
parameter per step more than torch's default ``set_to_none`` path, which adopts the new gradient
tensor as ``.grad``. Data-parallel bucketing pays this anyway (DDP's ``gradient_as_bucket_view``
does the same); on one GPU without accumulation it is the price of reading gradients from one
flat buffer. The step benchmark (scripts/bench_optimizer.py) times the optimizer step alone.
"""

from __future__ import annotations

from collections import defaultdict
from copy import deepcopy
from itertools import chain
from typing import Any

import torch

from trainer.ops.utils import capturing, triton_can_run
from trainer.optim import grad_table
from trainer.optim.flat_group import FlatGroup, group_by_dtype_and_device
from trainer.optim.grad_norm import grad_norm
from trainer.optim.grad_table import is_dtensor, local_tensor


class FlatOptimizer(torch.optim.Optimizer):
    """Base of the flat-buffer Triton optimizers: flat groups, per-parameter state, checkpoints.

    Subclasses set ``state_keys`` (the per-parameter state tensors, fp32 flat buffers), implement
    ``_hparams(group)`` (the group's scalars, written to a float64 device tensor each step when they
    change, so a scheduler never causes a recompile or a host sync) and ``_update(...)`` (one kernel
    launch per flat group), and may override ``_has_state``.

    Args:
        params: Parameters or param-group dicts, as for any ``torch.optim`` optimizer.
        defaults: Default hyperparameters.
        max_grad_norm: Clip gradients to this global L2 norm inside the step (0 disables). The norm
            is computed on device and read by the update kernel from device memory: no host sync.
        flat_grads: Keep gradients in flat buffers too (see the module docstring); False leaves them where
            autograd puts them and the kernels read them through a table of their addresses
            (:mod:`trainer.optim.grad_table`), so ``zero_grad`` sets them to None as torch's does.
            None (default): flat buffers, except for ``DTensor`` parameters (FSDP2's), which are always updated
            where they live, with their gradients read where FSDP left them (``True`` is then an error).

    Attributes:
        sharded: The parameters are ``DTensor``s (see the module docstring).

    CUDA graphs: ``step()`` may be captured. Call ``before_graph_replay()`` before each replay (and before
    the capture: it writes the hyperparameters a schedule changed, which a captured write would freeze) and
    ``after_graph_replay()`` after it (the host's step count, for ``state_dict``).
    """

    state_keys: tuple[str, ...] = ()

    def _state_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the states of parameters of ``dtype``: fp32 (a subclass may keep bf16 ones)."""
        return torch.float32

    state_has_step = True  # torch's AdamW keeps a per-parameter 'step'; its SGD does not

    def __init__(
        self, params: Any, defaults: dict[str, Any], max_grad_norm: float = 0.0, *, flat_grads: bool | None = None
    ):
        if max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0 (0 disables clipping), got {max_grad_norm}")
        super().__init__(params, defaults)
        self.max_grad_norm = float(max_grad_norm)
        self._norm_groups = self._shard_groups()
        self.sharded = self._norm_groups is not None
        if self.sharded and flat_grads:
            raise ValueError(
                f"{type(self).__name__}(flat_grads=True) cannot take DTensor parameters (FSDP2's): their shards stay "
                "in FSDP's storage and their gradients where its reduce-scatter leaves them; leave flat_grads unset"
            )
        self.flat_grads = not self.sharded if flat_grads is None else flat_grads
        self.clips_grad_norm = self.max_grad_norm > 0
        self.last_grad_norm: torch.Tensor | None = None
        self._pending_norm: torch.Tensor | None = None  # from grad_norm(), used by the next step
        self._flats: list[tuple[int, FlatGroup]] | None = None  # (param-group index, group)
        # per flat group: state key -> flat fp32 buffer (in place: a tensor per parameter, see FlatGroup.zeros)
        self._bufs: list[dict[str, torch.Tensor | list[torch.Tensor]]] = []
        self._steps: list[torch.Tensor] = []  # per flat group: fp32 step counter on device
        self._host_steps: list[int] = []  # the same count on the host, so state_dict needs no sync
        self._hparams_dev: list[torch.Tensor] = []  # per param group: float64 hyperparameters on device
        self._hparams_host: list[tuple[float, ...] | None] = []
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if len(devices) > 1:
            raise ValueError(
                f"{type(self).__name__} needs all parameters on one device, got {sorted(map(str, devices))}"
            )
        (device,) = devices
        # Fail now where the kernels can never run; CPU parameters on a CUDA machine may still be
        # moved to the GPU (accelerate's prepare() does) before the first step.
        if not triton_can_run(device, self._kernel()) and not (device.type == "cpu" and torch.cuda.is_available()):
            raise ValueError(self._device_error(device))

    # -- subclass hooks ------------------------------------------------------------------------
    def _kernel(self) -> Any:
        """The main ``@triton.jit`` kernel (used to tell whether Triton can run on a device)."""
        raise NotImplementedError

    def _hparams(self, group: dict[str, Any]) -> tuple[float, ...]:
        raise NotImplementedError

    def _update(
        self,
        group: dict[str, Any],
        flat: FlatGroup,
        bufs: dict[str, torch.Tensor | list[torch.Tensor]],
        step: torch.Tensor,
        hparams: torch.Tensor,
        grad_norm: torch.Tensor | None,
    ) -> None:
        raise NotImplementedError

    def _has_state(self, group: dict[str, Any], host_step: int) -> bool:
        """Whether torch's optimizer would hold state for this group's parameters by now."""
        return host_step > 0

    def _loaded_step(self, state: dict[str, Any]) -> float:
        """The step count a loaded per-parameter state implies."""
        return float(state.get("step", 0))

    # -- building ------------------------------------------------------------------------------
    def _shard_groups(self) -> list | None:
        """The process groups to sum the clipping norm's squares over: those of the mesh dimensions the
        ``DTensor`` parameters are sharded on (none of the replicated ones); None for plain tensors."""
        params = [p for g in self.param_groups for p in g["params"]]
        dtensors = [p for p in params if is_dtensor(p)]
        if not dtensors:
            return None
        name = type(self).__name__
        if len(dtensors) != len(params):
            raise ValueError(
                f"{name} got DTensor parameters (FSDP2's) next to plain tensors; the gradient norm would count the "
                "plain ones once per rank. Shard the whole model (fully_shard on the root), or use torch's optimizer"
            )
        mesh, placements = dtensors[0].device_mesh, tuple(dtensors[0].placements)
        for p in dtensors:
            if p.device_mesh != mesh or tuple(p.placements) != placements:
                raise ValueError(
                    f"{name} needs every DTensor parameter on one device mesh with one placement, got "
                    f"{tuple(p.placements)} next to {placements}"
                )
        if any(pl.is_partial() for pl in placements):
            raise ValueError(f"{name} cannot update parameters with a Partial placement: {placements}")
        return [mesh.get_group(i) for i, pl in enumerate(placements) if not pl.is_replicate()]

    def _device_error(self, device: torch.device) -> str:
        return (
            f"{type(self).__name__} runs Triton kernels, which need a CUDA device; its parameters are on "
            f"{device}. Use the torch optimizer there (build_optimizer(impl='foreach')), or for tests set "
            "TRITON_INTERPRET=1 before trainer.optim.optimizers is imported."
        )

    def _build(self) -> None:
        """Lay parameters, gradients and states out in flat buffers; import any existing state."""
        saved = self._export_state()
        self._flats, self._bufs, self._steps, self._host_steps = [], [], [], []
        for gi, group in enumerate(self.param_groups):
            trainable = [p for p in group["params"] if p.requires_grad]
            for (dtype, device), ps in group_by_dtype_and_device(trainable).items():
                if not triton_can_run(device, self._kernel()):
                    raise ValueError(self._device_error(device))
                if dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    # The kernels compute in fp32: float64 parameters would lose precision.
                    raise ValueError(f"{type(self).__name__} supports fp32, bf16 and fp16 parameters, got {dtype}")
                if self.flat_grads:
                    flat = FlatGroup(ps)
                else:
                    in_place = self.sharded
                    flat = FlatGroup(ps, flat_grads=False, flat_params=not in_place, align=grad_table.BLOCK_SIZE)
                    flat.table = grad_table.GradTable(ps, flat.offsets, flat.numel, in_place=in_place)
                bufs = {k: flat.zeros(self._state_dtype(dtype)) for k in self.state_keys}
                # torch keeps a step per parameter; a flat group steps as one. They agree unless
                # some parameter never had a gradient, and then the group takes the largest.
                host_step = int(max((self._loaded_step(saved[p]) for p in ps if saved.get(p)), default=0))
                for p, *views in zip(ps, *(flat.views(b) for b in bufs.values())):
                    for key, view in zip(self.state_keys, views):
                        if saved.get(p, {}).get(key) is not None:
                            view.copy_(_local_like(saved[p][key], p))
                self._flats.append((gi, flat))
                self._bufs.append(bufs)
                self._steps.append(torch.full((), float(host_step), dtype=torch.float32, device=flat.device))
                self._host_steps.append(host_step)
        devices = {flat.device for _, flat in self._flats}
        if len(devices) > 1:
            raise ValueError(
                f"{type(self).__name__} needs all parameters on one device, got {sorted(map(str, devices))}"
            )
        device = devices.pop() if devices else torch.device("cpu")
        self._hparams_dev = [
            torch.zeros(len(self._hparams(g)), dtype=torch.float64, device=device) for g in self.param_groups
        ]
        self._hparams_host = [None] * len(self.param_groups)
        self._refresh_state()

    def _refresh_state(self) -> None:
        """Point ``self.state[p]`` at the live views (torch's layout: only once a step has happened)."""
        self.state = defaultdict(dict)
        for (gi, flat), bufs, step, host_step in zip(self._flats, self._bufs, self._steps, self._host_steps):
            if not self._has_state(self.param_groups[gi], host_step):
                continue
            per_key = {k: flat.views(b) for k, b in bufs.items()}
            for i, p in enumerate(flat.params):
                self.state[p] = {
                    **({"step": step} if self.state_has_step else {}),
                    **{k: _like_param(v[i], p) for k, v in per_key.items()},
                }

    def _export_state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Standalone copies of the per-parameter state (to survive a rebuild)."""
        out = {}
        for p, s in self.state.items():
            out[p] = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
        return out

    def _maybe_build(self) -> None:
        n_groups = len(self.param_groups)
        if (
            self._flats is None
            or len(self._hparams_dev) != n_groups
            or not all(flat.owns_params() for _, flat in self._flats)
        ):
            self._build()

    # -- the step ------------------------------------------------------------------------------
    def _sync_hparams(self) -> None:
        for gi, group in enumerate(self.param_groups):
            values = self._hparams(group)
            old = self._hparams_host[gi]
            if values != old:
                if capturing():
                    raise RuntimeError(
                        f"{type(self).__name__}: hyperparameters changed during a CUDA graph capture, where their "
                        "write would be frozen into the graph; call before_graph_replay() before capturing"
                    )
                dev = self._hparams_dev[gi]
                for i, v in enumerate(values):
                    if old is None or old[i] != v:
                        dev[i].fill_(v)  # a kernel launch with the value as argument: no host sync
                self._hparams_host[gi] = values

    @torch.no_grad()
    def step(self, closure=None):
        """Update every parameter: optional on-device grad-norm clipping, then one launch per flat group.

        Args:
            closure: Optional callable that re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._maybe_build()
        self._load_grads()
        self._sync_hparams()
        grad_norm, self._pending_norm = self._pending_norm, None
        if self.clips_grad_norm and grad_norm is None:
            grad_norm = self._global_norm()
        self.last_grad_norm = grad_norm
        if not self.clips_grad_norm:
            grad_norm = None
        for (gi, flat), bufs, step in zip(self._flats, self._bufs, self._steps):
            self._update(self.param_groups[gi], flat, bufs, step, self._hparams_dev[gi], grad_norm)
        if not capturing():  # a capture runs nothing: each replay counts its step
            self.after_graph_replay()
        return loss

    def before_graph_replay(self) -> None:
        """Write the hyperparameters (a schedule's new lr) to the device buffers a captured ``step()`` reads."""
        self._maybe_build()
        self._sync_hparams()

    def after_graph_replay(self) -> None:
        """Count a step on the host (``step()`` does; a replay of a captured one must): the device counters count
        themselves. After the first, torch's layout has per-parameter state."""
        self._host_steps = [h + 1 for h in self._host_steps]
        if any(h == 1 for h in self._host_steps):
            self._refresh_state()

    def _load_grads(self) -> None:
        for _, flat in self._flats:
            if self.flat_grads:
                flat.sync_grads()
            else:
                flat.table.load_grads()

    def _global_norm(self) -> torch.Tensor:
        if not self._flats:
            return torch.zeros((), dtype=torch.float32)
        if not self.flat_grads:
            return grad_table.tables_norm([flat.table for _, flat in self._flats], self._norm_groups or ())
        return grad_norm([flat.grad for _, flat in self._flats])

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the current gradients, a 0-dim fp32 device tensor (no host sync).

        The next ``step()`` clips with this norm instead of reading the gradients again, so call it
        after the last backward of the step (and after ``GradScaler.unscale_``), e.g. to skip a
        step whose norm is not finite. Without ``max_grad_norm`` it is only a measurement.
        """
        self._maybe_build()
        self._load_grads()
        self._pending_norm = self._global_norm()
        return self._pending_norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers in place (see the module docstring for why ``set_to_none`` is ignored);
        without flat gradients (or before the first step), ``torch.optim.Optimizer.zero_grad``."""
        self._pending_norm = None
        if self._flats is None or not self.flat_grads:
            super().zero_grad(set_to_none=set_to_none)
            return
        for _, flat in self._flats:
            flat.zero_grad()

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's layout: ``state[i] = {'step': cpu fp32 tensor, <state_keys>: tensors}``.

        Each parameter gets its own ``step`` tensor on the CPU (as torch's non-capturable
        optimizers keep it); sharing one tensor would make a torch optimizer that loads this
        increment it once per parameter. The other state tensors are live views, like torch's.
        """
        sd = super().state_dict()
        host_steps = {}
        for s in sd["state"].values():
            step = s.get("step")
            if isinstance(step, torch.Tensor) and id(step) not in host_steps:
                host_steps[id(step)] = step.detach().to("cpu", torch.float32)
        sd["state"] = {
            k: {**s, **({"step": host_steps[id(s["step"])].clone()} if "step" in s else {})}
            for k, s in sd["state"].items()
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint of this class or of the matching torch optimizer, before or mid-run.

        Mirrors ``torch.optim.Optimizer.load_state_dict`` (hooks, validation, group update) but copies
        states into the fp32 flat buffers instead of casting them to the parameter dtype, which for
        bf16 parameters would round the moments. Mid-run the values are copied into the buffers the
        optimizer already has (states, step counters, and the parameters stay where they are), so a
        CUDA graph that captured ``step()`` stays valid: call ``before_graph_replay()`` before the next
        replay, as after any change of hyperparameters.

        Raises:
            ValueError: The state dict does not fit: a different number of groups or parameters, a state
                tensor not of its parameter's shape, or a group setting this optimizer does not implement.
        """
        if capturing():
            raise RuntimeError(f"{type(self).__name__}.load_state_dict() during a CUDA graph capture")
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        groups = self.param_groups
        saved_groups = deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError(
                "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
            )
        id_map = dict(
            zip(
                chain.from_iterable(s["params"] for s in saved_groups), chain.from_iterable(g["params"] for g in groups)
            )
        )
        loaded = {id_map[k]: v for k, v in state_dict["state"].items() if k in id_map}
        for k, v in state_dict["state"].items():
            p = id_map.get(k)
            for key in self.state_keys:
                value = v.get(key) if p is not None else None
                if isinstance(value, torch.Tensor) and value.shape != p.shape:
                    raise ValueError(
                        f"optimizer state dict does not fit: state[{k!r}][{key!r}] has shape {tuple(value.shape)}, "
                        f"its parameter has {tuple(p.shape)}. Was it saved for another model? Load the checkpoint "
                        "of this model, or build the optimizer over the parameters it was saved with"
                    )
        for g, s in zip(groups, saved_groups):
            s["params"] = g["params"]
            if "param_names" in g and "param_names" not in s:
                s["param_names"] = g["param_names"]
            self._check_group(s)
        for g, s in zip(groups, saved_groups):  # in place: the group dicts stay the optimizer's own
            g.clear()
            g.update(s)
        if self._flats is None:
            # Snapshot now (torch's state_dict() hands out live tensors); copied into the flat buffers
            # when they are built, at the first step.
            self.state = defaultdict(
                dict,
                {
                    p: {n: (t.detach().clone() if isinstance(t, torch.Tensor) else t) for n, t in v.items()}
                    for p, v in loaded.items()
                },
            )
        else:
            self._copy_into_buffers(loaded)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    @torch.no_grad()
    def _copy_into_buffers(self, loaded: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Write loaded per-parameter states and step counts into the existing flat buffers (no new tensors).

        A parameter without loaded state starts from zero, as in a fresh optimizer; the step count of a
        flat group is the largest of its parameters', as when the buffers are built.
        """
        for i, ((_, flat), bufs) in enumerate(zip(self._flats, self._bufs)):
            host_step = int(max((self._loaded_step(loaded[p]) for p in flat.params if loaded.get(p)), default=0))
            for key, buf in bufs.items():
                # Per view, not zero_() first: the loaded tensors may be these very views (a round trip).
                for p, view in zip(flat.params, flat.views(buf)):
                    value = loaded.get(p, {}).get(key)
                    if value is None:
                        view.zero_()
                    else:
                        view.copy_(_local_like(value, p))
            self._steps[i].fill_(float(host_step))
            self._host_steps[i] = host_step
        self._refresh_state()

    def _check_group(self, group: dict[str, Any]) -> None:
        """Raise ``ValueError`` for a loaded group this optimizer cannot honour (e.g. amsgrad)."""


def _like_param(view: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A state tensor as torch's optimizers hold it for ``p``: for a ``DTensor`` parameter, a ``DTensor`` over it (the
    same memory, so DCP reads and writes the optimizer's own state) laid out as ``p``; else the tensor itself."""
    if not is_dtensor(p):
        return view
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(view, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)


def _local_like(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The part of a loaded state tensor that this rank keeps for ``p``: for a ``DTensor`` parameter its local
    shard (redistributed if the value is laid out otherwise; a whole plain tensor is sliced locally, without
    communication), else the value (a ``DTensor`` value gathered whole)."""
    if not is_dtensor(p):
        return value.full_tensor() if is_dtensor(value) else value
    from torch.distributed.tensor import distribute_tensor

    if not is_dtensor(value):
        value = distribute_tensor(value.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
    elif value.device_mesh != p.device_mesh or tuple(value.placements) != tuple(p.placements):
        value = value.redistribute(p.device_mesh, p.placements)
    return local_tensor(value)
