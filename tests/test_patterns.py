"""Our kernels substituted into models not shaped by our code (trainer/compile/passes/).

Each model is compiled with ``aot_eager`` (the pass runs before AOTAutograd, so the backend does not matter) and
its kernels run under TRITON_INTERPRET=1 on CPU tensors. Substituted and plain graphs must give the same losses
and gradients over several optimizer steps.
"""

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.conftest import FAST, cli
from trainer.compile.capture import LossOnly
from trainer.compile.passes import KERNEL_NAMES
from trainer.compile.passes.substitute import KernelLog, substituting


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles LossOnly.forward around new models: start from Dynamo's empty cache, not its recompile
    limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ---- a nanoGPT-shaped GPT with names of its own, returning (logits, loss) --------------------------------------


class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).contiguous().view(B, T, C))


class Layer(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm_a = nn.LayerNorm(width)
        self.mix = SelfAttention(width, heads)
        self.norm_b = nn.LayerNorm(width)
        self.ffn = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.mix(self.norm_a(x))
        x = x + self.ffn(self.norm_b(x))
        return x


class NanoGPT(nn.Module):
    def __init__(self, vocab=64, width=32, heads=2, n_layer=2, seq=16):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq, width)
        self.layers = nn.ModuleList([Layer(width, heads) for _ in range(n_layer)])
        self.norm_out = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm_out(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def make_nanogpt(**kwargs):
    return NanoGPT(**kwargs)


# ---- near-misses: look alike, mean something else -------------------------------------------------------------


class NearMisses(nn.Module):
    """A LayerNorm without weight, an RMSNorm over the wrong dimension (with a Gemma-style 1 + w weight), a head
    with a bias: each left as it is."""

    def __init__(self, vocab=64, width=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.lin = nn.Linear(width, width)
        self.plain = nn.LayerNorm(width, elementwise_affine=False)
        self.w = nn.Parameter(torch.ones(width))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx, targets):
        x = self.emb(idx)
        x = x + self.lin(self.plain(x))
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(1, keepdim=True) + 1e-6)  # over the sequence, not the width
        h = (1.0 + self.w) * h  # Gemma's weight
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def _batches(vocab=64, seq=16, n=10):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, vocab, (4, seq), generator=g), torch.randint(0, vocab, (4, seq), generator=g))
            for _ in range(n)]  # fmt: skip


