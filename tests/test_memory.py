"""The memory model (trainer/memory.py) and ``trainer tune`` (trainer/tune.py) on the CPU.

The parts are checked against the tensors a real step leaves (parameters, gradients, optimizer state) and the
prediction at one micro-batch, made from a probe at another, against the live tensor bytes counted at it. The
search is checked on a synthetic device whose memory and speed follow known lines; ``trainer tune`` itself runs
on the tiny config, alone and under torchrun on 2 gloo ranks.
"""

import json
import re
import sys

import pytest
import torch
import yaml

from tests.conftest import ROOT, cli, run_cli, torchrun
from trainer import memory, tune
from trainer.config import load_config
from trainer.memory import GB, Estimate, Point, probe

GPT2 = ["model.preset=gpt2-small", "data.seq_len=32", "train.precision=fp32"]


def _llama_overrides(tmp_path) -> list[str]:
    pytest.importorskip("transformers")
    from tests.test_hf import LLAMA

    (tmp_path / "llama").mkdir(exist_ok=True)
    (tmp_path / "llama" / "config.json").write_text(json.dumps({**LLAMA, "max_position_embeddings": 128}))
    return [f"model.hf={tmp_path / 'llama'}", "data.seq_len=64", "train.precision=fp32"]


@pytest.mark.parametrize("name", ["gpt2-124m", "tiny-llama"])
def test_parts_and_prediction_match_the_tensors_of_a_step(name, tmp_path):
    """fp32 on the CPU, where ``torch.cuda.memory`` is absent: the counted parts against the bytes of the tensors
    of a step, and the step's peak at micro-batch 4, predicted from probes at 1 and 2, against the live bytes
    counted at 4, within 10% (observed: the parts exact; the peaks within 1%)."""
    overrides = GPT2 if name == "gpt2-124m" else _llama_overrides(tmp_path)
    vocab = 50304 if name == "gpt2-124m" else 256
    cfg = load_config(None, overrides)
    model = memory.model_on_meta(cfg, vocab)
    counted = memory.static_parts(model, cfg, 1, "cpu")
    transient = memory.step_transient(model, cfg, 1, "cpu")
    assert transient[0] == counted["parameters"][0]  # foreach on the CPU
    for mode in ["none"] if name == "gpt2-124m" else list(memory.MODES):
        est = Estimate(counted, cfg.data.seq_len, transient=transient)
        est.points = [Point(mode, b, probe.cpu_peak(cfg, mode, b, vocab)) for b in (1, 2)]
        actual = {}
        backward = probe.cpu_peak(cfg, mode, 4, vocab, parts=actual)
        for part in ("parameters", "gradients", "optimizer state"):
            assert counted[part][0] == pytest.approx(actual[part], rel=0.10), (part, counted[part], actual[part])
        assert est.peak(mode, 4) == pytest.approx(actual["step"], rel=0.10), (mode, est.peak(mode, 4), actual)
        if name == "tiny-llama":  # its activations outweigh its weights: the line's slope is what is tested
            assert backward > 1.5 * est.points[0].peak
    if name == "gpt2-124m":  # at 4 x 32 tokens the peak is the backward's end: every gradient, the embedding's twice
        assert counted["parameters"][0] == pytest.approx(124.4e6 * 4, rel=0.01)  # GPT-2 small, vocab 50304


def test_live_bytes_counts_what_a_step_creates_and_frees():
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256)
    with probe.LiveBytes() as live:
        y = lin(x).relu()
        after_forward = live.live
        y.sum().backward()
        del y
    assert after_forward == 64 * 256 * 4  # the relu's output, which its backward keeps; the linear's is gone
    assert live.peak >= after_forward + 256 * 256 * 4  # the weight's gradient joins it in the backward
    assert live.live < live.peak


