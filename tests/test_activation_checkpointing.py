"""train.activation_checkpointing: the same gradients as without it, the blocks recomputed as the mode says (selective
keeping the matmuls and attention), state-dict keys unchanged; eager, compiled (whole model, per block), a Hugging
Face Llama, `trainer fit`, ddp and fsdp on 2 gloo ranks."""

from collections import Counter

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from tests.conftest import FAST, losses
from trainer.build import uncompiled
from trainer.compile.capture import apply_compile
from trainer.config import load_config
from trainer.models import build_model
from trainer.models.recompute import apply_activation_checkpointing, chosen, mode_of

VOCAB, T = 64, 16


@pytest.fixture(autouse=True)
def _fresh_dynamo(fresh_dynamo):
    yield


def _gpt(n_layer=4, dropout=0.0):
    torch.manual_seed(0)
    return build_model(preset="tiny", vocab_size=VOCAB, seq_len=T, n_layer=n_layer, n_head=2, n_embd=32,
                       dropout=dropout, bias=True, target=None, kwargs={})  # fmt: skip


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (4, T), generator=g), torch.randint(0, VOCAB, (4, T), generator=g)


def _grads(model, call=None) -> dict[str, torch.Tensor]:
    """One forward and backward from a fixed RNG state (dropout draws the same masks): the parameters' gradients."""
    x, y = _batch()
    torch.manual_seed(2)
    (model if call is None else call)(x, y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


class _Recording:
    """aot_eager that records how many checkpointed regions (``tag_activation_checkpoint``) each Dynamo graph has."""

    def __init__(self):
        self.regions = []
        self.inner = torch._dynamo.lookup_backend("aot_eager")

    def __call__(self, gm, example_inputs, **kwargs):
        self.regions.append(sum(1 for n in gm.graph.nodes if "tag_activation_checkpoint" in str(n.target)))
        return self.inner(gm, example_inputs, **kwargs)


def _compiled(model, scope: str, backend):
    """``model`` compiled as ``compile.scope=scope`` would (the trainer's own apply_compile), with ``backend``."""
    cfg = load_config(None, [f"compile.scope={scope}", "compile.backend=aot_eager", "compile.loss=false"]).compile
    return apply_compile(model, cfg, say=lambda m: None, backend=backend)


@pytest.mark.parametrize(
    "mode, scope", [("full", "eager"), ("selective", "eager"), ("full", "model"), ("selective", "model"),
                    ("full", "blocks"), ("selective", "blocks")],
)  # fmt: skip
def test_gradients_equal_those_without_checkpointing(mode, scope):
    """Against the eager model without checkpointing, with dropout on, so the recompute must draw the forward's
    masks again (eagerly, checkpoint restores the RNG state; compiled, the partitioner saves random ops' outputs
    or replays them with the forward's RNG state)."""
    n_layer = 4 if scope == "eager" else 2  # compiled: fewer layers, less to trace
    want = _grads(_gpt(n_layer, dropout=0.1))
    model = _gpt(n_layer, dropout=0.1)
    assert apply_activation_checkpointing(model, mode) == f"{mode}, {n_layer} of {n_layer} blocks"
    call = None
    if scope != "eager":
        rec = _Recording()
        call = _compiled(model, scope, rec)
    got = _grads(model, call)
    # Observed 0.0 in every mode and scope (fp32, CPU): the recompute runs the same ops on the same inputs, and
    # aot_eager runs the ops eager would. 1e-7 still fails for a stale or re-drawn dropout mask (errors ~1e-2).
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-7, msg=name)
    if scope == "model":  # one graph; each block's checkpoint is a region of it
        assert rec.regions == [n_layer]
    elif scope == "blocks":  # the blocks share one graph, which is the checkpointed region
        assert rec.regions == [1]
        assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize(
    "mode, every_n, runs",
    [
        ("none", 1, [1, 1, 1, 1]),
        ("full", 1, [2, 2, 2, 2]),
        ("full", 2, [2, 1, 2, 1]),  # blocks 0 and 2 (i % 2 == 0)
        ("selective", 3, [2, 1, 1, 2]),  # blocks 0 and 3
    ],
)
def test_checkpointed_blocks_run_their_forward_again_in_the_backward(mode, every_n, runs):
    model = _gpt()
    n = sum(r == 2 for r in runs)
    if mode != "none":
        assert chosen(4, every_n) == [i for i, r in enumerate(runs) if r == 2]
    note = apply_activation_checkpointing(model, mode, every_n)
    assert note == ("" if mode == "none" else f"{mode}, {n} of 4 blocks")
    # The recompute calls the block's forward, not the block (its own hooks stay outside): count its first child.
    calls = Counter()
    for i, block in enumerate(model.transformer.h):
        block.ln_1.register_forward_hook(lambda *_, i=i: calls.update([i]))
    x, y = _batch()
    loss = model(x, y)
    assert [calls[i] for i in range(4)] == [1, 1, 1, 1]
    loss.backward()
    assert [calls[i] for i in range(4)] == runs


