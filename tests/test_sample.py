"""`trainer sample`: text from a run's checkpoint (built-in GPT, model.target, model.hf, a prepared directory)."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.conftest import FAST, ROOT
from trainer import Trainer, load_config, sample
from trainer.cli import main

PROMPT = "def "
GPT = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32"]  # the built-in GPT's shape; others bring their own


def _fit(run_dir, *overrides):
    """Four steps of a tiny run on the embedded corpus (or data.path), in this process; returns its run directory."""
    base = [o for o in FAST if not o.startswith("model.")]
    cfg = load_config(ROOT / "configs/tiny.yaml", [*base, "train.steps=4", "train.eval_every=0", f"run.dir={run_dir}",
                                                   *overrides])  # fmt: skip
    Trainer(cfg).fit()
    return run_dir


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    return _fit(tmp_path_factory.mktemp("gpt"), *GPT)


@pytest.fixture
def spy(monkeypatch):
    """The ids each generate() call drew, in order."""
    drawn, real = [], sample.generate

    def generate(*args, **kwargs):
        drawn.append(real(*args, **kwargs))
        return drawn[-1]

    monkeypatch.setattr(sample, "generate", generate)
    return drawn


def _sample(capsys, run_dir, *args):
    """Exit status, stdout and stderr of an in-process `trainer sample`."""
    capsys.readouterr()
    code = main(["sample", str(run_dir), *args])
    out = capsys.readouterr()
    return SimpleNamespace(code=code, out=out.out, err=out.err)


def _bytes_continuation(capsys, run_dir, spy, *args, tokens=20):
    r = _sample(capsys, run_dir, "--prompt", PROMPT, "--tokens", str(tokens), *args)
    assert r.code == 0, r.err
    assert r.out.startswith(PROMPT) and r.out.endswith("\n")
    text = r.out[len(PROMPT) : -1]
    ids = spy[-1]
    # The bytes codec: one byte per token, invalid UTF-8 read as U+FFFD (one per bad sequence, so at most 20 chars).
    assert len(ids) == tokens and all(0 <= i < 256 for i in ids)
    assert text == bytes(ids).decode("utf-8", errors="replace") and 0 < len(text) <= tokens
    return r


def test_sample_a_built_in_gpt_run(capsys, gpt_run, spy):
    r = _bytes_continuation(capsys, gpt_run, spy)
    assert r.err.splitlines()[0] == f"sampling 20 tokens from {gpt_run / 'checkpoints/step_000004'} (step 4)"
    again = _bytes_continuation(capsys, gpt_run, spy)
    assert again.out == r.out  # same seed, same text
    other = _bytes_continuation(capsys, gpt_run, spy, "--seed", "1")
    assert spy[-1] != spy[0]  # another seed draws other bytes
    assert other.out.startswith(PROMPT)
    greedy = [_bytes_continuation(capsys, gpt_run, spy, "--temperature", "0", "--seed", str(s)).out for s in (0, 5)]
    assert greedy[0] == greedy[1]  # greedy ignores the seed
    one = _bytes_continuation(capsys, gpt_run, spy, "--top-k", "1", "--temperature", "2")
    assert one.out == greedy[0]  # top-k 1 is greedy at any temperature


def test_sample_crops_the_context_to_seq_len(capsys, gpt_run, spy):
    # 40 prompt bytes and 30 more tokens: past data.seq_len (32) twice over; the GPT asserts T <= its block size.
    r = _sample(capsys, gpt_run, "--prompt", "x" * 40, "--tokens", "30", "--checkpoint", str(gpt_run))
    assert r.code == 0, r.err
    assert r.out.startswith("x" * 40) and len(spy[-1]) == 30


def test_sample_errors_exit_2(capsys, gpt_run, tmp_path):
    cases = {
        "no such run directory": [str(tmp_path / "nope")],
        "--tokens: expected a positive number": [str(gpt_run), "--tokens", "0"],
        "--temperature: expected a finite number, 0 (greedy) or more, got -1": [str(gpt_run), "--temperature", "-1"],
        "--top-k: expected 0 (every token) or a positive number": [str(gpt_run), "--top-k", "-3"],
        "--checkpoint /no/such: no such checkpoint directory": [str(gpt_run), "--checkpoint", "/no/such"],
        "is not a run directory (no config.yaml)": [str(tmp_path)],
    }
    for message, args in cases.items():
        capsys.readouterr()
        assert main(["sample", *args]) == 2, message
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    # A run without a checkpoint: say how to get one.
    empty = tmp_path / "no-ckpt"
    empty.mkdir()
    shutil.copy(gpt_run / "config.yaml", empty / "config.yaml")
    r = _sample(capsys, empty)
    assert r.code == 2 and "no complete checkpoint" in r.err and "checkpoint.enabled=true" in r.err, r.err
    # A run on a bare .bin: no tokenizer to encode the prompt with.
    bare = tmp_path / "bare"
    shutil.copytree(gpt_run, bare)
    np.arange(5000, dtype=np.uint16).tofile(tmp_path / "tokens.bin")
    config = (bare / "config.yaml").read_text()
    assert "  path: null\n" in config
    (bare / "config.yaml").write_text(config.replace("  path: null\n", f"  path: {tmp_path / 'tokens.bin'}\n"))
    r = _sample(capsys, bare)
    assert r.code == 2 and "no tokenizer is recorded for this token file" in r.err, r.err
    assert str(tmp_path / "tokens.bin") in r.err and "Traceback" not in r.err


def test_next_logits_of_user_models():
    class NanoGPTLike(torch.nn.Module):
        def forward(self, idx, targets=None):
            return torch.randn(idx.size(0), 1, 7), None  # nanoGPT: the last position's logits only, no loss

    class LossOnly(torch.nn.Module):
        def forward(self, idx, targets):
            return torch.tensor(0.0)

    class Scalar(torch.nn.Module):
        def forward(self, idx, targets=None):
            return torch.tensor(0.0)

    assert sample.next_logits(NanoGPTLike(), torch.zeros(2, 5, dtype=torch.long)).shape == (2, 7)
    with pytest.raises(ValueError, match=r"LossOnly.forward\(idx\) failed .*expects the logits, \(B, T, V\)"):
        sample.next_logits(LossOnly(), torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"Scalar.forward\(idx\) returned \(\); sampling calls forward\(idx\)"):
        sample.next_logits(Scalar(), torch.zeros(1, 5, dtype=torch.long))


def test_sample_a_model_target_run(capsys, tmp_path, spy):
    kwargs = "model.kwargs={n_layer: 1, n_head: 2, n_embd: 32, vocab_size: 256, block_size: 32}"
    run = _fit(tmp_path, "model.preset=null", "model.target=scripts.nanogpt_model:make", kwargs)
    _bytes_continuation(capsys, run, spy)


def test_sample_a_hugging_face_run(capsys, tmp_path, spy):
    pytest.importorskip("transformers")
    from tests.test_hf import LLAMA

    model_dir = tmp_path / "llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({**LLAMA, "num_hidden_layers": 1}))
    run = _fit(tmp_path / "run", f"model.hf={model_dir}", "model.preset=null")
    r = _bytes_continuation(capsys, run, spy)
    assert "(step 4)" in r.err


def test_sample_finds_the_data_of_a_run_launched_from_another_directory(capsys, tmp_path, spy, monkeypatch):
    """`trainer prepare` and `trainer fit` with relative paths in one directory, `trainer sample ../work/runs/mine`
    from another: the run's relative data.path is read from the directory it was launched from (plan.json's cwd)."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(work)
    (work / "src").mkdir()
    for name in ("config.py", "sample.py", "codec.py", "data.py", "io.py", "console.py"):  # 2 of them go to val.bin
        (work / "src" / name).write_text((ROOT / "trainer" / name).read_text())
    prepare = ["prepare", "src", "--tokenizer", "bpe:300", "--out", "data", "--workers", "1", "--val-fraction", "0.3"]
    assert main(prepare) == 0
    _fit(Path("runs/mine"), "data.path=data", *GPT)
    assert "  path: data\n" in (work / "runs/mine/config.yaml").read_text()  # as given: relative
    assert json.loads((work / "runs/mine/plan.json").read_text())["cwd"] == str(work)
    monkeypatch.chdir(elsewhere)
    r = _sample(capsys, "../work/runs/mine", "--prompt", PROMPT, "--tokens", "5", "--temperature", "0")
    assert r.code == 0, r.err
    assert r.out.startswith(PROMPT) and all(0 <= i < 300 for i in spy[-1])


