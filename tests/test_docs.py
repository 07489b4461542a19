"""The README and docs/ say only what the code has: links, files, config keys and CLI commands that exist."""

import re
from pathlib import Path

import pytest

from trainer.config import _REMOVED, iter_fields

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
SECTIONS = "run|seed|model|data|optim|schedule|train|compile|distributed|checkpoint|log"
TYPO_EXAMPLE = "optim.lrr"  # the pages show what a misspelt key does
FILE_SUFFIXES = {"bin", "json", "jsonl", "yaml", "py", "md", "txt", "png", "pt", "npy"}
HISTORY = re.compile(r"\bsession \d+|\bsince then\b|\bthis session\b", re.IGNORECASE)


def _code_spans(text: str) -> list[str]:
    """Inline code and indented/fenced code lines: where keys, paths and commands are written."""
    spans = re.findall(r"`([^`\n]+)`", text)
    spans += [line for line in text.splitlines() if line.startswith("    ")]
    return spans


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_and_paths_exist(page):
    text = page.read_text()
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)", text):  # Markdown links
        if not target.startswith("http") and not (page.parent / target).exists():
            missing.append(target)
    for span in _code_spans(text):  # repository files named in code
        for path in re.findall(r"\b((?:scripts|configs|trainer|tests|docs)/[\w./-]+\.(?:py|yaml|md|json|sh))\b", span):
            if not (ROOT / path).exists():
                missing.append(path)
    assert not missing, f"{page.name} names files that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_config_keys_exist(page):
    keys = {key for key, *_ in iter_fields()}
    unknown = []
    for span in _code_spans(page.read_text()):
        for found in re.finditer(rf"(?<![\w./])((?:{SECTIONS})\.[a-z_]+)\b(\.\w+)?", span):
            key, after = found.group(1), (found.group(2) or "").lstrip(".")
            if after in FILE_SUFFIXES:  # train.mask.bin is a file
                continue
            known = key in keys or key in _REMOVED or key == TYPO_EXAMPLE  # removed keys: named where they went
            if known or key.startswith(("model.kwargs", "compile.inductor_options")):
                continue
            if key.rsplit(".", 1)[1] not in FILE_SUFFIXES:  # train.bin is a file
                unknown.append(key)
    assert not unknown, f"{page.name} names config keys the schema lacks: {sorted(set(unknown))}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_commands_exist(page):
    import argparse

    from trainer.cli import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    commands = set(sub.choices)
    named = set()
    for span in _code_spans(page.read_text()):
        named.update(re.findall(r"(?:^|[\s$(])trainer ([a-z][a-z-]+)\b", span))
    assert named <= commands, f"{page.name} names commands the CLI lacks: {sorted(named - commands)}"


def test_no_development_history_in_the_product():
    pages = [*PAGES, *ROOT.glob("configs/*.yaml"), *ROOT.glob("trainer/**/*.py"), *ROOT.glob("scripts/**/*.py")]
    found = [str(p.relative_to(ROOT)) for p in pages if HISTORY.search(p.read_text())]
    assert not found, f"these files speak of development history (git log and CHANGELOG.md hold it): {found}"


def test_version_is_one():
    import trainer

    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    assert trainer.__version__ == version
    assert f"## {version}" in (ROOT / "CHANGELOG.md").read_text(), "CHANGELOG.md has no section for this version"


def test_readme_is_a_product_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the details belong in docs/"


def test_the_readme_test_command_is_what_ci_runs_with_the_pins():
    """CI runs the README's test command, and that command installs the pinned versions (constraints.txt), which
    name every package the dev extra asks for: a fresh machine gets what CI was green on."""
    import tomllib

    readme = (ROOT / "README.md").read_text()
    command = next(line for line in readme.splitlines() if line.startswith("pip install") and "pytest" in line)
    assert command in (ROOT / ".ci" / "run").read_text()
    assert "-c constraints.txt" in command
    pins = {
        re.split(r"[=<>]", line)[0].strip().lower().replace("_", "-")
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["dev"]
    names = {re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower().replace("_", "-") for req in wanted}
    assert not names - pins, f"constraints.txt does not pin {sorted(names - pins)}"