class _OpCount(TorchDispatchMode):
    """Counts the aten ops that run while it is on, by name (``mm``, ``gelu``, ...)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(mode: str) -> Counter:
    model = _gpt()
    apply_activation_checkpointing(model, mode)
    x, y = _batch()
    loss = model(x, y)
    with _OpCount() as count:
        loss.backward()
    return count.ops


def test_selective_keeps_the_matmuls_and_attention_and_recomputes_the_rest():
    """In the backward, forward ops run only as a recompute. Selective recomputes the norms and GELU (cheap) but no
    matmul or attention: its backward runs exactly as many of those as none's (their gradients' alone)."""
    none, full, selective = (_backward_ops(m) for m in ("none", "full", "selective"))
    heavy = ["mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu"]
    assert full["addmm"] > none["addmm"] and full["_scaled_dot_product_flash_attention_for_cpu"] == 4  # recomputed
    assert none["_scaled_dot_product_flash_attention_for_cpu"] == 0
    for op in heavy:
        assert selective[op] == none[op], (op, selective[op], none[op])
    # Forward ops of the 4 blocks (2 LayerNorms and a GELU each): recomputed by both, never run by none's backward.
    for op, n in (("native_layer_norm", 8), ("gelu", 4)):
        assert none[op] == 0 and selective[op] == full[op] == n, (op, none[op], selective[op], full[op])


def _compiled_backward_ops(mode: str) -> Counter:
    """The aten ops of the backward graph of the whole model compiled (AOTAutograd's partition of the joint graph,
    which the checkpoint's policy steers), by name."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    ops = Counter()

    def bw(gm, _):
        ops.update(getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    model = _gpt(n_layer=2)
    apply_activation_checkpointing(model, mode)
    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=bw)
    _grads(model, _compiled(model, "model", backend))
    return ops


def test_selective_under_compile_keeps_the_matmuls_and_attention():
    """Compiled, the recompute is in the backward graph: selective's has the forward's norms and GELUs but no more
    matmuls than none's and no attention forward; full's recomputes the projections (addmm) and attention (an RNG
    op on CPU, replayed under ``run_with_rng_state``)."""
    none, full, selective = (_compiled_backward_ops(m) for m in ("none", "full", "selective"))
    for op in ("addmm.default", "run_with_rng_state", "native_layer_norm.default", "gelu.default"):
        assert none[op] == 0, (op, none)
    assert full["addmm.default"] > 0 and full["run_with_rng_state"] == 2, full
    assert selective["mm.default"] == none["mm.default"] and selective["addmm.default"] == 0, selective
    assert selective["run_with_rng_state"] == 0, selective
    assert selective["native_layer_norm.default"] == full["native_layer_norm.default"] == 4  # 2 blocks' 2 each
    assert selective["gelu.default"] == full["gelu.default"] == 2


def test_state_dict_keys_unchanged_and_checkpoints_load_both_ways():
    plain, ckpt = _gpt(), _gpt()
    apply_activation_checkpointing(ckpt, "selective", every_n=2)
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in ckpt.named_modules()] == [n for n, _ in plain.named_modules()]
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1.0)
    ckpt.load_state_dict(plain.state_dict(), strict=True)
    plain.load_state_dict(ckpt.state_dict(), strict=True)
    for a, b in zip(ckpt.parameters(), plain.parameters()):
        assert torch.equal(a, b)


def test_uncompiling_keeps_checkpointing_and_applying_twice_changes_nothing():
    """FSDP compiles each block's checkpointed forward; the eager fallback's uncompiled() keeps the checkpoint."""
    model = _gpt(n_layer=2)
    apply_activation_checkpointing(model, "full")
    _compiled(model, "blocks", "aot_eager")
    for block in model.transformer.h:  # as FSDP does (hooks_outside): the forward itself compiled
        block._compiled_call_impl = None
        block.forward = torch.compile(block.forward, backend="aot_eager")
    assert [mode_of(b) for b in model.transformer.h] == ["full", "full"]
    assert apply_activation_checkpointing(model, "full") == "full, 2 of 2 blocks"  # a no-op: already so
    uncompiled(model)
    for block in model.transformer.h:
        assert mode_of(block) == "full" and not hasattr(block.forward, "_torchdynamo_orig_callable")
    with pytest.raises(AssertionError, match="already checkpointed"):
        apply_activation_checkpointing(model, "selective")


