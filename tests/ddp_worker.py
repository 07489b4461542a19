"""Run under torchrun by tests/test_distributed.py: checks of the bucket plan, the graph split and the reducer.

Writes ``$OUT/rank<r>.json``. Not a test module itself (no ``test_`` prefix). ``DDP_WORKER_DEVICE=cuda``: NCCL,
one GPU per rank, and the split variant's pieces compiled by Inductor (whose outputs are the gradients reduced).
"""

import json
import os
import sys

import torch
import torch.distributed as dist


def main(out_dir: str) -> None:
    from trainer.compile.autograd import compiled_autograd
    from trainer.distributed.buckets import plan_buckets
    from trainer.distributed.ddp import DataParallel, PlanSplitter
    from trainer.models import build_model

    cuda = os.environ.get("DDP_WORKER_DEVICE", "cpu") == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def model():
        torch.manual_seed(0)
        return build_model(preset="tiny", vocab_size=64, seq_len=16, n_layer=4, n_head=2, n_embd=32, dropout=0.0,
                           bias=True, target=None, kwargs={}).to(dev)  # fmt: skip

    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (4 * world, 16), generator=g).to(dev)
    y = torch.randint(0, 64, (4 * world, 16), generator=g).to(dev)
    mine = slice(4 * rank, 4 * rank + 4)

    ref = model()
    ref(x, y).backward()  # the whole global batch in one process: the mean over all of it
    expect = {n: p.grad for n, p in ref.named_parameters()}
    result = {}

    # 1. eager, and 2. compiled with the plan splitter (pieces recorded), 3. compiled autograd (graph ops recorded),
    # 4. eager with buckets reduced in bf16.
    for variant in ("eager", "split", "ca", "bf16"):
        raw = model()
        plan = plan_buckets(raw, bucket_mb=0.01)  # 10 KiB: one block per bucket for this size
        compiled_pieces, ca_ops = [], []

        def record_piece(gm, example_inputs, compiled_pieces=compiled_pieces, **kw):
            compiled_pieces.append(sorted({n.name for n in gm.graph.nodes if n.op == "placeholder"}))
            if cuda:
                from torch._inductor.compile_fx import compile_fx

                return compile_fx(gm, example_inputs)
            return gm.forward

        def record_ca(gm, example_inputs, ca_ops=ca_ops, **kw):
            ca_ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return gm.forward

        splitter = PlanSplitter(plan, record_piece)
        fwd = (
            raw
            if variant in ("eager", "bf16")
            else torch.compile(raw, backend=splitter if variant == "split" else "eager")
        )
        dp = DataParallel(fwd, plan, reduce_dtype=torch.bfloat16 if variant == "bf16" else None)
        ctx = (lambda: compiled_autograd(backend=record_ca)) if variant == "ca" else torch.enable_grad
        for _ in range(2):  # the second step reuses the compiled graphs and the buffers
            for p in raw.parameters():
                p.grad = None
            with ctx():
                dp(x[mine], y[mine]).backward()
            before = [p.grad.data_ptr() for p in raw.parameters()]
            norm = dp.finish_grad_sync(norm=True)
        in_place = before == [p.grad.data_ptr() for p in raw.parameters()]
        want = torch.nn.utils.get_total_norm(list(expect.values()))
        err = max((p.grad - expect[n]).abs().max().item() for n, p in raw.named_parameters())
        rel = max(((p.grad - expect[n]).abs().max() / expect[n].abs().max()).item() for n, p in raw.named_parameters())
        result[variant] = {
            "max_grad_err": err,
            "max_rel_grad_err": rel,
            "in_place": in_place,
            "norm_rel_err": ((norm - want).abs() / want).item(),
            "grad_dtypes": sorted({str(p.grad.dtype) for p in raw.parameters()}),
            "buckets": [list(b.names) for b in plan.buckets],
            "units": [list(b.units) for b in plan.buckets],
            "pieces": splitter.pieces,
            "n_compiled_pieces": len(compiled_pieces),
            "misaligned": splitter.misaligned,
            "ca_all_reduces": sum("all_reduce" in op for op in ca_ops),
            "ca_ops": len(ca_ops),
        }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)  # not finalizing the interpreter, where gloo's threads can abort it (trainer.distributed.env.exit_code)
