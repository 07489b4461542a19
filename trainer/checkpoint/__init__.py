"""A run's checkpoints and its directory: :mod:`~trainer.checkpoint.checkpointer` saves and restores the run's
states (:mod:`~trainer.checkpoint.states`) atomically, in the foreground or the background, through ``torch.save``
or DCP; :mod:`~trainer.checkpoint.rundir` claims the run directory and decides what a start resumes;
:mod:`~trainer.checkpoint.integrity` finds a damaged checkpoint and the newest intact one."""

from trainer.checkpoint.checkpointer import (
    DCP,
    TORCH_SAVE,
    Checkpointer,
    ReadAhead,
    Storage,
    checkpoint_meta,
    compare_configs,
    load_model_weights,
    read,
)
from trainer.checkpoint.integrity import LAST, CheckpointError, resolve
from trainer.checkpoint.write import CheckpointWriteError

__all__ = [
    "DCP",
    "LAST",
    "TORCH_SAVE",
    "CheckpointError",
    "CheckpointWriteError",
    "Checkpointer",
    "ReadAhead",
    "Storage",
    "checkpoint_meta",
    "compare_configs",
    "load_model_weights",
    "read",
    "resolve",
]