@pytest.mark.parametrize(
    "mode, scope", [("full", "eager"), ("selective", "eager"), ("full", "model"), ("selective", "blocks")]
)
def test_hugging_face_llama(mode, scope, tmp_path):
    """The decoder layers of a tiny LlamaForCausalLM (hf.model.layers; keyword arguments, rotary embeddings)."""
    pytest.importorskip("transformers")
    import json

    from tests.test_hf import LLAMA
    from trainer.models.hf import build_hf_model

    (tmp_path / "config.json").write_text(json.dumps(LLAMA))

    def llama():
        torch.manual_seed(0)
        return build_hf_model(str(tmp_path), overrides={}, pretrained=False, vocab_size=VOCAB, seq_len=T)

    want = _grads(llama())
    model = llama()
    assert apply_activation_checkpointing(model, mode) == f"{mode}, 2 of 2 blocks"
    got = _grads(model, _compiled(model, scope, "aot_eager") if scope != "eager" else None)
    for name in want:  # observed 0.0 (fp32; as for the GPT above)
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-7, msg=name)


def flat_model():
    """model.target for the test below: no nn.ModuleList of blocks."""
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))


def test_a_model_without_repeated_blocks_is_a_config_error(capsys, tmp_path):
    from trainer.cli import main

    rc = main(["fit", "configs/tiny.yaml", *FAST, "model.preset=null", f"model.target={__name__}:flat_model",
               "train.activation_checkpointing=full", f"run.dir={tmp_path}"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "train.activation_checkpointing=full" in err and "compile.blocks=" in err, err
    assert "Traceback" not in err


def _fit(tmp_path, *overrides):
    from trainer.cli import main

    # On the CPU also where a GPU is: CUDA's attention backward is not bitwise deterministic from run to run.
    args = [
        "fit",
        "configs/tiny.yaml",
        *FAST,
        "train.device=cpu",
        "train.steps=4",
        "log.every=1",
        f"run.dir={tmp_path}",
    ]
    assert main([*args, *overrides]) == 0
    return losses(tmp_path)


@pytest.mark.parametrize("extra", [[], ["compile.enabled=true", "compile.backend=aot_eager", "compile.scope=blocks"]])
def test_fit_gives_the_loss_curve_without_checkpointing(extra, tmp_path, capsys):
    want = _fit(tmp_path / "none", *extra)
    got = _fit(tmp_path / "full", *extra, "train.activation_checkpointing=full")
    assert "activation checkpointing: full, 2 of 2 blocks" in capsys.readouterr().out  # console.info: stdout
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    for step in want:  # observed equal to the last bit (fp32): the same ops on the same inputs
        assert abs(got[step] - want[step]) <= 1e-6, (step, got[step], want[step])


def test_compiled_autograd_needs_a_compiled_forward(tmp_path, capsys):
    from trainer.cli import main

    rc = main(["fit", "configs/tiny.yaml", *FAST, "train.steps=1", "compile.enabled=false", "compile.autograd=true",
               "train.activation_checkpointing=selective", f"run.dir={tmp_path}"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "compile.enabled=true" in err, err


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """tests/test_distributed.py's reference: one process (a test process), the whole global batch, no checkpointing."""
    from tests.conftest import cli, shared_run
    from tests.test_distributed import COMMON

    def make(one):
        args = [*COMMON, "train.steps=4", "train.micro_batch_size=8", f"run.dir={one}"]
        assert cli(None, "fit", "configs/tiny.yaml", *args).returncode == 0

    return shared_run(tmp_path_factory, "activation_checkpointing-one", make)


DISTRIBUTED = {
    # One block per bucket: the compiled forward split into pieces between the checkpointed regions.
    "ddp": ["distributed.strategy=ddp", "compile.enabled=true", "compile.backend=aot_eager",
            "distributed.bucket_mb=0.01"],
    # A unit per block: FSDP gathers each block's parameters again for its recompute.
    "fsdp": ["distributed.strategy=fsdp", "compile.enabled=true", "compile.backend=aot_eager",
             "distributed.fsdp_unit_mb=0"],
}  # fmt: skip


@pytest.mark.parametrize("strategy", list(DISTRIBUTED))
def test_two_ranks_with_checkpointing_reproduce_one_process(strategy, one_process, tmp_path):
    from tests.test_distributed import COMMON, _torchrun

    r = _torchrun(2, *COMMON, "train.steps=4", "train.micro_batch_size=4", *DISTRIBUTED[strategy],
                  "train.activation_checkpointing=full", f"run.dir={tmp_path}")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "activation checkpointing: full, 2 of 2 blocks" in r.stdout  # console.info: stdout
    assert "do not follow the bucket plan" not in r.stdout + r.stderr
    a, b = losses(one_process), losses(tmp_path)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    # As in tests/test_distributed.py: the ranks' gradients are summed in another order than one process's batched
    # matmuls (observed max |diff| 1e-6 there; the checkpoint itself adds nothing, see the tests above).
    for step in a:
        assert abs(a[step] - b[step]) < 1e-5, (step, a[step], b[step])
