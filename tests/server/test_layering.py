"""The layers of docs/architecture.md, read off the source with an AST walk (imports anywhere in a
module count: inside functions and under TYPE_CHECKING too).

Issue 31 moves server/ towards a core that imports no grpc. Until every core module is there,
`GRPC_FREE_CORE` lists the ones that are: a module leaves the list only by a deliberate edit here,
and each step of the refactor adds the modules it frees.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "sidecar" / "kv_sidecar"

# Pure planning and the data plane: no gRPC, and nothing of the control plane above them.
LOWER_LAYERS = ("plan", "execute", "memory", "transport")

# server/ modules that decide (the core) and already import no grpc.
GRPC_FREE_CORE = (
    "drain",
    "errors",
    "engine_calls",
    "engines",
    "gpu_direct",
    "gpu_staging",
    "inflight",
    "lease_view",
    "nixl_reads",
    "notifications",
    "published",
    "pull",
    "pull_direct",
    "pull_job",
    "push_runs",
    "reads",
    "staged_copies",
    "staged_protocol",
    "status",
    "transfers",
)


def imports(path: Path) -> set[str]:
    """Every module name `path` imports (absolute, as written; relative imports resolved in-package)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = path.relative_to(PACKAGE.parent).with_suffix("").parts[: -node.level]
                base = ".".join(parts)
                names.add(f"{base}.{node.module}" if node.module else base)
            elif node.module:
                names.add(node.module)
    return names


def is_grpc(name: str) -> bool:
    return name == "grpc" or name.startswith(("grpc.", "grpc_"))


@pytest.mark.parametrize("package", LOWER_LAYERS)
def test_plan_and_data_plane_know_neither_grpc_nor_the_server(package: str) -> None:
    for path in sorted((PACKAGE / package).rglob("*.py")):
        bad = {n for n in imports(path) if is_grpc(n) or n.startswith("kv_sidecar.server")}
        assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}"


@pytest.mark.parametrize("module", GRPC_FREE_CORE)
def test_core_modules_import_no_grpc(module: str) -> None:
    path = PACKAGE / "server" / f"{module}.py"
    bad = {n for n in imports(path) if is_grpc(n) or n.startswith("kv_sidecar.server.adapters")}
    assert not bad, f"server/{module}.py imports {sorted(bad)}: gRPC belongs in server/adapters/"


def test_the_status_mapping_is_the_adapters_alone() -> None:
    """grpc.StatusCode appears in server/ only where Code is mapped to it, and in the drain's gate."""
    users = {
        path.relative_to(PACKAGE / "server").as_posix()
        for path in (PACKAGE / "server").rglob("*.py")
        if "StatusCode" in path.read_text()
    }
    assert users <= {"adapters/grpc_status.py", "adapters/drain_gate.py"}, sorted(users)
