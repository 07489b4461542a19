"""The fit loop: build the run from the config, then step, log, evaluate and checkpoint until ``train.steps``.

Reads top to bottom like nanoGPT's train.py. The pieces live beside it: the step in :mod:`trainer.step`, the
logging in :mod:`trainer.metrics`, checkpoints in :mod:`trainer.checkpoint`, building in :mod:`trainer.build`."""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
from pathlib import Path
from types import SimpleNamespace

from torch.optim.lr_scheduler import LambdaLR

from trainer import build, console, describe, memory, plan
from trainer.checkpoint import DCP, TORCH_SAVE, Checkpointer, ReadAhead, rundir
from trainer.checkpoint.states import CompileCache, run_states
from trainer.config import Config, to_dict
from trainer.data import load_corpus
from trainer.distributed import env as dist_env
from trainer.errors import Rollback, TrainingError
from trainer.faults import fault_point
from trainer.metrics import Metrics, StepLog, peak_flops
from trainer.models import flops_per_token
from trainer.step import SpikeWatch, check_replicas, step_checks

__all__ = ["Trainer", "TrainingError"]


class Trainer:
    """Trains a model as a :class:`~trainer.config.Config` describes.

    Args:
        cfg: the validated config (see :func:`trainer.load_config`).
        resume: ``"last"``, a checkpoint path, ``"auto"`` (run.dir's last checkpoint, if any), or None (fresh).
    """

    def __init__(self, cfg: Config, resume: str | None = None):
        self.cfg, self.resume = cfg, resume
        self.splitter = None  # the DDP graph splitter, when one is used (for explain and tests)
        self.raw_model = self.plan = None  # the unwrapped model and the run's plan (trainer.plan.Plan), after fit()

    def fit(self) -> dict:
        """Train for ``train.steps`` steps. Returns a summary (final loss, val loss, tokens/s, ...)."""
        run, dist = self.cfg.run, self.cfg.distributed
        env = dist_env.setup(self.cfg.train.device, dist.backend, dist.timeout_s)
        # The run directory held (refused if it holds another run), stop signals caught, a lost rank named.
        claim = rundir.claim(Path(run.dir), resume=self.resume, overwrite=run.overwrite, env=env)
        lost = dist_env.lost_rank_stops(env, dist.timeout_s, TrainingError)
        try:
            with claim as start, dist_env.StopSignals(env) as signals, lost:
                for rollbacks in itertools.count():  # train.on_spike=rollback: again from the last checkpoint
                    try:
                        return self._fit(env, signals, start)
                    except Rollback as spike:
                        self.raw_model = self.plan = self.splitter = None  # the run given up: its memory freed
                        start = rundir.roll_back(self.cfg, env, spike, rollbacks)
        finally:
            dist_env.teardown(env, failed=sys.exc_info()[0] is not None)  # an exception on its way out

    def _fit(self, env: dist_env.DistEnv, signals: dist_env.StopSignals, start: rundir.Start) -> dict:
        # A resume's files read while the run builds; every auto once, the mesh built (a resume keeps its batch).
        ahead = ReadAhead(start.resume, Path(self.cfg.run.dir), env) if start.resume else None
        resolved = plan.resolve(self.cfg, env, plan.SavedBatch.read(start.resume)).with_device_mesh()
        cfg, run_dir, record = resolved.cfg, Path(resolved.cfg.run.dir), to_dict(resolved.run_config())  # config.yaml's
        threads = build.set_up_process(cfg, env.device)  # the seeds, torch's threads
        compiling = build.compile_caches(resolved, run_dir)  # and Triton's compile workers started
        # The data, the model (checked against the data) and its layout, the optimizer; a resume's state.
        corpus = load_corpus(cfg.data.path, cfg.data.vocab_size, cfg.data.val_fraction, cfg.data.seq_len,
                             dtype=cfg.data.dtype)  # fmt: skip
        batches = build.batches(resolved, corpus, env)
        self.raw_model = raw_model = build.make_model(resolved, corpus.vocab_size, env, resume=ahead is not None)
        self.plan = resolved = resolved.placed(raw_model)  # the bucket plan or the FSDP units
        if env.is_main:
            (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            resolved.write(run_dir)  # config.yaml and plan.json
            memory.say_startup_note(self.cfg, raw_model, env.world_size, resolved.device_memory)  # none on CPU
        if resolved.strategy.fsdp:
            build.shard(raw_model, resolved, env)
        opt = build.make_optimizer(raw_model, resolved)  # shard_optimizer: parameters moved into buckets
        sched, scaler = LambdaLR(opt, build.lr_lambda(cfg)), build.grad_scaler(resolved.autocast, env.device)
        states = run_states(raw_model, opt, sched, scaler, batches, lr=cfg.optim.lr, device=env.device)
        storage, sides = DCP if resolved.strategy.fsdp else TORCH_SAVE, [CompileCache()] if compiling else []
        ckpts = Checkpointer(states, storage, run_dir, env, config=record, keep=cfg.checkpoint.keep, beside=sides,
                             background=resolved.async_save)  # fmt: skip
        progress = ckpts.begin(start, ahead)  # the step and tokens seen: resumed (resume=auto: if a checkpoint), or 0
        # The step: compiled and wrapped for data parallelism as the config says; graphed where it can be.
        metrics = Metrics(run_dir if env.is_main else None, total_steps=cfg.train.steps, progress=cfg.log.progress,
                          tensorboard=cfg.log.tensorboard, wandb=cfg.log.wandb, start_step=progress.step)  # fmt: skip
        model, self.splitter = build.wrap(raw_model, resolved, env, opt=opt)
        spikes = SpikeWatch(cfg.train.spike_window, cfg.train.spike_sigma, cfg.train.on_spike)
        train_step = build.train_step(model, raw_model, opt, scaler, resolved, env, spikes)
        tokens_per_step = batches.global_batch * cfg.data.seq_len
        describe.say_startup(resolved, raw_model, corpus, tokens_per_step, opt, threads)  # the run, its path, notes
        watcher = build.compile_watcher(resolved, model=raw_model)
        check = step_checks(watcher, env, lambda: ckpts.last, spikes)  # recompiles; a finite loss, no spike
        log = StepLog(metrics, env=env, start_step=progress.step, last_step=cfg.train.steps, log_every=cfg.log.every,
                      tokens_per_step=tokens_per_step, flops_per_token=flops_per_token(raw_model, cfg.data.seq_len),
                      peak_flops=peak_flops(env.device, cfg.log.peak_flops), compiled=compiling,
                      check=check, targets=getattr(batches, "targets", None))  # fmt: skip
        model.train()
        try:
            while progress.step < cfg.train.steps:
                lr = sched.base_lrs[0] * sched.lr_lambdas[0](sched.last_epoch)  # this step's, as a float
                out = train_step(functools.partial(batches.train_batch, progress.step), progress.step + 1)
                sched.step()  # a graphed step reads the new lr from the optimizer's lr tensor, which this fills
                step = progress.advance(0 if out.skipped else tokens_per_step)
                log.launched(step, out, lr, progress.tokens_seen)  # and writes the step before it
                due = _due(cfg, step, env, signals)
                if due.evaluate or due.save or due.stop or log.reads_at_once(step):
                    record = log.read(force=due.evaluate or bool(due.stop))  # now; a stop's step is the last row
                    if (due.evaluate or due.save) and resolved.strategy.ddp:  # before a checkpoint keeps rank 0's
                        check_replicas(raw_model, env, step, drift=fault_point("replica_drift", step, env.rank))
                    if due.evaluate:  # the first evaluation compiles its own (eval, no-grad) graph: expected
                        with watcher.expect_first("eval") if watcher else contextlib.nullcontext():
                            record["val_loss"] = train_step.evaluate(batches.val_batch, cfg.train.eval_batches)
                    log.write(record)  # before the checkpoint: a crash after it loses no row
                if due.save:  # the seconds the steps waited (async_save: for the copy) go in the next row
                    log.held(*ckpts.save(step, wait=bool(due.stop)))  # a stop's save is written before it says so
                if due.evaluate or due.save:
                    log.timer.restart()  # evaluation and saving are not training time
                if due.stop:
                    saved = f"checkpoint saved: {ckpts.last}" if due.save else "checkpoint.enabled=false: nothing saved"
                    console.warn(f"stopped {due.stop} at step {step}; {saved}")  # short of train.steps
                    break
            log.write(log.read())
            ckpts.wait()  # the background write in flight
        finally:
            ckpts.close()  # after a failure, a background write ends here: no collective with ranks that may be gone
            if watcher is not None:
                watcher.stop(report=run_dir / "compile_report.json" if env.is_main else None)
            metrics.close()  # a failed run's too: a gloo rank then exits without finalizing the interpreter
        step, last = progress.step, str(ckpts.last) if ckpts.last else None
        return log.summary(steps=step, run_dir=str(run_dir), checkpoint=last, stopped=step < cfg.train.steps)


def _due(cfg: Config, step: int, env: dist_env.DistEnv, signals: dist_env.StopSignals) -> SimpleNamespace:
    """What is due after ``step``: an evaluation, a checkpoint, a stop (by signal, or at train.stop_at)."""
    evaluate = step == cfg.train.steps or bool(cfg.train.eval_every and step % cfg.train.eval_every == 0)
    periodic = bool(cfg.checkpoint.every and step % cfg.checkpoint.every == 0)
    # One process checks its own flag every step; ranks agree on it at log steps (a collective).
    check_stop = not env.distributed or step % cfg.log.every == 0 or evaluate or periodic
    stop = "by signal" if check_stop and signals.on_any_rank(env) else None
    stop = stop or ("at train.stop_at" if step == cfg.train.stop_at else None)
    save = cfg.checkpoint.enabled and bool(stop or step == cfg.train.steps or periodic)
    return SimpleNamespace(evaluate=evaluate, save=save, stop=stop)
