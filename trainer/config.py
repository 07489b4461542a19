"""Config loading: YAML file + ``key=value`` overrides through OmegaConf, onto the schema of :mod:`trainer.schema`.

Every field carries a one-line docstring under it; :func:`field_help` reads them so that
``trainer print-config`` and the README's config reference show the same text. Range and
choice checks are declared in field metadata and checked by :func:`validate`.

User errors raise :class:`ConfigError`, which names the key, where it came from (file or
override), what was expected and, where one fits, a did-you-mean. The CLI turns it into
exit status 2 without a traceback.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer import console
from trainer.schema import Config, ConfigError
from trainer.shipped import find_config

__all__ = [
    "Config",
    "ConfigError",
    "load_config",
    "validate",
    "to_dict",
    "to_yaml",
    "reference_markdown",
    "field_help",
    "iter_fields",
    "get",
]

# ---------------------------------------------------------------------------------------------
# Schema introspection: field help and the set of valid keys.


def _field_docs(cls) -> dict[str, str]:
    """Field name -> the docstring written under it in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def iter_fields(cls=Config, prefix: str = "", docs: bool = True):
    """Yield ``(dotted_key, dataclass_field, doc, is_section)`` for the whole schema, depth first. ``docs=False``
    leaves each doc empty (reading them parses the schema's source: a large part of a run's config load)."""
    found = _field_docs(cls) if docs else {}
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        sub = _section_type(f)
        yield key, f, found.get(f.name, ""), sub is not None
        if sub is not None:
            yield from iter_fields(sub, key + ".", docs)


def _section_type(f):
    t = f.type if not isinstance(f.type, str) else eval(f.type, vars(sys.modules[Config.__module__]))  # noqa: S307
    return t if dataclasses.is_dataclass(t) else None


def field_help() -> dict[str, str]:
    return {key: doc for key, _, doc, _ in iter_fields()}


_ALL = {key: (f, is_section) for key, f, _, is_section in iter_fields(docs=False)}
# Fields whose value is a free-form mapping: anything below them is allowed.
_OPEN = {key for key, (f, _) in _ALL.items() if "dict" in str(f.type)}


_REMOVED = {
    key: "trainer's Triton kernels reach every model through the compile layer: use compile.kernels (auto, all, none "
    "or a list of add_layer_norm, add_rms_norm, cross_entropy, linear_cross_entropy)"
    for key in ("model.fused_loss", "model.cross_entropy", "model.layer_norm")
}
"""Keys of earlier versions, and what replaces them (CHANGELOG.md)."""


def _check_key(key: str, where: str) -> None:
    if key in _ALL or any(key.startswith(o + ".") for o in _OPEN):
        return
    if key in _REMOVED:
        raise ConfigError(f"{key}: removed (in {where}); {_REMOVED[key]}")
    parent, _, leaf = key.rpartition(".")
    if parent and parent in _ALL and not _ALL[parent][1]:
        raise ConfigError(f"{key}: '{parent}' is a value, not a section (in {where})")
    siblings = [k for k in _ALL if k.rpartition(".")[0] == parent]
    near = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6) or difflib.get_close_matches(
        key, list(_ALL), n=1, cutoff=0.75
    )
    if not near:  # the right leaf in the wrong section: `lr=1` -> `optim.lr`
        near = [k for k in _ALL if k.rpartition(".")[2] == leaf and k != key][:1]
    hint = f"; did you mean '{near[0]}'?" if near else ""
    if parent and parent not in _ALL:
        top = parent.split(".")[0]
        near = difflib.get_close_matches(top, [k for k in _ALL if "." not in k], n=1, cutoff=0.6)
        if near and top != near[0]:
            hint = f"; did you mean '{near[0] + key[len(top) :]}'?"
        siblings = [k for k in _ALL if "." not in k]
        parent = ""
    section = f"section '{parent}'" if parent else "the top level"
    valid = ", ".join(k.rpartition(".")[2] for k in siblings)
    raise ConfigError(f"unknown config key '{key}' (in {where}){hint or '.'} Valid keys in {section}: {valid}.")


