"""The path a run takes by default: compile.enabled and compile.cudagraphs resolved from ``auto``, and said so."""

import pytest
import torch

from tests.conftest import FAST, ROOT, cli
from trainer.config import ConfigError, load_config
from trainer.plan import one_process

CUDA, CPU = torch.device("cuda"), torch.device("cpu")  # the plan's rules read the device's type only
GPT = "compile.scope=auto: the whole model (the built-in GPT measured 1.3% faster compiled whole)"


def _resolve(device, *overrides, config="configs/gpt2-small.yaml"):
    p = one_process(load_config(ROOT / config, list(overrides)), device)
    return p.compiled, p.graphed, "; ".join(p.compile_reasons)


@pytest.mark.parametrize("config", ["configs/gpt2-small.yaml", "configs/gpt2-small-ddp.yaml"])
def test_every_gpu_config_runs_compiled_and_graphed_as_shipped(config):
    enabled, graphs, why = _resolve(CUDA, config=config)
    assert enabled is True and graphs is True, why
    assert why == f"compile.enabled=auto: on for CUDA; {GPT}; compile.cudagraphs=auto: on"


def test_auto_is_off_on_the_cpu():
    assert _resolve(CPU) == (False, False, "compile.enabled=auto: off on cpu; compile.cudagraphs=auto: off on cpu")


@pytest.mark.parametrize(
    "override, reason",
    [
        ("distributed.strategy=fsdp", "distributed.strategy=fsdp (needs none or ddp"),
        ("train.on_nan=skip", "train.on_nan=skip (needs stop"),
        ("train.precision=fp16", "train.precision=fp16 (needs bf16 or fp32"),
        ("optim.name=sgd", "optim.name=sgd (needs adamw or adam"),
        ("compile.autograd=true", "compile.autograd=true (needs false)"),
        ("compile.enabled=false", "compile.enabled=false"),
    ],
)
def test_graphs_stay_off_where_the_step_cannot_be_captured_and_say_why(override, reason):
    enabled, graphs, why = _resolve(CUDA, override)
    assert graphs is False
    assert f"compile.cudagraphs=auto: off, {reason}" in why, why


def test_explicit_values_are_kept_and_not_explained():
    assert _resolve(CUDA, "compile.enabled=false", "compile.cudagraphs=false") == (False, False, "")
    assert _resolve(CPU, "compile.enabled=true", "compile.cudagraphs=true", "compile.scope=model") == (
        True,
        False,  # graphed on CUDA only
        "compile.cudagraphs=true has no effect on cpu",
    )


HF = ["model.preset=null", "model.hf=configs/hf/llama-3.2-1b", "data.vocab_size=null"]


def _scope(device, *overrides):
    p = one_process(load_config(ROOT / "configs/tiny.yaml", [*HF, *overrides]), device)
    return p.scope, p.graphed, "; ".join(p.compile_reasons)


def test_a_hugging_face_model_compiles_each_block_once_on_one_gpu_and_is_graphed():
    """auto: each block of a model.hf model that makes no mask between its blocks, graphed (measured on an H200);
    the whole model on the CPU, where each block was not measured; explicit values kept."""
    scope, graphed, why = _scope(CUDA)
    assert (scope, graphed) == ("blocks", True), why
    assert "compile.scope=auto: each block once (no attention mask made between them)" in why
    assert _scope(CUDA, "compile.scope=model")[:2] == ("model", True)
    assert _scope(CUDA, "compile.scope=blocks", "compile.cudagraphs=true")[:2] == ("blocks", True)
    scope, _, why = _scope(CPU, "compile.enabled=true")
    assert scope == "model" and "not on cpu" in why, why