def test_estimate_fits_lines_and_respects_measured_out_of_memory():
    parts = {"parameters": (4 * GB, ""), "gradients": (4 * GB, ""), "optimizer state": (8 * GB, "")}
    est = Estimate(parts, 2048, capacity=60 * GB, points=[Point("none", 4, 28 * GB)])
    assert est.fit("none") == (pytest.approx(3 * GB), 0.0)  # (28 - 16) / 4 through the counted parts
    assert est.peak("none", 10) == pytest.approx(46 * GB)
    assert est.largest("none", [1, 2, 4, 8, 12, 16, 20]) == 12  # 52 GB fits, 16 (64 GB) does not
    est.points += [Point("none", 12, 51 * GB), Point("none", 2, 20 * GB)]  # the line through the two largest
    slope, const = est.fit("none")
    assert slope == pytest.approx(23 / 8 * GB) and const == pytest.approx(28 * GB - 16 * GB - 4 * slope)
    est.points.append(Point("none", 12, None, status="out of memory"))  # measured beats predicted
    assert est.fits("none", 12) is False and est.fits("none", 16) is False and est.fits("none", 8) is True
    assert est.fit("full") is None and est.fits("full", 1) is None and est.largest("full", [1]) is None
    text = est.describe([1, 2, 4, 8, 12, 16], "memory:")
    assert "largest micro-batch that fits: 8" in text and "full" in text and "not measured" in text
    # The line's intercept is said as where the line runs against the counted parts, never as a negative part.
    assert "2.88 GB (measured at micro-batch 2, 4, 12; their line meets micro-batch 0 500.0 MB above the" in text
    below = Estimate(parts, 2048, points=[Point("none", 4, 28 * GB), Point("none", 12, 56 * GB)])
    assert below.fit("none") == (pytest.approx(3.5 * GB), pytest.approx(-2 * GB))  # 28 - 16 - 4 x 3.5
    text = below.describe([1, 2, 4], "memory:")
    said = "3.50 GB (measured at micro-batch 4, 12; their line meets micro-batch 0 2.00 GB below the counted parts)"
    assert said in text, text
    assert not re.search(r"-[\d.]+ [MG]B", text), text  # no negative size anywhere


class FakeDevice:
    """Runs of a synthetic GPU: peak = 16 GB + B * per-sequence bytes of the mode (out of memory past 60 GB),
    speed rising with the micro-batch and falling with recomputation."""

    PER_SEQ = {"none": 3 * GB, "selective": 1.5 * GB, "full": 0.5 * GB}
    COST = {"none": 1.0, "selective": 1.05, "full": 1.3}

    def __init__(self):
        self.calls = []

    def run(self, mode, micro_batch, overrides, predicted=None):
        self.calls.append((mode, micro_batch, tuple(o for o in overrides if "precision" in o or "_mb" in o)))
        peak = 16 * GB + micro_batch * self.PER_SEQ[mode]
        if peak > 60 * GB:
            return Point(
                mode, micro_batch, None, status="out of memory", overrides=overrides, seconds=1, predicted=predicted
            )
        tps = 60e3 * micro_batch / (micro_batch + 2) / self.COST[mode]
        return Point(mode, micro_batch, peak, tps, overrides=overrides, seconds=1, predicted=predicted)


def _session(monkeypatch, tmp_path, overrides, device, capacity=None, capability=None):
    monkeypatch.setattr(tune, "on_cuda", lambda cfg: True)
    monkeypatch.setattr(
        tune,
        "plan_facts",
        lambda work: {"device.memory_gb": capacity / GB / memory.USABLE, "device.capability": capability},
    )
    s = tune.Session(
        str(ROOT / "configs/tiny.yaml"),
        [f"run.dir={tmp_path / 'run'}", *overrides],
        100.0,
        reuse=False,
        say=lambda *_: None,
    )
    s.runner.run = device.run
    return s


def test_search_probes_each_mode_then_its_largest_fitting_micro_batch(monkeypatch, tmp_path):
    """64 sequences per rank and step: none probed at 4 (3 GB a sequence), then the largest divisor of 64 that
    fits 60 GB: 8; selective (1.5 GB) fits 16, not 32; full (0.5 GB) fits 64. Each mode only above the last."""
    device = FakeDevice()
    s = _session(monkeypatch, tmp_path, ["train.micro_batch_size=4", "train.grad_accum=16"], device, 60 * GB)
    s.estimate.parts = {"counted": (16 * GB, "")}  # the synthetic device's constant
    tune.search(s)
    assert [(m, b) for m, b, _ in device.calls] == [
        ("none", 4),
        ("none", 8),
        ("selective", 4),
        ("selective", 16),
        ("full", 4),
        ("full", 64),
    ]
    best = tune.fastest(s.measured)
    assert (best.mode, best.micro_batch) == ("selective", 16)  # 50.8K against none 8: 48K, full 64: 44.8K
    text = tune.table(s.measured)
    assert text.count("\n") == len(device.calls) + 1 and "**fastest**" in text