def _leaf_keys(d: Any, prefix: str = ""):
    if isinstance(d, dict) and d:
        for k, v in d.items():
            key = f"{prefix}{k}"
            if key in _OPEN:
                yield key
                continue
            if isinstance(v, dict) and not (key in _ALL and not _ALL[key][1]):
                yield from _leaf_keys(v, key + ".")
            else:
                yield key
    elif prefix:
        yield prefix.rstrip(".")


# ---------------------------------------------------------------------------------------------
# Loading.


def _load_yaml(path: Path) -> dict:
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    if path.is_dir():
        raise ConfigError(f"config path is a directory, expected a YAML file: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: malformed YAML{at}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(data).__name__}")
    return data


def parse_override(item: str) -> tuple[str, Any]:
    """``'optim.lr=3e-4'`` -> ``('optim.lr', 3e-4)``; the value is parsed as YAML.

    A value that is not valid YAML is the text as given for a key that takes text (a path with a colon), and a
    :class:`ConfigError` otherwise, or where it opens a list, a mapping or a quote (``optim.betas=[0.9,0.95``).
    """
    key, eq, raw = item.partition("=")
    key = key.strip()
    if not eq or not key or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key):
        raise ConfigError(f"malformed override '{item}': expected key=value, e.g. optim.lr=3e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        fld = _ALL.get(key, (None, False))[0]
        known = fld is not None or any(key.startswith(o + ".") for o in _OPEN)  # else _check_key names the key
        takes_text = fld is None or "str" in str(fld.type) or "Any" in str(fld.type)
        if known and (raw.lstrip().startswith(("[", "{", '"', "'")) or not takes_text):
            expected = f"; expected {_type_name(fld)}" if fld is not None else ""
            raise ConfigError(
                f"{key}: the value is not valid YAML ({_yaml_problem(raw, e)}) (in override '{item}'){expected}"
            ) from None
        value = raw  # a plain string such as a path with a colon
    return key, value


def _yaml_problem(raw: str, e: yaml.YAMLError) -> str:
    """What is wrong with ``raw``: an unbalanced bracket or quote, else the YAML parser's own words."""
    for opener, closer in (("[", "]"), ("{", "}")):
        if raw.count(opener) != raw.count(closer):
            return f"unbalanced '{opener if raw.count(opener) > raw.count(closer) else closer}'"
    for quote in ('"', "'"):
        if raw.count(quote) % 2:
            return f"unclosed {quote}"
    return getattr(e, "problem", None) or str(e).splitlines()[0]


def _nest(key: str, value: Any) -> dict:
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def _merge(cfg: DictConfig, data: dict, where: str) -> DictConfig:
    """``cfg`` with ``data`` merged over it; a value of the wrong shape is a :class:`ConfigError` naming its key."""
    try:
        return OmegaConf.merge(cfg, OmegaConf.create(data))
    except OmegaConfBaseException as e:
        raise _merge_error(e, where, data) from None
    except (TypeError, ValueError) as e:  # OmegaConf's own, e.g. a list where a mapping goes: find the key
        for key in _leaf_keys(data):
            try:
                OmegaConf.merge(cfg, OmegaConf.create(_nest(key, _lookup(data, key))))
            except (OmegaConfBaseException, TypeError, ValueError):
                fld = _ALL.get(key, (None, False))[0]
                got = type(_lookup(data, key)).__name__
                expected = f", expected {_type_name(fld)}" if fld is not None else f" ({e})"
                raise ConfigError(f"{key}: got a {got} (in {where}){expected}") from None
        raise ConfigError(f"{e} (in {where})") from None


def _lookup(data: dict, key: str) -> Any:
    for part in key.split("."):
        data = data[part]
    return data


def _merge_error(e: OmegaConfBaseException, where: str, data: dict | None = None) -> ConfigError:
    """The error of a value that does not fit its key: the value as given (OmegaConf's words where it is not
    known, or where an item of a list failed) and what the key takes."""
    key = re.sub(r"(\[\d+\])+$", "", getattr(e, "full_key", None) or "")  # an item of a list: the list's key
    if not key:  # a whole section set to a value: OmegaConf names no key; the one the data sets is it
        leaves = list(_leaf_keys(data)) if data is not None else []
        key = leaves[0] if len(leaves) == 1 else "?"
    msg = str(e).splitlines()[0]
    fld = _ALL.get(key, (None, False))[0]
    if fld is not None and data is not None:
        try:
            msg = f"got {_shown(_lookup(data, key))}"
        except (KeyError, TypeError):
            pass  # set by an interpolation or a default: OmegaConf's message says what
    expected = f"; expected {_type_name(fld)}" if fld is not None else ""
    return ConfigError(f"{key}: {msg} (in {where}){expected}")


def _shown(value: Any) -> str:
    """A value as given: a string quoted, anything else as YAML writes it (``true``, ``[0.9, 0.95]``)."""
    if isinstance(value, str):
        return repr(value)
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def _type_name(f) -> str:
    """What field ``f`` takes, in words: ``a list of numbers, e.g. [0.9, 0.95]``, ``an integer or null``."""
    if "names" in f.metadata:
        return f"auto, all, none or a list of {', '.join(f.metadata['names'])}"
    if "choices" in f.metadata:
        return "one of " + " | ".join(_yaml_value(c) for c in f.metadata["choices"])
    t = str(f.type).replace("typing.", "")
    if t.startswith("dict") or _section_type(f) is not None:
        return "a mapping, e.g. {key: value}"
    if t.startswith("list"):
        items = {"float": "numbers", "int": "integers", "str": "strings"}.get(t[5:-1], "values")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        return f"a list of {items}, e.g. {_shown(default) if default else '[a, b]'}"
    names = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string", "None": "null"}
    return " or ".join(names.get(part.strip(), "a YAML value") for part in t.split("|"))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a config: schema defaults, then the YAML file, then ``key=value`` overrides (later wins).

    Args:
        path: YAML file, a shipped config's name (``"tiny"``: :func:`trainer.shipped.find_config`), or None for
            the defaults alone.
        overrides: ``key=value`` strings; values are parsed as YAML.

    Returns:
        The validated, interpolation-resolved :class:`Config`.

    Raises:
        ConfigError: naming the key, its source and what was expected.
    """
    sources: list[tuple[str, dict]] = []
    empty = None  # the config file, when it sets nothing
    if path is not None:
        try:
            path = find_config(path)[0]
        except FileNotFoundError as e:  # as every other problem of a config: a ConfigError
            raise ConfigError(str(e)) from None
        where = str(path)
        data = _load_yaml(Path(path))
        empty = where if not data else None
        for key in _leaf_keys(data):
            _check_key(key, where)
        sources.append((where, data))
    origin: dict[str, str] = {}
    for item in overrides or []:
        key, value = parse_override(item)
        where = f"override '{item}'"
        _check_key(key, where)
        if isinstance(value, dict):
            for sub in _leaf_keys(value, key + "."):
                _check_key(sub, where)
        origin[key] = where
        sources.append((where, _nest(key, value)))
    if empty:
        _warn_empty(empty, set(origin))

    cfg: DictConfig = OmegaConf.structured(Config)
    for where, data in sources:
        cfg = _merge(cfg, data, where)
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{getattr(e, 'full_key', '?')}: cannot resolve interpolation: {e}".splitlines()[0]) from None
    try:
        obj = OmegaConf.to_object(cfg)
    except ConfigError as e:
        raise ConfigError(_with_origin(str(e), origin, path)) from None
    except OmegaConfBaseException as e:
        raise _merge_error(e, str(path) if path else "defaults") from None
    validate(obj, origin, path)
    return obj


def _warn_empty(path: str, overridden: set[str]) -> None:
    """Say that the config file ``path`` sets nothing (no keys, or only comments), and what a run of it trains: the
    defaults of the keys that matter most, those not in ``overridden``."""
    d = Config()
    shown = {
        "train.steps": str(d.train.steps),
        "model.preset": f"{d.model.preset} (the built-in GPT)",
        "data.path": "null (the embedded corpus)",
    }
    which = "every key not overridden" if overridden else "every key"
    defaults = ", ".join(f"{k}={v}" for k, v in shown.items() if k not in overridden)
    console.warn(
        f"{path} is empty: {which} takes its default ({defaults}, ...); trainer print-config {path} shows them all"
    )


def _with_origin(msg: str, origin: dict[str, str], path) -> str:
    key = msg.split(":", 1)[0]
    below = [w for k, w in origin.items() if k.startswith(key + ".")]  # set by a deeper key, e.g. a mapping's entry
    where = origin.get(key) or (below[-1] if below else None) or (str(path) if path else "defaults")
    return f"{msg} (from {where})"


def validate(cfg: Config, origin: dict[str, str] | None = None, path=None) -> None:
    """Check every field's declared choices and bounds."""
    for key, f, _, is_section in iter_fields(docs=False):
        if is_section or not f.metadata:
            continue
        value = get(cfg, key)
        if value is None:
            continue
        problem = None
        if "names" in f.metadata:
            problem = _bad_names(value, f.metadata["names"])
        elif "choices" in f.metadata and not any(value is c or value == c for c in f.metadata["choices"]):
            choices = [_yaml_value(c) for c in f.metadata["choices"]]
            near = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.5)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            problem = f"got {value!r}, expected one of {' | '.join(choices)}{hint}"
        elif "gt" in f.metadata and not value > f.metadata["gt"]:
            problem = f"got {value}, expected a value > {f.metadata['gt']}"
        elif "ge" in f.metadata and not value >= f.metadata["ge"]:
            problem = f"got {value}, expected a value >= {f.metadata['ge']}"
        if problem:
            raise ConfigError(_with_origin(f"{key}: {problem}", origin or {}, path))