@pytest.fixture
def falcon(tmp_path):
    """A model.hf directory of an architecture whose attention mask transformers makes (Falcon's)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.FalconConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
    cfg.save_pretrained(tmp_path / "falcon")
    return str(tmp_path / "falcon")


def test_blocks_that_get_a_mask_made_between_them_are_never_graphed(falcon):
    """A mask made in eager code between compiled blocks is a new input of each block inside the capture (which
    then fails on a GPU): auto compiles the whole model; compiled blocks leave the graphed step off, or, insisted
    on, stop as a user error naming compile.scope."""
    scope, graphed, why = _scope(CUDA, f"model.hf={falcon}")
    assert (scope, graphed) == ("model", True), why
    assert "compile.scope=auto: the whole model (transformers makes the attention mask of a falcon model" in why
    scope, graphed, why = _scope(CUDA, f"model.hf={falcon}", "compile.scope=blocks")
    assert (scope, graphed) == ("blocks", False)
    assert "compile.cudagraphs=auto: off, compile.scope=blocks (needs model for this model.hf model" in why, why
    with pytest.raises(ConfigError, match="compile.cudagraphs: needs compile.scope=model for this model.hf model"):
        _scope(CUDA, f"model.hf={falcon}", "compile.scope=blocks", "compile.cudagraphs=true")


def test_a_bad_value_names_the_choices():
    with pytest.raises(ValueError, match="compile.enabled: got 'maybe', expected one of auto . true . false"):
        load_config(ROOT / "configs/tiny.yaml", ["compile.enabled=maybe"])


def test_the_run_says_its_path_and_the_first_step_its_time(tmp_path, capsys, fresh_dynamo):
    r = cli(capsys, "fit", "configs/tiny.yaml", *FAST, "train.steps=2", f"run.dir={tmp_path / 'eager'}")
    assert r.returncode == 0, r.stderr
    assert "path: eager; foreach adamw (compile.enabled=auto: off on cpu; compile.cudagraphs=auto: off on cpu)" in (
        r.stdout
    )
    first = next(line for line in r.stdout.splitlines() if line.startswith("step      1"))
    assert first.startswith("step      1 | first step ") and "tok/s" not in first and "ms/step" not in first, first

    compiled = ["compile.enabled=true", "compile.backend=aot_eager"]
    r = cli(capsys, "fit", "configs/tiny.yaml", *FAST, "train.steps=2", *compiled, f"run.dir={tmp_path / 'aot'}")
    assert r.returncode == 0, r.stderr
    assert (
        f"path: compiled (aot_eager, whole model); foreach adamw ({GPT}; compile.cudagraphs=auto: off on cpu)"
        in r.stdout
    )
    first = next(line for line in r.stdout.splitlines() if line.startswith("step      1"))
    assert first.startswith("step      1 | compiled in ") and "tok/s" not in first, first


@pytest.mark.parametrize("scope", ["auto", "model"])
def test_fsdp_compiles_each_block_whatever_the_scope(scope):
    """Under fsdp a compiled root would run eagerly: the blocks are compiled, the plan's scope and line say so."""
    from trainer.distributed.env import DistEnv
    from trainer.plan import resolve

    env = DistEnv(rank=0, local_rank=0, world_size=2, device=CPU, backend="gloo")
    overrides = ["distributed.strategy=fsdp", "compile.enabled=true", f"compile.scope={scope}"]
    p = resolve(load_config(ROOT / "configs/tiny.yaml", overrides), env)
    assert p.scope == "blocks"
    assert f"compile.scope={scope}: each block" in "; ".join(p.compile_reasons)
    assert p.run_config().compile.scope == "blocks"


def test_blocks_of_a_built_model_that_makes_a_mask_refuse_the_graphed_step(falcon):
    """Where the built model turns out to make its mask between blocks the plan expected none of, compiling its
    blocks for the graphed step stops with an error naming compile.scope (not a failed capture on the GPU)."""
    from trainer.compile.capture import apply_compile
    from trainer.models.hf import build_hf_model

    cfg = load_config(None, ["compile.scope=blocks", "compile.backend=aot_eager"]).compile
    with pytest.raises(ValueError, match="compile.scope: this model.hf model makes its attention mask"):
        apply_compile(build_hf_model(falcon), cfg, no_mask=True)
    apply_compile(build_hf_model(falcon), cfg)  # not graphed: compiled, the mask made between the blocks
