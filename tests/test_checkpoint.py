"""The Checkpointer of Stateful parts in one process: a checkpoint kept in tests/data loads, the states round-trip,
the layout on disk is the documented one, a damaged checkpoint is found by its manifest and never outlives an
intact one in pruning. Runs through `trainer fit` (resume, faults, fsdp, sharded
optimizer) are in test_fit.py, test_faults.py, test_distributed.py, test_fsdp_optim.py and test_shard_optimizer.py.
"""

import collections
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import ROOT
from trainer import build, plan
from trainer.checkpoint import DCP, TORCH_SAVE, Checkpointer, CheckpointError, ReadAhead, integrity, rundir
from trainer.checkpoint.checkpointer import _load_failure, _onto
from trainer.checkpoint.states import RNGState, TrainState, run_states
from trainer.config import load_config, to_dict
from trainer.data import load_corpus
from trainer.distributed.env import DistEnv
from trainer.models import loss_of

# tests/data/tiny_checkpoint: the step-3 checkpoint of `trainer fit configs/tiny.yaml` with these overrides, on the
# CPU in one process (commit de538f1), a checkpoint without a manifest. Kept as files: a change to the format
# that stops existing checkpoints from loading fails here.
FIXTURE = Path(__file__).parent / "data" / "tiny_checkpoint"
FIXTURE_ARGS = ["model.n_layer=1", "model.n_head=1", "model.n_embd=4", "data.seq_len=8", "train.micro_batch_size=2",
                "train.steps=3", "checkpoint.every=3", "train.eval_every=0", "schedule.warmup_steps=2",
                "log.every=1", "train.device=cpu"]  # fmt: skip
ENV = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None)


def _parts(run_dir: Path, *overrides: str, resume: bool = False):
    """The states and config of a run of FIXTURE_ARGS in ``run_dir``, built as trainer.loop builds them (fresh, or
    for a ``resume``: the model uninitialised)."""
    resolved = plan.resolve(load_config("configs/tiny.yaml", [*FIXTURE_ARGS, *overrides, f"run.dir={run_dir}"]), ENV)
    cfg = resolved.cfg
    build.set_up_process(cfg, ENV.device)
    corpus = load_corpus(cfg.data.path, cfg.data.vocab_size, cfg.data.val_fraction, cfg.data.seq_len,
                         dtype=cfg.data.dtype)  # fmt: skip
    model = build.make_model(resolved, corpus.vocab_size, ENV, resume=resume)
    opt = build.make_optimizer(model, resolved.placed(model))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, build.lr_lambda(cfg))
    batches = build.batches(resolved, corpus, ENV)
    states = run_states(model, opt, sched, None, batches, lr=cfg.optim.lr, device=ENV.device)
    return states, cfg, model, opt, sched


def _checkpointer(states, cfg, storage=TORCH_SAVE):
    return Checkpointer(states, storage, Path(cfg.run.dir), ENV, config=to_dict(cfg), keep=cfg.checkpoint.keep)


def _assert_same(a, b, where=""):
    """``a`` and ``b`` equal, tensors exactly (a load copies; nothing is computed)."""
    kinds = (dict, (list, tuple), torch.Tensor)
    assert [isinstance(a, k) for k in kinds] == [isinstance(b, k) for k in kinds], (where, type(a), type(b))
    if isinstance(a, dict):
        assert set(a) == set(b), (where, sorted(a, key=str), sorted(b, key=str))
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)


def test_a_checkpoint_of_the_kept_format_loads(tmp_path, capsys):
    """The kept checkpoint loads into a freshly built run: its step and tokens, every weight, the optimizer's state
    and hyperparameters, the schedule's position, the RNG."""
    states, cfg, model, opt, sched = _parts(tmp_path)
    saved_model = torch.load(FIXTURE / "model.pt", weights_only=True)
    saved_optim = torch.load(FIXTURE / "optim.pt", weights_only=True)
    assert not all(torch.equal(p, saved_model[n]) for n, p in model.state_dict().items())  # fresh: not yet loaded
    assert not (FIXTURE / "manifest.json").exists()  # checked as one without it is (integrity.py)

    assert _checkpointer(states, cfg).restore(str(FIXTURE)) == 3
    assert f"resumed from {FIXTURE} at step 3" in capsys.readouterr().out
    train = states["train"]
    assert (train.step, train.tokens_seen) == (3, 3 * 2 * 8)  # steps x sequences x tokens per sequence
    _assert_same(model.state_dict(), _head_major(saved_model, model.cfg.n_head), "model")
    _assert_same(opt.state_dict(), saved_optim["optimizer"], "optimizer")
    assert opt.state_dict()["state"][0]["step"] == 3
    assert sched.last_epoch == 3 and sched.state_dict()["_last_lr"] == saved_optim["scheduler"]["_last_lr"]
    _assert_same(RNGState(ENV.device).state_dict(), torch.load(FIXTURE / "rng_rank0.pt", weights_only=True), "rng")


