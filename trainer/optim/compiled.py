"""Compiled optimizer drop-in (``compile_optimizer``): any torch optimizer, its step compiled.

``compile_optimizer(opt)`` returns a ``torch.optim.Optimizer`` that shares ``opt``'s param groups
and state and runs a ``torch.compile``-d copy of its step. What it does that a bare
``torch.compile(opt.step)`` does not:

- Scalars that schedulers change live in device tensors: ``lr`` always, ``betas`` for
  Adam/AdamW/Adamax (the only optimizers whose compiled step takes tensor betas). Users and
  schedulers still see Python floats in ``param_groups``; before each step the drop-in copies a
  changed float into its tensor with ``fill_`` (no recompile, no host sync). Any other
  hyperparameter stays a Python constant in the graph: changing it (SGD ``momentum`` under
  OneCycleLR, say) recompiles, and past Dynamo's recompile limit the drop-in warns and runs eagerly.
- The step runs with ``capturable=True`` and ``foreach=True`` in private copies of the groups, so a
  tensor ``lr`` is legal, the bias correction stays on the device, and on CUDA torch's functional
  optimizers do not drop to eager (they do for non-capturable steps on CUDA; Adagrad has no
  ``capturable`` flag, so on CUDA it may fall back, with a warning).
- The undecorated ``step`` is compiled under ``torch.no_grad()`` with ``fullgraph=True``: no graph
  breaks (torch's ``_use_grad_for_differentiable`` inserts two), so a failure to compile shows up
  at once and the drop-in falls back to the eager optimizer and says why, once.
- ``load_state_dict`` copies a checkpoint into the state tensors the step was compiled with (Dynamo guards
  on their identity) and checks their shapes, so a checkpoint loaded mid-run recompiles nothing.
- Each drop-in compiles its own code object. Dynamo caches per code object and gives up on a frame
  after ``torch._dynamo.config.recompile_limit`` (8) entries, and every optimizer instance shares
  ``Optimizer.step``'s code: Dynamo would stop compiling the ninth and later optimizers in a process.

Compile time grows with the number of parameter tensors (tens of seconds for GPT-2's 148 on
Inductor): for CUDA training, :func:`trainer.optim.build_optimizer` with ``impl="triton"`` (what ``auto`` picks
there for Adam(W)) avoids it with trainer's Triton kernels: no compile, one launch for the whole step.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import types
from typing import Any

import torch

from trainer import console

# Keys of each torch optimizer that become device tensors, found by compiling each optimizer with
# each candidate key as a tensor (torch 2.13): the others either break the graph (SGD momentum,
# NAdam betas) or fail in the functional code (weight_decay, eps everywhere).
_TENSOR_KEYS: dict[type, tuple[str, ...]] = {
    torch.optim.SGD: ("lr",),
    torch.optim.Adam: ("lr", "betas"),
    torch.optim.AdamW: ("lr", "betas"),
    torch.optim.Adamax: ("lr", "betas"),
    torch.optim.RMSprop: ("lr",),
    torch.optim.Adagrad: ("lr",),
    torch.optim.Adadelta: ("lr",),
    torch.optim.NAdam: ("lr",),
    torch.optim.RAdam: ("lr",),
    torch.optim.ASGD: ("lr",),
    torch.optim.Rprop: ("lr",),
}
if hasattr(torch.optim, "Muon"):  # torch >= 2.9
    _TENSOR_KEYS[torch.optim.Muon] = ("lr",)

_EAGER_ONLY: dict[str, str] = {
    "LBFGS": "it re-evaluates the closure many times per step",
    "SparseAdam": "it works on sparse gradients",
    "Adafactor": "its step reads a tensor value on the host (.item()), which cannot be captured",
}

# Raised by torch.compile when it cannot (or will no longer) compile; errors of the compiled code
# itself (NaN checks, OOM) are other types and propagate.
_COMPILE_ERRORS: tuple[type[BaseException], ...] = tuple(
    e
    for e in (
        getattr(torch._dynamo.exc, "TorchDynamoException", None),
        getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", None),
    )
    if e is not None
)
# Keys forced in the private groups of the compiled step. ``fused`` as well: a checkpoint of torch's fused
# optimizer loads ``fused=True`` into the groups, and its kernel is a graph break (the drop-in would fall back).
_FORCED = {"capturable": True, "foreach": True, "fused": None}

_warned: set[str] = set()
_instances = itertools.count()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        console.warn(message)


def _why_eager(opt: torch.optim.Optimizer) -> str | None:
    """Why ``opt`` must run eagerly, or ``None`` if its step can be compiled."""
    cls = type(opt)
    if cls.__name__ in _EAGER_ONLY and cls.__module__.startswith("torch.optim"):
        return f"{cls.__name__} is not compiled: {_EAGER_ONLY[cls.__name__]}"
    if cls not in _TENSOR_KEYS:
        return (
            f"{cls.__module__}.{cls.__qualname__} is not one of torch's optimizers known to compile "
            f"({', '.join(sorted(c.__name__ for c in _TENSOR_KEYS))}); it runs eagerly"
        )
    for group in opt.param_groups:
        if group.get("fused"):
            return f"{cls.__name__}(fused=True) already runs one fused kernel (and is a graph break); it runs eagerly"
        if group.get("differentiable"):
            return f"{cls.__name__}(differentiable=True) is not compiled; it runs eagerly"
    return None


def _step_template(optimizer: torch.optim.Optimizer, raw_step: Any) -> None:
    raw_step(optimizer)


def _fresh_step_fn() -> types.FunctionType:
    """A copy of ``_step_template`` with its own code object, hence its own Dynamo cache."""
    code = _step_template.__code__.replace(co_name=f"compiled_optimizer_step_{next(_instances)}")
    return types.FunctionType(code, _step_template.__globals__, code.co_name)


def _update_groups(groups: list[dict[str, Any]], loaded: list[dict[str, Any]]) -> None:
    """Make each of ``groups`` equal to its loaded group, in place (anyone holding a group sees the load).

    The compiled step reads the private copies (``_sync_shadows`` writes a loaded ``lr`` into their tensors),
    so the values themselves are the loaded ones, as torch's ``load_state_dict`` leaves them.
    """
    for group, new in zip(groups, loaded):
        group.clear()
        group.update(new)


def _update_state(state: dict[Any, dict[str, Any]], loaded: dict[Any, dict[str, Any]]) -> None:
    """Make ``state`` (in place) equal to ``loaded``, copying into the tensors it holds already.

    Shapes were checked before loading; a state tensor is kept wherever the loaded value is a tensor of its
    shape, and takes the value with ``copy_`` (cast to its dtype, moved to its device).
    """
    for p in [p for p in state if p not in loaded]:
        del state[p]
    for p, new in loaded.items():
        live = state.get(p)
        if live is None:
            state[p] = new
            continue
        for key in [key for key in live if key not in new]:
            del live[key]
        for key, value in new.items():
            old = live.get(key)
            if isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) and old.shape == value.shape:
                if old is not value:
                    old.copy_(value)
            else:
                live[key] = value


class CompiledOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that runs another optimizer's step compiled.

    It shares ``param_groups``, ``state`` and ``defaults`` with the wrapped optimizer (one set of
    dicts: a scheduler built on either sees the same values), so ``state_dict()`` /
    ``load_state_dict()`` interchange with the eager optimizer in both directions and every LR
    scheduler, ReduceLROnPlateau included, accepts it. Build it with :func:`compile_optimizer`.

    Attributes:
        optimizer: The wrapped (eager) optimizer.
        compiled: Whether steps run compiled (false after a fallback to eager).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        backend: str | Any = "inductor",
        mode: str | None = None,
        options: dict[str, Any] | None = None,
        fullgraph: bool = True,
    ):
        if isinstance(optimizer, CompiledOptimizer):
            raise ValueError("this optimizer is compiled already")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"compile_optimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        # Optimizer.__init__ wires the hook dicts and the step profiler; groups and state are then
        # replaced by the wrapped optimizer's own objects.
        super().__init__([{"params": []}], {})
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._shadows: list[dict[str, Any]] = []
        self._last: list[dict[str, Any]] = []
        self._inner: torch.optim.Optimizer | None = None
        self._compiled_fn = None
        reason = _why_eager(optimizer)
        if reason is not None:
            _warn_once(reason)
            return
        self._tensor_keys = _TENSOR_KEYS[type(optimizer)]
        # A shallow copy steps on private groups (tensor hyperparameters, capturable) and the shared state.
        self._inner = copy.copy(optimizer)
        self._inner.state = self.state
        self._raw_step = inspect.unwrap(type(optimizer).step)
        kwargs: dict[str, Any] = {"backend": backend, "fullgraph": fullgraph}
        if mode is not None:
            kwargs["mode"] = mode
        if options is not None:
            kwargs["options"] = options
        self._compiled_fn = torch.compile(_fresh_step_fn(), **kwargs)

    @property
    def compiled(self) -> bool:
        return self._compiled_fn is not None

    def __repr__(self) -> str:
        return f"Compiled{self.optimizer!r}" if self.compiled else repr(self.optimizer)

    # -- private groups ------------------------------------------------------------------------
    def _build_shadows(self) -> None:
        self._shadows, self._last = [], []
        for group in self.param_groups:
            device = group["params"][0].device if group["params"] else torch.device("cpu")
            shadow = {k: group[k] for k in self.optimizer.defaults if k in group}
            shadow["params"] = group["params"]
            for key, value in _FORCED.items():
                if key in shadow:
                    shadow[key] = value
            last: dict[str, Any] = {}
            for key in self._tensor_keys:
                value = group[key]
                if isinstance(value, (tuple, list)):
                    shadow[key] = tuple(torch.tensor(float(v), dtype=torch.float32, device=device) for v in value)
                else:
                    shadow[key] = torch.tensor(float(value), dtype=torch.float32, device=device)
                last[key] = value
            self._shadows.append(shadow)
            self._last.append(last)
        self._inner.param_groups = self._shadows
        self._steps_to_device()

    def _steps_to_device(self) -> None:
        # capturable keeps `step` on the parameter's device; an eager checkpoint keeps it on the CPU.
        for p, s in self.state.items():
            step = s.get("step") if isinstance(s, dict) else None
            if isinstance(step, torch.Tensor) and step.device != p.device and "capturable" in self.optimizer.defaults:
                s["step"] = step.to(p.device)

    def _sync_shadows(self) -> None:
        """Copy the user-visible groups into the private ones: floats into tensors, the rest as is."""
        if len(self._shadows) != len(self.param_groups) or any(
            s["params"] is not g["params"] for s, g in zip(self._shadows, self.param_groups)
        ):
            self._build_shadows()
        for group, shadow, last in zip(self.param_groups, self._shadows, self._last):
            for key in shadow:
                if key not in last and key not in _FORCED and key != "params" and shadow[key] is not group[key]:
                    shadow[key] = group[key]
            for key, old in last.items():
                value = group[key]
                targets = shadow[key] if isinstance(shadow[key], tuple) else (shadow[key],)
                values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
                if any(isinstance(v, torch.Tensor) for v in values):
                    # The user's own tensor: copy on the device (comparing it would sync).
                    for t, v in zip(targets, values):
                        t.copy_(v)
                    last[key] = None
                elif value != old:
                    for t, v in zip(targets, values):
                        t.fill_(float(v))
                    last[key] = value

    def _fall_back(self, reason: str) -> None:
        _warn_once(f"compile_optimizer: {reason}; {type(self.optimizer).__name__} runs eagerly from now on")
        self._compiled_fn = None

    # -- the optimizer API ---------------------------------------------------------------------
    def step(self, closure=None):
        """Run the wrapped optimizer's step, compiled.

        Args:
            closure: Optional callable that re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or ``None``.
        """
        if self._compiled_fn is None:
            return self.optimizer.step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_shadows()
        try:
            with torch.no_grad():
                self._compiled_fn(self._inner, self._raw_step)
        except _COMPILE_ERRORS as e:
            # Compilation happens before the graph runs, so nothing has been updated yet.
            self._fall_back(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            self.optimizer.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint of the wrapped optimizer's class (from the drop-in or the eager optimizer).

        Loading goes through the wrapped optimizer, so its class's ``__setstate__`` fixes up old checkpoints
        exactly as it would eagerly. The loaded values are then copied into the state tensors and param groups
        the drop-in already has (``copy_``: dtype, device and identity kept), because the compiled step guards
        on the identity of every state tensor: a checkpoint loaded mid-run, in a live process, recompiles
        nothing. State the drop-in does not hold yet (before the first step) is taken over as torch takes it
        (the loaded tensors themselves: deep-copy a live optimizer's ``state_dict()`` first).

        Raises:
            ValueError: The state dict does not fit: a different number of groups or parameters (torch's
                check), or a state tensor whose shape is not that of the state or parameter it loads into.
        """
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._check_state_shapes(state_dict)
        groups, state = self.param_groups, self.state
        self.optimizer.load_state_dict(state_dict)
        _update_groups(groups, self.optimizer.param_groups)
        with torch.no_grad():
            _update_state(state, self.optimizer.state)
        self.optimizer.param_groups, self.optimizer.state = groups, state
        if self._inner is not None:
            self._steps_to_device()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _check_state_shapes(self, state_dict: dict[str, Any]) -> None:
        """Raise ``ValueError`` for a loaded state tensor whose shape differs from the one it replaces.

        torch checks only the number of parameters per group; a state of another model's shapes would load
        and fail later inside the step (or broadcast silently). Before the first step a tensor is checked
        against its parameter's shape: every non-scalar state of the optimizers compiled here has it.
        """
        saved_groups = state_dict.get("param_groups", [])
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)
        ):
            return  # the wrapped optimizer raises torch's own error
        index = {
            k: (gi, p)
            for gi, (s, g) in enumerate(zip(saved_groups, self.param_groups))
            for k, p in zip(s["params"], g["params"])
        }
        for k, saved in state_dict.get("state", {}).items():
            if k not in index or not isinstance(saved, dict):
                continue
            gi, p = index[k]
            live = self.state.get(p, {})
            for key, value in saved.items():
                if not isinstance(value, torch.Tensor):
                    continue
                old = live.get(key)
                if isinstance(old, torch.Tensor):
                    expected, what = old.shape, "the state it replaces"
                elif self._inner is not None and value.dim() > 0:
                    expected, what = p.shape, "its parameter"
                else:
                    continue
                if value.shape != expected:
                    raise ValueError(
                        f"optimizer state dict does not fit: state[{k!r}][{key!r}] (param group {gi}) has shape "
                        f"{tuple(value.shape)}, {what} has {tuple(expected)}. Was it saved for another model? Load "
                        "the checkpoint of this model, or build the optimizer over the parameters it was saved with"
                    )


def compile_optimizer(
    opt: torch.optim.Optimizer,
    *,
    backend: str | Any = "inductor",
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    fullgraph: bool = True,
) -> torch.optim.Optimizer:
    """Wrap ``opt`` in a drop-in whose step is compiled and whose scheduled scalars never recompile.

    Use the returned object in place of ``opt`` (step, zero_grad, schedulers, checkpoints); the two
    share param groups and state. Optimizers that cannot be compiled (LBFGS, SparseAdam, Adafactor,
    ``fused=True``, ``differentiable=True``, classes not from ``torch.optim``) run eagerly, with one
    warning saying why.

    Args:
        opt: Any ``torch.optim.Optimizer``.
        backend: ``torch.compile`` backend ("inductor", "aot_eager", or a callable).
        mode: ``torch.compile`` mode (Inductor only).
        options: ``torch.compile`` options (Inductor only).
        fullgraph: Compile the step as one graph and fall back to eager if that fails (default);
            false lets Dynamo split the step at graph breaks instead.

    Returns:
        A :class:`CompiledOptimizer` (a ``torch.optim.Optimizer``).

    Example::

        opt = compile_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    """
    return CompiledOptimizer(opt, backend=backend, mode=mode, options=options, fullgraph=fullgraph)
