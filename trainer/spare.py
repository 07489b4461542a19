"""A spare process of ``trainer tune`` (:class:`trainer.tune_runs.Runner`): started while a candidate runs, it imports
what a candidate's ``trainer fit`` imports on its way to the first step, creating no CUDA context, then waits for
the next candidate's arguments and runs it.

    python -m trainer.spare TUNE_PID GO_FILE CONFIG [key=value ...]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def preload(config: str, overrides: list[str]) -> None:
    """Import what a candidate's ``trainer fit`` of ``config`` imports on its way to the first step, creating no CUDA
    context: torch with Dynamo and Inductor, trainer's run and kernels, and for a ``model.hf`` model transformers
    with its architecture's module. What fails here is left for the run to meet and say."""
    import importlib

    for name in ("torch", "torch._dynamo", "torch._inductor.compile_fx", "torch._inductor.lowering", "trainer.loop",
                 "trainer.ops.add_layer_norm", "trainer.ops.add_rms_norm", "trainer.ops.linear_cross_entropy",
                 "torchao.float8"):  # fmt: skip
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001, S112 - not installed, or failing: the run says so
            continue
    try:
        from trainer.config import load_config

        cfg = load_config(config, overrides)
        import torch

        from trainer.compile.cache import start_workers, wants_workers

        device_type = "cuda" if torch.cuda.is_available() else "cpu"  # asked without making a CUDA context
        if cfg.compile.enabled is not False and wants_workers(cfg.compile.backend, device_type):
            start_workers()  # Triton's compile workers, ready when the candidate compiles
        if cfg.model.hf is not None:
            from transformers import AutoModelForCausalLM

            from trainer.models.hf import load_hf_config

            hf = load_hf_config(cfg.model.hf, dict(cfg.model.hf_overrides or {}))
            AutoModelForCausalLM._model_mapping[type(hf)]  # imports the architecture's modeling module
    except Exception:  # noqa: BLE001, S110 - the run meets it again and says it
        pass


def spare_main(parent: int, go: Path, config: str, overrides: list[str]) -> int:
    """A spare: preload, then wait for ``go`` (written by :meth:`trainer.tune_runs.Runner._take_spare`: the
    candidate's arguments and log file) and run ``trainer fit`` with them; ends with no run where the tune process is
    gone (``parent``: its pid, given by it, since it may be gone before this process could ask)."""
    preload(config, overrides)
    while not go.is_file():
        if os.getppid() != parent:
            return 0
        time.sleep(0.02)
    request = json.loads(go.read_text())
    go.unlink(missing_ok=True)
    os.environ["TRAINER_STARTED_AT"] = str(time.time())  # the run's start phases count from here (trainer.startup)
    sys.stdout.flush()  # what preload printed stays out of the run's log
    sys.stderr.flush()
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [sys.argv[0], *request["args"]]
    from trainer.cli import main

    return main(request["args"])


if __name__ == "__main__":
    sys.exit(spare_main(int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:]))