def _head_major(state: dict, n_head: int) -> dict:
    """The kept checkpoint's model (nanoGPT's ``c_attn``: every query row, then every key, then every value) as the
    built-in GPT holds it (``c_qkv``: head by head, each one's query, key and value rows)."""
    out = {}
    for name, t in state.items():
        if ".c_attn." in name:
            name, t = name.replace(".c_attn.", ".c_qkv."), t.view(3, n_head, -1, *t.shape[1:]).transpose(0, 1)
        out[name] = t.reshape(state[name.replace(".c_qkv.", ".c_attn.")].shape) if ".c_qkv." in name else t
    return out


def test_states_round_trip(tmp_path, capsys):
    """Saved by one run, restored into another built fresh: every state dict equal to the saved one; the files are
    the documented ones (whole tensors in model.pt and optim.pt, meta.json as before)."""
    states, cfg, model, opt, sched = _parts(tmp_path / "a")
    loss_of(model(*states["sampler"].batches.train_batch(0, 0))).backward()
    opt.step()
    sched.step()
    states["train"].advance(16)
    ckpts = _checkpointer(states, cfg)
    ckpts.save(1)
    path = ckpts.last
    assert path == tmp_path / "a" / "checkpoints" / "step_000001"
    files = ["meta.json", "model.pt", "optim.pt", "rng_rank0.pt"]
    assert sorted(p.name for p in path.iterdir()) == sorted([*files, "manifest.json"])
    manifest = json.loads((path / "manifest.json").read_text())["files"]
    assert sorted(manifest) == files and all(manifest[f]["size"] == (path / f).stat().st_size for f in files)
    assert all("crc32" in entry for entry in manifest.values())  # every file of a tiny model is small: checksummed
    assert (path.parent / "last").read_text() == "step_000001\n"
    meta = json.loads((path / "meta.json").read_text())
    assert (meta["step"], meta["tokens_seen"], meta["world_size"]) == (1, 16, 1)
    assert meta["sampler"] == {"seed": cfg.seed, "next_step": 1, "global_batch": 2, "skip": []}
    assert meta["config"] == to_dict(cfg)
    assert set(torch.load(path / "optim.pt", weights_only=True)) == {"optimizer", "scheduler"}
    saved = {name: state.state_dict() for name, state in states.items()}

    other, cfg_b, *_ = _parts(tmp_path / "b")
    random.seed(1), np.random.seed(1), torch.manual_seed(1)  # other RNG states, which the load replaces
    assert RNGState(ENV.device).state_dict()["torch"].ne(saved["rng"]["torch"]).any()
    assert _checkpointer(other, cfg_b).restore(str(path)) == 1
    for name, state in other.items():
        _assert_same(state.state_dict(), saved[name], name)
    assert isinstance(other["train"], TrainState)


