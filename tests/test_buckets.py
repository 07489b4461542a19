"""The bucket plan (trainer/distributed/buckets.py) and `trainer explain`'s view of it."""

import pytest
import torch
import torch.nn as nn

from tests.conftest import cli
from trainer.distributed.buckets import MiB, plan_buckets
from trainer.models import build_model


def _gpt(n_layer=4):
    return build_model(preset="tiny", vocab_size=64, seq_len=16, n_layer=n_layer, n_head=2, n_embd=32, dropout=0.0,
                       bias=True, target=None, kwargs={})  # fmt: skip


def test_whole_blocks_packed_up_to_the_cap_in_ready_order():
    model = _gpt(4)
    block = sum(p.numel() * 4 for p in model.transformer.h[0].parameters())
    plan = plan_buckets(model, bucket_mb=2 * block / MiB, split_tail=False)  # two blocks, not two and the head
    units = [b.units for b in plan.buckets]
    # The head (tiny) and the embeddings (64 x 32 + 16 x 32 floats) are small next to a block.
    assert units == [("head", "transformer.h.3"), ("transformer.h.2", "transformer.h.1"), ("transformer.h.0",
                     "embeddings")]  # fmt: skip
    # Every trainable parameter exactly once; no block split across buckets; nothing over the cap but whole units.
    names = [n for b in plan.buckets for n in b.names]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    for b in plan.buckets:
        blocks = {n.split(".")[2] for n in b.names if n.startswith("transformer.h.")}
        for i in blocks:
            assert all(n in b.names for n, _ in model.named_parameters() if n.startswith(f"transformer.h.{i}."))
        assert b.nbytes <= plan.cap_bytes or len(b.units) == 1


def test_the_block_ready_last_is_a_bucket_of_its_own():
    """split_tail (the default): the first block is not packed with the blocks ready before it."""
    model = _gpt(5)
    block = sum(p.numel() * 4 for p in model.transformer.h[0].parameters())
    plan = plan_buckets(model, bucket_mb=3.5 * block / MiB)
    assert [b.units for b in plan.buckets] == [
        ("head", "transformer.h.4", "transformer.h.3", "transformer.h.2"), ("transformer.h.1",), ("transformer.h.0",),
        ("embeddings",),
    ]  # fmt: skip
    packed = plan_buckets(model, bucket_mb=3.5 * block / MiB, split_tail=False)
    assert [b.units for b in packed.buckets] == [
        ("head", "transformer.h.4", "transformer.h.3", "transformer.h.2"), ("transformer.h.1", "transformer.h.0",
        "embeddings"),
    ]  # fmt: skip


def test_a_unit_larger_than_the_cap_is_a_bucket_of_its_own():
    plan = plan_buckets(_gpt(3), bucket_mb=0.001)
    assert [b.units for b in plan.buckets] == [("head",), ("transformer.h.2",), ("transformer.h.1",),
                                               ("transformer.h.0",), ("embeddings",)]  # fmt: skip
    assert plan.bucket_of()[id(_first(plan, "transformer.wte.weight"))] == len(plan.buckets) - 1  # tied: last


def _first(plan, name):
    for b in plan.buckets:
        for n, p in zip(b.names, b.params):
            if n == name:
                return p
    raise KeyError(name)


def test_fsdp_units_are_the_plans_blocks():
    """FSDP shards the blocks in the bucket plan's groups (one fully_shard unit per bucket's blocks, no tail
    rule); the embeddings and head stay with the root; without a cap, one unit per block."""
    from trainer.distributed.fsdp import block_units

    model = _gpt(5)
    h = model.transformer.h
    block = sum(p.numel() * 4 for p in h[0].parameters())
    # the plan without DDP's tail rule: the head's bytes keep block 4 alone
    assert block_units(model, None, 2 * block / MiB) == [[h[4]], [h[3], h[2]], [h[1], h[0]]]
    assert block_units(model, None, 100) == [[h[4], h[3], h[2], h[1], h[0]]]
    assert block_units(model, None, None) == [[h[4]], [h[3]], [h[2]], [h[1]], [h[0]]]