class _Traced:
    """A mode's traced activations on the synthetic device: its bytes per sequence."""

    def __init__(self, mode):
        self.mode = mode

    def activations(self, micro_batch, keep_grads):
        return micro_batch * FakeDevice.PER_SEQ[self.mode]


class Fp8Device(FakeDevice):
    def run(self, mode, micro_batch, overrides, predicted=None):
        p = super().run(mode, micro_batch, overrides, predicted)
        if p.tokens_per_s and "train.precision=fp8" in overrides:
            p.tokens_per_s *= 1.05
        return p


def _traced_session(monkeypatch, tmp_path, device):
    monkeypatch.setattr(tune, "installed", lambda name: name == "torchao")
    s = _session(monkeypatch, tmp_path, ["train.micro_batch_size=4", "train.grad_accum=16"], device, 60 * GB, "9.0")
    s.estimate.parts = {"counted": (16 * GB, "")}
    s.estimate.traced, s.estimate.keep_grads = {m: _Traced(m) for m in memory.MODES}, False
    return s


def test_with_traced_memory_tune_runs_fp8_first_then_each_modes_largest_micro_batch(monkeypatch, tmp_path):
    """The modes' traced memory, no probes: the config as given (none, 4), fp8 at none's largest fitting size (8 of
    the divisors of 64), none 8, then selective 16 and full 64 (each larger than the cheaper modes'); fp8 was faster
    than bf16 at none 8, so it is tried on the fastest, selective 16."""
    device = Fp8Device()
    s = _traced_session(monkeypatch, tmp_path, device)
    tune.search(s)
    fp8 = ("train.precision=fp8",)
    assert device.calls == [
        ("none", 4, ()), ("none", 8, fp8), ("none", 8, ()), ("selective", 16, ()), ("full", 64, ()),
        ("selective", 16, fp8),
    ]  # fmt: skip
    best = tune.fastest(s.measured)
    assert (best.mode, best.micro_batch, "train.precision=fp8" in best.overrides) == ("selective", 16, True)
    assert not s.skipped


def test_tune_lists_what_the_budget_left_out(monkeypatch, tmp_path):
    device = Fp8Device()
    s = _traced_session(monkeypatch, tmp_path, device)
    s.affords = lambda: len(s.measured) < 3
    tune.search(s)
    assert len(device.calls) == 3
    text = tune.table(s.measured, 1, s.skipped)
    assert text.count("skipped: no budget left") == 2, text
    assert "train.activation_checkpointing=selective micro-batch 16" in text and "micro-batch 64" in text


def test_with_global_batch_size_a_candidate_sets_the_micro_batch_alone(monkeypatch, tmp_path):
    """train.global_batch_size=64 in one process: the 64 sequences per rank and step of micro-batch 4 x grad_accum
    16, searched alike; each candidate sets train.micro_batch_size alone and its run derives train.grad_accum, and
    the tuned config keeps the key."""
    from trainer import plan
    from trainer.config import ConfigError

    device = FakeDevice()
    s = _session(monkeypatch, tmp_path, ["train.micro_batch_size=4", "train.global_batch_size=64"], device, 60 * GB)
    s.estimate.parts = {"counted": (16 * GB, "")}
    assert (s.per_rank, s.derived) == (64, True)
    tune.search(s)
    assert [(m, b) for m, b, _ in device.calls] == [
        ("none", 4),
        ("none", 8),
        ("selective", 4),
        ("selective", 16),
        ("full", 4),
        ("full", 64),
    ]
    assert [p.overrides[1:] for p in s.measured[:2]] == [["train.micro_batch_size=4"], ["train.micro_batch_size=8"]]
    best = tune.fastest(s.measured)
    tune.write_tuned(s, best, tmp_path / "tuned.yaml", "trainer tune")
    tuned = load_config(tmp_path / "tuned.yaml")
    assert (tuned.train.micro_batch_size, tuned.train.global_batch_size) == (best.micro_batch, 64)
    assert plan.one_process(tuned).cfg.train.grad_accum == 64 // best.micro_batch
    assert tune.batch_overrides(3, None, derived=True) == [
        "train.micro_batch_size=3",
        "train.grad_accum=1",
        "train.global_batch_size=null",
    ]  # a probe of one micro-batch a step
    with pytest.raises(ConfigError, match="train.global_batch_size: 6 is not a multiple of train.micro_batch_size"):
        _session(monkeypatch, tmp_path, ["train.micro_batch_size=4", "train.global_batch_size=6"], device, 60 * GB)


