"""The shipped configs: `trainer fit tiny` by name, the working directory's file first, `trainer configs`, the
did-you-mean for a mistyped name, and the wheel that carries them (built here, run from outside the repository)."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import FAST, ROOT, cli
from trainer.config import ConfigError, load_config
from trainer.shipped import configs_dir, find_config, shipped_path

CONFIG_FILES = sorted(p.relative_to(ROOT / "configs") for p in (ROOT / "configs").rglob("*") if p.is_file())


def _main_in(cwd: Path, capsys, *args):
    """``trainer ARGS`` in this process with ``cwd`` as the working directory: ``(exit status, stdout, stderr)``."""
    from trainer.cli import main

    capsys.readouterr()
    saved = os.getcwd()
    os.chdir(cwd)
    try:
        code = main(list(args))
    finally:
        os.chdir(saved)
    out, err = capsys.readouterr()
    return code, out, err


def test_a_checkout_reads_the_repository_configs():
    assert configs_dir() == ROOT / "configs"


@pytest.mark.parametrize("spec", ["tiny", "tiny.yaml", "configs/tiny.yaml"])
def test_a_name_not_in_the_working_directory_is_the_shipped_config(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert find_config(spec) == (configs_dir() / "tiny.yaml", True)
    assert load_config(spec) == load_config(ROOT / "configs/tiny.yaml")


def test_the_working_directory_file_wins(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text("run:\n  name: mine\n")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/tiny.yaml").write_text("run:\n  name: mine-too\n")
    assert find_config("tiny") == (Path("tiny.yaml"), False)
    assert load_config("tiny").run.name == "mine"
    assert load_config("tiny.yaml").run.name == "mine"
    assert load_config("configs/tiny.yaml").run.name == "mine-too"
    code, out, err = _main_in(tmp_path, capsys, "print-config", "tiny", "--no-help")
    assert code == 0, err
    assert "name: mine\n" in out
    code, out, err = _main_in(tmp_path, capsys, "print-config", "gpt2-small", "--no-help")  # no such file here
    assert code == 0, err
    assert "name: gpt2-small\n" in out


def test_fit_by_name_says_which_file_it_read(tmp_path, capsys):
    r = cli(capsys, "fit", "tiny", *FAST, "train.steps=2", "checkpoint.enabled=false", f"run.dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"config: {configs_dir() / 'tiny.yaml'}, shipped with trainer (no tiny in the working directory)"
    assert "done: 2 steps" in r.stdout
    run2 = f"run.dir={tmp_path / 'run2'}"
    r = cli(capsys, "fit", "configs/tiny.yaml", *FAST, "train.steps=1", "checkpoint.enabled=false", run2)
    assert r.returncode == 0, r.stderr
    assert "config:" not in r.stdout  # the file named is there: nothing stands in for it


def test_configs_lists_every_shipped_config(capsys):
    r = cli(capsys, "configs")
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split(None, 1)[1] for line in r.stdout.split("\n\n")[0].splitlines()}
    shipped = sorted((ROOT / "configs").glob("*.yaml"))
    assert sorted(rows) == sorted(p.stem for p in shipped)
    for path in shipped:
        assert rows[path.stem] == path.read_text().splitlines()[0].removeprefix("# ")
    assert f"Files: {ROOT / 'configs'}" in r.stdout


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_starts_with_one_sentence_that_says_what_it_trains(path):
    first, second = path.read_text().splitlines()[:2]
    assert first.startswith("# ") and first.endswith(".") and len(first) <= 120, first  # `trainer configs`' row
    assert second.startswith("# "), "the details and the launch command follow in the comment"


@pytest.mark.parametrize(
    "args, near",
    [
        (["fit", "tiyn"], "did you mean 'tiny'?"),
        (["fit", "configs/gpt2-smal.yaml"], "did you mean 'gpt2-small'?"),
        (["print-config", "lama-1b"], "did you mean 'llama-1b'?"),
        (["explain", "nothing-like-it"], "CONFIG is the path of a YAML file or the name of a config shipped"),
    ],
)
def test_a_mistyped_name_exits_2_with_a_did_you_mean(args, near, tmp_path, capsys):
    code, out, err = _main_in(tmp_path, capsys, *args)
    assert code == 2, (out, err)
    assert near in err
    assert "gpt2-small, gpt2-small-ddp, llama-1b, llama-8b-long, sft-llama-1b, sft-tiny, tiny" in err
    assert "Traceback" not in err


def test_an_absolute_path_never_falls_back(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        find_config(tmp_path / "tiny.yaml")
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "tiny.yaml")


def test_model_hf_configs_path_is_the_shipped_directory(tmp_path, monkeypatch):
    from trainer.models.hf import _source

    monkeypatch.chdir(tmp_path)
    assert shipped_path("configs/hf/llama-3.2-1b") == configs_dir() / "hf/llama-3.2-1b"
    assert _source("configs/hf/llama-3.2-1b") == (str(configs_dir() / "hf/llama-3.2-1b"), True)
    assert shipped_path("configs/../pyproject.toml") is None
    with pytest.raises(FileNotFoundError, match="no such directory"):
        _source("configs/hf/nope")


def test_the_wheel_ships_the_configs_and_runs_them_from_anywhere(tmp_path):
    # `python -m build` as the README gives it, without an isolated environment (build and hatchling are dev
    # dependencies): the sdist, then the wheel from the sdist, about 3 s.
    dist = tmp_path / "dist"
    build = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)]
    r = subprocess.run(build, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    wheel = next(dist.glob("compiled_trainer-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "site")
    assert {f"trainer/configs/{p.as_posix()}" for p in CONFIG_FILES} <= names
    assert "trainer/configs/hf/llama-3.2-1b/config.json" in names
    assert not any(n.startswith("configs/") for n in names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)

    # The unpacked wheel, from a directory without configs: the names resolve to its own copy.
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}

    def python(*args: str) -> subprocess.CompletedProcess:
        r = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=work, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        return r

    probe = "import trainer.shipped as s, trainer.models.hf as h; print(s.configs_dir(), h._source(sys.argv[1])[0])"
    r = python("-c", f"import sys; {probe}", "configs/hf/llama-3.2-1b")
    shipped = tmp_path / "site/trainer/configs"
    assert r.stdout.split() == [str(shipped), str(shipped / "hf/llama-3.2-1b")]
    r = python("-m", "trainer", "print-config", "tiny", "--no-help")
    assert "name: tiny\n" in r.stdout
