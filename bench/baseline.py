"""Run the sidecar of another git revision next to this tree's, in the same benchmark run.

`export(ref)` writes `git archive <ref>` of sidecar/ and client/ to a temporary
directory; `env(tree)` is the environment that makes `python -m kv_sidecar`
import that tree instead of this one (PYTHONPATH comes before the editable
install). On a shared, noisy machine, old and new measured side by side in one
run (their samples interleaved) are comparable; numbers from separate runs are not.
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def export(ref: str) -> str:
    """A temporary copy of `ref`'s sidecar and client packages; returns its directory."""
    out = tempfile.mkdtemp(prefix="kvs-baseline-")
    blob = subprocess.run(
        ["git", "archive", "--format=tar", ref, "sidecar", "client"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(out, filter="data")
    return out


def describe(ref: str) -> str:
    sha = subprocess.run(["git", "rev-parse", "--short", ref], cwd=ROOT, capture_output=True, text=True)
    return f"{ref} ({sha.stdout.strip()})" if sha.returncode == 0 else ref


def env(tree: str) -> dict[str, str]:
    paths = [os.path.join(tree, "sidecar"), os.path.join(tree, "client"), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