def test_sample_a_prepared_directory_run(capsys, tmp_path, spy):
    """A directory as `trainer prepare` writes it (by hand here): its tokenizer.json encodes and decodes."""
    tokenizers = pytest.importorskip("tokenizers")
    text = (ROOT / "trainer" / "config.py").read_text()
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
                                             initial_alphabet=alphabet)  # fmt: skip
    tok.train_from_iterator([text], trainer=trainer)
    data = tmp_path / "data"
    data.mkdir()
    tok.save(str(data / "tokenizer.json"))
    ids = np.array(tok.encode(text).ids, dtype=np.uint16)
    n_val = len(ids) // 10
    ids[:-n_val].tofile(data / "train.bin")
    ids[-n_val:].tofile(data / "val.bin")
    meta = {"format": 1, "tokenizer": "bpe:400", "vocab_size": tok.get_vocab_size(), "dtype": "uint16",
            "eos_id": tok.token_to_id("<|endoftext|>"), "tokens": {"train": len(ids) - n_val, "val": n_val},
            "documents": {"train": 1, "val": 1}, "sources": ["config.py"], "field": "text"}  # fmt: skip
    (data / "meta.json").write_text(json.dumps(meta))
    run = _fit(tmp_path / "run", f"data.path={data}", *GPT)
    r = _sample(capsys, run, "--prompt", PROMPT, "--tokens", "12")
    assert r.code == 0, r.err
    drawn = spy[-1]
    assert len(drawn) == 12 and all(0 <= i < tok.get_vocab_size() for i in drawn)
    kept = drawn[: drawn.index(0)] if 0 in drawn else drawn  # the continuation stops at the end-of-text token (id 0)
    context = tok.encode(PROMPT).ids
    whole = tok.decode(context + kept)
    assert r.out == whole + "\n" and whole.startswith(PROMPT)


