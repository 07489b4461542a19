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
        return [a for k, v in value.items() if k not in ("choices", "cwd") for a in _autos(v, f"{where}.{k}")]
    if isinstance(value, list):
        return [a for i, v in enumerate(value) for a in _autos(v, f"{where}[{i}]")]
    return [where] if isinstance(value, str) and "auto" in value.lower() else []


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("env", [_env(), _env("cuda:0"), _env("cuda:0", 2)], ids=["cpu", "cuda", "cuda-x2"])
def test_every_shipped_config_plans_without_auto(config, env):
    """Resolved for a CPU, one GPU and two GPUs (no GPU is touched: the rules read the device's type); a config
    whose mesh needs more ranks (llama-8b-long's cp 4) on as many as it needs."""
    cfg = load_config(ROOT / config)
    d = cfg.distributed
    needs = d.replicate * max(d.shard, 1) * d.cp * d.tp
    if 1 < env.world_size < needs:
        env = _env(str(env.device), needs)
    doc = plan.resolve(cfg, env).as_dict()
    assert not _autos(doc), (config, _autos(doc), doc)
    # One line per auto, grad_accum's where train.global_batch_size derives it, a layout that needs torchrun, and
    # how packed documents are kept apart (where the config's instruction data has been prepared).
    said = ("auto: ", "train.grad_accum: ", "has no effect in a single process", "causal_attention steps aside",
            "documents packed into sequences")  # fmt: skip
    assert all(any(s in line for s in said) for line in doc["choices"]), doc["choices"]


def test_what_auto_becomes_on_each_device_and_world():
    """The rules, one device and world at a time: bf16, compiled and graphed, ours for AdamW on one GPU; torch's
    fused under fsdp (parameters gathered in bf16) and for the sharded optimizer; fp32 and foreach on a CPU."""
    from trainer.compile.passes import KERNEL_NAMES

    cfg = load_config(ROOT / "configs/tiny.yaml")
    cpu = plan.resolve(cfg, _env())
    assert (cpu.precision, cpu.autocast, cpu.optim_impl, cpu.data_dtype) == ("fp32", None, "foreach", "bytes")
    assert not cpu.compiled and not cpu.graphed and str(cpu.strategy) == "one process"
    assert cpu.cfg.compile.enabled == "auto" and cpu.cfg.compile.kernels == "auto"  # the config as given
    gpu = plan.resolve(cfg, _env("cuda:0"))
    assert (gpu.precision, gpu.autocast, gpu.optim_impl) == ("bf16", torch.bfloat16, "triton")
    assert gpu.compiled and gpu.graphed and gpu.kernels == tuple(KERNEL_NAMES)
    assert "optim.impl=auto: triton (trainer's Triton adamw on CUDA)" in gpu.choices
    fsdp = plan.resolve(load_config(ROOT / "configs/tiny.yaml", ["distributed.strategy=fsdp"]), _env("cuda:0", 2))
    assert fsdp.strategy.fsdp and (fsdp.optim_impl, fsdp.param_dtype) == ("fused", "bf16")
    assert not fsdp.graphed  # the graphed step is not for fsdp
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
    import yaml

    # config.yaml records the compile switches as resolved (what a resume compares); the plan's cfg keeps auto
    c = yaml.safe_load((tmp_path / "config.yaml").read_text())["compile"]
    assert (c["enabled"], c["cudagraphs"], c["kernels"]) == (False, False, [])


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
        try:
            doc = plan.resolve(cfg, env).as_dict()
        except ConfigError as e:  # a global batch these ranks cannot split: the one error the plan raises
            assert str(e).startswith("train.global_batch_size: "), (overrides, str(e))
            continue
        assert not _autos(doc), (overrides, _autos(doc))


@pytest.mark.parametrize("strategy", ["none", "ddp", "fsdp"])
def test_placed_plan_holds_the_bucket_plan_or_the_fsdp_units(strategy):
    """The plan placed on a model: ddp's buckets and fsdp's units, by module name in gradient-ready order, in
    plan.json; the functions that build them (wrap, shard, the sharded optimizer) read the same layout."""
    from trainer.model_setup import build_model_of

    cfg = load_config(ROOT / "configs/tiny.yaml", [f"distributed.strategy={strategy}"])
    the_plan = plan.resolve(cfg, _env("cpu", 2))
    placed = the_plan.placed(build_model_of(the_plan.cfg, 256, pretrained=False))
    units = placed.as_dict()["units"]
    if strategy == "none":
        assert placed.units == the_plan.units == () and units == [] and placed.layout is None
        return
    names = [name for unit in units for name in unit]
    assert {f"transformer.h.{i}" for i in range(4)} <= set(names) and len(names) == len(set(names))
    assert names.index("transformer.h.3") < names.index("transformer.h.0")  # the last block's gradients first
    if strategy == "ddp":
        assert [tuple(b.units) for b in placed.layout.buckets] == [tuple(u) for u in units]
        assert "embeddings" in names
    else:
        assert len(placed.layout) == len(units)


