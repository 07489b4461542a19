"""Data parallel: gradients all-reduced in buckets while the backward runs."""

from __future__ import annotations

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel


def apply_ddp(model: nn.Module, env, *, bucket_mb: float) -> nn.Module:
    """Wrap ``model`` in DDP with ``bucket_mb`` buckets, one device per process."""
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_mb)
