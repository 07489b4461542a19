"""The benchmark scripts' job scheduling and variant parsing (scripts/bench_ddp.py, scripts/_variants.py)."""

import json
import threading
import time
from pathlib import Path

import pytest

from scripts._variants import parse_variant
from scripts.bench_ddp import VARIANTS, GpuPool, loss_outliers, visible_devices

ROOT = Path(__file__).resolve().parents[1]


def test_pool_places_jobs_on_disjoint_gpus_in_order_and_says_which_ran_alone():
    pool = GpuPool(4, max_jobs=4)
    jobs = [(2, False), (2, False), (1, True), (1, False)]  # (GPUs, the machine to itself)
    held, events, lock = set(), [], threading.Lock()

    def run(ticket, world, solo):
        gpus, token = pool.take(ticket, 4 if solo else world)
        with lock:
            assert not held & set(gpus)  # nobody else holds them
            held.update(gpus)
            events.append(("start", ticket))
        time.sleep(0.2)
        with lock:
            held.difference_update(gpus)
        events.append(("end", ticket, pool.give(gpus, token)))

    threads = [threading.Thread(target=run, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    starts = [e[1] for e in events if e[0] == "start"]
    alone = {e[1]: e[2] for e in events if e[0] == "end"}
    assert starts == [0, 1, 2, 3]  # ticket order
    assert alone == {0: False, 1: False, 2: True, 3: True}  # 0 and 1 shared the machine; 2 had it to itself
    assert events.index(("start", 2)) > max(events.index(("end", 0, False)), events.index(("end", 1, False)))


def test_variant_overrides():
    spec = parse_variant("ours-ddp@distributed.split_tail=false", VARIANTS)
    assert spec["overrides"][-1] == "distributed.split_tail=false"
    assert "distributed.split_tail=false" not in VARIANTS["ours-ddp"]["overrides"]  # the table is not changed
    with pytest.raises(SystemExit, match="unknown variant 'bogus'"):
        parse_variant("bogus", VARIANTS)
    with pytest.raises(SystemExit, match="ours-\\* variants only"):
        parse_variant("eager-ddp@x=1", VARIANTS)
    # Environment variables for any variant's processes, beside overrides.
    spec = parse_variant("ours-ddp@env:TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1@distributed.bucket_mb=25", VARIANTS)
    assert spec["env"] == {"TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1"}
    assert spec["overrides"][-1] == "distributed.bucket_mb=25" and not any("env:" in o for o in spec["overrides"])
    assert parse_variant("eager-ddp@env:NCCL_MAX_CTAS=8", VARIANTS)["env"] == {"NCCL_MAX_CTAS": "8"}
    assert parse_variant("eager-ddp", VARIANTS)["env"] == {}
    with pytest.raises(SystemExit, match="expected env:NAME=value"):
        parse_variant("eager-ddp@env:NCCL_MAX_CTAS", VARIANTS)


def test_trace_gaps_splits_steps_at_the_optimizer_and_sums_each_category(tmp_path):
    """scripts/trace_gaps.py on a hand-made timeline: 3 steps of 10 ms, each a 4 ms GEMM, a 2 ms attention
    kernel overlapping a 3 ms NCCL all-reduce by 1 ms, a 1 ms Triton kernel and a 1 ms AdamW kernel."""
    import json

    from scripts.trace_gaps import analyse, category, label

    events = []
    for s in range(4):
        t = s * 10_000
        events += [
            {"cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": t, "dur": 4000},
            {"cat": "kernel", "name": "pytorch_flash::flash_bwd_kernel", "ts": t + 4000, "dur": 2000},
            {"cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32", "ts": t + 5000, "dur": 3000},
            {"cat": "kernel", "name": "triton_poi_fused_gelu_0", "ts": t + 8000, "dur": 1000},
            {"cat": "kernel", "name": "void multi_tensor_apply_kernel<FusedAdamWMathFunctor>", "ts": t + 9000,
             "dur": 1000},
        ]  # fmt: skip
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = analyse(str(path), steps=3, step_kernel="adam")
    assert "step 10.00 ms" in out and "compute busy 8.00 ms" in out and "compute idle 2.00 ms" in out
    assert "nccl 3.00 ms, of it not under compute 2.00 ms" in out
    assert "nccl 3.00 ms | optimizer 1.00 ms | triton 1.00 ms | attention 2.00 ms | matmul 4.00 ms" in out
    assert category("void at::native::vectorized_elementwise_kernel<4, ...>") == "other"
    assert category("triton_poi_fused__scaled_dot_product_flash_attention_3") == "triton"  # Inductor's, not SDPA
    assert category("_linear_cross_entropy_kernel") == "triton"
    assert category("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_kernel0_0") == "attention"
    # torch's foreach kernels: the optimizer's and clipping's, and FSDP's copy-in, told apart by their functor.
    mta = "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<TensorListMetadata<2>, at::native::"
    fsdp_copy_in = mta + "(anonymous namespace)::CopyFunctor<c10::BFloat16, float, 2>>"
    assert category(fsdp_copy_in) == "copies"
    assert category(mta + "(anonymous namespace)::FusedAdamMathFunctor<float, 4>>") == "optimizer"
    assert category(mta + "(anonymous namespace)::LpNormFunctor<float, 2>>") == "optimizer"
    assert label(fsdp_copy_in) == "multi_tensor_apply_kernel CopyFunctor<c10::BFloat16, float, 2>"
    assert category("at::native::detail::split_with_sizes_copy_out_contiguous_no_cast_kernel(char**)") == "copies"
    assert category("void at::native::detail::chunk_cat_cuda_kernel<char, char>(char**, char*)") == "copies"
    assert category("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>") == "copies"
    assert category("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "triton"  # Inductor's, with a cast
    assert category("_sumsq_blocks_kernel") == "optimizer"  # the Triton optimizer's clipping norm

    # An optimizer whose launches of one step lie 3 ms apart (its first kernel moved into the step's idle gap):
    # two ends per step at the default 1 ms, the true steps with cluster_ms above the gap.
    split = [dict(e, name="_adamw_in_place_kernel", ts=e["ts"] - 3000) for e in events if "Adam" in e["name"]]
    path.write_text(json.dumps({"traceEvents": events + split}))
    assert "step 5.00 ms" in analyse(str(path), steps=2, step_kernel="adam")  # ends 3 and 7 ms apart
    assert "step 10.00 ms" in analyse(str(path), steps=3, step_kernel="adam", cluster_ms=4)

    # With host events: the Triton kernel (after the 2 ms idle gap) was launched 1.5 ms into the gap, so
    # 1.5 ms of the idle time is the host's and 0.5 ms a device-side wait.
    for e in events:
        e.setdefault("args", {})["correlation"] = id(e)
    events += [
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": e["ts"] - (500 if "triton" in e["name"] else 2000),
         "dur": 5, "args": {"correlation": id(e)}}
        for e in list(events)
    ]  # fmt: skip
    path.write_text(json.dumps({"traceEvents": events}))
    out = analyse(str(path), steps=3, step_kernel="adam")
    assert (
        "idle: host 1.50 ms (kernel launched after the GPU ran dry) | device 0.50 ms (waits, kernel-to-kernel latency)"
        in out
    ), out


def test_step_benchmark_models_build_and_configure(tmp_path):
    """Every model of the step benchmark: its trainer overrides load, and the model it builds (without storage)
    counts its FLOPs with attention."""
    import torch

    from scripts import _models
    from trainer.config import load_config

    for name in _models.MODELS:
        cfg = load_config(ROOT / "configs/gpt2-small.yaml", _models.overrides(name, tmp_path))
        assert (cfg.model.hf is not None) == (_models.spec(name)["kind"] == "hf")
        seq = _models.spec(name)["seq"]
        with torch.device("meta"):
            model = _models.build(name, tmp_path, seq)
        n = sum(p.numel() for p in model.parameters())
        assert _models.flops_per_token(name, model, seq) > 6 * n * 0.9, name  # attention adds, tied heads too


def _bench_fsdp_on_cpu(tmp_path, monkeypatch, plan: str, steps: int) -> dict:
    """scripts/bench_fsdp.py's main in this process on ``plan`` (2 gloo processes a job, the 2-layer Llama): its
    JSON."""
    import json

    from scripts.bench_fsdp import main

    out = tmp_path / "result.json"
    argv = ["scripts/bench_fsdp.py", "--device", "cpu", "--tiny", "--compile-backend", "aot_eager", "--steps",
            str(steps), "--warmup", "1", "--plan", plan, "--out", str(out)]  # fmt: skip
    monkeypatch.setattr("sys.argv", argv)
    monkeypatch.chdir(ROOT)
    main()
    return json.loads(out.read_text())


def test_fsdp_benchmark_runs_the_loop_and_ours_on_two_cpu_processes(tmp_path, monkeypatch):
    """scripts/bench_fsdp.py end to end on 2 gloo processes, a 2-layer Llama: both rows train and report, the loop's
    layers share one compiled graph, and the table reads both back. The script's main runs in this process; each
    job, as always, under torchrun in processes of its own."""
    import math

    from scripts.bench_fsdp import table

    # a job that fails is kept in the JSON under "error" (checked below)
    doc = _bench_fsdp_on_cpu(tmp_path, monkeypatch, "hf-llama-1b:2:2:loop:none,hf-llama-1b:2:2:ours:none", steps=3)
    loop, ours = doc["results"]["hf-llama-1b:2:2:loop:none"], doc["results"]["hf-llama-1b:2:2:ours:none"]
    for res in (loop, ours):
        assert "error" not in res, res.get("error")
        assert math.isfinite(res["tokens_per_s_per_gpu"]) and res["tokens_per_s_per_gpu"] > 0
        assert math.isfinite(res["final_loss"])
    # The loop trains on uniformly random tokens: from an initialised model its loss stays near ln(256) = 5.545
    # (observed 5.557-5.566 after 4 steps); the weights to_empty left uninitialised would read far off or NaN.
    assert abs(loop["final_loss"] - math.log(256)) < 0.1, loop["final_loss"]
    assert ours["final_loss"] < math.log(256) + 0.1  # bytes of source code: below uniform once it learns anything
    assert loop["dynamo_graphs"] == 1  # one graph for both decoder layers (no recompile per layer)
    assert doc["run"]["device"] == "cpu" and doc["run"]["tiny"]
    lines = table(doc).splitlines()
    assert sum("| hf-llama-1b (tiny) | 2 | 2 x 64 |" in line for line in lines) == 2


def test_bench_ddp_names_a_run_whose_loss_went_wrong():
    """Final losses of GPT-2 124M runs on 4 H100s: world 1, world 4 twice as expected, and once diverged."""

    def run(loss):
        return {"tokens_per_s_per_gpu": 4.6e5, "final_loss": loss}

    doc = {"preset": "gpt2-small", "results": {"ours-ddp-graphed": {"1": run(3.159), "4": run(13.673)},
                                              "ours-ddp-graphed@env:NCCL_PROTO=Simple": {"4": run(3.347)},
                                              "ours-ddp": {"4": run(3.326)}}}  # fmt: skip
    (line,) = loss_outliers(doc)
    assert line.startswith("gpt2-small ours-ddp-graphed x4: final loss 13.673") and "median" in line
    doc["results"]["ours-ddp-graphed"]["4"] = run(3.351)
    assert loss_outliers(doc) == []
    assert loss_outliers({"preset": "p", "results": {"v": {"4": run(13.0)}}}) == []  # nothing to compare with
    assert len(loss_outliers({"preset": "p", "results": {"v": {"1": run(3.2), "4": run(13.0)}}})) == 1


def _first_eval_step(t: float) -> float:
    """What the first evaluation of each start (steps 25 and 75, every 25 steps) takes once, resident and reserved:
    3%, before and after the restart at 150 s."""
    return 0.03 if 50 < t < 150 or t > 152 else 0.0


def _soak_run(step_s=lambda t: 0.1, rss=lambda t: 1.0, cache_after_kill=0, steps=None):
    """A 5-minute soak as scripts/soak.py records it: a row every 2 s, a rank killed at 150 s (the restart resumed
    from step 70), the compile cache sampled every second, an evaluation every 25 steps."""
    rows = [{"step": int(t / 2), "t": float(t), "step_time": step_s(t), "host_rss_gb": rss(t) + _first_eval_step(t),
             "mem_allocated_gb": 5.0, "mem_reserved_gb": 6.0 + 6 * _first_eval_step(t)}
            for t in range(2, 300, 2)]  # fmt: skip
    if steps is not None:
        for r, s in zip(rows, steps):
            r["step"] = s
    samples = [{"t": float(t), "step": 0, "cache_bytes": 1000 + (cache_after_kill if t > 150 else 0),
                "bundle_bytes": 10} for t in range(300)]  # fmt: skip
    starts = [{"restart": 0, "step": 0, "checkpoint": None}, {"restart": 1, "step": 70, "checkpoint": "c/step_70"}]
    return {"returncode": 0, "rows": rows, "samples": samples, "kill": {"t": 150.0, "rank": 1, "last_step": 74},
            "stop_s": 300.0, "starts": starts}  # fmt: skip


def test_soak_checks_each_series_for_drift():
    """scripts/soak.py's checks on synthetic series: steady ones pass (resident and reserved memory that grow 3%
    once, at each start's first evaluation, too); step time 3% slower in the last minute, resident memory growing
    4% over the second start, reserved memory growing 3% after the first evaluation, a compile cache that grew
    after the restart, a repeated step: each fails its own check, and only it."""
    import argparse

    from scripts.soak import analyse

    a = argparse.Namespace(minutes=5.0, eval_every=25, tiny=False)
    steady = analyse(a, _soak_run())
    assert steady["ok"] and all(c["ok"] for c in steady["checks"].values()), steady["checks"]
    assert steady["restart"]["resumed_from_step"] == 70 and steady["restart"]["steps_run_again"] == 4
    failing = {
        "step_time": _soak_run(step_s=lambda t: 0.103 if t >= 240 else 0.1),
        "host_rss": _soak_run(rss=lambda t: 1.0 + (0.04 * (t - 150) / 150 if t > 150 else 0)),
        "mem_reserved": _soak_run(),
        "compile_cache": _soak_run(cache_after_kill=4096),
        "job": _soak_run(steps=[1, 2, 2]),
    }
    for r in failing["mem_reserved"]["rows"]:
        r["mem_reserved_gb"] += 0.18 * max(0.0, r["t"] - 60) / 90 if r["t"] < 150 else 0.0
    for name, run in failing.items():
        checks = analyse(a, run)["checks"]
        assert [k for k, c in checks.items() if c["ok"] is False] == [name], (name, checks)
    slow = analyse(a, failing["step_time"])["checks"]["step_time"]
    assert abs(slow["change_pct"] - 3.0) < 1e-9
    tiny = argparse.Namespace(**{**vars(a), "tiny": True})  # --tiny on shared CPU cores: a quarter, not 2%
    assert analyse(tiny, failing["step_time"])["checks"]["step_time"]["ok"]
    leak = _soak_run(step_s=lambda t: 0.13 if t >= 240 else 0.1)
    assert analyse(tiny, leak)["checks"]["step_time"]["ok"] is False


def test_soak_leaves_out_each_starts_compile_and_capture_rows():
    """A start's first row (its compile) and the row after it (the CUDA graph's capture, 15% slower here) are not
    steady: in the first window of a short soak they would read as a speed-up over the run."""
    import argparse

    from scripts.soak import analyse

    a = argparse.Namespace(minutes=5.0, eval_every=25, tiny=False)
    r = _soak_run()
    r["rows"][29].update(first_step_s=30.0, step_time=30.0)  # the start's first row at 60 s, in the first window
    r["rows"][30]["step_time"] = 0.115
    assert analyse(a, r)["checks"]["step_time"]["ok"] is True
    for row in r["rows"][31:59]:  # the rest of the first window slow too: counted
        row["step_time"] = 0.115
    assert analyse(a, r)["checks"]["step_time"]["ok"] is False


def test_soak_counts_no_cache_growth_at_a_first_evaluation_after_the_kill():
    """The job's first evaluation, after the restart (at 250 s here), compiles the evaluation's graphs: the cache
    that grows there passes; grown at the same time after an evaluation before the kill (whose graphs the cache
    holds), or before the evaluation, it fails."""
    import argparse

    from scripts.soak import analyse

    a = argparse.Namespace(minutes=5.0, eval_every=25, tiny=False)

    def run(eval_at: float, grows_at: float):
        r = _soak_run()
        for row in r["rows"]:
            row["val_loss"] = 3.0 if row["t"] == eval_at else None
        for sample in r["samples"]:
            sample["cache_bytes"] += 2048 if sample["t"] >= grows_at else 0
        return analyse(a, r)["checks"]["compile_cache"]

    assert run(eval_at=250.0, grows_at=249.0)["ok"] is True  # the evaluation's compile, before its row
    assert run(eval_at=250.0, grows_at=249.0)["until_t"] == 248.0
    assert run(eval_at=100.0, grows_at=249.0)["ok"] is False
    assert run(eval_at=250.0, grows_at=200.0)["ok"] is False


def test_soak_reads_host_memory_after_each_starts_first_checkpoint():
    """A background save allocates the pinned host copy of the state at a start's first checkpoint and keeps it: the
    resident memory that jumps there (steps 40 and 80 here, after the evaluations at 25 and 75) is steady after
    it, and fails the check only where the soak does not know when the checkpoints came."""
    import argparse

    from scripts.soak import analyse

    run = _soak_run()
    for r in run["rows"]:
        first_save = 40 if r["t"] < 150 else 80
        r["host_rss_gb"] += 12.0 if r["step"] > first_save else 0.0
    a = argparse.Namespace(minutes=5.0, eval_every=25, checkpoint_every=40, tiny=False)
    assert analyse(a, run)["checks"]["host_rss"]["ok"], analyse(a, run)["checks"]["host_rss"]
    unknown = argparse.Namespace(**{**vars(a), "checkpoint_every": 0})
    assert analyse(unknown, run)["checks"]["host_rss"]["ok"] is False


def test_soak_refuses_bad_arguments(capsys):
    from scripts.soak import _args

    for argv, says in ((["--minutes", "0"], "--minutes: expected a positive number"),
                       (["--kill-at", "1.5"], "--kill-at: expected a fraction"),
                       (["--nproc", "2", "--kill-rank", "2"], "--kill-rank: expected a rank below --nproc 2"),
                       (["--config", "configs/nope.yaml"], "--config: no such file")):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            _args(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err, argv


def test_bench_fsdp_gives_each_row_at_its_best():
    """The best-settings table: per (model, world, row) the fastest AC and micro-batch that ran, against the loop's
    and loop-fp8's fastest at the same model and world, and the largest micro-batch that fit per AC mode."""
    from scripts.bench_fsdp import best_table

    def e(row, ac, batch, tps=None, oom=False):
        out = {"model": "m", "world": 4, "row": row, "ac": ac, "batch": batch, "peak_mem_gb": 50.0}
        return {**out, "tokens_per_s_per_gpu": tps} if tps else {**out, "oom": oom}

    rows = [e("loop", "full", 4, 8600), e("loop", "selective", 4, 10200), e("loop", "none", 2, oom=True),
            e("loop-fp8", "selective", 4, 13200), e("ours", "selective", 4, 14000), e("ours", "selective", 6, 12600),
            e("ours", "selective", 8, oom=True)]  # fmt: skip
    lines = best_table({"results": {str(i): r for i, r in enumerate(rows)}}).splitlines()
    loop = "| m | 4 | loop | selective, 4 | 10.2K | 50.0 | - | 0.773x | none - (OOM at 2); full 4; selective 4 |"
    assert loop in lines, lines
    assert "| m | 4 | ours | selective, 4 | 14.0K | 50.0 | 1.373x | 1.061x | selective 6 (OOM at 8) |" in lines


def test_bench_fsdp_skips_the_larger_micro_batches_of_a_setting_that_ran_out_of_memory(monkeypatch, tmp_path, capsys):
    """Within a call: loop at B=4 runs out of memory, so its B=8 is not run; ours at B=8 still is."""
    import scripts.bench_fsdp as bench

    spawned = []

    def fake_spawn(a, job):
        spawned.append(job)
        j = bench.parse_job(job)
        if j["row"] == "loop" and j["batch"] >= 4:
            return {"error": "CUDA out of memory", "oom": True}
        return {"tokens_per_s_per_gpu": 1000.0 * j["batch"], "step_ms": 1.0, "first_step_s": 1.0,
                "process_wall_s": 1.0, "final_loss": 1.0, "peak_mem_gb": 1.0}  # fmt: skip

    monkeypatch.setattr(bench, "_spawn", fake_spawn)
    monkeypatch.setattr(bench, "model_flops", lambda a, m, seq: 1.0)
    monkeypatch.setattr("sys.argv", ["bench_fsdp.py", "--device", "cpu", "--tiny", "--models", "hf-llama-1b",
                                     "--worlds", "2", "--batch", "2,4,8", "--rows", "loop,ours", "--ac", "none",
                                     "--out", str(tmp_path / "r.json")])  # fmt: skip
    bench.main()
    assert spawned == ["hf-llama-1b:2:2:loop:none", "hf-llama-1b:2:2:ours:none", "hf-llama-1b:2:4:loop:none",
                       "hf-llama-1b:2:4:ours:none", "hf-llama-1b:2:8:ours:none"]  # fmt: skip
    out = capsys.readouterr().out
    assert "hf-llama-1b:2:8:loop:none: skipped (out of memory at micro-batch 4 in this call)" in out
    assert "| hf-llama-1b | 2 | loop | none, 2 | 2.0K | 1.0 | - | - | none 2 (OOM at 4) |" in out


def test_visible_devices_map_through_the_scripts_own(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_devices([0, 1]) == "0,1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # the script was given GPUs 2 and 3
    assert visible_devices([1]) == "3"
    assert visible_devices([0, 1]) == "2,3"


def test_parity_warmup_gives_both_sides_the_same_schedule(tmp_path, monkeypatch):
    """scripts/parity.py --warmup 3 on the CPU (tiny GPT, fp32, eager on both sides): the user loop and the trainer
    agree at every step, and the warm-up changes the curve (a schedule on one side only would show as a gap)."""
    from argparse import Namespace

    from scripts.parity import trainer_losses, user_losses

    a = Namespace(device="cpu", preset="tiny", batch=4, seq=64, steps=5, seed=0, user_compile=False, warmup=3)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # the trainer's run directory
    user, ours = user_losses(a), trainer_losses(a, [])
    assert max(abs(u - o) for u, o in zip(user, ours, strict=True)) < 1e-4
    flat = user_losses(Namespace(**{**vars(a), "warmup": 0}))
    assert user[0] == pytest.approx(flat[0]) and abs(user[1] - flat[1]) > 1e-3  # step 1 at lr/4: a different step 2


def test_slow_tests_lists_what_the_quick_run_leaves_out(tmp_path):
    """scripts/slow_tests.py adds each test's setup, call and teardown, lists those at the threshold or above
    (longest first) but the ones it keeps in the quick run, and conftest reads the list back."""
    from scripts.slow_tests import KEEP, main
    from tests.conftest import slow_tests

    keep = next(iter(KEEP))
    log = tmp_path / "log"
    log.write_text(
        "============ slowest durations ============\n"
        "4.00s call     tests/a.py::test_one\n1.50s setup    tests/a.py::test_one\n"
        "9.00s call     tests/b.py::test_two[x-1]\n3.00s call     tests/a.py::test_fast\n"
        f"30.00s call     {keep}\n"
    )
    out = tmp_path / "slow.txt"
    assert main([str(log), "--out", str(out)]) == 0
    assert out.read_text().splitlines()[1:] == ["9.0 tests/b.py::test_two[x-1]", "5.5 tests/a.py::test_one"]
    empty = tmp_path / "empty"
    empty.write_text("no durations here\n")
    assert main([str(empty), "--out", str(out)]) == 2
    assert all(name.startswith("tests/test_") and "::test_" in name for name in slow_tests())


def test_bench_checkpoint_counts_the_wait_and_the_steps_after():
    """scripts/bench_checkpoint.py: a save's cost is the loop's wait (checkpoint_s) plus the excess of the AFTER
    steps after it over the median step; the first save (the pinned buffers' allocation) is left out."""
    from scripts.bench_checkpoint import AFTER, analyse

    rows = [{"step": 1, "step_time": 9.0, "first_step_s": 9.0}]
    rows += [{"step": s, "step_time": 0.1} for s in range(2, 41)]
    for s in (10, 20, 30):
        rows[s]["checkpoint_s"] = {10: 5.0, 20: 0.02, 30: 0.04}[s]  # in the row after the save's step
        rows[s]["step_time"] = 0.3  # the step after a save is 0.2 s slower
    out = analyse(rows, every=10)
    assert out["median_step_s"] == 0.1 and [c["step"] for c in out["saves"]] == [20, 30] and AFTER >= 1
    assert [round(c["stall_s"], 6) for c in out["saves"]] == [0.22, 0.24]
    assert round(out["held_s"], 6) == 0.03 and round(out["stall_s"], 6) == 0.23


def test_bench_tune_reads_tunes_table_and_seconds_and_finds_the_grids_best():
    from scripts import bench_tune

    out = """tune: llama-1b on 1 rank, budget 300 s
[1] train.activation_checkpointing=none train.micro_batch_size=4 train.grad_accum=16: running (29 s elapsed)
[1] train.activation_checkpointing=none train.micro_batch_size=4 train.grad_accum=16: 63.5K tok/s, peak 35.3 GB (49 s)
[2] train.activation_checkpointing=full train.micro_batch_size=64 train.grad_accum=1: out of memory (30 s)
| # | candidate | tok/s | peak GB | predicted GB | status |
|---|---|---|---|---|---|
| 1 | train.activation_checkpointing=none train.micro_batch_size=4 | 63.5K | 35.3 | 35.0 | **fastest** |
| 2 | train.activation_checkpointing=full train.micro_batch_size=64 train.grad_accum=1 | - | - | 60.4 | out of memory |
| - | train.precision=fp8 micro-batch 4 | - | - | - | skipped: no budget left |
"""
    got = bench_tune.parse_tune(out)
    assert [(r["n"], r["tokens_per_s"], r["peak_gb"], r["status"], r["seconds"]) for r in got["rows"]] == [
        (1, 63500.0, 35.3, "fastest", 49.0),
        (2, None, None, "out of memory", 30.0),
    ]
    assert got["fastest"]["n"] == 1
    grid = [{"tokens_per_s": 60e3, "status": "ok"}, {"tokens_per_s": 70e3, "status": "out of memory"},
            {"tokens_per_s": 64e3, "status": "ok"}]  # fmt: skip
    assert bench_tune.best(grid) is grid[2]


def test_bench_tune_says_where_a_runs_seconds_went(tmp_path):
    """A candidate's start phases and first step from its first row; the steps after it from the rows' step times
    (each over the steps since the row before); the compile by phase from compile_report.json; None with no row."""
    from scripts import bench_tune

    rows = [{"step": 2, "step_time": 1.5, "first_step_s": 20.0, "startup_s": {"imports": 0.1, "build": 0.6}},
            {"step": 4, "step_time": 2.0}, {"step": 6, "step_time": 1.9}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "compile_report.json").write_text(json.dumps({"compile_time_s": {"dynamo": 1.0, "total": 15.0}}))
    got = bench_tune.seconds_of(tmp_path)
    assert got == {"startup_s": {"imports": 0.1, "build": 0.6}, "first_step_s": 20.0, "later_steps_s": 7.8,
                   "compile_time_s": {"dynamo": 1.0, "total": 15.0}}  # fmt: skip
    assert bench_tune.seconds_of(tmp_path / "none") is None


def test_bench_fsdp_reads_a_rows_layout_and_compares_it_with_the_loop_of_the_same_layout():
    from scripts.bench_fsdp import _shape, parse_job, split_row, table

    job = parse_job("hf-llama-1b:4:2:ours@distributed.tp=2@train.precision=fp8@data.seq_len=32768:none")
    assert job["layout"] == {"distributed.tp": 2, "data.seq_len": 32768}
    assert job["spec"]["overrides"] == ["train.precision=fp8", "distributed.tp=2", "data.seq_len=32768"]
    assert parse_job("hf-llama-1b:4:2:loop@distributed.cp=2@distributed.replicate=2:none")["layout"] == {
        "distributed.cp": 2, "distributed.replicate": 2}  # fmt: skip
    for bad in (
        "hf-llama-1b:4:2:loop@distributed.tp=3:none",
        "hf-llama-1b:2:2:loop@distributed.tp=0:none",
        "hf-llama-1b:2:2:loop-fp8@distributed.tp=2:none",
        "hf-llama-1b:2:2:loop@train.precision=fp8:none",
    ):
        with pytest.raises(SystemExit):
            parse_job(bad)
    assert split_row("ours@distributed.tp=2@train.precision=fp8")[0] == "ours@train.precision=fp8"

    def entry(row, tps):
        return {"model": "m", "world": 2, "batch": 2, "row": row, "ac": "none", "seq": 64, "tokens_per_s_per_gpu": tps,
                "step_ms": 1.0, "first_step_s": 1.0, "process_wall_s": 1.0, "final_loss": 1.0}  # fmt: skip

    results = {
        f"m:2:2:{r}:none": entry(r, t)
        for r, t in [("loop", 100.0), ("ours", 110.0), ("loop@distributed.tp=2", 50.0), ("ours@distributed.tp=2", 60.0)]
    }
    assert _shape(results["m:2:2:ours@distributed.tp=2:none"])[4] == (
        ("distributed.tp", "2"),)  # fmt: skip
    doc = {"run": {"gpu": None, "device": "cpu", "gpus": 0, "torch": "t", "triton": "t", "git_sha": "g"},
           "results": results}  # fmt: skip
    rows = {
        line.split("|")[4].strip(): line.split("|")[7].strip()
        for line in table(doc).splitlines()
        if line.startswith("| m ")
    }
    assert rows == {"loop": "-", "ours": "1.100x", "loop@distributed.tp=2": "-", "ours@distributed.tp=2": "1.200x"}


def test_bench_fsdps_loop_trains_under_tensor_parallel_and_hsdp_on_two_cpu_processes(tmp_path, monkeypatch):
    """The loop's layouts on 2 gloo processes, a 2-layer Llama: TP 2 (transformers' plan, the gradient norm across
    the two meshes) and HSDP 2 x 1 train from an initialised model (loss near ln 256 on random tokens)."""
    import math

    plan = "hf-llama-1b:2:2:loop@distributed.tp=2:none,hf-llama-1b:2:2:loop@distributed.replicate=2:none"
    for res in _bench_fsdp_on_cpu(tmp_path, monkeypatch, plan, steps=2)["results"].values():
        assert "error" not in res, res.get("error")
        assert abs(res["final_loss"] - math.log(256)) < 0.1, res["final_loss"]