# -- the global batch: train.global_batch_size, grad_accum derived, a resume's checkpoint -------------------------

GLOBAL = ["train.micro_batch_size=8", "train.global_batch_size=64"]


def _train(*overrides: str):
    return load_config(ROOT / "configs/tiny.yaml", list(overrides)).train


@pytest.mark.parametrize("ranks, accum", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_global_batch_size_derives_grad_accum_for_each_world(ranks, accum):
    """64 sequences a step on any number of ranks: grad_accum = 64 / (8 x ranks), in the resolved config, the
    sampler's global batch and plan.json (one line in its choices)."""
    cfg = load_config(ROOT / "configs/tiny.yaml", [*GLOBAL, "distributed.strategy=ddp"])
    p = plan.resolve(cfg, _env("cpu", ranks))
    assert (p.global_batch, p.cfg.train.grad_accum, p.cfg.train.global_batch_size) == (64, accum, 64)
    ranks_said = f"{ranks} data-parallel rank" + ("s" if ranks > 1 else "")
    line = f"train.grad_accum: {accum} = train.global_batch_size 64 / (train.micro_batch_size 8 x {ranks_said})"
    doc = p.as_dict()
    assert line in doc["choices"] and (doc["train.grad_accum"], doc["global_batch"]) == (accum, 64)
    assert cfg.train.grad_accum == 1  # the config as given is not changed
    assert (p.batch.note, p.batch.warning) == (None, None)


def test_without_global_batch_size_the_global_batch_grows_with_the_ranks():
    cfg = load_config(ROOT / "configs/tiny.yaml", ["train.micro_batch_size=8", "train.grad_accum=2"])
    for ranks in (1, 2):
        p = plan.resolve(cfg, _env("cpu", ranks))
        assert (p.global_batch, p.cfg.train.grad_accum, p.cfg.train.global_batch_size) == (16 * ranks, 2, None)
        assert not [line for line in p.choices if line.startswith("train.grad_accum")]


@pytest.mark.parametrize(
    "sequences, micro, ranks, fix",
    [
        (48, 16, 2, "set train.global_batch_size to a multiple of 32, or train.micro_batch_size to a divisor of 24"),
        (24, 16, 1, "set train.global_batch_size to a multiple of 16, or train.micro_batch_size to a divisor of 24"),
        (8, 4, 3, "set train.global_batch_size to a multiple of 12, or run on a number of ranks that divides 2"),
    ],
)
def test_a_global_batch_the_ranks_cannot_split_names_both_numbers(sequences, micro, ranks, fix):
    with pytest.raises(ConfigError) as e:
        plan.global_batch(_train(f"train.micro_batch_size={micro}", f"train.global_batch_size={sequences}"), ranks)
    rank_s = "rank" if ranks == 1 else "ranks"
    assert str(e.value) == (
        f"train.global_batch_size: {sequences} is not a multiple of train.micro_batch_size ({micro}) x {ranks} "
        f"data-parallel {rank_s} = {micro * ranks}; {fix}"
    )


def test_a_given_grad_accum_that_disagrees_is_replaced_with_a_note():
    batch = plan.global_batch(_train(*GLOBAL, "train.grad_accum=3"), 2)
    assert batch.grad_accum == 4
    assert batch.note == "train.grad_accum=3 replaced by 4: derived from train.global_batch_size"
    assert plan.global_batch(_train(*GLOBAL, "train.grad_accum=4"), 2).note is None  # it agrees


def test_saved_batch_reads_a_checkpoints_meta():
    meta = {"world_size": 2, "sampler": {"seed": 1, "next_step": 3, "global_batch": 16},
            "config": {"train": {"micro_batch_size": 4, "grad_accum": 2, "global_batch_size": None}}}  # fmt: skip
    assert plan.SavedBatch.of(meta) == plan.SavedBatch(16, None, 2, 2)
    assert plan.SavedBatch.of({"world_size": 4}) == plan.SavedBatch(None, None, None, 4)  # no sampler saved


def test_a_resume_keeps_the_checkpoints_global_batch_on_another_world():
    """The checkpoint trained 16 sequences a step on 2 ranks (grad_accum 1) with train.global_batch_size set; the
    resume in one process keeps 16, with grad_accum 2, whether or not its own config sets the key."""
    saved = plan.SavedBatch(16, key=16, grad_accum=1, dp_ranks=2)
    line = "resume: global batch 16 sequences kept; train.grad_accum 1 -> 2 for 1 data-parallel rank"
    for train in (_train("train.micro_batch_size=8"), _train("train.micro_batch_size=8", "train.global_batch_size=16")):
        batch = plan.global_batch(train, 1, saved)
        assert (batch.sequences, batch.grad_accum, batch.note, batch.warning) == (16, 2, line, None)
    assert plan.global_batch(_train("train.micro_batch_size=8"), 2, saved).note is None  # the same world: nothing
    cfg = load_config(ROOT / "configs/tiny.yaml", ["train.micro_batch_size=8"])
    assert plan.resolve(cfg, _env(), saved).cfg.train.global_batch_size == 16  # carried into config.yaml


def test_a_resume_given_another_global_batch_size_says_so():
    saved = plan.SavedBatch(16, key=16, grad_accum=1, dp_ranks=2)
    batch = plan.global_batch(_train("train.micro_batch_size=8", "train.global_batch_size=32"), 1, saved)
    assert (batch.sequences, batch.grad_accum) == (32, 4)
    assert batch.note == (
        "resume: train.global_batch_size 32 replaces the checkpoint's global batch of 16 sequences; "
        "train.grad_accum 4 for 1 data-parallel rank"
    )


def test_without_the_key_a_resume_on_another_world_warns():
    """A checkpoint of 2 ranks x 8 sequences resumed in one process without train.global_batch_size: the global
    batch halves, and the warning gives both numbers and the key that would keep it."""
    saved = plan.SavedBatch(16, key=None, grad_accum=1, dp_ranks=2)
    batch = plan.global_batch(_train("train.micro_batch_size=8"), 1, saved)
    assert (batch.sequences, batch.grad_accum, batch.note) == (8, 1, None)
    assert batch.warning == (
        "resume: the global batch changes from the checkpoint's 16 sequences per step on 2 data-parallel ranks to 8 "
        "(train.micro_batch_size 8 x train.grad_accum 1 x 1 data-parallel rank); set train.global_batch_size=16 to "
        "keep it on any number of GPUs"
    )
    assert plan.global_batch(_train("train.micro_batch_size=8", "train.grad_accum=2"), 1, saved).warning is None
    assert plan.global_batch(_train("train.micro_batch_size=4"), 2, saved).warning is None  # the same world


def test_background_checkpoints_are_on_for_cuda_where_the_host_holds_the_copy_twice():
    from trainer.checkpoint.background import background_checkpoints

    gb = 10**9
    assert background_checkpoints("cuda", 12 * gb, 1, 100 * gb)[0] is True
    assert background_checkpoints("cuda", 12 * gb, 4, 100 * gb)[0] is True  # 48 GB, twice over in 100
    off, why = background_checkpoints("cuda", 12 * gb, 8, 100 * gb)  # 96 GB: not twice over
    assert off is False and "12.0 GB x 8 local ranks in host memory; 100 GB available" in why
    assert background_checkpoints("cuda", gb, 1, None) == (False, "off (the host's available memory is unknown; "
                                                                  "the copy needs 1.0 GB)")  # fmt: skip
    assert background_checkpoints("cpu", gb, 1, 100 * gb)[0] is False
    assert background_checkpoints("cuda", gb, 1, 100 * gb, sharded=True)[0] is False


def test_async_save_auto_is_resolved_on_the_model_and_recorded(tmp_path):
    """checkpoint.async_save=auto is resolved once the model exists (its state's size): off on a CPU, with the
    reason in plan.json's choices; true and false are taken as given."""
    from trainer.build import make_model

    for asked, want in (("auto", False), ("true", True), ("false", False)):
        cfg = load_config(ROOT / "configs/tiny.yaml", [*FAST, f"checkpoint.async_save={asked}"])
        p = plan.resolve(cfg, _env())
        placed = p.placed(make_model(p, 256))
        assert placed.async_save is want and placed.as_dict()["checkpoint.async_save"] is want
        said = [c for c in placed.choices if c.startswith("checkpoint.async_save=auto: ")]
        assert said == (["checkpoint.async_save=auto: off (on a CPU the copy and the write share the cores that "
                         "train)"] if asked == "auto" else [])  # fmt: skip
