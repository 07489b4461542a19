"""The fit loop: build everything from the config, then accumulate, clip, step, schedule, evaluate, save.

Reads top to bottom like nanoGPT's train.py: :meth:`Trainer.fit` is the whole story; the
helpers below it each build one piece.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import signal
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from trainer import build
from trainer import checkpoint as ckpt
from trainer.config import Config, to_dict, to_yaml
from trainer.data import Batches, load_corpus
from trainer.distributed import env as dist_env
from trainer.distributed.fsdp import is_sharded
from trainer.metrics import Metrics, StepTimer, peak_flops
from trainer.models import build_model, flops_per_token, loss_of


class TrainingError(RuntimeError):
    """The run cannot go on (a NaN loss, too many recompiles); the message says why and what was kept."""


class Trainer:
    """Trains a model as a :class:`~trainer.config.Config` describes.

    Args:
        cfg: the validated config (see :func:`trainer.load_config`).
        resume: ``"last"``, a checkpoint path, or None for a fresh run.
    """

    def __init__(self, cfg: Config, resume: str | None = None):
        self.cfg = cfg
        self.resume = resume
        self._stop_requested = False
        self.splitter = None  # the DDP graph splitter, when one is used (for explain and tests)
        self.raw_model: nn.Module | None = None  # the unwrapped model, after fit()

    # ------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train for ``train.steps`` steps. Returns a summary (final loss, val loss, tokens/s, ...)."""
        cfg = self.cfg
        env = dist_env.setup(cfg.train.device, cfg.distributed.backend)
        try:
            with self._signals():
                return self._fit(cfg, env)
        finally:
            dist_env.teardown(env)

    def _fit(self, cfg: Config, env: dist_env.DistEnv) -> dict:
        device = env.device
        run_dir = Path(cfg.run.dir)
        if env.is_main:
            (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(to_yaml(cfg))
        _seed_everything(cfg.seed)
        compiling = cfg.compile.enabled or cfg.compile.autograd
        if compiling:
            from trainer.compile import cache

            cache.use_cache_dir(Path(cfg.compile.cache_dir) if cfg.compile.cache_dir else run_dir / "compile_cache")

        corpus = load_corpus(cfg.data.path, cfg.data.vocab_size, cfg.data.val_fraction, cfg.data.seq_len)
        batches = Batches(
            corpus,
            seq_len=cfg.data.seq_len,
            micro_batch_size=cfg.train.micro_batch_size,
            grad_accum=cfg.train.grad_accum,
            rank=env.rank,
            world_size=env.world_size,
            seed=cfg.seed,
            device=device,
        )
        m = cfg.model
        fused_loss = build.fused_loss(cfg, device)
        cross_entropy = build.cross_entropy(cfg, device)
        layer_norm = build.layer_norm(cfg, device)
        amp_dtype = build.amp_dtype(cfg.train.precision, device)
        build.check_attention(cfg, device, amp_dtype)
        raw_model = build_model(
            preset=m.preset, vocab_size=corpus.vocab_size, seq_len=cfg.data.seq_len, n_layer=m.n_layer,
            n_head=m.n_head, n_embd=m.n_embd, dropout=m.dropout, bias=m.bias, fused_loss=fused_loss,
            attention=m.attention, cross_entropy=cross_entropy, layer_norm=layer_norm, target=m.target,
            kwargs=dict(m.kwargs),
        ).to(device)  # fmt: skip
        scaler = torch.amp.GradScaler(device.type) if amp_dtype == torch.float16 else None
        if env.distributed and cfg.distributed.strategy == "fsdp":
            # Sharding replaces the parameters (DTensors): before the optimizer is built and state is loaded.
            build.shard(raw_model, cfg, amp_dtype, say=(lambda m: print(m, flush=True)) if env.is_main else None)
        opt = build.build_optimizer(raw_model, cfg, device)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, build.lr_lambda(cfg))

        start_step, tokens_seen = 0, 0
        if self.resume:
            start_step, tokens_seen = self._restore(raw_model, opt, sched, scaler, env, run_dir)
            # The compile bundle is generated code: load it only from this run's own directory.
            if compiling and cache.load_artifacts(run_dir / "checkpoints") and env.is_main:
                print("loaded the compile cache saved with the checkpoints", flush=True)

        metrics = Metrics(
            run_dir if env.is_main else None,
            total_steps=cfg.train.steps,
            progress=cfg.log.progress,
            tensorboard=cfg.log.tensorboard,
            start_step=start_step,
        )
        self.raw_model = raw_model
        model, self.splitter = build.wrap(raw_model, cfg, env, say=metrics.print)
        n_params = sum(p.numel() for p in raw_model.parameters())
        fpt = flops_per_token(raw_model, cfg.data.seq_len)
        peak = peak_flops(device, cfg.log.peak_flops)
        tokens_per_step = batches.global_batch * cfg.data.seq_len
        metrics.print(
            f"[bold]trainer[/bold] {cfg.run.name}: {n_params / 1e6:.2f}M params, {corpus.description}, "
            f"{len(corpus.train) / 1e6:.1f}M train tokens; device {device}"
            f"{f' x{env.world_size}' if env.distributed else ''}, {build.precision_name(amp_dtype)}, "
            f"compile {'on (' + cfg.compile.backend + ')' if cfg.compile.enabled else 'off'}"
            f"{', compiled autograd' if cfg.compile.autograd else ''}{', fused loss' if fused_loss else ''}"
            f"{', triton cross-entropy' if cross_entropy == 'triton' else ''}"
            f"{', triton add+layernorm' if layer_norm == 'triton' else ''}; "
            f"{cfg.train.steps} steps x {tokens_per_step} tokens; run dir {run_dir}"
        )

        autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext()
        accum = cfg.train.grad_accum
        backward_ctx = _backward_context(cfg)

        # 1/accum as a device tensor, not a Python number: compiled autograd lifts a Python scalar saved by
        # DivBackward into its graph, and torch 2.11's Inductor then called .item() on it in the generated
        # Triton code (seen on an H100). A tensor factor is an ordinary graph input.
        inv_accum = torch.tensor(1.0 / accum, device=device)

        def forward_backward(batch_of) -> torch.Tensor:
            """All micro-steps of one optimizer step (``batch_of(micro) -> (x, y)``); returns the mean loss."""
            loss_sum = None
            for micro in range(accum):
                x, y = batch_of(micro)
                with backward_ctx(), self._maybe_no_sync(model, micro < accum - 1):
                    with autocast:
                        loss = loss_of(model(x, y))
                    scaled = loss * inv_accum if accum > 1 else loss
                    (scaler.scale(scaled) if scaler else scaled).backward()
                loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()  # no zeros kernel
            return loss_sum / accum if accum > 1 else loss_sum

        graphs = cfg.compile.cudagraphs and device.type == "cuda"
        graphed = None

        def graph_step(xs: torch.Tensor, ys: torch.Tensor):
            """The whole step, as captured by :class:`~trainer.compile.graphed.GraphedStep`: no host syncs."""
            loss = forward_backward(lambda micro: (xs[micro], ys[micro]))
            norm = _finish_grad_sync(model, clips_itself)  # ddp: the all-reduces are in the graph, on NCCL's stream
            norm = _clip(raw_model, opt, cfg.optim.grad_clip, clips_itself, norm=norm)
            opt.step()
            return loss, norm

        watcher = _maybe_watch(compiling, cfg, metrics)
        clips_itself = getattr(opt, "clips_grad_norm", False)
        speed = StepTimer()
        last_saved, summary, evaluated = None, {}, False
        pending: dict | None = None  # the newest launched step; its loss is read (a host sync) one step later

        def resolve(p: dict, force_record: bool = False) -> dict | None:
            """Read a launched step's loss: NaN check, throughput, progress bar; its metrics record at log steps."""
            first = p["step"] == start_step + 1
            loss_f, norm_f = p["read"]()  # waits for this step's two numbers only, not for the queued next step
            speed.tick(tokens_per_step, first=first)
            if watcher is not None:
                _check_recompiles(watcher, p["step"], first=first)
            if not math.isfinite(loss_f):
                where = f"; the last good checkpoint is {last_saved}" if last_saved else ""
                raise TrainingError(
                    f"loss is {loss_f} at step {p['step']}: stopping without saving{where}. Lower optim.lr, raise "
                    "schedule.warmup_steps, check the data, or set train.on_nan=skip."
                )
            metrics.advance(p["step"], loss_f, speed.last_tps)
            if force_record or first or p["step"] % cfg.log.every == 0 or p["step"] == cfg.train.steps:
                tps, step_time = speed.read()
                record = {
                    "step": p["step"],
                    "loss": dist_env.all_reduce_mean(p["loss"], env).item() if env.distributed else loss_f,
                    "lr": p["lr"],
                    "grad_norm": norm_f,
                    "tokens_per_s": tps,
                    "step_time": step_time,
                    "tokens": p["tokens"],
                }
                if peak is not None:
                    record["mfu"] = fpt * tps / env.world_size / peak
                if device.type == "cuda":
                    record["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
                return record
            return None

        def _log(record: dict | None) -> None:
            if record is not None:
                metrics.log(record)
                summary.update(record)

        step = start_step
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        model.train()
        try:
            while step < cfg.train.steps:
                # This step's lr as a float from the schedule (a graphed step keeps the optimizer's in a tensor).
                lr = sched.base_lrs[0] * sched.lr_lambdas[0](sched.last_epoch)
                if graphs and step - start_step >= GRAPH_AFTER_STEPS:
                    xs, ys = _stacked(batches, step, accum)
                    if graphed is None:
                        from trainer.compile.graphed import GraphedStep

                        graphed = GraphedStep(graph_step, opt, raw_model.parameters(), xs, ys)
                        metrics.print(f"step {step + 1}: the whole step captured as one CUDA graph, replayed from here")
                    loss_val, grad_norm = graphed(xs, ys)
                    read = _copy_to_host(loss_val, grad_norm)
                else:
                    train_batch = functools.partial(batches.train_batch, step)  # (micro) -> (x, y)
                    try:
                        loss_val = forward_backward(train_batch)
                    except Exception as e:
                        if not _is_compile_failure(e):
                            raise
                        if cfg.compile.fallback == "error":
                            raise TrainingError(
                                compile_error_hint(e) + "\nSet compile.fallback=eager to run eagerly instead."
                            ) from e
                        metrics.print(
                            f"[bold red]compile failed at step {step + 1}; compile.fallback=eager: running this run "
                            f"eagerly (forward, backward and compiled autograd).[/bold red]\n{compile_error_hint(e)}"
                        )
                        if hasattr(model, "remove_hooks"):
                            model.remove_hooks()  # the new wrapper registers its own on the same parameters
                        model, _ = build.wrap(build.uncompiled(raw_model), cfg, env, say=metrics.print, compile=False)
                        backward_ctx = contextlib.nullcontext
                        opt.zero_grad(set_to_none=True)
                        loss_val = forward_backward(train_batch)
                    # ddp: waits for the bucket all-reduces started during the backward
                    norm = _finish_grad_sync(model, clips_itself or scaler is not None)
                    if scaler is not None:
                        scaler.unscale_(opt)
                    grad_norm = _clip(raw_model, opt, cfg.optim.grad_clip, clips_itself, scaler, norm)
                    read = _copy_to_host(loss_val, grad_norm)  # started now, read one step later
                    if cfg.train.on_nan == "skip" and not _all_finite(loss_val, grad_norm, env):  # syncs every step
                        opt.zero_grad(set_to_none=True)
                        skipped = "non-finite loss or gradient norm; update skipped"
                        metrics.print(f"[yellow]step {step + 1}: {skipped}[/yellow]")
                        step += 1
                        sched.step()
                        continue
                    if scaler is not None:
                        scaler.step(opt)
                        scaler.update()
                    else:
                        opt.step()
                    opt.zero_grad(set_to_none=True)
                sched.step()  # a graphed step reads the new lr from the optimizer's lr tensor, which this fills
                step += 1
                tokens_seen += tokens_per_step
                if pending is not None:
                    _log(resolve(pending))
                pending = {"step": step, "loss": loss_val, "read": read, "lr": lr, "tokens": tokens_seen}

                evaluate_now = step == cfg.train.steps or (cfg.train.eval_every and step % cfg.train.eval_every == 0)
                periodic = cfg.checkpoint.every and step % cfg.checkpoint.every == 0
                # One process checks its own flag every step; ranks agree on it at log steps (a collective).
                check_stop = not env.distributed or step % cfg.log.every == 0 or evaluate_now or periodic
                signalled = check_stop and dist_env.any_rank(self._stop_requested, env)  # on any rank
                stop = signalled or step == cfg.train.stop_at
                save_now = cfg.checkpoint.enabled and (stop or step == cfg.train.steps or periodic)
                record = None
                # On the CPU every op runs before the host moves on: reading one step late gains nothing there.
                if step == start_step + 1 or evaluate_now or save_now or stop or device.type != "cuda":
                    # The first step (its time is the compile time), and before anything reads the state.
                    record = resolve(pending, force_record=evaluate_now)
                    pending = None
                if evaluate_now:
                    # The first evaluation compiles its own (eval, no-grad) graph: expected, not a recompile.
                    first_eval = watcher.expect_compiles() if watcher and not evaluated else contextlib.nullcontext()
                    with first_eval:
                        val = self._evaluate(model, batches, autocast, env)
                    evaluated = True
                    record["val_loss"] = val
                _log(record)
                if save_now:
                    last_saved = self._save(raw_model, opt, sched, scaler, env, run_dir, step, tokens_seen, batches)
                if evaluate_now or save_now:
                    speed.restart()  # evaluation and saving are not training time
                if stop:
                    saved = f"checkpoint saved: {last_saved}" if save_now else "checkpoint.enabled=false: nothing saved"
                    why = "by signal" if signalled else "at train.stop_at"
                    metrics.print(f"[yellow]stopped {why} at step {step}; {saved}[/yellow]")
                    break
            if pending is not None:
                _log(resolve(pending))
        finally:
            _finish_watch(watcher, env, run_dir)
        metrics.close()
        summary.update(
            steps=step,
            first_step_s=speed.first_step_s,
            mean_tokens_per_s=speed.mean_tps,
            median_step_s=speed.median_step_s,
            run_dir=str(run_dir),
            checkpoint=str(last_saved) if last_saved else None,
            stopped=step < cfg.train.steps,
        )
        if device.type == "cuda":
            summary["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        return summary

    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _maybe_no_sync(model: nn.Module, skip_reduction: bool):
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: no reduce-scatter until the last micro-batch
            model.set_requires_gradient_sync(not skip_reduction)
            return contextlib.nullcontext()
        no_sync = getattr(model, "no_sync", None)
        return no_sync() if (skip_reduction and no_sync is not None) else contextlib.nullcontext()

    @torch.no_grad()
    def _evaluate(self, model: nn.Module, batches: Batches, autocast, env) -> float:
        model.eval()
        total = torch.zeros((), device=env.device)
        for i in range(self.cfg.train.eval_batches):
            x, y = batches.val_batch(i)
            with autocast:
                total += loss_of(model(x, y)).float()
        model.train()
        return dist_env.all_reduce_mean(total / self.cfg.train.eval_batches, env).item()

    def _save(self, raw_model, opt, sched, scaler, env, run_dir, step, tokens_seen, batches) -> Path:
        sharded = is_sharded(raw_model)
        optim_state = {"scheduler": sched.state_dict()}
        if not sharded:
            from trainer.compile.graphed import plain_lrs

            optim_state["optimizer"] = plain_lrs(opt.state_dict())  # a graphed step keeps lr in a tensor
        if scaler is not None:
            optim_state["scaler"] = scaler.state_dict()
        meta = {
            "step": step,
            "tokens_seen": tokens_seen,
            "sampler": batches.state_dict(next_step=step),
            "world_size": env.world_size,
            "config": to_dict(self.cfg),
        }
        barrier = (lambda: torch.distributed.barrier()) if env.distributed else (lambda: None)
        if env.is_main and (self.cfg.compile.enabled or self.cfg.compile.autograd):
            from trainer.compile import cache

            cache.save_artifacts(run_dir / "checkpoints")
        return ckpt.save(
            run_dir / "checkpoints",
            step=step,
            model_state=None if sharded else raw_model.state_dict(),
            optim_state=optim_state,
            meta=meta,
            rng=ckpt.rng_state(env.device),
            rank=env.rank,
            is_main=env.is_main,
            keep=self.cfg.checkpoint.keep,
            barrier=barrier,
            write_shards=_dcp_writer(raw_model, opt) if sharded else None,
        )

    def _restore(self, raw_model, opt, sched, scaler, env, run_dir) -> tuple[int, int]:
        path = ckpt.resolve(self.resume, run_dir)
        state = ckpt.load(path, rank=env.rank, device=env.device)
        meta = state["meta"]
        changes = ckpt.compare_configs(meta.get("config", {}), to_dict(self.cfg), path)
        if is_sharded(raw_model) and state["dcp"] is None:
            raise ckpt.CheckpointError(
                f"checkpoint {path} was written without fsdp (whole tensors in model.pt); resume it with "
                "distributed.strategy=ddp or none"
            )
        try:
            if state["dcp"] is not None:  # written under FSDP: resharded to this run's world size by DCP
                from trainer.distributed.fsdp import load_dcp

                load_dcp(state["dcp"], raw_model, opt)
            else:
                raw_model.load_state_dict(state["model"])
                opt.load_state_dict(state["optim"]["optimizer"])
            sched.load_state_dict(state["optim"]["scheduler"])
            if scaler is not None and "scaler" in state["optim"]:
                scaler.load_state_dict(state["optim"]["scaler"])
        except (RuntimeError, KeyError, ValueError) as e:
            raise ckpt.CheckpointError(f"checkpoint {path} does not fit this model/optimizer: {e}") from None
        # The schedule follows the current config (its lambdas are not in the checkpoint), so a changed
        # optim.lr or train.steps takes effect on resume; unchanged, the LR continues exactly.
        sched.base_lrs = [self.cfg.optim.lr for _ in sched.base_lrs]
        for group, lam in zip(opt.param_groups, sched.lr_lambdas):
            group["lr"] = self.cfg.optim.lr * lam(sched.last_epoch)
        if state["rng"] is not None:
            ckpt.set_rng_state(state["rng"], env.device)
        if env.is_main:
            print(f"resumed from {path} at step {meta['step']}", flush=True)
            for line in changes:
                if not line.startswith(("run.", "model.kwargs")):
                    print(f"  changed on resume: {line}", flush=True)
        return int(meta["step"]), int(meta.get("tokens_seen", 0))

    @contextlib.contextmanager
    def _signals(self):
        """SIGINT/SIGTERM: finish the current step, save a checkpoint, exit cleanly. A second SIGINT aborts."""

        def handler(signum, frame):
            if self._stop_requested and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self._stop_requested = True
            print(
                f"\n{signal.Signals(signum).name}: finishing this step and saving a checkpoint"
                + (" (Ctrl-C again to abort)" if signum == signal.SIGINT else ""),
                flush=True,
            )

        try:
            old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:  # not the main thread: leave signals alone
            yield
            return
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)


# ----------------------------------------------------------------------------------------------
# Ordinary (compiled) steps before the capture: every kernel compiled and run once, allocator warm.
GRAPH_AFTER_STEPS = 3


def _stacked(batches: Batches, step: int, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All micro-batches of a step as ``(accum, micro_batch, seq_len)`` tensors (the graphed step's input)."""
    pairs = [batches.train_batch(step, micro) for micro in range(accum)]
    return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])


def _dcp_writer(model: nn.Module, opt):
    def write(path: Path) -> None:
        from trainer.distributed.fsdp import save_dcp

        save_dcp(path, model, opt)

    return write


def _finish_grad_sync(model: nn.Module, own_norm: bool) -> torch.Tensor | None:
    """ddp: wait for the buckets' all-reduces; returns the gradients' global norm, computed bucket by bucket as
    the reductions finish (see ``DataParallel.finish_grad_sync``), unless ``own_norm`` (the optimizer computes
    its own, or fp16's scaled gradients are unscaled later). None without ddp."""
    finish = getattr(model, "finish_grad_sync", None)
    return finish(norm=not own_norm) if finish is not None else None


def _clip(model: nn.Module, opt, max_norm: float, clips_itself: bool, scaler=None, norm=None):
    """Clip by global norm unless the optimizer does it inside its kernel; returns the pre-clip norm.

    ``norm``: the gradients' global norm if already known (ddp computes it while reducing)."""
    if clips_itself:
        return opt.grad_norm()  # on device, no sync; the optimizer's step() clips with this same tensor
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:  # as clip_grad_norm_ of nothing: a zero norm when clipping, none logged otherwise
        return torch.zeros(()) if max_norm > 0 else None
    if norm is None:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if max_norm > 0 and scaler is None and _divides_by_grad_scale(opt, model):
        # torch's fused Adam/AdamW divide every gradient by `opt.grad_scale` inside their kernel (and
        # write it back): GradScaler's hook. Clipping through it saves clip_grad_norm_'s separate read and
        # write of every gradient (0.37 ms of a 35 ms gpt2-small step on an H100). The divisor is
        # 1 / clip_grad_norm_'s coefficient: the same clipped gradients to rounding.
        opt.grad_scale = torch.clamp((norm.float() + 1e-6) / max_norm, min=1.0)  # the kernel reads fp32
    elif max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: a DTensor, reduced over ranks


def _divides_by_grad_scale(opt, model: nn.Module) -> bool:
    """Whether ``opt.step()`` divides the gradients by ``opt.grad_scale``: torch's fused Adam/AdamW, not FSDP's
    DTensors (whose norm is a DTensor)."""
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    return all(g.get("fused") for g in opt.param_groups) and not is_sharded(model)


def _all_finite(loss: torch.Tensor, grad_norm, env) -> bool:
    ok = torch.isfinite(loss).all()
    if grad_norm is not None:
        ok = ok & torch.isfinite(torch.as_tensor(grad_norm, device=loss.device)).all()
    return not dist_env.any_rank(not bool(ok), env)


def _backward_context(cfg: Config):
    """A factory of the context each micro-step's forward and backward run in: compiled autograd or nothing."""
    if not cfg.compile.autograd:
        return contextlib.nullcontext
    from trainer.compile.autograd import compiled_autograd

    c = cfg.compile
    mode = c.mode if c.backend == "inductor" else None
    options = dict(c.inductor_options) or None
    return lambda: compiled_autograd(
        c.backend, mode=mode, dynamic=bool(c.dynamic), fullgraph=c.fullgraph, options=options
    )


def _copy_to_host(*values):
    """Start copying scalar tensors to the host; returns a function that waits for them alone and gives floats.

    ``tensor.item()`` would queue its copy behind everything launched since, so reading step k's loss after
    launching step k+1 would wait for step k+1 and leave the GPU idle while the host prepares step k+2. A
    non-blocking copy into pinned memory plus an event waits only for step k's own numbers.
    """
    present = [v for v in values if isinstance(v, torch.Tensor)]
    if not present or present[0].device.type != "cuda":
        return lambda: [float(v) if v is not None else None for v in values]
    host = torch.empty(len(present), dtype=torch.float32, pin_memory=True)
    host.copy_(torch.stack([v.detach().float().reshape(()) for v in present]), non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def read() -> list[float | None]:
        done.synchronize()
        it = iter(host.tolist())
        return [next(it) if isinstance(v, torch.Tensor) else (float(v) if v is not None else None) for v in values]

    return read


def _is_compile_failure(e: BaseException) -> bool:
    exc = getattr(getattr(torch, "_dynamo", None), "exc", None)
    return exc is not None and isinstance(e, exc.TorchDynamoException)


def compile_error_hint(e: BaseException) -> str:
    from trainer.compile.report import compile_error_hint

    return compile_error_hint(e)


def _maybe_watch(compiling: bool, cfg: Config, metrics: Metrics):
    """A compile watcher (graphs, breaks, recompiles, compile time) when anything is compiled, else None."""
    if not compiling:
        return None
    from trainer.compile.report import CompileWatcher

    def warn(rec: dict) -> None:
        metrics.print(f"[yellow]warning: {rec['message']}[/yellow]")

    return CompileWatcher(max_recompiles=cfg.compile.max_recompiles, on_recompile=warn).start()


def _check_recompiles(watcher, step: int, first: bool) -> None:
    """Warn on a recompile after warm-up; past compile.max_recompiles, stop the run."""
    from trainer.compile.report import RecompileLimitError

    if first:
        watcher.mark_warm()
        return
    try:
        watcher.check(step)
    except RecompileLimitError as e:
        raise TrainingError(str(e)) from None


def _finish_watch(watcher, env, run_dir: Path) -> None:
    if watcher is None:
        return
    watcher.stop()
    if env.is_main:
        watcher.write(run_dir / "compile_report.json")


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
