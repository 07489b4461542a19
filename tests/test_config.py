"""Config loading: every shipped config, overrides, interpolation, and the exit-2 user errors."""

import runpy
import sys

import pytest
import yaml

from tests.conftest import ROOT, cli
from trainer.config import Config, ConfigError, load_config, reference_markdown, to_yaml

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"tiny.yaml", "gpt2-small.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads_and_says_how_to_launch(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    first = path.read_text().splitlines()[0]
    assert first.startswith("#"), f"{path.name} must start with a comment saying how to launch it"
    assert "trainer fit" in path.read_text().split("\n\n")[0] or "torchrun" in path.read_text()


def test_overrides_win_later_and_interpolate(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("run:\n  name: base\noptim:\n  lr: 0.1\n")
    cfg = load_config(f, ["optim.lr=0.2", "optim.lr=3e-4", "run.name=other"])
    assert cfg.optim.lr == 3e-4
    assert cfg.run.dir == "runs/other"  # ${run.name} resolved after the override
    assert load_config(f).optim.lr == 0.1


def test_nested_value_and_list_override():
    cfg = load_config(None, ["optim.betas=[0.8,0.9]", "model.kwargs={a: 1}", "model.kwargs.b=2"])
    assert cfg.optim.betas == [0.8, 0.9]
    assert cfg.model.kwargs == {"a": 1, "b": 2}


@pytest.mark.parametrize(
    "override, expect",
    [
        ("optim.lrr=1", ["optim.lrr", "did you mean 'optim.lr'", "override"]),
        ("trian.steps=3", ["did you mean 'train.steps'"]),
        ("lr=1", ["did you mean 'optim.lr'"]),
        ("train.steps=abc", ["train.steps", "abc", "integer"]),
        ("distributed.strategy=dpp", ["distributed.strategy", "did you mean 'ddp'", "none | ddp | fsdp"]),
        ("compile.mode=max-autotun", ["compile.mode", "did you mean 'max-autotune'"]),
        ("train.steps=0", ["train.steps", "> 0"]),
        ("train.micro_batch_size=-1", ["train.micro_batch_size", "> 0"]),
        ("optim.lr.x=1", ["'optim.lr' is a value"]),
        ("steps", ["malformed override 'steps'", "key=value"]),
        ("optim.betas=[0.9]", ["optim.betas", "two numbers"]),
        ("model.n_head=5", ["model.n_embd", "divisible"]),
    ],
)
def test_bad_overrides_name_the_key(override, expect):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/tiny.yaml", [override])
    for piece in expect:
        assert piece in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "optim.betas=[0.9,0.95",
            "optim.betas: the value is not valid YAML (unbalanced '[') (in override 'optim.betas=[0.9,0.95'); "
            "expected a list of numbers, e.g. [0.9, 0.95]",
        ),
        (
            "optim.betas=0.9",
            "optim.betas: got 0.9 (in override 'optim.betas=0.9'); expected a list of numbers, e.g. [0.9, 0.95]",
        ),
        ("optim.betas=[a,b]", "optim.betas: got [a, b] (in override 'optim.betas=[a,b]'); expected a list of numbers"),
        ("model.hf_overrides={a: 1", "model.hf_overrides: the value is not valid YAML (unbalanced '{')"),
        ("train.steps='3", "train.steps: the value is not valid YAML (unclosed ')"),
        (
            "optim.lr=[1",
            "optim.lr: the value is not valid YAML (unbalanced '[') (in override 'optim.lr=[1'); expected a",
        ),
        (
            "train.stop_at=abc",
            "train.stop_at: got 'abc' (in override 'train.stop_at=abc'); expected an integer or null",
        ),
        ("optim=3", "optim: got 3 (in override 'optim=3'); expected a mapping"),  # a section: OmegaConf names no key
    ],
)
def test_a_value_that_is_no_yaml_or_does_not_fit_names_the_key_and_type(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/tiny.yaml", [override])
    assert message in str(e.value)


def test_a_value_that_is_no_yaml_is_text_where_the_key_takes_text():
    assert load_config(None, ["data.path=a: b: c"]).data.path == "a: b: c"  # YAML: "mapping values are not allowed"


def test_unknown_key_in_file_names_the_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("optim:\n  learning_rate: 1\n")
    with pytest.raises(ConfigError, match=r"optim.learning_rate.*c\.yaml"):
        load_config(f)


def test_malformed_and_missing_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: [1,\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: malformed YAML at line"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(lst)


def test_cli_user_errors_exit_2_without_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {steps: 1\n")
    cases = [
        (["fit", "configs/tiny.yaml", "optim.lrr=1"], "did you mean 'optim.lr'"),
        (["fit", "configs/tiny.yaml", "train.steps=abc"], "train.steps"),
        (["fit", "configs/tiny.yaml", "distributed.strategy=dpp"], "did you mean 'ddp'"),
        (["fit", str(tmp_path / "missing.yaml")], "not found"),
        (["fit", str(bad)], "malformed YAML"),
        (["fit"], "required"),
    ]
    for args, needle in cases:
        r = cli(capsys, *args)  # in this process: an exception that escaped would fail the test here
        assert r.returncode == 2, (args, r.stderr)
        assert needle in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr, r.stderr


def test_print_config_shows_resolved_yaml_with_help(capsys):
    r = cli(capsys, "print-config", "configs/tiny.yaml", "optim.lr=0.01")
    assert r.returncode == 0, r.stderr
    assert "lr: 0.01  # Peak learning rate." in r.stdout
    plain = yaml.safe_load(cli(capsys, "print-config", "configs/tiny.yaml", "--no-help").stdout)
    assert plain["run"]["dir"] == "runs/tiny"


def test_yaml_round_trip():
    cfg = load_config(ROOT / "configs/tiny.yaml", ["optim.lr=0.01"])
    text = to_yaml(cfg)
    assert load_config(None, [f"{k}={v}" for k, v in _flat(yaml.safe_load(text))]) == cfg


def _flat(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


def test_config_reference_in_sync(monkeypatch):
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert reference_markdown() in doc, "run: python scripts/update_config_reference.py"
    monkeypatch.setattr(sys, "argv", ["scripts/update_config_reference.py", "--check"])
    with pytest.raises(SystemExit) as e:  # the script as `python scripts/update_config_reference.py --check` runs it
        runpy.run_path(str(ROOT / "scripts" / "update_config_reference.py"), run_name="__main__")
    assert e.value.code == 0


def test_every_field_has_help():
    from trainer.config import iter_fields

    missing = [key for key, _, doc, _ in iter_fields() if not doc]
    assert not missing, f"fields without a docstring: {missing}"
    assert (ROOT / "docs" / "configuration.md").exists()


@pytest.mark.parametrize(
    "name, why",
    [
        ("../x", "it holds '/', a path separator"),
        ("a/b", "it holds '/', a path separator"),
        ("a\\b", "it holds '\\', a path separator"),
        ("..", "'..' is the parent directory"),
        (".", "'.' is the directory it stands in"),
        ('""', "it is empty"),
    ],
)
def test_run_name_is_one_directory_name(name, why):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"run.name={name}"])
    shown = name.strip('"')
    assert f"run.name: '{shown}' is not a single directory name ({why})" in str(e.value), str(e.value)
    assert "set run.dir, which takes any path" in str(e.value) and f"override 'run.name={name}'" in str(e.value)


def test_run_dir_takes_any_path_beside_a_plain_name():
    cfg = load_config(None, ["run.name=ok", "run.dir=../elsewhere/a/b"])
    assert (cfg.run.name, cfg.run.dir) == ("ok", "../elsewhere/a/b")


@pytest.mark.parametrize("command", [["fit"], ["print-config"], ["explain"], ["tune", "--budget-s", "5"]])
def test_every_command_refuses_a_run_name_that_leaves_runs(capsys, command):
    r = cli(capsys, command[0], "configs/tiny.yaml", "run.name=../escape", *command[1:])
    assert r.returncode == 2, r.stderr
    assert "run.name: '../escape' is not a single directory name" in r.stderr and "Traceback" not in r.stderr
    assert not (ROOT / "escape").exists()


def test_an_empty_config_file_warns_that_every_key_takes_its_default(tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# a config, to be written\n\n")
    capsys.readouterr()
    assert load_config(empty).train.steps == 1000
    err = capsys.readouterr().err
    assert f"warning: {empty} is empty: every key takes its default (train.steps=1000, model.preset=tiny" in err, err
    load_config(empty, ["train.steps=5"])
    err = capsys.readouterr().err
    assert "every key not overridden takes its default (model.preset=tiny" in err and "steps=1000" not in err, err
    load_config(ROOT / "configs/tiny.yaml")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "args, flag",
    [
        (["tune", "tiny", "--budget-s", "nan"], "--budget-s"),
        (["tune", "tiny", "--budget-s", "inf"], "--budget-s"),
        (["tune", "tiny", "--budget-s", "-5"], "--budget-s"),
        (["tune", "tiny", "--budget-s", "0"], "--budget-s"),
        (["explain", "tiny", "--steps", "0"], "--steps"),
        (["explain", "tiny", "--steps", "nan"], "--steps"),
        (["sample", "runs/none", "--tokens", "-1"], "--tokens"),
        (["sample", "runs/none", "--temperature", "nan"], "--temperature"),
        (["sample", "runs/none", "--temperature", "-0.5"], "--temperature"),
        (["sample", "runs/none", "--top-k", "-1"], "--top-k"),
        (["prepare", "--out", "OUT", "--val-fraction", "nan"], "--val-fraction"),
        (["prepare", "--out", "OUT", "--val-fraction", "1"], "--val-fraction"),
        (["prepare", "--out", "OUT", "--workers", "0"], "--workers"),
    ],
)
def test_numeric_flags_refuse_nan_infinity_and_out_of_range(tmp_path, capsys, args, flag):
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    r = cli(capsys, *args)
    assert r.returncode == 2, r.stderr
    assert f"argument {flag}: expected " in r.stderr and f"got {args[-1]}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


def test_numeric_flags_take_their_whole_range():
    from trainer.cli import _parser

    assert _parser().parse_args(["tune", "tiny", "--budget-s", "0.5"]).budget_s == 0.5
    a = _parser().parse_args(["sample", "r", "--temperature", "0", "--top-k", "0", "--tokens", "1"])
    assert (a.temperature, a.top_k, a.tokens) == (0.0, 0, 1)
    a = _parser().parse_args(["prepare", "--out", "o", "--val-fraction", "0", "--workers", "1"])
    assert (a.val_fraction, a.workers) == (0.0, 1)
