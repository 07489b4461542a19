"""One training step: every micro-batch's forward and backward, the gradient sync, clipping and the optimizer.

    step = TrainStep(model, raw_model, opt, grad_accum=4, grad_clip=1.0, amp_dtype=torch.bfloat16, ...)
    out = step(lambda micro: batches.train_batch(k, micro))    # -> StepOutput(loss, grad_norm, skipped)

The same object runs the step three ways:

- eager, or compiled: ``model`` is what :func:`trainer.build.wrap` returned (``torch.compile``d or not, wrapped for
  data parallelism or not); the micro-batches run one after another, gradients accumulate, and only the last
  micro-batch's backward reduces them (``no_sync``).
- graphed (``compile.cudagraphs``): after :data:`GRAPH_AFTER_STEPS` ordinary steps, which compile and run every
  kernel once, the whole step is captured as one CUDA graph (:class:`trainer.compile.graphed.GraphedStep`) and
  each later call copies its batch into the graph's inputs and replays it.

Nothing here waits for the GPU: the loss and the norm come back as device tensors (the caller reads them a step
later), except with ``skip_non_finite`` or ``spike_limit``, which must know before the update whether to skip it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from trainer import console
from trainer.distributed import env as dist_env
from trainer.distributed.ddp import replicas_differ
from trainer.distributed.fsdp import is_sharded
from trainer.distributed.sync import GradSync, NoSync
from trainer.errors import TrainingError
from trainer.faults import fault_point
from trainer.models import loss_of
from trainer.ops import warm

# Ordinary (compiled) steps before the capture: every kernel compiled and run once, the allocator warm.
GRAPH_AFTER_STEPS = 3

BatchOf = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
"""``batch_of(micro) -> (x, y)``, or ``(x, y, positions)`` under context parallel (a rank's slices of each
sequence and their positions in it): micro-batch ``micro`` of one step, on the device."""


def step_checks(watcher, env: dist_env.DistEnv, last_checkpoint: Callable[[], object], spikes=None):
    """``check(step, loss, first, ranks)`` for :class:`trainer.metrics.StepLog`: what every step's numbers must pass
    once read: few recompiles (``watcher``, :class:`trainer.compile.report.CompileWatcher`, or None), a finite loss
    on every rank (the error names the last checkpoint, ``last_checkpoint()``), no loss spike (``spikes``, a
    :class:`SpikeWatch`, or None)."""
    from trainer.compile.report import RecompileLimitError

    def check(step: int, loss: float, first: bool, ranks: list[int] | None) -> None:
        try:
            watcher and watcher.after_step(step, first)
        except RecompileLimitError as e:
            raise TrainingError(str(e)) from None
        if spikes is not None:
            spikes.see(step, loss, last_checkpoint())
        if not math.isfinite(loss):
            raise non_finite_loss(loss, step, ranks, env.world_size, last_checkpoint())

    return check


class SpikeWatch:
    """Loss spikes: a loss above the mean + ``sigma`` standard deviations of the last ``window`` losses (once that
    many are in), or a loss that is not finite. The losses are the ones the log reads (one step late on CUDA, the
    mean over ranks under torchrun): no host sync of its own, and the same decision on every rank. A spike stops
    the run (``action="stop"``) or raises :class:`trainer.errors.Rollback`; a spike's loss does not enter the
    window."""

    def __init__(self, window: int, sigma: float, action: str):
        from collections import deque

        self.losses: deque[float] = deque(maxlen=window)
        self.sigma, self.action = sigma, action

    def limit(self) -> tuple[float, str]:
        """The loss above which a step is a spike now (inf until the window is full), and what it is."""
        n = len(self.losses)
        if n < self.losses.maxlen:
            return math.inf, ""
        mean = sum(self.losses) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in self.losses) / (n - 1))
        return mean + self.sigma * std, f"the mean + {self.sigma:g} sigma of the last {n}"

    def see(self, step: int, loss: float, last) -> None:
        from trainer.errors import Rollback

        why, (limit, what) = None, self.limit()
        if not math.isfinite(loss):
            if self.action != "rollback":
                return  # the check's own error for a loss that is not finite (skip: the step skipped it)
            why = f"the loss is {loss}"
        elif loss > limit:
            why = f"{loss:.4f} > {limit:.4f}, {what}"
        if why is None or self.action == "skip":  # skip: the step compared its loss before its update
            if why is None:
                self.losses.append(loss)
            return
        if self.action == "rollback":
            raise Rollback(step, why)
        kept = f"; the last good checkpoint is {last}" if last else ""
        raise TrainingError(
            f"loss spike at step {step}: {why}: stopping without saving{kept}. train.on_spike=rollback goes back to "
            "the last checkpoint and passes over the batches since it.",
            all_ranks=True,
        )


def non_finite_loss(loss: float, step: int, ranks: list[int] | None, world_size: int, last) -> TrainingError:
    """The error that stops a run whose loss is not finite at ``step``: on every rank at once under torchrun
    (``ranks``: those whose own loss was not finite); ``last``: the last checkpoint saved, or None."""
    kept = f"; the last good checkpoint is {last}" if last else ""
    where = ""
    if ranks:
        names = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        where = f" ({names} of {world_size}; every rank stops at this step)"
    return TrainingError(
        f"loss is {loss} at step {step}: stopping without saving{kept}{where}. Lower optim.lr, raise "
        "schedule.warmup_steps, check the data, or set train.on_nan=skip.",
        all_ranks=ranks is not None,
    )


def check_replicas(model: nn.Module, env: dist_env.DistEnv, step: int, *, drift: bool = False) -> None:
    """Stop every rank at once if the ddp replicas' parameters differ (:func:`trainer.distributed.ddp.replicas_differ`).
    ``drift`` (tests): this rank's parameters first move away from the others'."""
    if drift:
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
    if why := replicas_differ(model.parameters(), env):
        raise TrainingError(f"step {step}: {why}: stopping without saving.", all_ranks=True)


class StepOptimizer(Protocol):
    """What the step needs of an optimizer beyond ``torch.optim.Optimizer``'s ``step`` and ``zero_grad``
    (:func:`trainer.optim.build_optimizer` and the sharded optimizer give it)."""

    clips_grad_norm: bool
    """It clips inside its own step, with the norm :meth:`grad_norm` gives (the step clips for it otherwise)."""
    before_graph_replay: Callable[[], None] | None
    """Called before a CUDA graph's capture and each replay (``triton``: the hyperparameters written to the device);
    None: the optimizer is made capturable instead (torch's)."""
    after_graph_replay: Callable[[], None] | None
    """Called after each replay (``triton``: the host's step count); None with ``before_graph_replay``."""

    def grad_norm(self) -> torch.Tensor:
        """The gradients' global norm, on the device (with ``clips_grad_norm``)."""

    def step(self) -> None: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...


class StepOutput(NamedTuple):
    loss: torch.Tensor
    """The mean loss over the step's micro-batches (this rank's), a device scalar. With weighted micro-batches (packed
    documents) the weighted sum: its mean over the ranks is the global batch's loss per target."""
    grad_norm: torch.Tensor | None
    """The global gradient norm before clipping, a device scalar (None when nothing reported one)."""
    skipped: str = ""
    """Why the update was skipped ("" when it was not): the loss or the norm was not finite (``train.on_nan=skip``),
    or the loss was a spike (``train.on_spike=skip``)."""


class TrainStep:
    """One optimizer step of ``model`` (see the module docstring): ``step(batch_of) -> StepOutput``.

    Args:
        model: the module to call: compiled and wrapped for data parallelism, or not.
        raw_model: the unwrapped model, whose parameters are clipped and whose gradients a graph captures.
        opt: the optimizer (:class:`StepOptimizer`).
        grad_accum: micro-batches per step.
        grad_clip: clip gradients to this global norm (0: the norm is measured, nothing is clipped).
        amp_dtype: the autocast dtype, or None for fp32.
        scaler: fp16's grad scaler (:func:`trainer.build.grad_scaler`), or None.
        env: the process environment (the device; the ranks agree on a skipped step).
        graphed: capture the whole step as one CUDA graph after :data:`GRAPH_AFTER_STEPS` ordinary steps.
        skip_non_finite: skip the update of a step whose loss or norm is not finite (one host sync per step).
        spike_limit: ``() -> (limit, what it is)``: skip the update of a step whose loss, the mean over ranks, is
            above ``limit`` or not finite (:meth:`SpikeWatch.limit`; one host sync per step); None: no such check.
        backward_ctx: a factory of the context each micro-step runs in (compiled autograd), or None.
        fallback: on a compile failure, ``fallback(model, sync) -> (eager model, its sync)`` to go on with; None
            stops the run.
        sync: how the gradients reach the other ranks (:mod:`trainer.distributed.sync`); None: one process.
        weighted: each micro-batch ends with its weight, which its loss is multiplied by in place of
            ``1 / grad_accum`` (packed documents: :mod:`trainer.packing`).
        eval_context: a factory of the context :meth:`evaluate` runs in (packed documents under FlexAttention:
            eager, with a dense mask), or None.
    """

    def __init__(
        self,
        model: nn.Module,
        raw_model: nn.Module,
        opt: StepOptimizer,
        *,
        grad_accum: int,
        grad_clip: float,
        amp_dtype: torch.dtype | None,
        env: dist_env.DistEnv,
        scaler=None,
        graphed: bool = False,
        skip_non_finite: bool = False,
        spike_limit: Callable[[], tuple[float, str]] | None = None,
        backward_ctx: Callable | None = None,
        fallback: Callable | None = None,
        sync: GradSync | None = None,
        weighted: bool = False,
        eval_context: Callable | None = None,
    ):
        self.model, self.raw_model, self.opt, self.env = model, raw_model, opt, env
        self.weighted, self.eval_context = weighted, eval_context or contextlib.nullcontext
        self.sync = sync or NoSync()
        self.accum, self.grad_clip = grad_accum, grad_clip
        self.graphed = graphed and env.device.type == "cuda"
        self.skip_non_finite, self.spike_limit = skip_non_finite, spike_limit
        self.backward_ctx = backward_ctx or contextlib.nullcontext
        self.fallback = fallback
        device = env.device
        self.autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else None
        self.scaler = scaler
        self.clips_itself = opt.clips_grad_norm
        # 1/accum as a device tensor, not a Python number: compiled autograd lifts a Python scalar saved by
        # DivBackward into its graph, and torch 2.11's Inductor then called .item() on it in the generated
        # Triton code (seen on an H100). A tensor factor is an ordinary graph input.
        self.inv_accum = torch.tensor(1.0 / grad_accum, device=device)
        self.calls = 0
        self.graph = None  # the captured step (a GraphedStep), once there is one

    def __call__(self, batch_of: BatchOf, step: int = 0) -> StepOutput:
        """Run one optimizer step on the micro-batches ``batch_of(0) ... batch_of(grad_accum - 1)`` (``step``: its
        number, for the fault points)."""
        self.calls += 1
        if self.graphed and self.calls > GRAPH_AFTER_STEPS:
            out = self._replay(batch_of)
            return out._replace(loss=out.loss * 10.0) if fault_point("spike", step, self.env.rank) else out
        loss = self._forward_backward_or_fall_back(batch_of)
        if self.calls == 1:
            warm.finish(wait_s=0)  # had no op of ours launched, nothing it compiles is used: it ends
        if fault_point("spike", step, self.env.rank):  # tests: this rank's loss spikes (as read; the update is not)
            loss = loss * 10.0
        norm = self._reduce_and_clip()
        if why := self._why_skipped(loss, norm):  # a host sync, when asked for
            self.opt.zero_grad(set_to_none=True)
            return StepOutput(loss, norm, skipped=why)
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return StepOutput(loss, norm)

    def _why_skipped(self, loss: torch.Tensor, norm) -> str:
        """Why this step's update is skipped (train.on_nan=skip, train.on_spike=skip); "" if it is not. The same
        answer on every rank: the loss compared is the mean over ranks, a non-finite loss on any rank skips."""
        if self.spike_limit is not None:
            limit, what = self.spike_limit()
            mean = dist_env.all_reduce_mean(loss.detach().float(), self.env)  # every rank gets the same value
            got = torch.stack([mean, torch.as_tensor(0.0 if norm is None else norm, device=mean.device).float()])
            mean, norm_ = got.tolist()  # the host sync
            if not (math.isfinite(mean) and math.isfinite(norm_)):
                return f"the loss (mean over ranks) is {mean:g} and the gradient norm {norm_:g}: a spike"
            if mean > limit:
                return f"loss spike: {mean:.4f} > {limit:.4f}, {what}"
            return ""
        if self.skip_non_finite and not _all_finite(loss, norm, self.env):
            return "non-finite loss or gradient norm"
        return ""

    def forward_backward(self, batch_of: BatchOf) -> torch.Tensor:
        """Every micro-batch's forward and backward (gradients accumulated, reduced on the last); the step's loss:
        the mean over the micro-batches, or with ``weighted`` batches the weighted sum."""
        loss_sum = None
        for micro in range(self.accum):
            batch, weight = self._split(batch_of(micro))  # (x, y[, positions]), the weight or None
            with self.backward_ctx(), self.sync.no_sync(micro < self.accum - 1):
                with self.autocast or contextlib.nullcontext():
                    loss = loss_of(self.model(*batch))
                factor = weight if weight is not None else self.inv_accum if self.accum > 1 else None
                scaled = loss if factor is None else loss * factor
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            part = loss.detach() if weight is None else loss.detach() * weight
            loss_sum = part if loss_sum is None else loss_sum + part  # no zeros kernel
        return loss_sum / self.accum if self.accum > 1 and not self.weighted else loss_sum

    def _split(self, batch: tuple) -> tuple[tuple, torch.Tensor | None]:
        """A micro-batch's model inputs and its weight (the last item, with ``weighted``; else None)."""
        return (tuple(batch[:-1]), batch[-1]) if self.weighted else (tuple(batch), None)

    @torch.no_grad()
    def evaluate(self, batch_of: BatchOf, n_batches: int) -> float:
        """The mean loss over ``batch_of(0) ... batch_of(n_batches - 1)`` in eval mode, averaged over ranks; a batch
        with a weight (packed documents) counts its loss times its weight (the mean over all of the targets)."""
        self.model.eval()
        total = torch.zeros((), device=self.env.device)
        with self.eval_context():
            for i in range(n_batches):
                batch, weight = self._split(batch_of(i))  # (x, y[, positions]), the weight or None
                with self.autocast or contextlib.nullcontext():
                    loss = loss_of(self.model(*batch)).float()
                total += loss if weight is None else loss * weight
        self.model.train()
        return dist_env.all_reduce_mean(total / n_batches, self.env).item()

    def _forward_backward_or_fall_back(self, batch_of: BatchOf) -> torch.Tensor:
        try:
            return self.forward_backward(batch_of)
        except Exception as e:
            if not _is_compile_failure(e):
                raise
            from trainer.compile.debug import compile_error_hint

            if self.fallback is None:
                raise TrainingError(f"{compile_error_hint(e)}\nSet compile.fallback=eager to run eagerly.") from e
            console.warn(
                "compile failed; compile.fallback=eager: running this run eagerly (forward, backward and compiled "
                f"autograd).\n{compile_error_hint(e)}"
            )
            (self.model, self.sync), self.backward_ctx = self.fallback(self.model, self.sync), contextlib.nullcontext
            self.opt.zero_grad(set_to_none=True)
            return self.forward_backward(batch_of)

    def _replay(self, batch_of: BatchOf) -> StepOutput:
        micros = [batch_of(micro) for micro in range(self.accum)]
        inputs = [torch.stack(items) for items in zip(*micros)]  # (accum, B, T) each; weights (accum,)
        if self.graph is None:
            from trainer.compile.graphed import GraphedStep

            self.graph = GraphedStep(self._graph_body, self.opt, self.raw_model.parameters(), inputs)
            console.info(
                f"the whole step captured as one CUDA graph after {GRAPH_AFTER_STEPS} ordinary steps, replayed"
            )
        return StepOutput(*self.graph(inputs))

    def _reduce_and_clip(self) -> torch.Tensor | None:
        """After the backward, in both paths: the gradients reduced over the ranks (ddp: waits for the bucket
        reductions started during the backward, and gives the norm computed on the way; in the graph they are
        captured), fp16's unscaled, then clipped; the norm before clipping."""
        norm = self.sync.finish(norm=not (self.clips_itself or self.scaler is not None))
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        return clip_gradients(self.raw_model, self.opt, self.grad_clip, self.clips_itself, self.scaler, norm)

    def _graph_body(self, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step as captured: no host syncs, no zero_grad (the captured backward writes the gradients)."""
        loss = self.forward_backward(lambda micro: tuple(t[micro] for t in inputs))
        norm = self._reduce_and_clip()
        self.opt.step()
        return loss, norm


def clip_gradients(model: nn.Module, opt, max_norm: float, clips_itself: bool, scaler=None, norm=None):
    """Clip by global norm unless the optimizer does it inside its kernel; returns the pre-clip norm.

    ``norm``: the gradients' global norm if already known (ddp computes it while reducing)."""
    if clips_itself:
        return opt.grad_norm()  # on device, no sync; the optimizer's step() clips with this same tensor
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:  # as clip_grad_norm_ of nothing: a zero norm when clipping, none logged otherwise
        return torch.zeros(()) if max_norm > 0 else None
    if norm is None:
        norm = total_norm(params)
    if max_norm > 0 and scaler is None and _divides_by_grad_scale(opt, model):
        # torch's fused Adam/AdamW divide every gradient by `opt.grad_scale` inside their kernel (and
        # write it back): GradScaler's hook. Clipping through it saves clip_grad_norm_'s separate read and
        # write of every gradient. The divisor is 1 / clip_grad_norm_'s coefficient: the same clipped gradients
        # to rounding.
        opt.grad_scale = torch.clamp((norm.float() + 1e-6) / max_norm, min=1.0)  # the kernel reads fp32
    elif max_norm > 0:
        for group in _by_mesh(params):  # one foreach op cannot mix DTensors of two meshes (tensor parallel)
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm  # FSDP: a DTensor, reduced over ranks


def _by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params`` grouped by their gradients' device mesh (one group without DTensors, or on one mesh)."""
    groups: dict = {}
    for p in params:
        groups.setdefault(id(p.grad.device_mesh) if isinstance(p.grad, DTensor) else None, []).append(p)
    return list(groups.values())


def total_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of ``params``' gradients: torch's ``get_total_norm`` (a DTensor under FSDP, reduced when
    read). With tensor parallel the gradients lie on two meshes (the FSDP x TP one of the split linears, FSDP's of
    the replicated norms and embeddings), which one DTensor reduction cannot mix: each mesh's norm is reduced over
    its own ranks, and the norms combine as ``sqrt(sum of squares)``, a plain tensor."""
    groups = _by_mesh(params)
    if len(groups) == 1:
        return torch.nn.utils.get_total_norm([p.grad for p in params])
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in groups]
    return torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))


def _divides_by_grad_scale(opt, model: nn.Module) -> bool:
    """Whether ``opt.step()`` divides the gradients by ``opt.grad_scale``: torch's fused Adam/AdamW, not FSDP's
    DTensors (whose norm is a DTensor)."""
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    return all(g.get("fused") for g in opt.param_groups) and not is_sharded(model)


def _all_finite(loss: torch.Tensor, grad_norm, env: dist_env.DistEnv) -> bool:
    ok = torch.isfinite(loss).all()
    if grad_norm is not None:
        ok = ok & torch.isfinite(torch.as_tensor(grad_norm, device=loss.device)).all()
    return not dist_env.any_rank(not bool(ok), env)


def _is_compile_failure(e: BaseException) -> bool:
    import torch._dynamo

    return isinstance(e, torch._dynamo.exc.TorchDynamoException)