def test_a_global_batch_smaller_than_what_fits_is_named(monkeypatch, tmp_path):
    """4 sequences per step, and 12 (52 GB) would fit the synthetic device: tune says how to let it try them."""
    device = FakeDevice()
    s = _session(monkeypatch, tmp_path, ["train.micro_batch_size=4", "train.grad_accum=1"], device, 60 * GB)
    s.estimate.parts = {"counted": (16 * GB, "")}
    tune.search(s)
    hint = tune.larger_batch_hint(s, tune.fastest(s.measured))
    assert "micro-batches up to 12 are predicted to fit" in hint and "raise train.grad_accum" in hint
    s.per_rank = 64
    assert tune.larger_batch_hint(s, tune.fastest(s.measured)) is None


def test_search_steps_down_after_an_unpredicted_out_of_memory(monkeypatch, tmp_path):
    """The estimate is optimistic (the probe's memory says 1 GB per sequence; the device needs 3 past B=8):
    the run out of memory is recorded and the next smaller micro-batch tried."""

    class Growing(FakeDevice):
        def run(self, mode, micro_batch, overrides, predicted=None):
            self.PER_SEQ = {"none": 1 * GB if micro_batch <= 4 else 3 * GB}
            return super().run(mode, micro_batch, overrides, predicted)

    device = Growing()
    s = _session(monkeypatch, tmp_path, ["train.micro_batch_size=4", "train.grad_accum=8"], device, 60 * GB)
    s.estimate.parts = {"counted": (16 * GB, "")}
    monkeypatch.setattr(tune, "MODES", ("none",))
    tune.search(s)
    assert [(b, p.status) for (_, b, _), p in zip(device.calls, s.measured)] == [
        (4, "ok"),
        (32, "out of memory"),
        (16, "out of memory"),
        (8, "ok"),
    ]


class Faster(FakeDevice):
    """fp8, every unit kept gathered and bf16 reduction each faster; keeping the units gathered costs ``KEPT``."""

    GAIN = {"train.precision=fp8": 1.2, "distributed.reshard_after_forward=false": 1.05,
            "distributed.reduce_dtype=bf16": 1.02}  # fmt: skip
    KEPT = 10 * GB

    def run(self, mode, micro_batch, overrides, predicted=None):
        kept = "distributed.reshard_after_forward=false" in overrides
        p = super().run(mode, micro_batch, overrides, predicted)
        self.calls[-1] = (
            mode,
            micro_batch,
            tuple(
                o
                for o in overrides
                if o.startswith(("train.", "distributed."))
                and not o.startswith(("train.micro", "train.grad", "train.act"))
            ),
        )
        if p.status != "ok":
            return p
        if kept and p.peak + self.KEPT > 60 * GB:
            return Point(mode, micro_batch, None, status="out of memory", overrides=overrides, seconds=1)
        for o in overrides:
            p.tokens_per_s *= self.GAIN.get(o, 1.0)
        p.peak += self.KEPT if kept else 0
        return p


def _fsdp_session(monkeypatch, tmp_path, device, per_rank):
    monkeypatch.setattr(tune, "installed", lambda name: name == "torchao")
    s = _session(
        monkeypatch,
        tmp_path,
        [f"train.micro_batch_size={per_rank}", "train.grad_accum=1", "train.precision=bf16",
         "distributed.strategy=fsdp"],
        device,
        60 * GB,
        "9.0",
    )  # fmt: skip
    s.world, s.dp = tune.World(size=2, local_size=2), 2  # one node of 2 GPUs, both data parallel
    s.world.broadcast = lambda obj: obj
    s.estimate.parts = {"counted": (16 * GB, "")}
    return s


def test_search_adds_fp8_fsdp_settings_and_unit_sizes_on_the_fastest(monkeypatch, tmp_path):
    """After the modes: fp8, then every unit kept gathered, then bf16 reduction, then tensor parallel over 2 of the
    node's GPUs (the global batch kept: 2 sequences on each of 2 ranks), then half and twice the unit size, each on
    the fastest so far, keeping the settings that made it the fastest."""
    device = Faster()
    s = _fsdp_session(monkeypatch, tmp_path, device, 2)
    tune.search(s)
    fp8, kept, bf16 = "train.precision=fp8", "distributed.reshard_after_forward=false", "distributed.reduce_dtype=bf16"
    assert [x for _, _, x in device.calls if x] == [
        (fp8,),
        (fp8, kept),
        (fp8, kept, bf16),
        (fp8, kept, bf16, "distributed.tp=2", "distributed.shard=-1", "train.global_batch_size=4"),
        (fp8, kept, bf16, "distributed.fsdp_unit_mb=256"),
        (fp8, kept, bf16, "distributed.fsdp_unit_mb=1024"),
    ]
    best = tune.fastest(s.measured)
    assert best.micro_batch == 2 and {fp8, kept, bf16} <= set(best.overrides)


