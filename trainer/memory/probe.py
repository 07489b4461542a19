"""The memory of a step measured on the host: the live tensor bytes of one real step of the model (the CPU's
probes for ``trainer explain --memory --measure``, and the tests' reference)."""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from trainer import console
from trainer.config import Config
from trainer.memory import MODES, Estimate, Point, model_on_meta, static_parts, step_transient


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensor storages every op inside creates while they live, on one device type, and
    their peak: the memory a step allocates on a device without an allocator's statistics (the CPU).

    Storages that existed before (parameters, gradients, optimizer state) are not counted: add them."""

    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type, self.live, self.peak = device_type, 0, 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }  # an in-place op's or a view's output is not new memory
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                if t.untyped_storage().data_ptr() not in inputs:
                    self._track(t.untyped_storage())
        return out

    def _track(self, storage) -> None:
        ptr = storage.data_ptr()
        if ptr in self._seen or storage.nbytes() == 0:
            return
        self._seen.add(ptr)
        n = storage.nbytes()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, ptr, n)

    def _free(self, ptr: int, n: int) -> None:
        self._seen.discard(ptr)
        self.live -= n


def cpu_estimate(cfg: Config, micro_batch: int) -> Estimate:
    """The estimate on the CPU: the counted parts, and each mode probed by :func:`cpu_peak` at ``micro_batch``."""
    from trainer.data import load_corpus

    corpus = load_corpus(
        cfg.data.path, cfg.data.vocab_size, cfg.data.val_fraction, cfg.data.seq_len, dtype=cfg.data.dtype
    )
    model = model_on_meta(cfg, corpus.vocab_size)
    est = Estimate(static_parts(model, cfg, 1, "cpu"), cfg.data.seq_len, transient=step_transient(model, cfg, 1, "cpu"))
    for mode in MODES:
        for b in (micro_batch, 2 * micro_batch):  # two micro-batches: the line's constant too
            est.points.append(Point(mode, b, cpu_peak(cfg, mode, b, corpus.vocab_size)))
    return est


def cpu_peak(cfg: Config, mode: str, micro_batch: int, vocab_size: int, parts: dict | None = None) -> float:
    """The peak bytes of the forward and backward of the second training step of ``cfg`` at ``micro_batch`` in
    ``mode`` on the CPU: the tensors alive before it (parameters, optimizer state) and the peak of those it
    creates until the update. ``parts``, if given, receives the bytes of the parameters, gradients and optimizer
    state as the step leaves them, and ``step``: the peak of the whole step, the update's temporaries included."""
    import copy

    from trainer import build, plan
    from trainer.distributed.env import DistEnv

    cfg = copy.deepcopy(cfg)
    cfg.train.micro_batch_size, cfg.train.grad_accum, cfg.train.activation_checkpointing = micro_batch, 1, mode
    cfg.train.global_batch_size = None  # one micro-batch a step, whatever the run's global batch
    cfg.train.device = "cpu"
    p = plan.one_process(cfg, "cpu")
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=p.device, backend=None)
    torch.manual_seed(0)
    with console.quiet():  # a probe: what building and stepping the model would say is the run's to say
        model = build.make_model(p, vocab_size, env)
        opt = build.make_optimizer(model, p)
        wrapped, _ = build.wrap(model, p, env, opt=opt)
        step = build.train_step(wrapped, model, opt, None, p, env)
        x = torch.randint(0, vocab_size, (micro_batch, cfg.data.seq_len))
        batch = lambda _i: (x, x)  # noqa: E731
        step(batch)  # the first step creates the gradients and the optimizer state
    before = _storage_bytes(existing(model, opt))
    grads = {}  # each parameter's gradient as the backward leaves it (the step may drop them after the update)
    hooks = [q.register_post_accumulate_grad_hook(lambda q: grads.__setitem__(q, q.grad)) for q in model.parameters()]
    update, backward_peak = opt.step, []

    def step_after_backward(*args, **kwargs):  # the peak of the forward and backward, before the update
        backward_peak.append(live.peak)
        return update(*args, **kwargs)

    opt.step = step_after_backward
    with console.quiet(), LiveBytes("cpu") as live:
        step(batch)
    opt.step = update
    for h in hooks:
        h.remove()
    if parts is not None:
        parts["step"] = before + live.peak
        parts["parameters"] = _storage_bytes(list(model.parameters()))
        parts["gradients"] = _storage_bytes(list(grads.values()))
        parts["optimizer state"] = _storage_bytes(
            [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
        )
    return before + backward_peak[0]


def existing(model: nn.Module, opt) -> list[torch.Tensor]:
    """The parameters, their gradients and the optimizer's state tensors."""
    ts = [*model.parameters(), *(q.grad for q in model.parameters() if q.grad is not None)]
    ts += [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return ts


def _storage_bytes(tensors) -> int:
    seen, n = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            n += st.nbytes()
    return n
