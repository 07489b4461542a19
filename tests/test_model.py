"""The built-in GPT and the user-model contract."""

import re
import sys
import textwrap

import pytest
import torch

from trainer.models import build_model, flops_per_token, loss_of


def test_gpt2_small_has_gpt2_shape():
    m = build_model(preset="gpt2-small", vocab_size=50304, seq_len=1024)
    params = list(m.parameters())
    assert len(params) == 148  # as GPT-2 124M in nanoGPT: tied head counted once
    assert sum(p.numel() for p in params) == 124_475_904
    assert m.lm_head.weight is m.transformer.wte.weight
    # 6N + 12 L C T with N excluding position embeddings (nanoGPT's estimate_mfu)
    n = 124_475_904 - 1024 * 768
    assert flops_per_token(m, 1024) == 6 * n + 12 * 12 * 768 * 1024


def test_forward_loss_and_logits():
    torch.manual_seed(0)
    m = build_model(preset=None, vocab_size=256, seq_len=16, n_layer=2, n_head=2, n_embd=32)
    idx, targets = torch.randint(0, 256, (2, 3, 16))
    loss = m(idx, targets)
    # init std 0.02 gives near-uniform predictions: ln 256 = 5.545; observed 5.55 +- 0.02 over seeds
    assert loss.shape == () and abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1
    logits = m(idx)
    assert logits.shape == (3, 16, 256)
    ref = torch.nn.functional.cross_entropy(logits.view(-1, 256), targets.view(-1))
    torch.testing.assert_close(loss, ref)
    # causal: the first position's logits do not depend on later tokens
    idx2 = idx.clone()
    idx2[:, 5:] = (idx2[:, 5:] + 1) % 256
    torch.testing.assert_close(m(idx2)[:, :5], logits[:, :5])


