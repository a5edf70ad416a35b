"""Packaging promises: fresh generated code, a thin client without NIXL, specific import names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_generated_protos_are_fresh() -> None:
    res = subprocess.run(
        [sys.executable, "scripts/gen_protos.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr


def test_thin_client_imports_without_nixl_or_torch() -> None:
    # Make `import nixl` / `import torch` fail, as on an engine host without them.
    code = (
        "import sys; sys.modules['nixl'] = None; sys.modules['torch'] = None\n"
        "import kv_sidecar_client as c\n"
        "from kv_sidecar_client import shm  # torch only needed when allocating\n"
        "assert c.SidecarClient and c.params_to_json\n"
        "assert not any(m.startswith(('nixl', 'torch', 'kv_sidecar.')) for m in sys.modules if sys.modules[m])\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_client_distribution_does_not_depend_on_nixl() -> None:
    meta = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
    deps = " ".join(meta["dependencies"]).lower()
    assert "nixl" not in deps and "torch" not in deps
    assert set(meta["dependencies"]) == {"grpcio>=1.85.1", "protobuf>=7.35.1,<8"}


def test_installed_top_level_names_are_specific() -> None:
    for pyproject, expected in (
        (ROOT / "pyproject.toml", ["kv_sidecar*"]),
        (ROOT / "client" / "pyproject.toml", ["kv_sidecar_client*"]),
    ):
        find = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["packages"]["find"]
        assert find["include"] == expected
    generated = ROOT / "client" / "kv_sidecar_client" / "_proto" / "kvsidecar" / "v1" / "engine_pb2_grpc.py"
    assert "from kvsidecar" not in generated.read_text()  # rewritten to relative imports
