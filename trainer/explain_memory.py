"""``trainer explain --memory``: the peak memory per rank by part and the largest micro-batch that fits in each
checkpointing mode, from each mode's traced step (:mod:`trainer.memory.trace`) or, with ``--measure``, from short
runs of it (:func:`trainer.tune.probe_modes`)."""

from __future__ import annotations

import time

import torch

from trainer import console, memory
from trainer.config import load_config
from trainer.memory import work_dir
from trainer.tune import GRID, Session, World, on_cuda, probe_modes


def explain_memory(
    config: str,
    overrides: list[str],
    say=console.info,
    gpu: str | None = None,
    world: int | None = None,
    micro_batches: list[int] | None = None,
    as_json: bool = False,
    measure: bool = False,
) -> int:
    """``trainer explain --memory``: the counted parts and each mode's traced step (:func:`memory.traced_estimate`),
    for ``gpu`` (this one's memory by default) and ``world`` ranks; with ``measure``, each mode probed instead
    (:func:`probe_modes`; on the CPU: one step in this process, its live tensor bytes counted)."""
    cfg = load_config(config, overrides)
    if not measure:
        return _traced_memory(cfg, say, gpu, world, micro_batches, as_json)
    b0 = cfg.train.micro_batch_size
    if not on_cuda(cfg):
        if World.from_env().rank:  # each rank's model is the same; rank 0 speaks
            return 0
        from trainer.memory.probe import cpu_estimate

        est = cpu_estimate(cfg, b0)
        say(
            est.describe(
                GRID,
                f"memory on the CPU, counted, and probed at micro-batch {b0} (host memory is not "
                "checked against a limit):",
            )
        )
        return 0
    world = World.from_env()
    world.join()
    s = Session(config, overrides, None, reuse=False, say=(lambda *_: None) if world.rank else say)
    s.per_rank = None  # one micro-batch a step: the probes' sizes need not divide the global batch
    try:
        probe_modes(s, b0)
    finally:
        s.runner.close()
    if world.rank == 0:
        say(s.estimate.describe(GRID, f"memory per rank of {world.size}, predicted:"))
        say(memory.peak_table(s.estimate, [b for b in GRID if b >= b0][:12]))
    return 0


def _traced_memory(cfg, say, gpu: str | None, world: int | None, sizes: list[int] | None, as_json: bool) -> int:
    import json

    start = time.perf_counter()
    world = world or World.from_env().size
    if World.from_env().rank:  # each rank's prediction is the same; rank 0 speaks
        return 0
    if gpu is not None:
        device_memory, named = memory.device_bytes(gpu), gpu
    elif torch.cuda.is_available():
        device_memory, named = torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0)
    else:
        device_memory, named = None, None
    progress = None if as_json else say
    try:
        est = memory.traced_estimate(cfg, world, device_memory, say=progress, cache=work_dir(cfg) / "traced.json")
    except Exception as e:  # a model Dynamo cannot capture whole, say
        console.error(
            f"explain --memory: the step could not be traced ({type(e).__name__}: {str(e)[:300]}); "
            "--measure measures short runs of each mode instead"
        )
        return 1
    b0 = cfg.train.micro_batch_size
    sizes = sizes or [b for b in GRID if b >= b0][:10]
    on = f"{named} ({memory.size(device_memory)})" if named else "no GPU named (--gpu h100, h200 or a size in GB)"
    text, result = memory.traced_report(est, sizes, f"memory per rank of {world}, {on}, predicted:")
    result.update(gpu=named, world=world, seconds=round(time.perf_counter() - start, 1))
    if as_json:
        print(json.dumps(result, indent=1))
    else:
        say(text)
        say(f"({result['seconds']} s; `--measure` measures short runs instead, on the GPU)")
    return 0