def _train(model, kernels, steps=10, log=None):
    """Losses of ``steps`` AdamW steps on the compiled (forward + loss) and the gradients of the last."""
    log = KernelLog() if log is None else log
    backend = substituting(torch._dynamo.lookup_backend("aot_eager"), kernels, log)
    step = torch.compile(LossOnly(model), backend=backend, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in _batches(n=steps):
        opt.zero_grad(set_to_none=True)
        loss = step(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


def _same_training(make, kernels, rtol, grad_rtol=None, steps=10):
    """Train one model ``steps`` AdamW steps; at every step the substituted graph and the plain one each compute the
    loss and every gradient on the same weights, which must agree within ``rtol`` (loss, relative) and ``grad_rtol``
    (each gradient's largest difference over its largest element). The update uses the plain graph's gradients.

    Both graphs run on the same weights at every step, so the bounds measure the kernels' numerics alone (fp32 sums
    in another order). Two separate trainings would not: AdamW's first update is about ``lr * sign(g)`` per element,
    so an element whose gradient is near zero moves up to ``2 lr`` apart on a rounding difference, and after ten
    steps the two models' gradients differ by what that amplification makes of it (1e-4 of the largest element on a
    tiny Llama, varying with the installed libraries' initialisation and reduction order), not by the kernels' error.
    """
    grad_rtol = grad_rtol or rtol
    torch.manual_seed(0)
    model = make()
    log = KernelLog()
    aot_eager = torch._dynamo.lookup_backend("aot_eager")
    ours = torch.compile(LossOnly(model), backend=substituting(aot_eager, kernels, log), fullgraph=True)
    plain_graphs = []  # Dynamo guards on the backend: the plain callable compiles its own graph, never reuses ours

    def plain_backend(gm, example_inputs):
        plain_graphs.append(gm)
        return aot_eager(gm, example_inputs)

    plain = torch.compile(LossOnly(model), backend=plain_backend, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i, (x, y) in enumerate(_batches(n=steps)):
        grads = []
        for compiled in (ours, plain):
            opt.zero_grad(set_to_none=True)
            loss = compiled(x, y)
            loss.backward()
            grads.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (la, ga), (lb, gb) = grads
        assert la == pytest.approx(lb, rel=rtol), (i, la, lb)
        for name in ga:
            err = ((ga[name] - gb[name]).abs().max() / gb[name].abs().max().clamp_min(1e-12)).item()
            assert err < grad_rtol, f"step {i + 1}, {name}: gradient differs by {err:.2e} of its largest element"
        opt.step()  # with the plain graph's gradients, which the last backward left
    assert len(plain_graphs) == 1
    return log


def test_nanogpt_shaped_model_gets_the_norms_and_the_loss():
    # fp32 throughout: the kernels' sums and torch's differ in order only. Observed over 10 steps: losses within
    # 2.2e-7 relative, gradients within 1.0e-6 of their largest element (a few ulps of fp32 accumulated over the
    # sums of a row); the bounds (1e-6, 1e-5) leave 5-10x.
    log = _same_training(lambda: NanoGPT(n_layer=2), ["add_layer_norm", "cross_entropy"], rtol=1e-6, grad_rtol=1e-5)
    counts = {k["name"]: k["count"] for k in log.report()}
    assert counts == {"add_layer_norm": 2 * 2 + 1, "cross_entropy": 1}  # every norm; the logits are dead
    sources = {k["name"]: k["sources"] for k in log.report()}
    assert all(s.startswith(__file__) for s in sources["add_layer_norm"] + sources["cross_entropy"]), sources
    assert not log.near_misses


def test_fused_loss_replaces_the_head_and_the_loss():
    # Observed: losses 9.1e-8 relative, gradients 5.6e-7 of their largest element (as above).
    log = _same_training(lambda: NanoGPT(n_layer=1), ["linear_cross_entropy"], rtol=1e-6, grad_rtol=1e-5)
    assert {k["name"]: k["count"] for k in log.report()} == {"linear_cross_entropy": 1}


def test_near_misses_are_left_alone_and_said_why():
    log = _same_training(NearMisses, list(KERNEL_NAMES), rtol=1e-6)  # nothing substituted: the same graph
    assert log.report() == []
    reasons = " | ".join(r for _, _, r in log.near_misses)
    assert "no affine weight" in reasons and "mean over dim 1" in reasons and "the head has a bias" in reasons


class ScaledBiasedHead(nn.Module):
    """Logits of a head with a bias, scaled: ``linear(h, W, b) * c`` is not ``linear(h * c, W, b)``."""

    def __init__(self, vocab=64, width=32):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, width), nn.Linear(width, vocab)
        nn.init.normal_(self.head.bias, std=1.0)  # a bias that matters

    def forward(self, idx, targets):
        return F.cross_entropy((self.head(self.emb(idx)) * 0.25).flatten(0, 1), targets.flatten())


class WeightWrittenBetween(nn.Module):
    """A norm weight computed after the residual add and then written in place before the norm reads it: the
    kernel, placed at the add, would read it before the write."""

    def __init__(self, vocab=64, width=32):
        super().__init__()
        self.emb, self.lin, self.head = nn.Embedding(vocab, width), nn.Linear(width, width), nn.Linear(width, vocab)
        self.w = nn.Parameter(torch.zeros(width))

    def forward(self, idx, targets):
        x = self.emb(idx)
        a = x + self.lin(x)
        w = 1.0 + self.w.float()
        w.mul_(2.0)
        h = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize(
    "model, reason",
    [
        (ScaledBiasedHead, "do not come from a linear layer"),
        (WeightWrittenBetween, "written in place between the residual add"),
    ],
)
def test_rewrites_that_would_change_the_result_are_not_made(model, reason):
    # Observed: the same losses and gradients to 1e-7 (the scaled biased head was once rewritten regardless:
    # loss 4.97 against 2.83).
    log = _same_training(model, list(KERNEL_NAMES), rtol=1e-6, grad_rtol=1e-5)
    assert any(reason in r for _, _, r in log.near_misses), log.near_misses


def test_logits_used_elsewhere_keep_the_plain_loss():
    """A model whose logits are a graph output (compiled without LossOnly): the loss is left as it is."""
    log = KernelLog()
    model = NanoGPT(n_layer=1)
    backend = substituting(torch._dynamo.lookup_backend("aot_eager"), ["cross_entropy"], log)
    logits, loss = torch.compile(model, backend=backend, fullgraph=True)(*_batches(n=1)[0])
    assert log.report() == []
    assert "also used elsewhere" in log.near_misses[0][2]


def test_trainer_substitutes_and_reports_kernels(tmp_path, capsys):
    """compile.kernels through the trainer: the report names each kernel and the user's file:line."""
    run = tmp_path / "run"
    r = cli(capsys, "fit", "configs/tiny.yaml", *FAST, "model.preset=null",
            "model.target=tests.test_patterns:make_nanogpt", "model.kwargs={seq: 32, vocab: 256}",
            "compile.enabled=true", "compile.backend=aot_eager", "compile.kernels=all", "train.steps=3",
            f"run.dir={run}")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "kernels substituted where they match: add_layer_norm add_rms_norm cross_entropy" in r.stdout + r.stderr
    kernels = {k["name"]: k for k in json.loads((run / "compile_report.json").read_text())["kernels"]}
    assert kernels["add_layer_norm"]["count"] == 5 and kernels["cross_entropy"]["count"] == 1
    assert any("tests/test_patterns.py:" in s for s in kernels["cross_entropy"]["sources"])


def test_a_kernel_name_is_checked(capsys):
    r = cli(capsys, "print-config", "configs/tiny.yaml", "compile.kernels=[add_layer_nrm]")
    assert r.returncode == 2 and "did you mean 'add_layer_norm'" in r.stderr and "Traceback" not in r.stderr


def test_the_built_in_gpt_gets_its_kernels_from_the_pass():
    """The built-in GPT is plain PyTorch: the pass gives it every norm (the residual adds included) and the loss.
    Observed: losses 1.2e-7 relative, gradients 1.3e-6 of their largest element over 10 AdamW steps."""
    from trainer.models import build_model

    log = _same_training(lambda: build_model(preset=None, vocab_size=64, seq_len=16, n_layer=2, n_head=2, n_embd=32),
                         ["add_layer_norm", "cross_entropy"], rtol=1e-6, grad_rtol=1e-5)  # fmt: skip
    assert {k["name"]: k["count"] for k in log.report()} == {"add_layer_norm": 5, "cross_entropy": 1}


@pytest.mark.parametrize(
    ("overrides", "device", "expected"),
    [
        ([], "cuda", list(KERNEL_NAMES)),
        ([], "cpu", []),
        (["compile.kernels=all", "compile.enabled=true"], "cpu", list(KERNEL_NAMES)),
        (["compile.kernels=all"], "cpu", []),  # not compiled on CPU by default: nothing to substitute into
        (["compile.kernels=none"], "cuda", []),
        (["compile.kernels=[cross_entropy,add_layer_norm]"], "cuda", ["add_layer_norm", "cross_entropy"]),
        # auto leaves out the row kernel where its saved logits cost memory or its sums could overflow
        (
            ["train.precision=fp16"],
            "cuda",
            ["add_layer_norm", "add_rms_norm", "linear_cross_entropy", "causal_attention"],
        ),
        (
            ["compile.autograd=true"],
            "cuda",
            ["add_layer_norm", "add_rms_norm", "linear_cross_entropy", "causal_attention"],
        ),
        (["compile.enabled=false"], "cuda", []),
    ],
)
def test_what_compile_kernels_means_on_a_device(overrides, device, expected):
    from trainer.config import load_config
    from trainer.plan import one_process

    assert one_process(load_config(None, overrides), device).kernels == tuple(expected)


# ---- Hugging Face models, from tiny configs (no download) ----------------------------------------------------


def _hf(model_type: str, **config):
    transformers = pytest.importorskip("transformers")
    from trainer.models.hf import HFCausalLM

    cfg = transformers.AutoConfig.for_model(model_type, **config)
    return HFCausalLM(transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"))


def test_hugging_face_gpt2_gets_the_norms_and_the_loss():
    make = lambda: _hf("gpt2", vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,  # noqa: E731
                       embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    # Observed: losses 1.2e-7 relative, gradients 1.2e-6 of their largest element over 10 AdamW steps.
    log = _same_training(make, ["add_layer_norm", "cross_entropy", "causal_attention"], rtol=1e-6, grad_rtol=1e-5)
    counts = {k["name"]: k["count"] for k in log.report()}
    # The causal mask Hugging Face builds in the graph, one attention per layer.
    assert counts == {"add_layer_norm": 2 * 2 + 1, "cross_entropy": 1, "causal_attention": 2}


@pytest.mark.parametrize("checkpointing", ["none", "selective"])
def test_hugging_face_llama_gets_the_rms_norms_and_the_loss(checkpointing):
    from trainer.models.recompute import apply_activation_checkpointing

    def make():
        model = _hf("llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)  # fmt: skip
        apply_activation_checkpointing(model, checkpointing)  # the layers become checkpointed regions of the graph
        return model

    # Observed: losses 2.3e-7 relative, gradients 1.1e-6 of their largest element over 10 AdamW steps, with and
    # without checkpointing.
    log = _same_training(make, ["add_rms_norm", "linear_cross_entropy", "causal_attention"], rtol=1e-6, grad_rtol=1e-5)
    # Llama's hand-written RMSNorm: input_layernorm, post_attention_layernorm per layer and the final norm; the
    # causal mask and the repeated key/value heads of each layer's attention. Checkpointed, the same inside each
    # region: the mask is built outside the regions and passed in.
    counts = {k["name"]: k["count"] for k in log.report()}
    assert counts == {"add_rms_norm": 2 * 2 + 1, "linear_cross_entropy": 1, "causal_attention": 2}


# Other Hugging Face families, tiny configs: what each adds to Llama's pattern (Mistral and Qwen2 add nothing). Qwen3
# normalises each head's queries and keys (RMSNorm over head_dim, no add); OLMo2 normalises the attention's and the
# MLP's outputs before the residual add (post-norm) and its queries and keys over the whole width; Phi-3 fuses q/k/v
# and gate/up.
RMS, LN = "add_rms_norm", "add_layer_norm"
FAMILIES = {  # model_type: (config fields beyond the shared ones, the norms substituted)
    "mistral": ({}, {RMS: 2 * 2 + 1}),
    "qwen2": ({}, {RMS: 2 * 2 + 1}),
    "qwen3": (dict(head_dim=8), {RMS: 2 * 2 + 1 + 2 * 2}),
    "olmo2": ({}, {RMS: 2 * 2 + 1 + 2 * 2}),
    "phi3": (dict(pad_token_id=0), {RMS: 2 * 2 + 1}),
    "gemma": (dict(head_dim=8), {RMS: 2 * 2 + 1}),  # its weight is 1 + w, computed in the graph after the add
    "granite": (dict(logits_scaling=4.0), {RMS: 2 * 2 + 1}),  # logits / 4: the head's input is divided instead
    "stablelm": ({}, {LN: 2 * 2 + 1}),  # LayerNorm with bias, partial rotary
    "starcoder2": ({}, {LN: 2 * 2 + 1}),  # LayerNorm with bias, biased projections
    "cohere": (dict(logit_scale=0.5), {}),  # logits * 0.5; its hand-written bias-free LayerNorm is not a pattern
}


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_other_hugging_face_families_get_their_norms_and_the_loss(model_type):
    extra, norms = FAMILIES[model_type]
    make = lambda: _hf(model_type, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,  # noqa: E731
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, bos_token_id=0,
                       eos_token_id=0, **extra)  # fmt: skip
    # One forward and backward, against the same model run eagerly. Observed: losses equal to 1.2e-7, gradients
    # within 9.4e-7 of their largest element. (Over 10 AdamW steps OLMo2's gradients drift to 9e-4: the first update
    # is lr times the gradient's sign, so an element near zero that rounds to the other sign moves the weights 2 lr.)
    torch.manual_seed(0)
    a, b = make(), make()
    b.load_state_dict(a.state_dict())
    log = KernelLog()
    (loss_a,), grads_a = _train(a, list(KERNEL_NAMES), steps=1, log=log)
    x, y = _batches(n=1)[0]
    loss_b = LossOnly(b)(x, y)
    loss_b.backward()
    assert loss_a == pytest.approx(loss_b.item(), rel=1e-6)
    for name, p in b.named_parameters():
        err = (grads_a[name] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12)
        assert err < 5e-6, f"{name}: gradient differs by {err:.2e} of its largest element"
    counts = {k["name"]: k["count"] for k in log.report()}
    assert counts == {**norms, "cross_entropy": 1, "causal_attention": 2}, counts
    assert not log.near_misses  # every norm with its residual add: Gemma's (1 + w) is computed before the add


def test_fx_marks_erased_nodes():
    """The pass skips nodes it erased with an earlier match by FX's ``_erased`` flag (pinned: an internal)."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.relu, (x,))
    g.output(x)
    g.erase_node(y)
    assert y._erased is True and x._erased is False


class InPlaceResidual(nn.Module):
    """``x += branch`` mutates x, which the model reads again after the norm: only the norm is ours."""

    def __init__(self, vocab=64, width=32):
        super().__init__()
        self.emb, self.lin, self.norm = nn.Embedding(vocab, width), nn.Linear(width, width), nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx, targets):
        e = self.emb(idx)
        branch = self.lin(e)
        x = e * 2.0
        x += branch
        h = self.norm(x) + x  # reads the mutated x
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def test_an_in_place_residual_add_is_not_fused():
    # Observed: losses 9.3e-8 relative, gradients 2.8e-7 of their largest element.
    log = _same_training(InPlaceResidual, ["add_layer_norm"], rtol=2e-6, grad_rtol=1e-5)
    assert {k["name"]: k["count"] for k in log.report()} == {"add_layer_norm": 1}  # the norm alone


class MaskedAttention(nn.Module):
    """One attention layer whose mask is built as ``mask`` says: ``causal`` (boolean), ``additive`` (0 / -inf),
    ``window`` (causal within 4 positions), ``input`` (read from the batch: padding) or ``repeat`` (no mask, is_causal,
    keys and values repeated from 2 heads to 4 as Hugging Face's repeat_kv)."""

    def __init__(self, mask: str, vocab=64, width=32, heads=4):
        super().__init__()
        self.mask, self.heads = mask, heads
        self.emb, self.qkv = nn.Embedding(vocab, width), nn.Linear(width, 3 * width)
        if mask == "repeat":
            self.kv = nn.Linear(width, width)  # 2 heads of keys and values
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.emb(idx)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        i = torch.arange(T, device=idx.device)
        keep = i[:, None] >= i[None, :]
        mask, causal = keep[None, None].expand(B, 1, T, T), False
        if self.mask == "additive":
            mask = torch.zeros(T, T, device=idx.device).masked_fill(~keep, float("-inf"))
        elif self.mask == "window":
            mask = keep & (i[:, None] - i[None, :] < 4)
        elif self.mask == "input":
            mask = keep & (idx != 0)[:, None, None, :]
        elif self.mask == "repeat":
            k, v = (t.view(B, T, 2, -1).transpose(1, 2) for t in self.kv(x).chunk(2, dim=-1))
            k, v = (t[:, :, None, :, :].expand(B, 2, 2, T, t.shape[-1]).reshape(B, 4, T, t.shape[-1]) for t in (k, v))
            mask, causal = None, True
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        h = y.transpose(1, 2).reshape(B, T, -1) + x
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("mask", ["causal", "additive", "repeat"])
def test_a_causal_mask_built_in_the_graph_becomes_is_causal(mask):
    # Observed on CPU: causal and additive equal to the last bit; repeat (grouped heads) losses equal, gradients
    # 2.7e-7 of their largest element (the shared heads' gradients summed in another order).
    log = _same_training(lambda: MaskedAttention(mask), ["causal_attention"], rtol=1e-6, grad_rtol=1e-5)
    assert {k["name"]: k["count"] for k in log.report()} == {"causal_attention": 1}
    assert not log.near_misses


@pytest.mark.parametrize(("mask", "reason"), [("window", "not the causal mask"), ("input", "read from an input")])
def test_other_masks_are_left_alone_and_said_why(mask, reason):
    log = _same_training(lambda: MaskedAttention(mask), ["causal_attention"], rtol=1e-6)
    assert log.report() == []
    assert reason in log.near_misses[0][2]


def test_the_substituted_attention_has_no_mask_and_shares_the_key_value_heads():
    seen = []

    def inner(gm, example_inputs):
        seen.extend(dict(n.kwargs) for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention)
        return gm

    model = MaskedAttention("repeat")
    torch.compile(LossOnly(model), backend=substituting(inner, ["causal_attention"]), fullgraph=True)(*_batches(n=1)[0])
    assert seen[0]["attn_mask"] is None and seen[0]["is_causal"] is True and seen[0]["enable_gqa"] is True


def test_a_graph_with_substituted_kernels_comes_from_the_autograd_cache_when_compiled_again(tmp_path, monkeypatch):
    """The passes put Python functions in the graph; AOTAutograd's cache leaves out such a graph unless they are
    marked cacheable, and every start (a resume) would trace the joint graph again."""
    from trainer.compile.capture import inner_backend
    from trainer.compile.report import CompileWatcher

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = NanoGPT(n_layer=1)
    idx = torch.randint(0, 64, (2, 16))

    def compile_once() -> dict:
        torch._dynamo.reset()
        backend = inner_backend("inductor", kernels=["add_layer_norm", "cross_entropy"])
        with CompileWatcher() as watcher:
            torch.compile(LossOnly(model), backend=backend)(idx, idx).backward()
        return watcher.report()["cache"]

    first = compile_once()
    assert first["autograd_cache_bypass"] == 0 and first["autograd_cache_miss"] == 1
    again = compile_once()
    assert again["autograd_cache_hit"] == 1 and again["autograd_cache_miss"] == 0
