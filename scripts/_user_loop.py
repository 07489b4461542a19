"""The training loop a user writes by hand (nanoGPT's): the baseline of the benchmarks and of scripts/parity.py.

One definition, so that every comparison with ours runs the same model, data, optimizer and step: the model
built on the device after ``torch.manual_seed(seed)`` (as the trainer builds it), the embedded corpus, AdamW (lr 6e-4,
betas 0.9/0.95, weight decay 0.1 on matrices; fused on CUDA), ``clip_grad_norm_(1.0)``, bf16 autocast on CUDA,
a constant learning rate (after a linear warm-up, where one is asked for).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

LR, BETAS, WEIGHT_DECAY, MAX_NORM = 6e-4, (0.9, 0.95), 0.1, 1.0


def user_model_and_data(preset: str, vocab: int, seq: int, batch: int, device: torch.device, *, rank: int = 0,
                        world_size: int = 1, seed: int = 0, **shape) -> tuple[nn.Module, object]:  # fmt: skip
    """``(model, batches)``: the built-in GPT on ``device`` and the embedded corpus' batches for this rank."""
    from trainer.models import build_model

    torch.manual_seed(seed)
    with torch.device(device):  # initialized where the trainer initializes a model trained from scratch
        model = build_model(preset=preset, vocab_size=vocab, seq_len=seq, **shape)
    return model, user_data(seq, batch, device, rank=rank, world_size=world_size, seed=seed)


def user_data(seq: int, batch: int, device: torch.device, *, rank: int = 0, world_size: int = 1, seed: int = 0):
    """The embedded corpus' batches (bytes) for this rank, as the trainer draws them."""
    from trainer.data import Batches, load_corpus

    corpus = load_corpus(None, None, 0.05, seq)
    return Batches(corpus, seq_len=seq, micro_batch_size=batch, grad_accum=1, rank=rank, world_size=world_size,
                   seed=seed, device=device)  # fmt: skip


def float8_linear(module: nn.Module, fqn: str) -> bool:
    """torchao's float8 training as a user applies it (``convert_to_float8_training``'s ``module_filter_fn``): every
    linear but the LM head, where both dimensions are multiples of 16 (what float8 matmuls need)."""
    return not fqn.endswith("lm_head") and module.in_features % 16 == 0 and module.out_features % 16 == 0


def user_fsdp(model: nn.Module, bf16: bool) -> nn.Module:
    """FSDP2 as a user applies it: ``fully_shard`` per block, then the root (kept gathered after forward), bf16
    parameters when ``bf16``, fp32 gradient reduction. Returns ``model``, sharded in place."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, mp_policy=mp)
    return fully_shard(model, mp_policy=mp, reshard_after_forward=False)


def user_step(model: nn.Module, step_model: nn.Module, batches, device: torch.device,
              like_gpu: bool | None = None, warmup: int = 0) -> Callable[[int], torch.Tensor]:  # fmt: skip
    """``step(i) -> loss``: one optimizer step on batch ``i``. ``model`` owns the parameters (AdamW's groups,
    the clip); ``step_model`` runs the forward (``model`` itself, ``torch.compile(model)`` or a DDP wrapper).
    ``like_gpu`` (default: on CUDA): fused AdamW and bf16 autocast. ``warmup``: the learning rate rises linearly
    over that many steps, ``LR * (i + 1) / (warmup + 1)`` at step ``i``, then stays at ``LR``."""
    from trainer.models import loss_of
    from trainer.optim import param_groups

    like_gpu = device.type == "cuda" if like_gpu is None else like_gpu
    opt = torch.optim.AdamW(param_groups(model, WEIGHT_DECAY), lr=LR, betas=BETAS, fused=like_gpu)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=like_gpu)
    sched = (
        torch.optim.lr_scheduler.LambdaLR(opt, lambda i: (i + 1) / (warmup + 1) if i < warmup else 1.0)
        if warmup
        else None
    )

    def step(i: int) -> torch.Tensor:
        x, y = batches.train_batch(i, 0)
        with autocast:
            loss = loss_of(step_model(x, y))  # nanoGPT's model returns (logits, loss)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step