def test_sample_passes_over_a_damaged_checkpoint(capsys, tmp_path):
    """The newest checkpoint's model.pt cut to half its size: sample warns and reads the newest intact one, leaving
    the damaged one in place (sample does not hold the run directory: a resume there moves it aside); the damaged
    one named by --checkpoint exits 2 with why."""
    run = _fit(tmp_path / "run", *GPT, "checkpoint.every=2")
    root = run / "checkpoints"
    damaged, intact = root / "step_000004", root / "step_000002"
    size = (damaged / "model.pt").stat().st_size
    with open(damaged / "model.pt", "r+b") as f:
        f.truncate(size // 2)
    cut = f"model.pt is {size // 2:,} bytes, its manifest says {size:,}"
    r = _sample(capsys, run, "--tokens", "5")
    assert r.code == 0, r.err
    assert r.err.splitlines()[:2] == [
        f"warning: checkpoint {damaged} is damaged ({cut}): using {intact}, the newest intact one (left in place; "
        "resume=last or resume=auto in its run.dir moves it aside)",
        f"sampling 5 tokens from {intact} (step 2)",
    ], r.err
    assert (root / "last").read_text() == "step_000004\n"
    r = _sample(capsys, run, "--checkpoint", str(damaged))
    assert r.code == 2 and "Traceback" not in r.err
    beside = f"the newest intact one beside it is {intact}"
    assert f"sample: --checkpoint {damaged}: checkpoint {damaged} is damaged ({cut}); {beside}\n" in r.err, r.err
