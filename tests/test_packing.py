"""Packed instruction documents (trainer/packing.py): the packing, each document attending to itself only, a loss per
target token of the global batch whatever the micro-batches and ranks, and a resume inside an epoch.

The instruction directories here are written directly (tokens, a loss mask, document starts, meta.json in
``trainer prepare``'s format), so these tests pin the trainer's side of the format without tokenizing."""

import json
import os
import sys

import numpy as np
import pytest
import torch

from tests.conftest import cli, metric, shared_run, torchrun
from trainer.data import Documents, load_corpus
from trainer.packing import IGNORE, PackedBatches, Packing, pack

VOCAB = 97
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": VOCAB, "tie_word_embeddings": True}  # fmt: skip


def write_instructions(d, n_docs=(60, 12), lo=5, hi=60, seed=0):
    """An instruction directory: ``n_docs`` (train, val) documents of ``lo`` to ``hi - 1`` random tokens, each a
    prompt (no targets) then a completion (targets) of random lengths."""
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    meta = {"format": "chat", "vocab_size": VOCAB, "dtype": "uint16", "eos_id": 1, "tokenizer": "test", "tokens": {}}
    for split, n in zip(("train", "val"), n_docs):
        lengths = rng.integers(lo, hi, size=n)
        tokens = rng.integers(2, VOCAB, size=lengths.sum()).astype(np.uint16)
        mask = np.zeros(lengths.sum(), np.uint8)
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        for s, n_tokens in zip(starts[:-1], lengths):
            mask[s + rng.integers(1, n_tokens) : s + n_tokens] = 1
        tokens.tofile(d / f"{split}.bin")
        mask.tofile(d / f"{split}.mask.bin")
        np.save(d / f"{split}.docs.npy", starts)
        meta["tokens"][split] = int(lengths.sum())
    (d / "meta.json").write_text(json.dumps(meta))
    return d


def _docs(lengths, seed=0) -> Documents:
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return Documents(rng.integers(2, VOCAB, lengths.sum()), rng.integers(0, 2, lengths.sum()).astype(np.uint8), starts)


def test_every_piece_is_packed_once_an_epoch_and_long_documents_are_cut():
    """An epoch holds every piece once, no sequence is over seq_len, a 150-token document is cut into 64, 64, 22,
    best-fit fills the sequences to within a few percent, and the order is a function of (seed, epoch)."""
    rng = np.random.default_rng(1)
    docs = _docs([*rng.integers(5, 64, 2000), 150])
    p = Packing(docs, 64, seed=3, tag=0, filler=0)
    assert docs.split_documents(64) == 1 and list(p.lengths[-3:]) == [64, 64, 22]
    for e in (0, 1):
        items, bounds, _ = p.epoch(e)
        assert sorted(items) == list(range(len(p.lengths)))
        assert max(p.lengths[items[a:b]].sum() for a, b in zip(bounds[:-1], bounds[1:])) <= 64
    assert not np.array_equal(p.epoch(0)[0], p.epoch(1)[0])
    assert np.array_equal(p.epoch(0)[0], Packing(docs, 64, seed=3, tag=0, filler=0).epoch(0)[0])
    assert p.fill() > 0.97, p.fill()  # 2,000 pieces of 5-63 tokens: observed 0.995


def test_a_sequence_holds_whole_pieces_with_their_targets_and_restarting_positions():
    """Each sequence, read back piece by piece: the tokens in order, the target of token i the piece's token i + 1
    where the mask marks it (else -100, and -100 at a piece's last token), positions from 0; the rest is filler."""
    docs = _docs([7, 30, 12, 64, 3, 20])
    p = Packing(docs, 64, seed=0, tag=0, filler=1)
    items, bounds, per_seq = p.epoch(0)
    rows = p.rows(0, len(bounds) - 1)
    for s in range(len(bounds) - 1):
        x, y, pos = rows[:, s]
        at = 0
        for i in items[bounds[s] : bounds[s + 1]]:
            a, n = p.starts[i], p.lengths[i]
            t, m = docs.tokens[a : a + n], docs.mask[a : a + n]
            assert np.array_equal(x[at : at + n], t) and np.array_equal(pos[at : at + n], np.arange(n))
            assert np.array_equal(y[at : at + n - 1], np.where(m[1:] == 1, t[1:], IGNORE)) and y[at + n - 1] == IGNORE
            at += n
        assert (x[at:] == 1).all() and (y[at:] == IGNORE).all() and (pos[at:] == np.arange(64 - at)).all()
        assert per_seq[s] == (y != IGNORE).sum()