def test_mesh_candidates_are_hsdp_across_nodes_and_tensor_parallel_within_one(monkeypatch, tmp_path):
    s = _fsdp_session(monkeypatch, tmp_path, Faster(), 2)
    s.world = tune.World(size=8, local_size=4)  # 2 nodes of 4 GPUs
    assert tune.mesh_candidates(s) == [["distributed.replicate=2", "distributed.shard=-1"],
                                       ["distributed.tp=2", "distributed.shard=-1"]]  # fmt: skip
    s.world = tune.World(size=2, local_size=1)  # 2 nodes of 1 GPU: HSDP only
    assert tune.mesh_candidates(s) == [["distributed.replicate=2", "distributed.shard=-1"]]


def _kept_runs(device, s) -> list[tuple[int, str]]:
    """(micro-batch, status) of the candidates that kept every unit gathered."""
    kept = "distributed.reshard_after_forward=false"
    return [(b, p.status) for (_, b, x), p in zip(device.calls, s.measured) if kept in x]


def test_search_keeps_the_units_gathered_one_micro_batch_smaller_where_the_fastest_does_not_fit(monkeypatch, tmp_path):
    """Keeping every unit gathered needs 40 GB more: at the fastest micro-batch (4: 28 GB) it runs out of memory,
    so it is tried once at the next smaller one (2: 22 + 40 GB, out again: no third try)."""
    device = Faster()
    device.KEPT = 40 * GB
    s = _fsdp_session(monkeypatch, tmp_path, device, 4)
    monkeypatch.setattr(tune, "fp8_possible", lambda s: False)
    tune.search(s)
    assert _kept_runs(device, s) == [(4, "out of memory"), (2, "out of memory")]
    device.calls.clear()
    device.KEPT = 35 * GB  # 4: 28 + 35 GB does not fit; 2: 22 + 35 GB fits
    s = _fsdp_session(monkeypatch, tmp_path, device, 4)
    monkeypatch.setattr(tune, "fp8_possible", lambda s: False)
    tune.search(s)
    assert _kept_runs(device, s) == [(4, "out of memory"), (2, "ok")]


