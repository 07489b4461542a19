"""A new user's own model: found from the working directory under every launcher, and checked against the data
before step 1 (sequence length, vocabulary: exit 2 with both sizes, no traceback; a vocabulary far larger than the
data's: one warning)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import FAST, ROOT
from trainer.models.fit_check import check_model_fits

# A user's package: a nanoGPT-like model whose position table has block_size rows and no length assert of its own,
# so a longer sequence reaches torch.embedding (IndexError on a CPU, a device-side assert on a GPU).
USER_MODEL = """
import torch, torch.nn as nn, torch.nn.functional as F

class Tiny(nn.Module):
    def __init__(self, vocab_size, block_size, n_embd=16):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, targets):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        logits = self.head(x + self.mlp(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

def make(vocab_size=256, block_size=32):
    return Tiny(vocab_size, block_size)
"""


@pytest.fixture
def user_dir(tmp_path):
    """A working directory holding the package ``mypkg`` and a config that names ``mypkg.models:make``."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "models.py").write_text(textwrap.dedent(USER_MODEL))
    (tmp_path / "my.yaml").write_text("model:\n  preset: null\n  target: mypkg.models:make\n")
    return tmp_path


def _console_script(user_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``trainer fit my.yaml ...`` through the installed console script, from ``user_dir``. An installed package of
    the same name (a ``mypkg`` without ``models``, on PYTHONPATH) must not shadow the one in the working directory,
    as an installed ``scripts`` package would shadow the repository's ``scripts/``."""
    script = Path(sys.executable).with_name("trainer")
    assert script.is_file(), f"no console script beside {sys.executable}: pip install -e ."
    decoy = user_dir / "site" / "mypkg"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(user_dir / "site")}
    args = [str(script), "fit", "my.yaml", *FAST[3:], "train.steps=2", "compile.enabled=false", *overrides]
    return subprocess.run(args, cwd=user_dir, env=env, capture_output=True, text=True, timeout=240)


def test_a_package_in_the_working_directory_trains_from_the_console_script(user_dir):
    r = _console_script(user_dir)
    assert r.returncode == 0, r.stderr
    assert "done: 2 steps" in r.stdout
    assert json.loads((user_dir / "runs" / "run" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 2


def test_the_model_is_checked_against_the_data_before_step_1(user_dir):
    # A position table of 16 rows for data.seq_len=32 (FAST): exit 2 naming both, no traceback, no run left behind.
    r = _console_script(user_dir, "model.kwargs={block_size: 16}")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "IndexError" not in r.stderr
    assert "position table wpe.weight holds 16 positions; data.seq_len is 32" in r.stderr, r.stderr
    assert "lower data.seq_len" in r.stderr
    assert not (user_dir / "runs" / "run").exists(), "a refused run left its directory behind"


def test_a_vocabulary_smaller_than_the_data_exits_2_naming_both(user_dir, capsys, monkeypatch):
    """The same check in-process (the Python API's path): 100 token rows for byte data (256)."""
    from trainer.cli import main

    monkeypatch.chdir(user_dir)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the working directory it adds goes with the test
    for name in ("mypkg", "mypkg.models"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    rc = main(["fit", "my.yaml", *FAST[3:], "model.kwargs={vocab_size: 100}", "run.dir=r"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert "token table wte.weight holds 100 tokens; the data's vocabulary is 256" in err, err
    assert "a vocabulary of at least 256 tokens (model.kwargs.vocab_size)" in err
    assert not (user_dir / "r").exists()


def test_a_module_that_is_truly_missing_says_where_python_looked(user_dir, capsys):
    from trainer.cli import main

    rc = main(["fit", str(user_dir / "my.yaml"), "model.target=nopkg.models:make", f"run.dir={user_dir / 'r'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "No module named 'nopkg'" in err and "PYTHONPATH=DIR" in err and os.getcwd() in err, err


def _user_model(**kwargs):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from nanogpt_model import make
    finally:
        sys.path.pop(0)
    return make(n_layer=1, n_head=2, n_embd=16, **kwargs)


def test_the_meta_check_names_the_table_and_both_sizes():
    model = _user_model(vocab_size=256, block_size=32)
    before = [p.clone() for p in model.parameters()]
    assert check_model_fits(model, 32, 256).problems == []
    fit = check_model_fits(model, 64, 300)
    assert fit.checked and fit.token_table == 256
    assert [kind for kind, _ in fit.problems] == ["tokens", "positions"]
    assert "token table transformer.wte.weight holds 256 tokens; the data's vocabulary is 300" in fit.problems[0][1]
    assert "position table transformer.wpe.weight holds 32 positions; data.seq_len is 64" in fit.problems[1][1]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # nothing ran for real
    assert model.training  # left as it was


def test_a_model_that_refuses_the_length_itself_is_reported_with_its_message():
    class Asserts(torch.nn.Module):  # nanoGPT's own check: assert t <= block_size
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(256, 8)

        def forward(self, idx, targets):
            assert idx.size(1) <= 16, f"Cannot forward sequence of length {idx.size(1)}, block size is only 16"
            return self.emb(idx).sum()

    fit = check_model_fits(Asserts(), 32, 256)
    said = "(AssertionError: Cannot forward sequence of length 32, block size is only 16)"
    assert fit.problems == [
        ("length", f"the model cannot take a sequence of data.seq_len=32 tokens, though it takes 1 {said}")
    ]


def test_a_model_that_cannot_run_on_meta_is_not_judged():
    class Reads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(8, 8)
            self.table = torch.ones(8)  # a CPU tensor kept as a plain attribute: cannot meet meta tensors

        def forward(self, idx, targets):
            return (self.emb(idx) * self.table).sum()

    fit = check_model_fits(Reads(), 32, 256)
    assert not fit.checked and fit.problems == []


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hugging_face_models_run_the_meta_check(family):
    """Past the config's own checks (trainer.models.hf), the meta forward sees a Hugging Face model's tables too:
    transformers reads a value from the positions (``.all()``), which the check answers."""
    from trainer.models.hf import HFCausalLM

    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=256, n_positions=32)
        model = HFCausalLM(transformers.GPT2LMHeadModel(config))
        fit = check_model_fits(model, 64, 300)
        assert [kind for kind, _ in fit.problems] == ["tokens", "positions"], fit
        assert "hf.transformer.wpe.weight holds 32 positions" in fit.problems[1][1]
    else:
        config = transformers.LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                          hidden_size=16, intermediate_size=32, vocab_size=1000)  # fmt: skip
        fit = check_model_fits(HFCausalLM(transformers.LlamaForCausalLM(config)), 64, 256)
        assert fit.checked and fit.problems == [] and fit.token_table == 1000  # rotary: no position table


def test_a_vocabulary_far_larger_than_the_data_is_warned_of_unless_pretrained(tmp_path, capsys):
    """One warning line for a random-init Hugging Face model with 4096 tokens on byte data (256); none when the
    weights are pretrained (their vocabulary is fixed)."""
    from trainer.cli import main

    config = transformers.LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      hidden_size=16, intermediate_size=32, vocab_size=4096, bos_token_id=0,
                                      eos_token_id=0, max_position_embeddings=64)  # fmt: skip
    llama = transformers.LlamaForCausalLM(config)
    llama.save_pretrained(tmp_path / "llama")
    total = sum(p.numel() for p in llama.parameters())
    grows = 2 * 4096 * 16  # the embedding and the untied head, 16 wide
    text = tmp_path / "text.txt"
    text.write_text((ROOT / "trainer" / "config.py").read_text())
    base = ["fit", "configs/tiny.yaml", f"model.hf={tmp_path / 'llama'}", f"data.path={text}", *FAST[3:],
            "train.steps=1", "compile.enabled=false", "checkpoint.enabled=false"]  # fmt: skip
    warning = "has a 4,096-token vocabulary for data of 256 tokens"
    assert main([*base, f"run.dir={tmp_path / 'random'}"]) == 0
    err = capsys.readouterr().err  # console.warn: stderr
    assert err.count(f"warning: model.hf {tmp_path / 'llama'} {warning}") == 1, err
    assert "model.hf_overrides.vocab_size=256" in err, err
    share = f"hold {grows / 1e6:.2f}M of its {total / 1e6:.2f}M parameters ({grows / total:.0%}), where the data's "
    assert f"{share}vocabulary needs {2 * 256 * 16:,}." in err, err  # the share, not a "4096 / 256 = 16x slower"
    assert main([*base, f"run.dir={tmp_path / 'pretrained'}", "model.pretrained=true"]) == 0
    said = capsys.readouterr()
    assert warning not in said.out + said.err


# Models with nothing to train: today's first backward would stop with "element 0 of tensors does not require grad".
NOTHING_TO_TRAIN = """
import torch.nn as nn

class Constant(nn.Module):  # no parameters: the loss is computed from none
    def forward(self, idx, targets):
        return idx.float().mean() * 0 + 1.0

class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(256, 8).requires_grad_(False)

    def forward(self, idx, targets):
        return self.wte(idx).mean()

class Unused(Constant):  # a parameter that requires grad, which the loss never reaches
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 8)

def constant():
    return Constant()

def frozen():
    return Frozen()

def unused():
    return Unused()
"""


@pytest.mark.parametrize(
    "factory, why",
    [
        ("constant", "has no trainable parameters (it has no parameters)"),
        ("frozen", "has no trainable parameters (its one parameter has requires_grad=False)"),
        ("unused", "has no trainable parameters in its loss (the loss its forward returns does not require grad"),
    ],
)
def test_a_model_with_nothing_to_train_exits_2_before_step_1(user_dir, capsys, monkeypatch, factory, why):
    from trainer.cli import main

    (user_dir / "mypkg" / "still.py").write_text(textwrap.dedent(NOTHING_TO_TRAIN))
    monkeypatch.chdir(user_dir)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the working directory it adds goes with the test
    for name in ("mypkg", "mypkg.still"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    rc = main(["fit", "my.yaml", *FAST[3:], f"model.target=mypkg.still:{factory}", "run.dir=r"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "element 0 of tensors" not in err, err
    assert f"model.target mypkg.still:{factory} {why}" in err, err
    assert not (user_dir / "r").exists()
