"""Write one section of docs/benchmarks.md, leaving the other sections as they are."""

from __future__ import annotations

import re
from pathlib import Path

HEADER = "# Benchmarks\n\nEach section is written by the script named in its title; re-run it to refresh.\n"


def write_section(path: Path, title: str, body: str) -> None:
    text = path.read_text() if path.exists() else HEADER
    section = f"## {title}\n\n{body.rstrip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text)