def test_tune_on_the_cpu_writes_a_config_that_trains(tmp_path):
    """``trainer tune`` on the tiny config ends with its table and CONFIG.tuned.yaml, which ``trainer fit`` runs."""
    config = tmp_path / "tiny.yaml"
    config.write_text((ROOT / "configs/tiny.yaml").read_text())
    r = run_cli(
        "tune", str(config), f"run.dir={tmp_path / 'run'}", "train.micro_batch_size=4", "--budget-s", "60", cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| # | candidate | tok/s | peak GB | predicted GB | status |" in r.stdout
    assert r.stdout.count("train.micro_batch_size=") >= 3 and "**fastest**" in r.stdout
    if torch.get_num_threads() > 1:  # half the threads, on the fastest micro-batch
        assert f"train.threads={torch.get_num_threads() // 2} |" in r.stdout
    tuned = tmp_path / "tiny.tuned.yaml"
    head = tuned.read_text().splitlines()[:3]
    assert head[0].startswith("# trainer tune") and "tok/s" in head[1] and "Overrides over" in head[2]
    assert (tmp_path / "run.tune" / "measured.json").exists()
    # The printed command works after a run of the config as given: the tuned config's run has its own directory,
    # and the measurements beside it.
    assert f"  trainer fit {tuned}\n" in r.stdout
    saved = yaml.safe_load(tuned.read_text())["run"]
    assert (saved["name"], saved["dir"]) == ("tiny-tuned", str(tmp_path / "run-tuned"))
    assert (tmp_path / "run-tuned.tune" / "measured.json").read_bytes() == (
        tmp_path / "run.tune" / "measured.json"
    ).read_bytes()
    short = ["train.steps=2", "train.eval_every=0", "checkpoint.enabled=false"]
    assert run_cli("fit", str(config), f"run.dir={tmp_path / 'run'}", *short, cwd=tmp_path).returncode == 0
    r = run_cli("fit", str(tuned), *short, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "run-tuned" / "metrics.jsonl").is_file()


def test_tune_under_torchrun_runs_each_candidate_on_every_rank(tmp_path):
    """2 gloo ranks: rank 0 chooses, every rank's tune process takes part, each candidate is its own torchrun."""
    config = tmp_path / "tiny.yaml"
    config.write_text((ROOT / "configs/tiny.yaml").read_text())
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "-m",
        "trainer",
        "tune",
        str(config),
        f"run.dir={tmp_path / 'run'}",
        "distributed.strategy=ddp",
        "train.micro_batch_size=2",
        "train.grad_accum=1",
        "model.n_layer=1",
        "--budget-s",
        "120",
    ]
    r = torchrun(cmd, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count("| train.activation_checkpointing=") == 2, r.stdout  # micro-batches 2 and 1
    assert (tmp_path / "tiny.tuned.yaml").exists()
    plans = list((tmp_path / "run.tune" / "runs").glob("*/plan.json"))
    assert plans and all(json.loads(p.read_text())["world"] == 2 for p in plans)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["tune", "tiny", "--budget-s", "0"], "--budget-s: expected a positive"),
        (["tune", "tiny", "train.micro_batch_sise=4"], "did you mean"),
        (["tune", "tiny", "resume=last"], "resume: not supported by tune"),
    ],
)
def test_tune_errors_exit_2(capsys, args, needle):
    r = cli(capsys, *args)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


def test_fit_warns_before_step_1_from_measured_points(tmp_path):
    """The startup note: none on the CPU; the predicted peak from measured.json, a warning past the device."""
    cfg = load_config(
        ROOT / "configs/tiny.yaml", [f"run.dir={tmp_path / 'run'}", "train.micro_batch_size=8", "train.grad_accum=2"]
    )
    model = memory.model_on_meta(cfg, 256)
    assert memory.startup_note(cfg, model, 1, None) is None
    assert memory.startup_note(cfg, model, 1, 80 * GB) is None  # nothing measured, the counted parts fit
    static = sum(b for b, _ in memory.static_parts(model, cfg, 1, "cuda").values())
    key = memory.memory_key(cfg, 1)
    memory.save_point(memory.work_dir(cfg) / "measured.json", key, Point("none", 2, static + 2 * GB))
    note = memory.startup_note(cfg, model, 1, 80 * GB)
    assert note.startswith("memory: predicted peak 8.") and "warning" not in note  # static + 8 x 1 GB
    note = memory.startup_note(cfg, model, 1, 6 * GB)  # 5.64 GB allowed: 4 sequences fit, 8 do not
    assert note.startswith("warning: memory:") and "micro-batch 4 is predicted to fit" in note
    other = load_config(ROOT / "configs/tiny.yaml", [f"run.dir={tmp_path / 'run'}", "model.n_layer=2"])
    assert memory.startup_note(other, model, 1, 6 * GB) is None  # another model: the points are not its own


def test_explain_memory_on_the_cpu_prints_the_parts_and_each_mode(capsys, tmp_path):
    r = cli(
        capsys, "explain", "--memory", "--measure", "tiny", f"run.dir={tmp_path / 'run'}", "train.micro_batch_size=4"
    )
    assert r.returncode == 0, r.stderr
    for line in ("parameters", "gradients", "optimizer state", "optimizer step", "counted"):
        assert line in r.stdout, r.stdout
    for mode in memory.MODES:
        assert f"  {mode} " in r.stdout and "(measured at micro-batch 4, 8" in r.stdout, r.stdout
    assert not re.search(r"-[\d.]+ [MG]B", r.stdout), r.stdout  # no part, nor an intercept, as a negative size