def test_a_checkpoint_read_ahead_while_the_run_builds_restores_as_a_read_at_the_restore(tmp_path):
    """trainer.loop starts a ReadAhead of the chosen checkpoint before it builds the run, the model uninitialised
    (make_model's resume), and the restore takes what the thread read: every state equals that of a run built
    fresh that reads the checkpoint at its restore."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run / "checkpoints" / "step_000003")
    spec = str(run / "checkpoints" / "step_000003")
    ahead = ReadAhead(spec, run, ENV)
    states, cfg, *_ = _parts(run, resume=True)
    assert _checkpointer(states, cfg).begin(rundir.Start(resume=spec, asked=spec), ahead).step == 3
    other, cfg_b, *_ = _parts(tmp_path / "b")
    assert _checkpointer(other, cfg_b).restore(spec) == 3
    for name, state in other.items():
        _assert_same(states[name].state_dict(), state.state_dict(), name)


def test_a_read_ahead_that_fails_raises_in_the_restore(tmp_path):
    """The thread's failure (here a truncated model.pt) is raised where the restore takes the files, in the main
    thread, as the CheckpointError a restore that reads them itself raises; nothing is raised before."""
    run = tmp_path / "run"
    path = run / "checkpoints" / "step_000003"
    shutil.copytree(FIXTURE, path)
    data = (path / "model.pt").read_bytes()
    (path / "model.pt").write_bytes(data[: len(data) // 2])
    ahead = ReadAhead(str(path), run, ENV)
    states, cfg, *_ = _parts(run, resume=True)
    with pytest.raises(CheckpointError) as by_thread:
        _checkpointer(states, cfg).restore(str(path), ahead=ahead)
    with pytest.raises(CheckpointError) as by_restore:
        _checkpointer(states, cfg).restore(str(path))
    assert str(by_thread.value) == str(by_restore.value) and "model.pt" in str(by_thread.value)


@pytest.mark.gpu
def test_a_checkpoint_read_ahead_onto_cuda_holds_the_files_tensors():
    """On CUDA the thread copies the files' tensors to the device (Tensor.to, which lets the GIL go): the same
    values as the files hold, on the device; the RNG file's stay on the host."""
    from torch.utils._pytree import tree_map

    from trainer.checkpoint import read

    cuda = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cuda"), backend=None)
    path, saved = ReadAhead(str(FIXTURE), FIXTURE.parent, cuda).result()
    assert path == FIXTURE
    assert {t.device.type for t in saved["model"].values()} == {"cuda"}
    assert (
        saved["optimizer"]["state"][0]["exp_avg"].device.type == "cuda" and saved["rng"]["torch"].device.type == "cpu"
    )
    on_host = read(FIXTURE, rank=0, device=torch.device("cpu"))
    _assert_same(tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, saved), on_host)


def test_states_moved_to_a_device_keep_their_shared_storages_and_metadata():
    """_onto (the read on CUDA, here onto the meta device): each storage moved once, its tensors rebuilt with their
    offsets and strides (a tied weight and a view still share it), a state dict's _metadata kept."""
    w = torch.randn(4, 3)
    state = collections.OrderedDict(a=w, tied=w, view=w[1:].t(), other=torch.ones(2), groups=[{"betas": (0.9, 0.95)}])
    state._metadata = {"": {"version": 1}}
    out = _onto(state, torch.device("meta"), {})
    assert out is state and out._metadata == {"": {"version": 1}} and out["groups"] == [{"betas": (0.9, 0.95)}]
    assert all(out[k].device.type == "meta" for k in ("a", "tied", "view", "other"))
    layout = {k: (out[k].shape, out[k].stride(), out[k].storage_offset()) for k in ("a", "view")}
    assert layout == {"a": ((4, 3), (3, 1), 0), "view": ((3, 3), (1, 3), 3)}
    storage = {k: out[k].untyped_storage()._cdata for k in ("a", "tied", "view", "other")}
    assert storage["a"] == storage["tied"] == storage["view"] != storage["other"]


def test_fsdp_storage_refuses_a_checkpoint_of_whole_tensors(tmp_path):
    """A run that keeps its model and optimizer through DCP (fsdp) cannot load model.pt: the error says what to use."""
    states, cfg, *_ = _parts(tmp_path)
    with pytest.raises(CheckpointError, match="written without fsdp .* distributed.strategy=ddp or none"):
        _checkpointer(states, cfg, DCP).restore(str(FIXTURE))


def test_a_checkpoint_of_another_shape_is_refused_before_anything_loads(tmp_path):
    states, cfg, model, *_ = _parts(tmp_path, "model.n_embd=8", "model.n_head=2")
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="incompatible with this config: model.n_head was 1, now 2"):
        _checkpointer(states, cfg).restore(str(FIXTURE))
    _assert_same(model.state_dict(), before, "model")
    assert states["train"].step == 0


