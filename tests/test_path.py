"""The path a run takes by default: compile.enabled and compile.cudagraphs resolved from ``auto``, and said so."""

import pytest
import torch

from tests.conftest import FAST, ROOT, cli
from trainer.config import load_config
from trainer.plan import one_process

CUDA, CPU = torch.device("cuda"), torch.device("cpu")  # the plan's rules read the device's type only


def _resolve(device, *overrides, config="configs/gpt2-small.yaml"):
    p = one_process(load_config(ROOT / config, list(overrides)), device)
    return p.compiled, p.graphed, "; ".join(p.compile_reasons)


@pytest.mark.parametrize("config", ["configs/gpt2-small.yaml", "configs/gpt2-small-ddp.yaml"])
def test_every_gpu_config_runs_compiled_and_graphed_as_shipped(config):
    enabled, graphs, why = _resolve(CUDA, config=config)
    assert enabled is True and graphs is True, why
    assert why == "compile.enabled=auto: on for CUDA; compile.cudagraphs=auto: on"


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
    assert _resolve(CPU, "compile.enabled=true", "compile.cudagraphs=true") == (
        True,
        False,  # graphed on CUDA only
        "compile.cudagraphs=true has no effect on cpu",
    )


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
    assert "path: compiled (aot_eager, whole model); foreach adamw (compile.cudagraphs=auto: off on cpu)" in r.stdout
    first = next(line for line in r.stdout.splitlines() if line.startswith("step      1"))
    assert first.startswith("step      1 | compiled in ") and "tok/s" not in first, first