def test_bf16_master_weights_count_two_bytes_a_parameter_and_state():
    """optim.master_weights=bf16: the counted parameters, gradients and AdamW states against the tensors of a model
    cast as the run casts it and trainer's Triton AdamW after one step (bf16 states), exactly."""
    from trainer.model_setup import build_model_of, master_weights
    from trainer.optim.optimizers import TritonAdamW

    shape = ["model.n_layer=2", "model.n_embd=64", "model.n_head=2"]
    cfg = load_config(None, [*GPT2[:-1], *shape, "optim.master_weights=bf16", "train.precision=bf16"])
    counted = memory.static_parts(memory.model_on_meta(cfg, 256), cfg, 1, "cpu")
    model = master_weights(build_model_of(cfg, 256, pretrained=False), cfg)
    opt = TritonAdamW(model.parameters(), stochastic_rounding=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    states = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")
    assert counted["parameters"][0] == counted["gradients"][0] == params and "bf16" in counted["parameters"][1]
    assert counted["optimizer state"][0] == states == 2 * params


def test_explain_memory_traces_each_mode_for_a_named_gpu_on_the_cpu(capsys, tmp_path):
    """No probe runs: each mode's step traced, its peak at each micro-batch asked, the largest that fits."""
    r = cli(
        capsys, "explain", "--memory", "tiny", f"run.dir={tmp_path / 'run'}",
        "--gpu", "1", "--micro-batches", "4,8,64", "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["usable_gb"] == round(memory.USABLE, 2) and out["world"] == 1 and out["seconds"] < 120
    modes = out["modes"]
    assert list(modes) == list(memory.MODES)
    for m in modes.values():
        peaks = [m["peak_gb"][b] for b in ("4", "8", "64")]
        assert peaks[0] < peaks[1] < peaks[2], m
    saved = [modes[m]["saved_gb_per_sequence"] for m in memory.MODES]
    assert saved[0] > saved[1] >= saved[2] > 0, saved
    assert not (tmp_path / "run").exists() and (tmp_path / "run.tune" / "traced.json").is_file()  # nothing ran
    again = cli(
        capsys, "explain", "--memory", "tiny", f"run.dir={tmp_path / 'run'}", "--gpu", "1", "--micro-batches", "64"
    )
    assert again.returncode == 0 and "traced none in" not in again.stdout  # the traces kept: none made again
    assert abs(modes["none"]["peak_gb"]["64"] - memory_peak_in(again.stdout, 64, "none")) <= 0.05  # 1 decimal


def memory_peak_in(text: str, micro_batch: int, mode: str) -> float:
    """The peak of ``mode`` at ``micro_batch`` in explain --memory's printed table."""
    header = next(line for line in text.splitlines() if line.startswith("| micro-batch |"))
    column = [c.strip() for c in header.strip("|").split("|")].index(mode)
    row = next(line for line in text.splitlines() if line.startswith(f"| {micro_batch} |"))
    return float(row.strip("|").split("|")[column].split()[0])


def test_a_gpu_that_is_not_known_exits_2_with_a_suggestion(capsys, tmp_path):
    r = cli(capsys, "explain", "--memory", "tiny", f"run.dir={tmp_path / 'run'}", "--gpu", "h10")
    assert r.returncode == 2 and "did you mean 'h100'" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = cli(capsys, "explain", "--memory", "tiny", "--micro-batches", "4,x")
    assert r.returncode == 2 and "--micro-batches" in r.stderr, r.stderr


def test_fsdp_gradients_are_made_in_the_backward_without_accumulation():
    def cfg(*extra):
        return load_config(ROOT / "configs/tiny.yaml", ["distributed.strategy=fsdp", *extra])

    assert memory.grads_made_in_backward(cfg(), 2)
    assert not memory.grads_made_in_backward(cfg("train.grad_accum=2"), 2)


def test_fit_predicts_its_peak_from_the_traces_explain_kept(tmp_path):
    cfg = load_config(ROOT / "configs/tiny.yaml", [f"run.dir={tmp_path / 'run'}"])
    cache = memory.work_dir(cfg) / "traced.json"
    est = memory.traced_estimate(cfg, 1, 80 * GB, modes=("none",), cache=cache)
    model = memory.model_on_meta(cfg, 256)
    note = memory.startup_note(cfg, model, 1, 80 * GB)
    assert note == (
        f"memory: predicted peak {memory.size(est.peak('none', 32))} per rank of the {memory.size(0.89 * 80 * GB)} "
        f"this GPU allows (micro-batch 32, train.activation_checkpointing=none; activations traced in "
        f"{memory.work_dir(cfg)})"
    )
    longer = load_config(ROOT / "configs/tiny.yaml", [f"run.dir={tmp_path / 'run'}", "data.seq_len=64"])
    assert memory.startup_note(longer, model, 1, 80 * GB) is None  # another step: not its trace
