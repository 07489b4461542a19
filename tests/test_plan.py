"""The plan: every ``auto`` of a config resolved in one place (trainer/plan.py), for a device and a world; what
each became and why; ``plan.json`` in the run directory with no ``auto`` left."""

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import FAST, cli
from trainer import plan
from trainer.config import ConfigError, load_config
from trainer.distributed.env import DistEnv

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").glob("*.yaml"))


def _env(device: str = "cpu", world: int = 1) -> DistEnv:
    backend = None if world == 1 else ("nccl" if device.startswith("cuda") else "gloo")
    return DistEnv(rank=0, local_rank=0, world_size=world, device=torch.device(device), backend=backend)


def _autos(value, where: str = "") -> list[str]:
    """The places of ``value`` (a plan.json document) that still say auto."""
    if isinstance(value, dict):
        return [a for k, v in value.items() if k != "choices" for a in _autos(v, f"{where}.{k}")]
    if isinstance(value, list):
        return [a for i, v in enumerate(value) for a in _autos(v, f"{where}[{i}]")]
    return [where] if isinstance(value, str) and "auto" in value.lower() else []


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("env", [_env(), _env("cuda:0"), _env("cuda:0", 2)], ids=["cpu", "cuda", "cuda-x2"])
def test_every_shipped_config_plans_without_auto(config, env):
    """Resolved for a CPU, one GPU and two GPUs (no GPU is touched: the rules read the device's type)."""
    doc = plan.resolve(load_config(ROOT / config), env).as_dict()
    assert not _autos(doc), (config, _autos(doc), doc)
    assert all("auto: " in line for line in doc["choices"]), doc["choices"]


def test_what_auto_becomes_on_each_device_and_world():
    """The rules, one device and world at a time: bf16, compiled and graphed, ours for AdamW on one GPU; torch's
    fused under fsdp (parameters gathered in bf16) and for the sharded optimizer; fp32 and foreach on a CPU."""
    cfg = load_config(ROOT / "configs/tiny.yaml")
    cpu = plan.resolve(cfg, _env())
    assert (cpu.precision, cpu.autocast, cpu.optim_impl, cpu.data_dtype) == ("fp32", None, "foreach", "bytes")
    assert not cpu.cfg.compile.enabled and not cpu.cfg.compile.cudagraphs and str(cpu.strategy) == "one process"
    gpu = plan.resolve(cfg, _env("cuda:0"))
    assert (gpu.precision, gpu.autocast, gpu.optim_impl) == ("bf16", torch.bfloat16, "triton")
    assert gpu.cfg.compile.enabled and gpu.cfg.compile.cudagraphs
    assert "optim.impl=auto: triton (trainer's Triton adamw on CUDA)" in gpu.choices
    fsdp = plan.resolve(load_config(ROOT / "configs/tiny.yaml", ["distributed.strategy=fsdp"]), _env("cuda:0", 2))
    assert fsdp.strategy.fsdp and (fsdp.optim_impl, fsdp.param_dtype) == ("fused", "bf16")
    assert not fsdp.cfg.compile.cudagraphs  # the graphed step is not for fsdp
    zero = load_config(ROOT / "configs/tiny.yaml", ["distributed.strategy=ddp", "distributed.shard_optimizer=true"])
    zero = plan.resolve(zero, _env("cuda:0", 2))
    assert zero.strategy.zero and zero.optim_impl == "fused" and str(zero.strategy).endswith("optimizer state sharded")
    one = plan.resolve(load_config(ROOT / "configs/tiny.yaml", ["distributed.strategy=fsdp"]), _env("cuda:0"))
    assert not one.strategy.fsdp and one.optim_impl == "triton"  # fsdp over one rank runs as one process
    fp16 = plan.resolve(load_config(ROOT / "configs/tiny.yaml", ["train.precision=fp16"]), _env("cuda:0"))
    assert fp16.optim_impl == "fused" and fp16.autocast == torch.float16


def test_a_value_given_is_kept_and_gets_no_line():
    cfg = load_config(ROOT / "configs/tiny.yaml", ["train.precision=bf16", "optim.impl=eager", "train.device=cpu"])
    p = plan.resolve(cfg, _env())
    assert (p.precision, p.optim_impl) == ("bf16", "eager")
    assert not [line for line in p.choices if line.startswith(("train.precision", "optim.impl", "train.device"))]


def test_a_fit_writes_plan_json_without_auto(tmp_path, capsys):
    r = cli(capsys, "fit", "configs/tiny.yaml", *FAST, "train.steps=2", f"run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert not _autos(doc) and doc["train.device"] == "cpu" and doc["optim.impl"] == "foreach"
    assert "train.precision=auto: fp32 (on cpu)" in doc["choices"]


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.test_config_fuzz import CASES, _yaml_value, keys, values  # noqa: E402


@CASES
@given(overrides=st.lists(st.builds(lambda k, v: f"{k}={_yaml_value(v)}", keys, values), max_size=3))
def test_every_fuzzed_config_plans_without_auto(overrides):
    """The fuzzed overrides of tests/test_config_fuzz.py: each that loads plans with no auto, on a CPU, one GPU
    and two."""
    try:
        cfg = load_config(ROOT / "configs/tiny.yaml", overrides)
    except ConfigError:
        return
    for env in (_env(), _env("cuda:0"), _env("cuda:0", 2)):
        doc = plan.resolve(cfg, env).as_dict()
        assert not _autos(doc), (overrides, _autos(doc))


@pytest.mark.parametrize("strategy", ["none", "ddp", "fsdp"])
def test_placed_plan_holds_the_bucket_plan_or_the_fsdp_units(strategy):
    """The plan placed on a model: ddp's buckets and fsdp's units, by module name in gradient-ready order, in
    plan.json; the functions that build them (wrap, shard, the sharded optimizer) read the same layout."""
    from trainer import build

    cfg = load_config(ROOT / "configs/tiny.yaml", [f"distributed.strategy={strategy}"])
    the_plan = plan.resolve(cfg, _env("cpu", 2))
    placed = the_plan.placed(build.build_model_of(the_plan.cfg, 256, pretrained=False))
    units = placed.as_dict()["units"]
    if strategy == "none":
        assert placed is the_plan and units == [] and placed.layout is None
        return
    names = [name for unit in units for name in unit]
    assert {f"transformer.h.{i}" for i in range(4)} <= set(names) and len(names) == len(set(names))
    assert names.index("transformer.h.3") < names.index("transformer.h.0")  # the last block's gradients first
    if strategy == "ddp":
        assert [tuple(b.units) for b in placed.layout.buckets] == [tuple(u) for u in units]
        assert "embeddings" in names
    else:
        assert len(placed.layout) == len(units)