def _bad_names(value: Any, names: tuple[str, ...]) -> str | None:
    """What is wrong with a value that is auto, all, none or a list of ``names`` (None if nothing)."""
    if isinstance(value, str) and value in ("auto", "all", "none"):
        return None
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, list | tuple) else None
    if items is None:
        return f"got {value!r}, expected auto, all, none or a list of {', '.join(names)}"
    for item in items:
        if item not in names:
            near = difflib.get_close_matches(str(item), names, n=1, cutoff=0.5)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            return f"unknown kernel {item!r}, expected auto, all, none or a list of {', '.join(names)}{hint}"
    return None


def _yaml_value(value: Any) -> str:
    """A value as a user writes it in YAML (``true``, not ``True``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def get(cfg: Config, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def to_yaml(cfg: Config, with_help: bool = False) -> str:
    """The resolved config as YAML, optionally with each field's help as a trailing comment."""
    text = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    if not with_help:
        return text
    helps = field_help()
    out, stack = [], []
    for line in text.splitlines():
        m = re.match(r"^( *)([A-Za-z_]\w*):(.*)$", line)
        if not m:
            out.append(line)
            continue
        depth = len(m.group(1)) // 2
        stack[depth:] = [m.group(2)]
        key = ".".join(stack)
        doc = helps.get(key, "")
        out.append(f"{line}  # {doc}" if doc and key in _ALL else line)
    return "\n".join(out) + "\n"


def reference_markdown() -> str:
    """The config reference table (docs/configuration.md embeds it; a test keeps the two in sync)."""
    rows = ["| key | default | description |", "|---|---|---|"]
    defaults = to_dict(Config())
    for key, _, doc, is_section in iter_fields():
        if is_section:
            continue
        value: Any = defaults
        for part in key.split("."):
            value = value[part]
        shown = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
        if key == "run.dir":  # show the interpolation, not its value for the default name
            shown = "runs/${run.name}"
        rows.append(f"| `{key}` | `{shown}` | {doc.replace('|', '/')} |")  # a literal | would split the cell
    return "\n".join(rows)
