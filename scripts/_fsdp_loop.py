"""The loop row of scripts/bench_fsdp.py: FSDP2 by hand, torchtitan's way, on torchtitan's mesh (HSDP, tensor
parallel with transformers' plan, torch's context_parallel). scripts/bench_fsdp.py's docstring says what it does."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time

from scripts._models import hf_dir


def loop_mesh(world: int, layout: dict, device_type: str):
    """The loop's mesh, as torchtitan lays it out (``parallel_dims.py``): dimensions ``dp_replicate``, ``dp_shard``,
    ``cp``, ``tp`` (``dp_shard``: what the others leave of ``world``); FSDP shards over ``dp_shard`` and ``cp``
    flattened (``dp_shard_cp``), HSDP also replicates over ``dp_replicate``. Returns ``(fsdp_mesh, tp_mesh, cp_mesh,
    dp_rank)``: the tensor- and context-parallel meshes None where their size is 1; ``dp_rank`` this rank's index
    among the data-parallel ranks (those that draw different batches)."""
    from torch.distributed.device_mesh import init_device_mesh

    r, tp, cp = (layout.get(f"distributed.{k}", 1) for k in ("replicate", "tp", "cp"))
    names = ("dp_replicate", "dp_shard", "cp", "tp")
    mesh = init_device_mesh(device_type, (r, world // (r * tp * cp), cp, tp), mesh_dim_names=names)
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    dp = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    fsdp = mesh["dp_replicate", "dp_shard_cp"] if r > 1 else mesh["dp_shard_cp"]
    return fsdp, mesh["tp"] if tp > 1 else None, mesh["cp"] if cp > 1 else None, dp.get_local_rank()


def clip_across_meshes(params: list, max_norm: float) -> None:
    """``clip_grad_norm_`` for gradients on several meshes (``clip_grad_norm_`` stacks the norms, which DTensor
    refuses across meshes): each mesh's norm summed over its ranks, then one scale for all."""
    import torch
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    squares = []
    for ps in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in ps], 2.0)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = torch.stack(squares).sum().sqrt()
    for ps in groups.values():  # one multiply per mesh: DTensor runs no op across meshes
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)


def _causal_attention_without_mask(hf) -> None:
    """The model's attention as one causal SDPA call with no mask, as context parallel needs (its ring attention
    takes ``is_causal`` and no mask; transformers would build one from the head-tail positions, which jump)."""
    import torch.nn.functional as F
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import repeat_kv

    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        groups = getattr(module, "num_key_value_groups", 1)
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # (B, H, T, D)
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling, is_causal=True)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("loop_causal", attention)
    AttentionMaskInterface.register("loop_causal", lambda *args, **kwargs: None)
    for sub in hf.modules():  # transformers reads the implementation from each submodule's config
        if hasattr(sub, "config") and hasattr(sub.config, "_attn_implementation"):
            sub.config._attn_implementation = "loop_causal"