def test_fsdp_keeps_the_forwards_last_units_gathered_into_the_backward():
    """distributed.keep_gathered: the first units of the gradient-ready order (the forward's last) are not resharded
    after their forward; the others are, until reshard_after_forward=false keeps them all. What shows it is FSDP2's
    own state after a forward: a resharded unit's parameters are DTensors again, a kept one's whole tensors."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from trainer.distributed.fsdp import apply_fsdp, block_units

    def gathered_after_forward(reshard: bool, keep: int) -> list[bool]:
        model = _gpt(4)
        units = block_units(model, None, None)  # a unit per block: h3, h2, h1, h0
        apply_fsdp(model, units, param_dtype=None, reduce_dtype=None, reshard_after_forward=reshard,
                   keep_gathered=keep)  # fmt: skip
        x = torch.randint(0, 64, (2, 16))
        model(x, x)
        return [not isinstance(u[0].attn.c_qkv.weight, DTensor) for u in units]

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # in-process: no port
    try:
        assert gathered_after_forward(True, 0) == [False, False, False, False]
        assert gathered_after_forward(True, 1) == [True, False, False, False]  # the default: the last block's unit
        assert gathered_after_forward(True, 3) == [True, True, True, False]
        assert gathered_after_forward(False, 0) == [True, True, True, True]
    finally:
        dist.destroy_process_group()


def test_explain_and_the_memory_model_count_the_units_kept_gathered():
    from tests.conftest import ROOT
    from trainer.config import load_config
    from trainer.describe import fsdp_units_report
    from trainer.memory import static_parts

    model = _gpt(5)
    block = sum(p.numel() for p in model.transformer.h[0].parameters())

    def cfg(*extra):
        return load_config(ROOT / "configs/tiny.yaml", ["distributed.strategy=fsdp", "distributed.fsdp_unit_mb=0",
                                                        "distributed.param_dtype=bf16", *extra])  # fmt: skip

    text = fsdp_units_report(model, cfg("distributed.keep_gathered=2"))
    kept = [line for line in text.splitlines() if "kept gathered" in line]
    assert len(kept) == 2 and "transformer.h.4 " in kept[0] and "transformer.h.3 " in kept[1], text
    root = sum(p.numel() for p in model.parameters()) - 5 * block  # embeddings, final norm, head: the root's
    gathered = {k: static_parts(model, cfg(f"distributed.keep_gathered={k}"), world=2)["gathered (fsdp)"][0]
                for k in (0, 1, 3)}  # fmt: skip
    # two bf16 units (the one computing, the one prefetched), and the root's, not resharded after its forward
    assert gathered[0] == gathered[1] == (2 * block + root) * 2
    assert gathered[3] == (4 * block + root) * 2  # three kept, one prefetched
    every = static_parts(model, cfg("distributed.reshard_after_forward=false"), world=2)["gathered (fsdp)"][0]
    assert every == sum(p.numel() for p in model.parameters()) * 2


def test_explain_describes_the_fsdp_units():
    from tests.conftest import ROOT
    from trainer.config import load_config
    from trainer.describe import fsdp_units_report

    def report(unit_mb):
        cfg = load_config(
            ROOT / "configs/tiny.yaml", ["distributed.strategy=fsdp", f"distributed.fsdp_unit_mb={unit_mb}"]
        )
        return fsdp_units_report(model, cfg)

    model = _gpt(5)
    text = report(2 * sum(p.numel() * 4 for p in model.transformer.h[0].parameters()) / MiB)
    # as block_units packs them: the head's bytes keep block 4 alone (see the test above, without the tail rule)
    assert "fsdp: 3 fully_shard unit(s)" in text, text
    assert "| transformer.h.4 " in text and "transformer.h.1 .. transformer.h.0 (2 blocks)" in text, text
    total = sum(p.numel() * 4 for p in model.parameters()) / MiB
    listed = sum(float(line.split("|")[2].split()[0]) for line in text.splitlines()[1:])
    assert abs(listed - total) < 0.02, (listed, total)  # every parameter in a unit or the root, once
    assert "fsdp: 5 fully_shard unit(s) of blocks (a unit per block)" in report(0)


def test_model_without_blocks_is_packed_per_parameter_in_reverse_order():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    plan = plan_buckets(model, bucket_mb=1)
    assert plan.blocks is None
    assert plan.buckets[0].names == ("2.bias", "2.weight", "0.bias", "0.weight")


def test_one_dtype_per_bucket():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16))
    plan = plan_buckets(model, bucket_mb=1)
    assert [b.dtype for b in plan.buckets] == [torch.bfloat16, torch.float32]


def test_bad_cap_is_refused():
    with pytest.raises(ValueError, match="bucket_mb"):
        plan_buckets(_gpt(1), bucket_mb=0)


def test_explain_prints_plan_and_graph_pieces(tmp_path, capsys, fresh_dynamo):
    r = cli(capsys, "explain", "configs/tiny.yaml", "compile.backend=aot_eager", "distributed.strategy=ddp",
            "distributed.bucket_mb=0.1", "model.n_embd=64", "data.seq_len=32", "--steps", "1")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "bucket plan: 6 buckets" in out
    assert "bucket  5 | embeddings" in out and "graph piece 0" in out
    assert "forward graph split into 6 pieces (one per bucket)" in out
    assert "bucket  5: transformer.wpe.weight, transformer.wte.weight" in out


def test_rewrapping_removes_the_old_hooks():
    """After a compile failure the loop wraps the same parameters again: one reduction per bucket, not two."""
    import torch.distributed as dist

    from trainer.distributed.ddp import DataParallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # in-process: no port
    try:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        plan = plan_buckets(model, bucket_mb=1)
        first = DataParallel(model, plan)
        first.remove_hooks()
        second = DataParallel(model, plan)
        model(torch.randn(3, 4)).sum().backward()
        assert first._reduced == [None] and second._reduced[0] is not None
        second.finish_grad_sync()
        flat = second.plan.buckets[0]
        assert all(p.grad is not None for p in flat.params)
    finally:
        dist.destroy_process_group()


def test_a_gradient_that_views_another_is_not_reduced_in_place():
    """autograd adopts p.unsqueeze(0)'s incoming gradient as p.grad without a copy: a view of the output's gradient,
    which the backward still reads for x. Reducing (scaling) it in place would change x's gradient."""
    import torch.distributed as dist

    from trainer.distributed.ddp import DataParallel

    class Viewing(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.Parameter(torch.ones(4, 3))

        def forward(self, x):
            return x * 2 + self.p.unsqueeze(0)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # in-process: no port
    try:
        model = Viewing()
        dp = DataParallel(model, plan_buckets(model, bucket_mb=1))
        dp._scale = 0.5  # as gloo on 2 ranks (pre-scaled sum), so an in-place write would show on one rank
        x = torch.ones(1, 4, 3, requires_grad=True)
        dy = torch.arange(12.0).reshape(1, 4, 3)
        dp(x).backward(dy)
        dp.finish_grad_sync()
        torch.testing.assert_close(x.grad, 2 * dy)  # untouched by the reduction of p's gradient
        torch.testing.assert_close(model.p.grad, 0.5 * dy[0])
    finally:
        dist.destroy_process_group()


def test_sole_owner_counts_tensors_on_a_storage():
    """The in-place reduction's guard, on torch's private storage refcount: pinned here across torch versions."""
    from trainer.distributed.ddp import _sole_owner

    a = torch.randn(4, 3)
    assert _sole_owner(a)
    v = a.view(12).detach()  # detached: no ._base, same memory
    assert v._base is None and not _sole_owner(v) and not _sole_owner(a)
    del a
    assert _sole_owner(v)  # the view outlived its base: nothing else reads that memory
