import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU, our Triton kernels run on CPU tensors through Triton's interpreter. It must be
# chosen before triton is first imported (which the first compiled test may do), so set it here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread per process: the suite runs two pytest workers on two cores (`-n 2`), each starting
# trainer processes of its own; more threads than cores wait on each other (docs/troubleshooting.md, "Slow on a
# CPU"). The tests' subprocesses inherit the variable, so a run in this process and one in a subprocess compute
# with the same thread count (their floats can then be compared bit for bit).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# Inductor on CPU first builds and loads a probe library for each vector ISA the CPU reports (about 5 s per process,
# every process compiling in a fresh cache directory, and every run has its own). Here the ISAs the CPU reports are
# taken as working: the generated code is the same as after a successful probe.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

ROOT = Path(__file__).resolve().parents[1]

# The GPU tests compile the same tiny models in many runs, so their runs share one compile cache for the session
# (Inductor keys each entry by graph, inputs, config and versions: a hit is the code a fresh compile would make).
# Made here, at import, so that pytest-xdist's workers, started later, inherit the directory.
_MADE_CACHE = None  # the directory this process made (removed at its end), or None
if torch.cuda.is_available() and "TRAINER_TESTS_COMPILE_CACHE" not in os.environ:
    import tempfile

    _MADE_CACHE = os.environ["TRAINER_TESTS_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="trainer-tests-compile-")
GPU_CACHE = [f"compile.cache_dir={os.environ['TRAINER_TESTS_COMPILE_CACHE']}"] if torch.cuda.is_available() else []

# A model and batch small enough that a step takes milliseconds on 2 CPU cores.
FAST = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
    "data.seq_len=32",
    "train.micro_batch_size=4",
    "train.eval_batches=2",
    "schedule.warmup_steps=2",
    "log.every=5",
    "log.progress=false",
]


@pytest.fixture
def fresh_dynamo():
    """Each test from an empty Dynamo cache and zeroed counters (recompile counts are per test)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def rank_process(launcher, rank: int):
    """The psutil process of ``rank`` among the trainer workers a torchrun ``launcher`` (a Popen) started."""
    import psutil

    workers = [p for p in psutil.Process(launcher.pid).children(recursive=True) if "trainer" in " ".join(p.cmdline())]
    return next(p for p in workers if p.environ().get("RANK") == str(rank))


def forbid_fallbacks(monkeypatch, module, *names: str) -> None:
    """Replace ``module``'s PyTorch fallbacks ``names`` with a failure: where Triton can run, a test of a kernel
    must test the kernel, not the fallback it would silently take."""

    def fail(*args, **kwargs):
        raise AssertionError("the PyTorch fallback ran where the Triton kernel should have")

    for name in names:
        monkeypatch.setattr(module, name, fail)


def run_cli(*args, env=None, timeout=300, cwd=ROOT):
    """Run `python -m trainer ARGS` in a subprocess; returns CompletedProcess with text output."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd
    )


def cli(capsys, *args, env=None):
    """``trainer ARGS`` in this process (``trainer.cli.main``), for a run that needs no process of its own (one that
    is not signalled or killed): the CompletedProcess :func:`run_cli` would give, without its ~3 s of imports.
    ``env`` is set for the call alone; the working directory is the repository's, as for :func:`run_cli`. Without
    ``capsys`` (a module's fixture) the output is left to pytest's capture, and stdout and stderr come back empty."""
    from trainer.cli import main

    if capsys is not None:
        capsys.readouterr()  # what the test printed before is not the command's
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ.update(env or {})
    os.chdir(ROOT)
    try:
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's errors
            code = e.code
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    out, err = capsys.readouterr() if capsys is not None else ("", "")
    return subprocess.CompletedProcess(["trainer", *args], code, out, err)


_torchrun_server = None  # tests/torchrun_server.py, started by this test process's first torchrun()


def _answer(server, deadline: float | None) -> dict | None:
    """The server's next JSON line, or None if ``deadline`` (time.monotonic()) passes first."""
    import select
    import time

    line = b""
    while not line.endswith(b"\n"):
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([server.stdout], [], [], wait)[0]:
            return None
        chunk = os.read(server.stdout.fileno(), 1)
        if not chunk:
            raise RuntimeError("tests/torchrun_server.py exited")
        line += chunk
    return json.loads(line)


