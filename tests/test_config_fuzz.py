"""The config layer under random input: every file and override either gives a valid config or exits 2 with one
message and no traceback.

Hypothesis with a fixed seed (``derandomize``) and a bounded number of cases, so CI runs the same cases each time.
"""

import string

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from trainer.cli import main  # noqa: E402
from trainer.config import iter_fields  # noqa: E402

KEYS = [key for key, _, _, _ in iter_fields()]
CASES = settings(derandomize=True, max_examples=150, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip

words = st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=8)
keys = st.one_of(
    st.sampled_from(KEYS),
    st.builds(lambda k, w: f"{k}.{w}", st.sampled_from(KEYS), words),  # below a leaf, or a typo'd leaf
    st.lists(words, min_size=1, max_size=3).map(".".join),  # anything
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["auto", "none", "all", "cuda", "cpu", "fsdp", "ddp", "bf16", "fp16", "[1, 2]", "{a: 1}", "${x}"]),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(words, inner, max_size=3),
                      max_leaves=6)  # fmt: skip


def _yaml_value(v) -> str:
    import yaml

    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


def _check(argv, capsys) -> None:
    """``trainer print-config ...`` returns 0 or 2; on 2, one message on stderr and no traceback."""
    code = main(["print-config", *argv, "--no-help"])
    err = capsys.readouterr().err
    assert code in (0, 2), (argv, code, err)
    if code == 2:
        assert "Traceback" not in err and err.startswith("trainer: error:"), (argv, err)
        assert err.count("trainer: error") == 1, (argv, err)


@CASES
@given(overrides=st.lists(st.builds(lambda k, v: f"{k}={_yaml_value(v)}", keys, values), max_size=3))
def test_random_overrides_give_a_config_or_exit_2(overrides, capsys):
    _check(["configs/tiny.yaml", *overrides], capsys)


@CASES
@given(items=st.lists(st.text(max_size=30), max_size=3))
def test_random_override_strings_give_a_config_or_exit_2(items, capsys):
    _check(["configs/tiny.yaml", *(i for i in items if not i.startswith("-"))], capsys)


@CASES
@given(doc=st.dictionaries(keys, values, max_size=4))
def test_random_config_files_give_a_config_or_exit_2(doc, capsys, tmp_path_factory):
    import yaml

    nested: dict = {}
    for key, value in doc.items():
        node = nested
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {}) if isinstance(node.get(p, {}), dict) else {}
        node[leaf] = value
    path = tmp_path_factory.mktemp("fuzz") / "c.yaml"
    path.write_text(yaml.safe_dump(nested))
    _check([str(path)], capsys)


@CASES
@given(text=st.text(alphabet=string.printable, max_size=80))
def test_random_yaml_text_gives_a_config_or_exit_2(text, capsys, tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "c.yaml"
    path.write_text(text)
    _check([str(path)], capsys)