def test_the_data_of_a_step_does_not_depend_on_the_ranks_and_the_weights_count_targets():
    """A step's global batch cut as 1 rank x 2 x 2, and as 2 ranks x 1 x 2: the same sequences; each micro-batch's
    weight is its targets x ranks / the global batch's targets."""
    docs = _docs(np.random.default_rng(2).integers(5, 64, 300))
    kw = dict(seq_len=64, seed=5, device="cpu")
    one = PackedBatches(docs, docs, micro_batch_size=2, grad_accum=2, rank=0, world_size=1, **kw)
    ranks = [PackedBatches(docs, docs, micro_batch_size=1, grad_accum=2, rank=r, world_size=2, **kw) for r in (0, 1)]
    for step in (0, 7, 30):  # 30: past the first epoch
        xs = torch.cat([one.train_batch(step, m)[0] for m in range(2)])
        assert torch.equal(xs, torch.cat([b.train_batch(step, m)[0] for b in ranks for m in range(2)]))
        total = one.targets(step)
        for b, world in ((one, 1), *((r, 2) for r in ranks)):
            for m in range(b.accum):
                _, y, _, w = b.train_batch(step, m)
                assert w.item() == pytest.approx((y != IGNORE).sum().item() * world / total, rel=1e-6)


def test_the_validation_loss_is_the_mean_over_all_of_its_targets():
    """An evaluation of E micro-batches on 1 rank and on 2: the mean over the ranks of (sum of each micro-batch's
    mean loss x its weight) / E (what TrainStep.evaluate computes) is the mean token loss over every target of the
    E global micro-batches, though they hold different target counts (asserted)."""
    docs = _docs(np.random.default_rng(4).integers(5, 64, 200))
    kw = dict(seq_len=64, seed=1, device="cpu", grad_accum=1, eval_batches=3)
    token_loss = torch.rand(VOCAB, generator=torch.Generator().manual_seed(0))  # a loss per target token id

    def evaluate(world: int) -> tuple[float, list[int]]:
        ranks = [PackedBatches(docs, docs, micro_batch_size=4 // world, rank=r, world_size=world, **kw)
                 for r in range(world)]  # fmt: skip
        totals, counts = [], []
        for b in ranks:
            total = 0.0
            for i in range(3):
                _, y, _, w = b.val_batch(i)
                kept = y[y != IGNORE]
                counts.append(len(kept))
                total += (token_loss[kept].mean().item() if len(kept) else 0.0) * w.item()
            totals.append(total / 3)
        return sum(totals) / world, counts

    one, counts = evaluate(1)
    assert len(set(counts)) > 1, counts  # the micro-batches hold different numbers of targets
    expected = (
        torch.cat(
            [
                token_loss[y[y != IGNORE]]
                for y in (
                    PackedBatches(docs, docs, micro_batch_size=4, rank=0, world_size=1, **kw).val_batch(i)[1]
                    for i in range(3)
                )
            ]  # fmt: skip
        )
        .mean()
        .item()
    )
    assert one == pytest.approx(expected, rel=1e-6)
    assert evaluate(2)[0] == pytest.approx(expected, rel=1e-6)


def _model(documents: str | None = "dense", attention: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.models.hf import HFCausalLM, use_document_mask

    torch.manual_seed(0)
    model = HFCausalLM(LlamaForCausalLM(LlamaConfig(**TINY, attn_implementation=attention))).eval()
    if documents:
        assert use_document_mask(model, documents, 64) is None
    return model


def test_the_loss_of_a_pack_is_the_documents_losses_alone_per_target():
    """A packed micro-batch's loss against the Hugging Face model run on each document alone with labels=-100 where
    the mask is 0: the sum of those losses (each its mean x its targets) over the targets, within 1e-5 (observed
    ~2e-7: fp32 reductions in another order)."""
    docs = _docs(np.random.default_rng(3).integers(5, 40, 24), seed=3)
    batches = PackedBatches(docs, docs, seq_len=64, micro_batch_size=4, grad_accum=1, rank=0, world_size=1, seed=0,
                            device="cpu")  # fmt: skip
    model = _model()
    x, y, pos, _ = batches.train_batch(0, 0)
    with torch.no_grad():
        packed = model(x, y, pos).item()
        p = batches.train
        items, bounds, _ = p.epoch(0)
        total, count = 0.0, 0
        for i in items[: bounds[4]]:  # the pieces of the first 4 sequences
            a, n = p.starts[i], p.lengths[i]
            ids = torch.as_tensor(docs.tokens[a : a + n]).long()[None]
            labels = torch.where(torch.as_tensor(docs.mask[a : a + n]).bool()[None], ids, IGNORE)
            targets = int((labels[0, 1:] != IGNORE).sum())
            if targets:
                total += model.hf(input_ids=ids, labels=labels).loss.item() * targets
                count += targets
    assert count == (y != IGNORE).sum().item()
    assert packed == pytest.approx(total / count, abs=1e-5)


@pytest.mark.parametrize("kind, attention", [("dense", "sdpa"), ("dense", "eager"), ("flex", "sdpa")])
def test_a_document_changed_in_a_pack_leaves_the_others_logits_unchanged(kind, attention):
    """Every token of one document replaced: the logits of every other document in the pack are unchanged, with
    SDPA's dense mask, with transformers' eager attention (which adds its mask to the scores: given a boolean one,
    it let every token see the whole sequence) and with FlexAttention's block mask (forward only: FlexAttention has
    no backward on the CPU). Observed: equal to the bit (dense), within 1e-6 (flex: its kernel's blocks)."""
    docs = _docs([20, 15, 25], seed=4)
    batches = PackedBatches(docs, docs, seq_len=64, micro_batch_size=1, grad_accum=1, rank=0, world_size=1, seed=0,
                            device="cpu")  # fmt: skip
    model = _model(kind, attention)
    assert model.documents == {"eager": "additive"}.get(attention, kind)
    x, _, pos, _ = batches.train_batch(0, 0)
    starts = torch.nonzero(pos[0] == 0).flatten().tolist() + [64]
    a, b = starts[1], starts[2]  # the second document of the pack
    changed = x.clone()
    changed[0, a:b] = (changed[0, a:b] + 1) % VOCAB
    with torch.no_grad():
        before, after = model(x, None, pos), model(changed, None, pos)
    others = torch.ones(64, dtype=torch.bool)
    others[a:b] = False
    assert not torch.allclose(before[0, a:b], after[0, a:b])
    torch.testing.assert_close(after[0, others], before[0, others], rtol=0, atol=1e-6)


SHAPE = ["model.hf=configs/hf/llama-3.2-1b", *(f"model.hf_overrides.{k}={v}" for k, v in TINY.items()),
         "seed=0", "data.seq_len=64", "train.steps=1", "schedule.warmup_steps=0", "train.eval_every=0", "log.every=1",
         "log.progress=false", "compile.enabled=false", "checkpoint.enabled=false"]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return shared_run(tmp_path_factory, "packing-data", write_instructions)


def test_one_batch_cut_three_ways_gives_one_loss_and_gradient(data, tmp_path):
    """The first step's loss and gradient norm with micro_batch_size 4 x grad_accum 1, 2 x 2, and 2 gloo ranks x
    1 x 2, on masked data whose micro-batches hold different numbers of targets: equal within 1e-6 relative (one
    fp32 rounding of sums taken in another order)."""
    corpus = load_corpus(str(data), None, 0.1, 64)
    b = PackedBatches(*corpus.documents, seq_len=64, micro_batch_size=1, grad_accum=4, rank=0, world_size=1, seed=0,
                      device="cpu")  # fmt: skip
    counts = {int((b.train_batch(0, m)[1] != IGNORE).sum()) for m in range(4)}
    assert len(counts) > 1, counts  # the micro-batches differ: a mean per micro-batch would weight tokens unequally
    runs = {}
    for name, mbs, accum in (("4x1", 4, 1), ("2x2", 2, 2)):
        runs[name] = tmp_path / name
        r = cli(None, "fit", "configs/tiny.yaml", *SHAPE, f"data.path={data}", f"train.micro_batch_size={mbs}",
                f"train.grad_accum={accum}", f"run.dir={runs[name]}")  # fmt: skip
        assert r.returncode == 0
    runs["2 ranks"] = tmp_path / "ranks"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "trainer", "fit",
           "configs/tiny.yaml", *SHAPE, f"data.path={data}", "distributed.strategy=ddp", "train.micro_batch_size=1",
           "train.grad_accum=2", f"run.dir={runs['2 ranks']}"]  # fmt: skip
    r = torchrun(cmd, timeout=180, env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    loss = {k: metric(d, "loss")[1] for k, d in runs.items()}
    norm = {k: metric(d, "grad_norm")[1] for k, d in runs.items()}
    for k in runs:
        assert loss[k] == pytest.approx(loss["4x1"], rel=1e-6), loss
        assert norm[k] == pytest.approx(norm["4x1"], rel=1e-6), norm
    assert metric(runs["4x1"], "targets")[1] == sum(int((b.train_batch(0, m)[1] != IGNORE).sum()) for m in range(4))


def test_a_resume_inside_an_epoch_continues_it_bit_for_bit(data, tmp_path):
    """10 steps straight against 4, a checkpoint, and a resume to 10 (an epoch is about 8 steps here): the same
    losses, bit for bit, before and after the epoch's end."""
    common = [*SHAPE, f"data.path={data}", "train.micro_batch_size=2", "train.grad_accum=2", "train.steps=10",
              "checkpoint.enabled=true", "checkpoint.every=4"]  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert cli(None, "fit", "configs/tiny.yaml", *common, f"run.dir={straight}").returncode == 0
    assert cli(None, "fit", "configs/tiny.yaml", *common, "train.stop_at=4", f"run.dir={resumed}").returncode == 0
    assert cli(None, "fit", "configs/tiny.yaml", *common, "resume=last", f"run.dir={resumed}").returncode == 0
    a, b = metric(straight, "loss"), metric(resumed, "loss")
    assert [a[s] for s in range(5, 11)] == [b[s] for s in range(5, 11)]
    assert metric(straight, "targets") == metric(resumed, "targets")


def test_instruction_data_with_a_model_that_takes_no_document_mask_exits_2(data, capsys):
    """The built-in GPT on packed documents would attend across them: refused, naming the key and the way out."""
    r = cli(capsys, "fit", "configs/tiny.yaml", f"data.path={data}", "train.steps=1", "compile.enabled=false")
    assert r.returncode == 2
    assert "data.path" in r.stderr and "document mask" in r.stderr and "model.hf" in r.stderr
    assert "Traceback" not in r.stderr


def test_pack_is_best_fit_within_a_window():
    """Pieces of 40, 30, 24 and 10 tokens in sequences of 64: 40 + 24 and 30 + 10 (best fit), not 40 + 10."""
    items, bounds = pack(np.array([40, 30, 24, 10]), 64, np.random.default_rng(0))
    seqs = sorted(sorted(items[a:b].tolist()) for a, b in zip(bounds[:-1], bounds[1:]))
    assert seqs == [[0, 2], [1, 3]]


@pytest.mark.gpu
def test_the_flex_document_mask_trains_compiled_on_cuda_as_the_dense_one():
    """On CUDA, compiled: FlexAttention's block mask gives the dense mask's loss and gradients (fp32; its kernel adds
    in blocks: within 1e-5 in the loss, 1e-4 relative in the gradients' norm)."""
    docs = _docs(np.random.default_rng(5).integers(5, 200, 40), seed=5)
    batches = PackedBatches(docs, docs, seq_len=256, micro_batch_size=2, grad_accum=1, rank=0, world_size=1, seed=0,
                            device="cuda")  # fmt: skip
    x, y, pos, _ = batches.train_batch(0, 0)
    out = {}
    for kind in ("dense", "flex"):
        model = _model(kind).cuda().train()
        loss = torch.compile(model)(x, y, pos)
        loss.backward()
        out[kind] = loss.item(), torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    assert out["flex"][0] == pytest.approx(out["dense"][0], abs=1e-5), out
    assert out["flex"][1] == pytest.approx(out["dense"][1], rel=1e-4), out


def test_a_sliding_window_narrower_than_the_sequence_is_refused():
    """A mask given to transformers replaces its sliding-window masks: a model whose window (16) is narrower than
    data.seq_len (64) would let a long document see past it, so it is refused, naming the key and the window."""
    from transformers import MistralConfig, MistralForCausalLM

    from trainer.models.hf import HFCausalLM, use_document_mask

    model = HFCausalLM(MistralForCausalLM(MistralConfig(**TINY, sliding_window=16)))
    with pytest.raises(ValueError, match="data.seq_len: 64.*sliding window of 16 .*at most 16"):
        use_document_mask(model, "dense", 64)
    assert use_document_mask(model, "dense", 16) is None


def test_the_evaluation_under_flexattention_runs_eager_with_the_dense_mask():
    """Packed documents under FlexAttention evaluate in trainer.build's context: no graph compiled (the compiled
    inference graph with FlexAttention inside fails on an H200), SDPA with the dense mask (the loss of a dense
    model, within 1e-6), and FlexAttention back after it."""
    from torch._dynamo.testing import CompileCounter

    from trainer.build import _eval_context

    docs = _docs(np.random.default_rng(6).integers(5, 40, 20), seed=6)
    batches = PackedBatches(docs, docs, seq_len=64, micro_batch_size=2, grad_accum=1, rank=0, world_size=1, seed=0,
                            device="cpu")  # fmt: skip
    x, y, pos, _ = batches.train_batch(0, 0)
    flex, counter = _model("flex"), CompileCounter()
    compiled = torch.compile(flex, backend=counter)
    plan = type("Plan", (), {"documents": "flex"})()
    with torch.no_grad(), _eval_context(flex, plan)():
        assert flex.documents == "dense" and flex.hf.config._attn_implementation == "sdpa"
        loss = compiled(x, y, pos)
        want = _model("dense")(x, y, pos)
    assert counter.frame_count == 0
    assert loss.item() == pytest.approx(want.item(), abs=1e-6)
    assert flex.documents == "flex" and flex.hf.config._attn_implementation == "flex_attention"
