"""Rewrite docs/configuration.md's config reference from the schema: python scripts/update_config_reference.py"""

import re
import sys
from pathlib import Path

from trainer.config import reference_markdown

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def render(doc: str) -> str:
    block = f"{START}\n{reference_markdown()}\n{END}"
    return re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: block, doc, flags=re.S)


if __name__ == "__main__":
    path = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    new = render(path.read_text())
    if "--check" in sys.argv:
        sys.exit(0 if new == path.read_text() else 1)
    path.write_text(new)