def torchrun(cmd: list, *, env=None, timeout=300, cwd=ROOT) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)`` for ``cmd`` =
    ``[sys.executable, "-m", "torch.distributed.run", ...]``, but the launcher is forked from a process that imported
    torchrun once (tests/torchrun_server.py): ~1.5 s of CPU less per launch. The ranks are new processes, started
    by torchrun with this environment, as from the command line."""
    import tempfile
    import time

    assert list(cmd[:3]) == [sys.executable, "-m", "torch.distributed.run"], cmd
    global _torchrun_server
    if _torchrun_server is None or _torchrun_server.poll() is not None:
        _torchrun_server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "torchrun_server.py")], cwd=ROOT,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)  # fmt: skip
    server = _torchrun_server
    cmd = [str(c) for c in cmd]
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        request = {"argv": cmd[3:], "env": dict(os.environ if env is None else env), "cwd": str(cwd),
                   "stdout": out, "stderr": err}  # fmt: skip
        server.stdin.write((json.dumps(request) + "\n").encode())
        pid = _answer(server, None)["pid"]
        ended = _answer(server, time.monotonic() + timeout)
        if ended is None:  # as subprocess.run: the launcher is killed
            os.kill(pid, signal.SIGKILL)
            _answer(server, None)
        with open(out, errors="replace") as f_out, open(err, errors="replace") as f_err:
            stdout, stderr = f_out.read(), f_err.read()
    if ended is None:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(cmd, ended["returncode"], stdout, stderr)


def start_torchrun(cmd: list, *, env=None, cwd=ROOT):
    """Start ``cmd`` (as for torchrun()) now, in a process of its own, beside what the caller runs next (torchrun()
    launches one job at a time). Returns ``wait(timeout=300)``, which gives its ``subprocess.CompletedProcess``."""
    import tempfile

    tmp = tempfile.TemporaryDirectory()
    out, err = (open(os.path.join(tmp.name, name), "w+") for name in ("stdout", "stderr"))  # noqa: SIM115
    proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=out, stderr=err, text=True)

    def wait(timeout: float = 300) -> subprocess.CompletedProcess:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        finally:
            texts = []
            for f in (out, err):
                f.seek(0)
                texts.append(f.read())
                f.close()
            tmp.cleanup()
        return subprocess.CompletedProcess(cmd, proc.returncode, *texts)

    return wait


def shared_run(tmp_path_factory, name: str, make) -> Path:
    """The directory ``make(directory)`` fills, made once per test session: by whichever pytest-xdist worker asks
    first, while another that asks waits for it (a module-scoped fixture alone runs once per worker). ``name`` is
    unique in the session; a ``make`` that raised is tried again by the next test that asks."""
    import filelock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's directory, above each worker's own
    (root / "shared").mkdir(exist_ok=True)
    run_dir, done = root / "shared" / name, root / "shared" / f"{name}.done"
    with filelock.FileLock(f"{run_dir}.lock"):
        if not done.exists():
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir()
            make(run_dir)
            done.touch()
    return run_dir


def metric(run_dir: Path, key: str) -> dict[int, float]:
    """``{step: value}`` of one metric (``loss``, ``grad_norm``, ...) from a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


def losses(run_dir: Path) -> dict[int, float]:
    """``{step: loss}`` from a run's metrics.jsonl."""
    return metric(run_dir, "loss")


def pytest_unconfigure(config):
    if _MADE_CACHE:
        shutil.rmtree(_MADE_CACHE, ignore_errors=True)


def slow_tests() -> dict[str, float]:
    """``{node id: seconds}`` of tests/slow.txt: the tests of 5 s or more on 2 CPU cores (scripts/slow_tests.py)."""
    rows = (line.split(maxsplit=1) for line in (ROOT / "tests" / "slow.txt").read_text().splitlines())
    return {r[1].strip(): float(r[0]) for r in rows if len(r) == 2 and not r[0].startswith("#")}


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    n_gpu = torch.cuda.device_count() if has_cuda else 0
    slow = slow_tests()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
    # The longest first, so that no worker is left with a long test at the end; the multi-GPU tests (a minute or
    # more each) before all where they run.
    items.sort(key=lambda item: -slow.get(item.nodeid, 0.0))
    if n_gpu >= 2:
        items.sort(key=lambda item: "multi_gpu" not in item.keywords)
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multi_gpu" in item.keywords and n_gpu < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2 CUDA GPUs"))