def _cut(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def test_a_damaged_checkpoint_is_found_by_its_manifest_or_its_files(tmp_path):
    """integrity.damage: a truncated file (its size against the manifest's), a lost one, a changed byte in a small
    file (its checksum; sizes alone, as pruning checks, miss it), a manifest that cannot be read; without a manifest
    (as FIXTURE), a missing meta.json or a torch.save file cut short (no zip directory at its end)."""
    states, cfg, *_ = _parts(tmp_path / "run")
    ckpts = _checkpointer(states, cfg)
    ckpts.save(1)
    saved = ckpts.last
    copies = iter(range(100))

    def copy(source=saved, manifest=True) -> Path:
        path = tmp_path / f"copy-{next(copies)}"
        shutil.copytree(source, path)
        if not manifest:
            (path / "manifest.json").unlink(missing_ok=True)
        return path

    assert integrity.damage(saved) is None
    size = (saved / "model.pt").stat().st_size
    _cut((cut := copy()) / "model.pt")
    assert integrity.damage(cut) == f"model.pt is {size // 2:,} bytes, its manifest says {size:,}"
    ((lost := copy()) / "rng_rank0.pt").unlink()
    assert integrity.damage(lost) == "rng_rank0.pt is missing"
    meta = (changed := copy()) / "meta.json"
    meta.write_text(meta.read_text().replace('"world_size": 1', '"world_size": 2'))  # the same size, valid JSON
    assert meta.read_text() != (saved / "meta.json").read_text()
    assert integrity.damage(changed, checksums=False) is None
    assert integrity.damage(changed) == "meta.json does not match its manifest's checksum"
    ((unreadable := copy()) / "manifest.json").write_text("{")
    assert integrity.damage(unreadable) == "its manifest.json cannot be read"

    assert integrity.damage(FIXTURE) is None  # no manifest: its files are there and whole
    _cut((old := copy(FIXTURE)) / "optim.pt")
    assert integrity.damage(old) == "optim.pt is cut short (its zip directory is missing)"
    ((old := copy(manifest=False)) / "meta.json").unlink()
    assert integrity.damage(old) == "meta.json is missing"


def test_pruning_keeps_intact_checkpoints_over_damaged_ones(tmp_path):
    """checkpoint.keep=2, the newest of steps 2 and 3 damaged, then step 4 saved: the two newest intact ones (2 and
    4) are kept and the damaged one is left for a resume to move aside; one moved aside is not looked at."""
    states, cfg, *_ = _parts(tmp_path, "checkpoint.keep=2")
    ckpts = _checkpointer(states, cfg)
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        ckpts.save(step)
    aside = root / "step_000001.damaged-1"  # as a resume leaves one: an intact-looking copy, never pruned
    shutil.copytree(root / "step_000002", aside)
    _cut(root / "step_000003" / "model.pt")
    ckpts.save(4)
    assert sorted(p.name for p in root.iterdir()) == ["last", aside.name, "step_000002", "step_000003", "step_000004"]
    ckpts.save(5)
    assert sorted(p.name for p in root.iterdir()) == ["last", aside.name, "step_000003", "step_000004", "step_000005"]


def test_a_load_failure_is_said_in_whole_words():
    """torch.load's reason: its first line whole (miniz's is 330 characters), a longer one cut at a word with an
    ellipsis; weights_only's refusals as what they mean."""
    miniz = ("PytorchStreamReader failed reading zip archive: failed finding central directory. This is an internal "
             "miniz error. If you are seeing this error, there is a high likelihood that your checkpoint file is "
             "corrupted. This can happen if the checkpoint was not saved properly, was transferred incorrectly, or "
             "the file was modified after saving.")  # fmt: skip
    assert _load_failure(RuntimeError(miniz + "\nmore")) == miniz
    long = _load_failure(RuntimeError("word " * 200))
    assert long.endswith("word ...") and len(long) <= 404
    assert _load_failure(RuntimeError("x" * 500)) == "x" * 400 + " ..."  # no word to cut at
    preamble = "Weights only load failed. In PyTorch 2.6, we changed the default value of `weights_only`."
    corrupt = (
        f"{preamble}\nPlease file an issue: WeightsUnpickler error: \n\nUnsupported operand 255\n\nCheck the docs."
    )
    assert _load_failure(RuntimeError(corrupt)) == "its pickled data is corrupt (Unsupported operand 255)"
    code = f"{preamble}\n\n\nTrying to load unsupported GLOBAL posix.system whose module posix is blocked.\n"
    assert "would run code" in _load_failure(RuntimeError(code))


def test_the_stager_copies_each_storage_once_and_keeps_views_and_shared_objects():
    """checkpoint.async_save's copy: tensors that share a storage still do, at their offsets and strides; an object
    met twice is one copy; the copies do not follow later changes of the originals; containers keep their type and
    a state dict's _metadata."""
    from collections import OrderedDict

    from trainer.checkpoint.background import Stager

    flat = torch.arange(12.0)
    betas = (0.9, 0.95)
    tail = flat[6:]
    sd = OrderedDict(w=flat[:6].view(2, 3), b=tail, t=tail, lr=1e-3)  # one tensor under two names (tied weights)
    sd._metadata = {"": {"version": 1}}
    snapshot = {"model": sd, "groups": [{"betas": betas}, {"betas": betas}]}
    staged = Stager(torch.device("cpu")).stage(snapshot)
    flat.add_(100.0)  # training goes on
    w, b, t = staged["model"]["w"], staged["model"]["b"], staged["model"]["t"]
    assert torch.equal(w, torch.arange(6.0).view(2, 3)) and torch.equal(b, torch.arange(6.0, 12.0))
    assert w.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and b.storage_offset() == 6
    assert t is b and staged["groups"][0]["betas"] is staged["groups"][1]["betas"]
    assert type(staged["model"]) is OrderedDict and staged["model"]._metadata == {"": {"version": 1}}
    assert staged["model"]["lr"] == 1e-3


def test_the_dcp_staging_api_background_saves_rely_on_is_there():
    """Pinned: DCP's stager and its options by the names trainer.checkpoint.background.ShardWriter uses."""
    import dataclasses

    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    names = {f.name for f in dataclasses.fields(StagingOptions)}
    assert {"use_pinned_memory", "use_shared_memory", "use_async_staging", "use_non_blocking_copy"} <= names
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                                          use_non_blocking_copy=False))  # fmt: skip
    t = torch.arange(4.0)
    staged = stager.stage({"a": t})
    t.add_(1.0)
    assert torch.equal(staged["a"], torch.arange(4.0))
    stager.close()


