"""Write one section of docs/benchmarks.md, leaving the other sections as they are."""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
from collections.abc import Sequence
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


def quantile(xs: Sequence[float], q: float, empty: float = float("nan")) -> float:
    """The nearest-rank q-quantile (0 <= q <= 1) of `xs`, one of its values; `empty` where there are none.
    The benches' tail percentiles (and p50s that are not a median) come from here, so that their tables
    read alike."""
    if not xs:
        return empty
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def gpus() -> str:
    """The machine's GPUs as nvidia-smi names them ("2x NVIDIA H200"), or "no GPU", without starting
    CUDA in this process (a host benchmark run on the GPU machine says where it ran)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "no GPU"
    out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    names = collections.Counter(n.strip() for n in out.stdout.splitlines() if n.strip())
    return ", ".join(f"{k}x {name}" for name, k in names.items()) or "no GPU"
