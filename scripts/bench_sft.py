"""Fine-tuning throughput: trainer's packed documents against a user's padded loop, on the same instruction set.

The set: ``--examples`` examples of lengths drawn uniformly from ``--min-len`` to ``--max-len`` tokens (random ids
below 32768), each a prompt (its first 20-80%, no loss) then a completion (the targets), written as a prepared
instruction directory (``trainer prepare``'s chat format: tokens, loss mask, document starts).

Rows, each in its own process on one GPU:

- ``loop``: what a user writes with transformers: ``LlamaForCausalLM`` of ``--hf``'s config (random weights),
  ``torch.compile(model)``, the examples in a seeded order, ``--batch`` of them per step padded to the batch's
  longest (dynamic padding), an attention mask for the padding, ``labels`` -100 on the prompt and the padding,
  transformers' own loss; fused AdamW (lr 1e-4, fp32 master weights), bf16 autocast, ``clip_grad_norm_(1.0)``.
- ``ours``: ``trainer fit --config`` on that directory: whole examples packed into sequences of ``--seq-len``
  (``--batch`` of them per step), each attending to itself only, the loss per target token.

Each row runs ``--warmup`` steps (compiles; the loop's recompile for a dynamic sequence length), then ``--steps``
timed steps. Reported: target tokens per second (the completion tokens a step trains on, over its time), all tokens
per second, peak memory, and ours over the loop.

    python scripts/bench_sft.py                       # one GPU: writes scripts/results/bench_sft/result.json
    python scripts/bench_sft.py --device cpu --tiny   # the same on a CPU with a tiny model, to check the script
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts._meta import ROOT, git_sha  # noqa: E402

RESULT = ROOT / "scripts/results/bench_sft/result.json"
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 32768}  # fmt: skip
VOCAB = 32768


def write_set(d: Path, examples: int, lo: int, hi: int, seed: int = 0) -> dict:
    """The instruction set as a prepared chat directory (train and a small val split); returns its counts."""
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    meta = {"format": "chat", "vocab_size": VOCAB, "dtype": "uint16", "eos_id": 0, "tokenizer": "random ids",
            "tokens": {}, "documents": {}, "targets": {}}  # fmt: skip
    for split, n in (("train", examples), ("val", max(examples // 50, 4))):
        lengths = rng.integers(lo, hi + 1, size=n)
        tokens = rng.integers(1, VOCAB, size=lengths.sum()).astype(np.uint16)
        mask = np.zeros(lengths.sum(), np.uint8)
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        for s, length in zip(starts[:-1], lengths):
            mask[s + int(length * rng.uniform(0.2, 0.8)) : s + length] = 1
        tokens.tofile(d / f"{split}.bin")
        mask.tofile(d / f"{split}.mask.bin")
        np.save(d / f"{split}.docs.npy", starts)
        meta["tokens"][split], meta["documents"][split] = int(lengths.sum()), int(n)
        meta["targets"][split] = int(mask.sum())
    (d / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def loop_row(args) -> dict:
    """The padded loop, in this process."""
    import torch
    import transformers

    from trainer.data import load_corpus

    device = torch.device(args.device)
    docs = load_corpus(args.data, None, 0.0, args.seq_len).documents[0]
    config = transformers.AutoConfig.from_pretrained(ROOT / args.hf)
    if args.tiny:
        for k, v in TINY.items():
            setattr(config, k, v)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    step_model = torch.compile(model)
    order = np.random.default_rng(0).permutation(len(docs.starts) - 1)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def batch(k: int):
        rows = order[(k * args.batch) % len(order) :][: args.batch]
        spans = [(docs.starts[i], docs.starts[i + 1]) for i in rows]
        longest = max(b - a for a, b in spans)
        ids = np.zeros((len(spans), longest), np.int64)
        labels = np.full((len(spans), longest), -100, np.int64)
        attn = np.zeros((len(spans), longest), np.int64)
        for j, (a, b) in enumerate(spans):
            t = docs.tokens[a:b].astype(np.int64)
            ids[j, : b - a], attn[j, : b - a] = t, 1
            labels[j, : b - a] = np.where(docs.mask[a:b] == 1, t, -100)
        targets = int((labels[:, 1:] != -100).sum())  # transformers shifts the labels: the first is never a target
        as_t = lambda a: torch.from_numpy(a).to(device, non_blocking=True)  # noqa: E731
        return as_t(ids), as_t(attn), as_t(labels), targets, ids.size

    def step(k: int) -> tuple[int, int]:
        ids, attn, labels, targets, tokens = batch(k)
        with autocast:
            loss = step_model(input_ids=ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return targets, tokens

    t0 = time.perf_counter()
    for k in range(args.warmup):
        step(k)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    warm = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0, targets, tokens = time.perf_counter(), 0, 0
    for k in range(args.warmup, args.warmup + args.steps):
        n, t = step(k)
        targets, tokens = targets + n, tokens + t
    sync()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    return {"targets_per_s": targets / seconds, "tokens_per_s": tokens / seconds, "step_s": seconds / args.steps,
            "warmup_s": warm, "peak_mem_gb": peak, "targets_per_step": targets / args.steps}  # fmt: skip


def ours_row(args) -> dict:
    """``trainer fit`` on the set, in a child process; the timed steps read from its metrics.jsonl."""
    run = Path(tempfile.mkdtemp(prefix="bench_sft_"))
    tiny = [f"model.hf_overrides.{k}={v}" for k, v in TINY.items()] if args.tiny else []
    cmd = [sys.executable, "-m", "trainer", "fit", args.config, f"data.path={args.data}", f"run.dir={run}",
           f"data.seq_len={args.seq_len}", f"train.micro_batch_size={args.batch}", "train.grad_accum=1",
           f"train.steps={args.warmup + args.steps}", "train.eval_every=0", "checkpoint.enabled=false", "log.every=1",
           "log.progress=false", f"train.device={args.device}", *tiny, *args.ours]  # fmt: skip
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"ours failed ({r.returncode}):\n{r.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    timed = [x for x in rows if x["step"] > args.warmup]
    seconds = sum(x["step_time"] for x in timed)
    targets = sum(x["targets"] for x in timed)
    return {"targets_per_s": targets / seconds, "tokens_per_s": len(timed) * args.batch * args.seq_len / seconds,
            "step_s": seconds / len(timed), "first_step_s": rows[0].get("first_step_s"),
            "peak_mem_gb": max((x.get("peak_mem_gb") or 0) for x in rows) or None,
            "targets_per_step": targets / len(timed), "wall_s": time.perf_counter() - t0,
            "path": next((line for line in r.stdout.splitlines() if line.startswith("path:")), "")}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model (a CPU check of the script)")
    p.add_argument("--hf", default="configs/hf/llama-3.2-1b", help="the model's config directory")
    p.add_argument("--config", default="configs/sft-llama-1b.yaml", help="ours: the trainer config")
    p.add_argument("--examples", type=int, default=4000)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="examples per step (loop), sequences per step (ours)")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rows", default="loop,ours")
    p.add_argument("--ours", nargs="*", default=[], help="more key=value overrides for ours")
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)  # a child's: the set's directory
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)  # a child's: the row it runs
    p.add_argument("--out", default=str(RESULT))
    args = p.parse_args()
    if args.row == "loop":
        print(json.dumps(loop_row(args)))
        return
    data = Path(tempfile.mkdtemp(prefix="bench_sft_data_"))
    meta = write_set(data, args.examples, args.min_len, args.max_len)
    args.data = str(data)
    import torch

    results = {}
    doc = {
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "git_sha": git_sha(),
        "set": {
            "examples": args.examples,
            "lengths": [args.min_len, args.max_len],
            "tokens": meta["tokens"]["train"],
            "targets": meta["targets"]["train"],
        },  # fmt: skip
        "args": {k: v for k, v in vars(args).items() if k not in ("data", "row", "out")},
        "results": results,
    }
    for row in args.rows.split(","):
        if row == "ours":
            results[row] = ours_row(args)
        else:
            child = [sys.executable, __file__, *sys.argv[1:], "--row", "loop", "--data", str(data)]
            r = subprocess.run(child, capture_output=True, text=True, cwd=ROOT)
            if r.returncode != 0:
                raise SystemExit(f"loop failed ({r.returncode}):\n{r.stderr[-4000:]}")
            results[row] = json.loads(r.stdout.strip().splitlines()[-1])
        print(row, json.dumps(results[row]), flush=True)
        if "loop" in results and "ours" in results:
            doc["speedup_targets"] = results["ours"]["targets_per_s"] / results["loop"]["targets_per_s"]
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")  # after each row: a cut-off run keeps its rows
    print("| row | target tok/s | tok/s | step | peak GB |\n|---|---|---|---|---|")
    for name, r in results.items():
        peak = "-" if r["peak_mem_gb"] is None else f"{r['peak_mem_gb']:.1f}"
        print(
            f"| {name} | {r['targets_per_s']:,.0f} | {r['tokens_per_s']:,.0f} | {r['step_s'] * 1e3:.0f} ms | {peak} |"
        )
    if "speedup_targets" in doc:
        print(f"ours / loop, target tokens per second: {doc['speedup_targets']:.2f}x")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
