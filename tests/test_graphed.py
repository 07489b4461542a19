"""The graphed step (compile.cudagraphs): refused where it cannot be right; equal to the ungraphed step on a GPU."""

import pytest

from tests.conftest import FAST, GPU_CACHE, ROOT, cli, losses, run_cli
from trainer.config import ConfigError, load_config


@pytest.mark.parametrize(
    "override, key",
    [
        ("distributed.strategy=fsdp", "distributed.strategy"),
        ("optim.impl=compiled", "optim.impl"),
        ("train.on_nan=skip", "train.on_nan"),
        ("train.on_spike=skip", "train.on_spike"),
        ("train.precision=fp16", "train.precision"),
        ("compile.autograd=true", "compile.autograd"),
        ("compile.mode=reduce-overhead", "compile.mode"),
        ("optim.name=sgd", "optim.name"),
    ],
)
def test_cudagraphs_refuses_what_it_cannot_capture(override, key):
    with pytest.raises(ConfigError, match=f"compile.cudagraphs: needs {key}="):
        load_config(ROOT / "configs/tiny.yaml", ["compile.cudagraphs=true", override])


def test_cudagraphs_takes_ddp_over_nccl_only():
    load_config(ROOT / "configs/tiny.yaml", ["compile.cudagraphs=true", "distributed.strategy=ddp"])  # accepted
    with pytest.raises(ConfigError, match="compile.cudagraphs: needs distributed.backend=auto or nccl"):
        load_config(
            ROOT / "configs/tiny.yaml",
            ["compile.cudagraphs=true", "distributed.strategy=ddp", "distributed.backend=gloo"],
        )


def test_cudagraphs_refusal_is_a_user_error(tmp_path, capsys):
    bad = ["compile.cudagraphs=true", "optim.impl=compiled"]
    r = cli(capsys, "fit", "configs/tiny.yaml", *FAST, *bad, f"run.dir={tmp_path}")
    assert r.returncode == 2, r.stderr
    assert "compile.cudagraphs: needs optim.impl=" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["auto", "triton"])
def test_graphed_step_equals_ungraphed(tmp_path, impl):
    """fp32 on the GPU, compiled, 12 steps with grad accumulation and clipping: replays give the same losses,
    with torch's fused AdamW (auto) and with ours (triton: lr written before each replay)."""
    common = [*FAST, *GPU_CACHE, "train.device=cuda", "train.precision=fp32", "compile.enabled=true", "train.steps=12",
              "log.every=1", "model.dropout=0.0", "train.grad_accum=2", "optim.grad_clip=1.0",
              f"optim.impl={impl}"]  # fmt: skip
    runs = {}
    for graphs in ("false", "true"):
        d = tmp_path / graphs
        r = run_cli("fit", "configs/tiny.yaml", *common, f"compile.cudagraphs={graphs}", f"run.dir={d}")
        assert r.returncode == 0, r.stderr[-3000:]
        runs[graphs] = losses(d)
    assert "captured as one CUDA graph" in r.stdout + r.stderr  # the console goes to stderr
    a, b = runs["false"], runs["true"]
    assert sorted(a) == sorted(b) == list(range(1, 13))
    print("max |loss diff| graphed vs ungraphed:", max(abs(a[s] - b[s]) for s in a))
    for step in a:
        # Steps 1-3 run ungraphed in both; from step 4 the replay runs the same kernels on the same inputs,
        # with the schedule's lr read from the optimizer's lr tensor: equal up to float noise.
        assert abs(a[step] - b[step]) < 1e-5, (step, a[step], b[step])


@pytest.mark.gpu
def test_spike_detection_adds_no_host_sync_to_the_graphed_step(tmp_path, monkeypatch):
    """The spike checks (train.on_spike stop and rollback) read the losses the log reads: from the 6th step on (the
    graph replayed) a run makes the same host syncs with them as with the check taken out. Counted: CUDA event,
    stream and device synchronizations, and the synchronizing ops torch's sync debug mode reports."""
    import warnings

    import torch

    from trainer import step as step_module
    from trainer.loop import Trainer

    counts = {"n": 0, "on": False}

    def counting(fn):
        def wrapped(*a, **k):
            counts["n"] += counts["on"]
            return fn(*a, **k)

        return wrapped

    for owner, name in (
        (torch.cuda.Event, "synchronize"),
        (torch.cuda.Stream, "synchronize"),
        (torch.cuda, "synchronize"),
    ):
        monkeypatch.setattr(owner, name, counting(getattr(owner, name)))
    call = step_module.TrainStep.__call__

    def step_call(self, batch_of, step=0):
        if self.calls == 5:  # from the 6th step: replays
            counts.update(on=True, since=len(counts["caught"]))
        return call(self, batch_of, step)

    monkeypatch.setattr(step_module.TrainStep, "__call__", step_call)
    common = [*FAST, *GPU_CACHE, "train.device=cuda", "compile.enabled=true", "compile.cudagraphs=true",
              "train.steps=40", "log.every=10", "train.spike_window=8", "checkpoint.enabled=false"]  # fmt: skip

    def syncs(*extra) -> int:
        counts.update(n=0, on=False, since=0)
        runs.append(extra)
        cfg = load_config(ROOT / "configs/tiny.yaml", [*common, *extra, f"run.dir={tmp_path / str(len(runs))}"])
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as counts["caught"]:
                warnings.simplefilter("always")
                Trainer(cfg).fit()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return counts["n"] + sum("synchronizing" in str(w.message) for w in counts["caught"][counts["since"] :])

    runs, seen = [], {}
    syncs("train.on_spike=stop")  # the first run in the process compiles (and syncs while it does); not counted
    seen["stop"] = syncs("train.on_spike=stop")
    seen["rollback"] = syncs("train.on_spike=rollback")
    monkeypatch.setattr(step_module.SpikeWatch, "see", lambda self, step, loss, last: None)
    seen["none"] = syncs("train.on_spike=stop")
    print("host syncs from step 6 to 40:", seen)
    assert 0 < seen["none"] <= 2 * 35 and seen["stop"] == seen["rollback"] == seen["none"], seen