def test_a_torch_save_write_that_comes_up_short_stops_the_run_with_why(tmp_path):
    """A file size limit (RLIMIT_FSIZE) makes torch.save's zip writer come up short, as a full disk does: it raises
    only "unexpected pos ...". The run stops with one line that says so and how much room the disk has, no
    traceback, and no checkpoint left half written."""
    script = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (2_000_000, 2_000_000))\n"
        "from trainer.cli import main\n"
        f"sys.exit(main(['fit', 'tiny', 'train.steps=4', 'checkpoint.every=2', 'run.dir={tmp_path}']))\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "cannot save the checkpoint of step 2: torch.save's write came up short" in r.stderr, r.stderr[-3000:]
    assert " GB free. Stopped; no checkpoint was saved before this one." in r.stderr
    assert not list((tmp_path / "checkpoints").iterdir())  # the partial checkpoint removed; no last


def test_a_short_write_on_a_nearly_full_disk_is_a_full_disk(tmp_path, monkeypatch):
    import errno

    from trainer.checkpoint import write

    def short(directory):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3892347456 vs 3892347408")

    for free, code in ((write.SHORT_WRITE_FREE - 1, errno.ENOSPC), (write.SHORT_WRITE_FREE * 10, None)):
        monkeypatch.setattr(shutil, "disk_usage", lambda p, free=free: shutil._ntuple_diskusage(free * 2, free, free))
        message, got, rank = write._attempt(short, tmp_path / "x", rank=3)
        assert got == code and rank == 3 and "came up short" in message and "unexpected pos" in message
    with pytest.raises(RuntimeError, match="something else"):
        write._attempt(lambda d: (_ for _ in ()).throw(RuntimeError("something else")), tmp_path, rank=0)
