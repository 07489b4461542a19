"""What a benchmark result records about the code it measured."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git_sha() -> str:
    """The commit measured: ``GIT_SHA`` if set (a copy of the tree without its git history, on a remote GPU
    machine), else ``git rev-parse``, with ``-dirty`` for uncommitted changes; ``unknown`` without either."""
    if os.environ.get("GIT_SHA"):
        return os.environ["GIT_SHA"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
    except OSError:
        return "unknown"
    return (sha.stdout.strip() or "unknown") + ("-dirty" if dirty and sha.stdout.strip() else "")
