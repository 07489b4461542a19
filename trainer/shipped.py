"""The configs shipped with trainer: what ``trainer fit tiny`` reads, and ``trainer configs``.

The repository's ``configs/`` is their one copy: a wheel installs it as ``trainer/configs`` (pyproject.toml's
``force-include``), and a source checkout reads it where it is. A CONFIG argument names, in this order:

1. the file or directory at that path, when there is one (``my.yaml``; ``configs/tiny.yaml`` in a clone);
2. ``CONFIG.yaml`` in the working directory, for a CONFIG without a ``.yaml``/``.yml`` suffix;
3. the shipped config of that name: ``tiny``, ``tiny.yaml`` and ``configs/tiny.yaml`` all name the shipped
   ``tiny.yaml``, so the commands in the README and the configs' comments work from any directory.

Any other ``configs/...`` path that is not in the working directory is looked up among the shipped files too
(:func:`shipped_path`): ``model.hf: configs/hf/llama-3.2-1b`` in ``llama-1b.yaml`` is its model directory.
"""

from __future__ import annotations

import difflib
from pathlib import Path

__all__ = ["configs_dir", "find_config", "shipped_path", "shipped_configs", "format_configs"]

_INSTALLED = Path(__file__).resolve().parent / "configs"  # where a wheel puts them
_CHECKOUT = Path(__file__).resolve().parents[1] / "configs"  # a source checkout, installed editable or not
_SUFFIXES = (".yaml", ".yml")


def configs_dir() -> Path:
    """The directory of the shipped configs."""
    return _INSTALLED if _INSTALLED.is_dir() else _CHECKOUT


def shipped_configs() -> dict[str, Path]:
    """Each shipped config's name (its file name without ``.yaml``) and file, by name."""
    return dict(sorted((p.stem, p) for p in configs_dir().glob("*.yaml")))


def shipped_path(spec: str | Path) -> Path | None:
    """The shipped file or directory that a relative ``configs/...`` path names; None if there is none.

    Args:
        spec: a path such as ``configs/hf/llama-3.2-1b``, relative to the repository root.
    """
    parts = Path(spec).parts
    if len(parts) < 2 or parts[0] != "configs" or ".." in parts:
        return None
    path = configs_dir().joinpath(*parts[1:])
    return path if path.exists() else None


def find_config(spec: str | Path) -> tuple[Path, bool]:
    """The config file a CONFIG argument names (the module docstring says in which order), and whether it is
    a shipped one that stands in for a file the working directory lacks.

    Args:
        spec: a path, or a shipped config's name (``tiny``, ``tiny.yaml``, ``configs/tiny.yaml``).

    Returns:
        ``(path, shipped)``.

    Raises:
        FileNotFoundError: nothing of that name, with a did-you-mean among the shipped configs.
    """
    path = Path(spec).expanduser()
    if path.exists():
        return path, False
    text = str(spec)
    if not text.endswith(_SUFFIXES) and Path(text + ".yaml").exists():
        return Path(text + ".yaml"), False
    name = Path(text).name.removesuffix(".yaml")
    one_level = len(path.parts) == 1 or (len(path.parts) == 2 and path.parts[0] == "configs")
    found = shipped_path(f"configs/{name}.yaml") if one_level and not path.is_absolute() else None
    if found is not None:
        return found, True
    names = list(shipped_configs())
    near = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    hint = f"; did you mean '{near[0]}'?" if near else "."
    raise FileNotFoundError(
        f"config file not found: {spec}{hint} CONFIG is the path of a YAML file or the name of a config shipped "
        f"with trainer: {', '.join(names)} (`trainer configs` lists them)"
    )


def _summary(path: Path) -> str:
    """The config's first line, the one-sentence comment that says what it trains."""
    first = next(iter(path.read_text().splitlines()), "")
    return first.removeprefix("#").strip() if first.startswith("#") else ""


def format_configs() -> str:
    """``trainer configs``: each shipped config's name and what it trains, then how to run one and where they are."""
    configs = shipped_configs()
    width = max(map(len, configs), default=0)
    lines = [f"{name:<{width}}  {_summary(path)}" for name, path in configs.items()]
    lines += [
        "",
        "trainer fit NAME trains one and trainer print-config NAME shows it; NAME.yaml in the working directory "
        "comes first.",
        f"Files: {configs_dir()}",
    ]
    return "\n".join(lines)