def test_user_model_target(tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(
        textwrap.dedent("""
        import torch, torch.nn as nn
        class Tiny(nn.Module):
            def __init__(self, vocab, width):
                super().__init__()
                self.emb = nn.Embedding(vocab, width)
                self.out = nn.Linear(width, vocab)
            def forward(self, idx, targets):
                logits = self.out(self.emb(idx))
                return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        def make(vocab=256, width=8):
            return Tiny(vocab, width)
        def not_a_module():
            return 3
        def boom(vocab=256):
            return _layers(vocab)
        def _layers(vocab):
            raise RuntimeError("boom from the factory")
        def adds(vocab=256):
            return vocab + "x"  # a TypeError inside the factory, not in its arguments
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    m = build_model(preset=None, vocab_size=256, seq_len=8, target="mymodels:make", kwargs={"width": 4})
    idx = torch.randint(0, 256, (2, 8))
    assert loss_of(m(idx, idx)).shape == ()
    assert flops_per_token(m, 8) == 6 * sum(p.numel() for p in m.parameters())
    with pytest.raises(ValueError, match="expected an nn.Module"):
        build_model(preset=None, vocab_size=256, seq_len=8, target="mymodels:not_a_module")
    with pytest.raises(ValueError, match="cannot import"):
        build_model(preset=None, vocab_size=256, seq_len=8, target="nopkg_xyz.mod:f")
    with pytest.raises(ValueError, match="rejected its arguments"):
        build_model(preset=None, vocab_size=256, seq_len=8, target="mymodels:make", kwargs={"depth": 1})
    # The factory's own exception: its type and message, and the line of the user's code that raised it.
    lines = (tmp_path / "mymodels.py").read_text().splitlines()
    at = {word: f"{tmp_path / 'mymodels.py'}:{lines.index(next(x for x in lines if word in x)) + 1}"
          for word in ("raise RuntimeError", "return vocab +")}  # fmt: skip
    with pytest.raises(ValueError) as e:
        build_model(preset=None, vocab_size=256, seq_len=8, target="mymodels:boom")
    assert str(e.value) == (
        "model.target: the factory mymodels:boom raised RuntimeError: boom from the factory "
        f"(at {at['raise RuntimeError']}; TRAINER_DEBUG=1 shows the traceback)"
    )
    assert isinstance(e.value.__cause__, RuntimeError)  # the traceback TRAINER_DEBUG=1 shows
    with pytest.raises(
        ValueError, match=rf"mymodels:adds raised TypeError: .* \(at {re.escape(at['return vocab +'])};"
    ):
        build_model(preset=None, vocab_size=256, seq_len=8, target="mymodels:adds")
    sys.modules.pop("mymodels", None)


def test_loss_of_rejects_non_scalars():
    with pytest.raises(ValueError, match="scalar loss"):
        loss_of(torch.zeros(3))


def test_attention_backend_choice_keeps_the_math_and_unavailable_ones_fail_at_startup():
    """model.attention: a named kernel gives the same loss and gradients as torch's own choice; a kernel the
    device cannot run is a config error naming the key (before anything is compiled), not a first-step crash."""
    from trainer.config import ConfigError, load_config
    from trainer.model_setup import check_attention
    from trainer.models.gpt import sdpa_backend

    idx = torch.randint(0, 64, (2, 16))
    outs = {}
    for name in ("auto", "math"):
        torch.manual_seed(0)
        model = build_model(preset=None, vocab_size=64, seq_len=16, n_layer=1, n_head=2, n_embd=16, attention=name)
        assert model.transformer.h[0].attn.sdpa.backend == sdpa_backend(name)  # the choice reached the attention
        loss = model(idx, idx)
        loss.backward()
        outs[name] = (loss.detach(), model.transformer.h[0].attn.c_qkv.weight.grad)
    assert torch.allclose(outs["auto"][0], outs["math"][0], atol=1e-6)
    assert torch.allclose(outs["auto"][1], outs["math"][1], atol=1e-6)

    cfg = load_config(None, ["model.attention=cudnn", "model.n_head=2"])
    check_attention(load_config(None, ["model.attention=math"]), torch.device("cpu"), None)  # runs on CPU
    with pytest.raises(ConfigError, match=r"model.attention: 'cudnn' cannot run on cpu .*head size 64"):
        check_attention(cfg, torch.device("cpu"), None)
    with pytest.raises(ConfigError, match=r"model.attention: 'flash' cannot run"):  # no CPU flash with dropout
        check_attention(load_config(None, ["model.attention=flash", "model.dropout=0.1"]), torch.device("cpu"), None)
    check_attention(load_config(None, ["model.attention=flash"]), torch.device("cpu"), None)
    with pytest.raises(ConfigError, match="model.attention: applies to the built-in GPT only"):
        load_config(None, ["model.attention=flash", "model.target=pkg.mod:make", "model.preset=null"])


def test_the_trainer_builds_the_gpt_with_the_configured_attention(tmp_path):
    """A dropped argument once made a GPU A/B run measure one kernel twice: the built model has the choice."""
    from trainer.config import load_config
    from trainer.loop import Trainer
    from trainer.models.gpt import sdpa_backend

    cfg = load_config(None, ["model.attention=math", "train.steps=1", f"run.dir={tmp_path}", "log.progress=false",
                             "checkpoint.enabled=false", "train.eval_batches=1"])  # fmt: skip
    trainer = Trainer(cfg)
    trainer.fit()
    assert trainer.raw_model.transformer.h[0].attn.sdpa.backend == sdpa_backend("math")


def test_a_nanogpt_layout_state_dict_computes_the_same_model():
    """The attention's projection is head-major (``c_qkv``, so tensor parallel can split it by heads); a state dict
    of nanoGPT's layout (``c_attn``: every query, then every key, then every value) loads into it as the same
    function. The reference is nanoGPT's attention written out here, on the loaded weights in their old layout."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    src = build_model(preset=None, vocab_size=64, seq_len=16, n_layer=1, n_head=4, n_embd=32)
    old = {}
    for name, t in src.state_dict().items():  # head-major -> nanoGPT's q | k | v rows
        if ".c_qkv." in name:
            name, t = (
                name.replace(".c_qkv.", ".c_attn."),
                t.view(4, 3, 8, *t.shape[1:]).transpose(0, 1).reshape(t.shape),
            )
        old[name] = t
    model = build_model(preset=None, vocab_size=64, seq_len=16, n_layer=1, n_head=4, n_embd=32)
    model.load_state_dict(old)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    h = model.transformer.wte(x) + model.transformer.wpe(torch.arange(16))
    attn = model.transformer.h[0].attn
    q, k, v = F.linear(model.transformer.h[0].ln_1(h), old["transformer.h.0.attn.c_attn.weight"],
                       old["transformer.h.0.attn.c_attn.bias"]).split(32, dim=2)  # fmt: skip
    q, k, v = (t.view(2, 16, 4, 8).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
    want = attn.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 16, 32))
    with torch.no_grad():
        got = attn(model.transformer.h[0].ln_1(h))
        assert torch.allclose(got, want.detach(), rtol=0, atol=1e-6)  # observed: equal (the same ops on each head)
        assert torch.equal(model(x), src(x))  # and the whole model is the one the state dict came from


def test_a_model_built_without_init_draws_nothing_and_keeps_its_buffers_and_ties():
    """build_without_init (a resume's build): every parameter on the CPU, uninitialised; the random stream untouched
    (the initialisation ran on meta tensors); the buffers as a usual build computes them; the tied head is the token
    table."""
    from trainer.models.no_init import build_without_init

    def gpt():
        return build_model(preset=None, vocab_size=256, seq_len=16, n_layer=2, n_head=2, n_embd=32)

    torch.manual_seed(0)
    model, why = build_without_init(gpt)
    drawn_after = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(drawn_after, torch.rand(1))
    torch.manual_seed(0)
    gpt()
    assert not torch.equal(drawn_after, torch.rand(1))  # a usual build draws ~25K numbers first
    assert why is None and isinstance(model, type(gpt()))
    assert all(p.device.type == "cpu" and isinstance(p, torch.nn.Parameter) for p in model.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight
    assert {n for n, _ in model.named_parameters()} == {n for n, _ in gpt().named_parameters()}
    usual = dict(gpt().named_buffers())
    assert {n: b.tolist() for n, b in model.named_buffers()} == {n: b.tolist() for n, b in usual.items()}


def test_a_model_that_computes_from_a_parameter_while_built_is_built_as_usual():
    """A buffer or a tensor attribute computed from a parameter would stay on the meta device, and an __init__ that
    reads a value fails there: build_without_init says so (the caller builds the model as usual)."""
    from trainer.models.no_init import build_without_init

    class NormBuffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3))
            self.register_buffer("norm", self.w.detach().norm(), persistent=False)

    class NormAttribute(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3))
            self.scale = self.w.detach() * 2

    class ReadsValue(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3))
            self.k = int(self.w.sum().item() > 0)

    assert build_without_init(NormBuffer) == (None, "norm is computed from a parameter while the model is built")
    assert build_without_init(NormAttribute) == (None, "scale is computed from a parameter while the model is built")
    model, why = build_without_init(ReadsValue)
    assert model is None and why.startswith("it cannot be built with its parameters on the meta device (")
