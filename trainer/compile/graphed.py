"""The graphed step: forward, backward, clipping and the optimizer step captured once as one CUDA graph.

After a few ordinary (compiled) steps have run every kernel once, :class:`GraphedStep` captures a
whole optimizer step — every micro-batch's forward and backward, ``clip_grad_norm_`` and
``optimizer.step()`` — into one ``torch.cuda.CUDAGraph``, reading its batch from static input
buffers. Each later step copies its batch into those buffers and replays the graph: one launch
instead of hundreds, and no Python between kernels.

What makes the replay equal to the ungraphed step:

- The optimizer runs with ``capturable=True`` and its learning rate in a device tensor, so the
  schedule's new value each step (``LRScheduler`` writes a tensor ``lr`` with ``fill_``) is read by
  the replayed kernels; the step counter lives on the device as well. trainer's Triton AdamW
  (``optim.impl=triton``) keeps its hyperparameters on the device anyway: its ``before_graph_replay``
  writes a changed lr there before each replay, and ``after_graph_replay`` counts the step on the host.
- Gradients are allocated inside the capture (they are None before it) from the graph's memory
  pool and rewritten by every replay; nothing may set them to None afterwards.
- Loss and gradient norm are static output tensors of the graph, rewritten by every replay; each
  call returns copies, so a caller may keep a step's values past the next replay (the loop reads a
  step's loss one step later, and a distributed run averages it over ranks then).
- The CUDA RNG is graph-safe (torch registers the default generator with the capture), so dropout
  draws fresh numbers on each replay.

Data parallel (``distributed.strategy=ddp``): the buckets' all-reduces are captured with the rest.
The hooks of :class:`~trainer.distributed.ddp.DataParallel` run once, during the capture, and leave
in the graph what they launched: each bucket's NCCL all-reduce (of its gradients in place, or of a
flat copy where one is needed) on NCCL's stream (forked from and joined back into the captured
stream by events, as in an eager step), and the wait before the gradients are read. Every rank
captures the same collectives in the same order, so the replays pair up. What it saves is host work
(Python gradient hooks, the graph pieces' wrappers, the all-reduce launches): where the host keeps
ahead of the GPU without it (GPT-2 124M under ddp), the graphed step runs at the ungraphed speed; it
pays where the host is the bottleneck.

Not supported (refused by the config): fp16 with a grad scaler (its skip-step logic reads the host),
``train.on_nan=skip`` and ``train.on_spike=skip`` (the update is inside the graph), FSDP (its hooks run Python
between kernels), ``distributed.shard_optimizer`` (its optimizer keeps a float lr and is not made capturable).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def requirements(
    *,
    strategy: str,
    backend: str,
    optim_impl: str,
    optim_name: str,
    precision: str,
    on_nan: str,
    on_spike: str,
    autograd: bool,
    dynamic: bool | None,
    mode: str,
    inductor_options: dict | None,
    shard_optimizer: bool,
    scope: str = "model",
    masks: str | None = None,
) -> list[tuple[bool, str, object, str]]:
    """``(unmet, key, value, what it needs)`` for each thing the graphed step needs of a run.

    Args:
        strategy: ``distributed.strategy`` as configured (none, ddp or fsdp).
        backend: ``distributed.backend`` as configured (auto, nccl or gloo).
        optim_impl: ``optim.impl``.
        optim_name: ``optim.name``.
        precision: ``train.precision``.
        on_nan: ``train.on_nan``.
        on_spike: ``train.on_spike``.
        autograd: ``compile.autograd``.
        dynamic: ``compile.dynamic``.
        mode: ``compile.mode``.
        inductor_options: ``compile.inductor_options``.
        shard_optimizer: ``distributed.shard_optimizer``.
        scope: ``compile.scope`` (as resolved: ``auto`` is neither).
        masks: why a ``model.hf`` model makes its attention mask between compiled blocks
            (:func:`trainer.models.hf.mask_between_blocks`); None where it makes none, or it is not known yet.
    """
    from trainer.compile.capture import inductor_options as options_of

    inductor_graphs = bool(options_of(mode, dict(inductor_options or {})).get("triton.cudagraphs"))
    return [
        (strategy == "fsdp", "distributed.strategy", strategy, "none or ddp (FSDP2's hooks run Python)"),
        (
            strategy == "ddp" and backend == "gloo",
            "distributed.backend",
            backend,
            "auto or nccl (gloo stages CUDA tensors through the host: nothing a graph can capture)",
        ),
        (
            optim_impl not in ("auto", "fused", "foreach", "triton"),
            "optim.impl",
            optim_impl,
            "auto, fused, foreach or triton",
        ),
        (on_nan == "skip", "train.on_nan", on_nan, "stop (the update happens inside the graph)"),
        (on_spike == "skip", "train.on_spike", on_spike, "stop or rollback (the update happens inside the graph)"),
        (precision == "fp16", "train.precision", precision, "bf16 or fp32 (no grad scaler in the graph)"),
        (autograd, "compile.autograd", autograd, "false"),
        (dynamic is True, "compile.dynamic", dynamic, "false or null (a graph has static shapes)"),
        (
            inductor_graphs,  # compile.mode's options, compile.inductor_options over them
            "compile.mode",
            mode,
            "default or max-autotune-no-cudagraphs, and no compile.inductor_options.triton.cudagraphs=true "
            "(Inductor's own CUDA graphs cannot nest in the step's graph)",
        ),
        (optim_name == "sgd", "optim.name", optim_name, "adamw or adam (torch's SGD has no capturable mode)"),
        (
            # Measured on an H200 (transformers 5.17): a mask made in eager code between the blocks is a new input
            # of every block inside the capture, which traces the blocks again and fails
            # (cudaErrorStreamCaptureInvalidated). With no mask made the blocks capture.
            scope == "blocks" and masks is not None,
            "compile.scope",
            scope,
            f"model for this model.hf model ({masks}: a new input of every compiled block, traced again inside "
            "the capture)",
        ),
        (
            shard_optimizer and strategy == "ddp",
            "distributed.shard_optimizer",
            shard_optimizer,
            "false (the sharded step's collectives and learning rate are not captured)",
        ),
    ]


def unmet_requirement(**settings) -> str | None:
    """What a run lacks for ``compile.cudagraphs=true``, as an error message; None if nothing. ``settings``: the
    keyword arguments of :func:`requirements`."""
    unmet = (f"compile.cudagraphs: needs {key}={needs}" for bad, key, _, needs in requirements(**settings) if bad)
    return next(unmet, None)


def blocker(compiled: bool, **settings) -> str | None:
    """Why ``compile.cudagraphs=auto`` leaves the graphed step off, in a few words; None if nothing does (the device
    aside). ``compiled``: ``compile.enabled`` as resolved; ``settings``: the keyword arguments of
    :func:`requirements`."""
    if not compiled:
        return "compile.enabled=false"
    unmet = next(((key, value, needs) for bad, key, value, needs in requirements(**settings) if bad), None)
    if unmet is None:
        return None
    key, value, needs = unmet
    return f"{key}={str(value).lower() if isinstance(value, bool) else value} (needs {needs})"


def make_capturable(opt: torch.optim.Optimizer) -> None:
    """Switch a torch optimizer to ``capturable=True`` with a device-tensor ``lr`` (before the first capture)."""
    device = next(p.device for g in opt.param_groups for p in g["params"])
    for group in opt.param_groups:
        if "capturable" not in group:
            raise ValueError(f"compile.cudagraphs: {type(opt).__name__} has no capturable mode")
        group["capturable"] = True
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
    for state in opt.state.values():  # steps taken so far: their counters move to the device
        if "step" in state and state["step"].device != device:
            state["step"] = state["step"].to(device)


def plain_lrs(optimizer_state: dict) -> dict:
    """An optimizer state dict as an ungraphed run keeps it: float lr, not capturable (readable by any run)."""
    for group in optimizer_state.get("param_groups", []):
        if isinstance(group.get("lr"), torch.Tensor):
            group["lr"] = float(group["lr"])
            group["capturable"] = False
    return optimizer_state


class GraphedStep:
    """One whole training step as a CUDA graph (see the module docstring).

    Args:
        step_fn: ``step_fn(inputs) -> (loss, grad_norm)``: runs every micro-batch's forward and
            backward (micro-batch ``i``: ``t[i]`` of each input), clips and steps the optimizer. It must not
            synchronise with the host.
        opt: the optimizer ``step_fn`` steps (:class:`trainer.step.StepOptimizer`): ``triton`` brings its replay hooks,
            torch's (hooks None) are made capturable here.
        inputs: the first batch to run, each ``(grad_accum, ...)`` (tokens and targets ``(grad_accum, micro_batch,
            seq_len)``; positions, weights where the batches have them); their shapes and dtypes are the static
            buffers'.
    """

    def __init__(self, step_fn: Callable, opt: torch.optim.Optimizer, params, inputs: list[torch.Tensor]):
        # trainer's Triton optimizers keep their hyperparameters on the device already: they are written before each
        # replay (a schedule's new lr) and the host counts the replays' steps; torch's are made capturable.
        self._before, self._after = opt.before_graph_replay, opt.after_graph_replay
        if self._before is None:
            make_capturable(opt)
        self.inputs = [t.clone() for t in inputs]
        for p in params:
            p.grad = None  # allocated by the captured backward, in the graph's pool
        if self._before is not None:
            self._before()
        self.graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph):
            self.loss, self.grad_norm = step_fn(self.inputs)

    def __call__(self, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one step on this batch; returns this replay's (loss, grad norm), copies the caller keeps."""
        got, captured = [tuple(t.shape) for t in inputs], [tuple(t.shape) for t in self.inputs]
        if got != captured:
            raise ValueError(f"graphed step: batch shapes {got} differ from the captured {captured}")
        for static, t in zip(self.inputs, inputs):
            static.copy_(t, non_blocking=True)
        if self._before is not None:
            self._before()
        self.graph.replay()
        if self._after is not None:
            self._after()
        return self.loss.clone(), None if self.grad_norm is None else self.grad_norm.clone()