def run_loop(a, job: dict, seq: int, group: int, hf_overrides: dict | None) -> dict:
    """FSDP2 by hand, torchtitan's way: built on meta, sharded, initialised in place; ``seq`` tokens a sequence,
    ``group`` GPUs sharing one batch, ``hf_overrides`` for the model's config (``--tiny``)."""
    import functools

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    from transformers import AutoModelForCausalLM

    from scripts._user_loop import BETAS, LR, MAX_NORM, WEIGHT_DECAY
    from trainer.models.hf import HFCausalLM, load_hf_config
    from trainer.models.recompute import policy
    from trainer.optim import param_groups

    local = int(os.environ["LOCAL_RANK"])
    cuda = a.device == "cuda"
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", **({"device_id": dev} if cuda else {}))
    t0 = time.perf_counter()
    fsdp_mesh, tp_mesh, cp_mesh, dp_rank = loop_mesh(dist.get_world_size(), job["layout"], dev.type)
    config = load_hf_config(str(hf_dir(job["model"], tempfile.mkdtemp())), hf_overrides)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model = HFCausalLM(hf)  # the root FSDP unit: its forward runs the base model, the head and the loss
    if cp_mesh is not None:
        _causal_attention_without_mask(hf)
    if tp_mesh is not None:  # transformers' own plan (config.base_model_tp_plan), as trainer reads it
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        plan = {k: styles[v]() for k, v in (config.base_model_tp_plan or {}).items() if v in styles}
        parallelize_module(getattr(hf, hf.base_model_prefix), tp_mesh, plan)
    if job["spec"].get("fp8"):  # torchtitan's float8: every linear but the head, float8 all-gather, scales per step
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        from scripts._user_loop import float8_linear

        f8 = Float8LinearConfig(enable_fsdp_float8_all_gather=cuda, emulate=not cuda)
        convert_to_float8_training(hf, config=f8, module_filter_fn=float8_linear)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cuda else None, reduce_dtype=torch.float32)
    # One context factory for every layer: Dynamo guards on it, so the layers share one compiled graph.
    selective = {"context_fn": functools.partial(create_selective_checkpoint_contexts, policy)}
    layers = hf.model.layers
    for i, layer in enumerate(layers):
        if job["ac"] != "none":
            layer = layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False,
                                                   **(selective if job["ac"] == "selective" else {}))  # fmt: skip
        if a.compile_backend != "none":
            layer.compile(backend=a.compile_backend)
        fully_shard(layer, mesh=fsdp_mesh, mp_policy=mp)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=mp)
    model.to_empty(device=dev)
    # transformers' own initialisation works on the DTensor shards (normal_ and fill_ are sharded ops) and
    # recomputes the rotary embedding's buffers, which to_empty left uninitialised. Same seed on every rank, so
    # the shards are those of one model (on CUDA: DTensor's offset-based random generator).
    torch.manual_seed(0)
    hf.init_weights()
    opt = torch.optim.AdamW(param_groups(model, WEIGHT_DECAY), lr=LR, betas=BETAS, fused=cuda)
    if job["spec"].get("fp8") and cuda:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        opt.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
    build_s = time.perf_counter() - t0

    batch, vocab = job["batch"], config.vocab_size
    gen = torch.Generator(dev).manual_seed(dp_rank)  # a tensor- or context-parallel group draws one batch
    cp_context = None
    if cp_mesh is not None:  # torch's context_parallel: the batch's sequences sharded head-tail, ring attention
        from torch.distributed.tensor.experimental import context_parallel
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]

        def cp_context(*buffers):
            stack = contextlib.ExitStack()
            stack.enter_context(context_parallel(cp_mesh, buffers=list(buffers), buffer_seq_dims=[1] * len(buffers),
                                                 no_restore_buffers=set(buffers)))  # fmt: skip
            stack.enter_context(sdpa_kernel(kernels))
            return stack

    def step() -> torch.Tensor:
        tokens = torch.randint(vocab, (batch, seq + 1), device=dev, generator=gen)  # (B, T + 1)
        idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # targets: the next token
        if cp_context is None:
            loss = model(idx, targets)
            loss.backward()
        else:  # each rank's slices of the sequences, with their positions (RoPE reads them)
            positions = torch.arange(seq, device=dev).expand(batch, seq).contiguous()
            with cp_context(idx, targets, positions):
                loss = model(idx, targets, positions)
                loss.backward()
        if tp_mesh is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        else:  # the split linears' gradients live on the (FSDP, TP) mesh, the rest on FSDP's: a norm per mesh
            clip_across_meshes(list(model.parameters()), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    loss = step()
    float(loss)
    first = time.perf_counter() - t0
    for _ in range(1, a.warmup):
        loss = step()
    sync()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    sync()
    per_step = (time.perf_counter() - t0) / a.steps
    out = {
        "tokens_per_s_per_gpu": batch * seq / group / per_step,
        "step_ms": per_step * 1e3,
        "first_step_s": first,
        "build_s": build_s,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        "final_loss": float(loss),
    }
    dist.destroy_process_group()
    return out
