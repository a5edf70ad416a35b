"""The layers of docs/architecture.md, read off the source with an AST walk (imports anywhere in a
module count: inside functions and under TYPE_CHECKING too).

- plan/ and the data plane (dataplane/, execute/, memory/, transport/) import neither grpc nor the server;
- the core (server/*.py but the composition root) imports neither grpc nor the adapters;
- the core reaches the data plane only through its door (dataplane/plane.py, the plain-data jobs of
  dataplane/jobs.py, and the staged protocol's pure bookkeeping): no torch, no mappings, no kernels;
- only the composition root (server/sidecar.py) and commands/serve.py import the composition root;
- server/ has no import cycle;
- grpc.StatusCode is named only where the core's codes are mapped to it, and in the drain's gate.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "sidecar" / "kv_sidecar"
SERVER = PACKAGE / "server"
ROOT = "kv_sidecar.server.sidecar"  # the composition root
ADAPTERS = "kv_sidecar.server.adapters"

# Pure planning and the data plane: no gRPC, and nothing of the control plane above them.
LOWER_LAYERS = ("plan", "dataplane", "execute", "memory", "transport")
# What the core may import of the data plane (dataplane/plane.py's __all__ names the handles it returns).
DATA_PLANE_DOOR = {
    "kv_sidecar.dataplane",  # the package (its __init__ is a docstring)
    "kv_sidecar.dataplane.jobs",
    "kv_sidecar.dataplane.plane",
    "kv_sidecar.dataplane.staged_protocol",
}
BEHIND_THE_DOOR = (
    "torch",
    "triton",
    "nixl",
    "kv_sidecar.execute",
    "kv_sidecar.memory",
    "kv_sidecar.dataplane",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (PACKAGE.parent / rel).with_suffix(".py").exists() or (
        PACKAGE.parent / rel / "__init__.py"
    ).exists()


def imports(path: Path) -> set[str]:
    """Every module `path` imports, absolute: `from pkg import mod` counts as pkg.mod where mod is a
    module, relative imports are resolved in-package."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module_name(path).split(".")
                base = ".".join(parts[: len(parts) - node.level + (path.name == "__init__.py")])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names if is_module(f"{module}.{a.name}"))
    return names


def is_grpc(name: str) -> bool:
    return name == "grpc" or name.startswith(("grpc.", "grpc_"))


def core_modules() -> Iterator[Path]:
    for path in sorted(SERVER.glob("*.py")):
        if module_name(path) != ROOT:
            yield path


@pytest.mark.parametrize("package", LOWER_LAYERS)
def test_plan_and_data_plane_know_neither_grpc_nor_the_server(package: str) -> None:
    for path in sorted((PACKAGE / package).rglob("*.py")):
        bad = {n for n in imports(path) if is_grpc(n) or n.startswith("kv_sidecar.server")}
        assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}"


def test_the_core_imports_neither_grpc_nor_the_adapters() -> None:
    bad = {
        path.relative_to(PACKAGE).as_posix(): sorted(
            n for n in imports(path) if is_grpc(n) or n == ADAPTERS or n.startswith(ADAPTERS + ".")
        )
        for path in core_modules()
    }
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"gRPC belongs in server/adapters/: {bad}"


def test_the_core_reaches_the_data_plane_only_through_its_door() -> None:
    """Bytes, mappings, rings and kernels are the data plane's: the core hands it plain-data jobs, so
    that a device's plane could run in another process (docs/architecture.md)."""

    def behind(name: str) -> bool:
        return name not in DATA_PLANE_DOOR and any(
            name == p or name.startswith(p + ".") or name.startswith(p + "_") for p in BEHIND_THE_DOOR
        )

    bad = {
        path.relative_to(PACKAGE).as_posix(): sorted(n for n in imports(path) if behind(n))
        for path in [*core_modules(), *(SERVER / "adapters").glob("*.py")]
    }
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"the core reaches past the data plane's door: {bad}"


def test_only_the_composition_root_knows_the_sidecar() -> None:
    allowed = {ROOT, "kv_sidecar.commands.serve"}
    users = sorted(
        module_name(path)
        for path in PACKAGE.rglob("*.py")
        if ROOT in imports(path) and module_name(path) not in allowed
    )
    assert not users, f"{users} import {ROOT}: give them what they use through their constructors"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or of one that imports itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1 or v in graph[v]:
                out.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_server_has_no_import_cycle() -> None:
    paths = sorted(SERVER.rglob("*.py"))
    names = {module_name(p) for p in paths}
    graph = {
        module_name(p): {n for n in imports(p) if n in names and n != "kv_sidecar.server"} for p in paths
    }
    assert not _cycles(graph), f"import cycles in server/ (TYPE_CHECKING imports count): {_cycles(graph)}"


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"a"}, "b": set()}) == [["a"]]
    assert not _cycles({"a": {"b"}, "b": set()})


def test_the_status_mapping_is_the_adapters_alone() -> None:
    """grpc.StatusCode appears in server/ only where Code is mapped to it, and in the drain's gate."""
    users = {
        path.relative_to(SERVER).as_posix()
        for path in SERVER.rglob("*.py")
        if "StatusCode" in path.read_text()
    }
    assert users <= {"adapters/grpc_status.py", "adapters/drain_gate.py"}, sorted(users)


def test_control_shards_run_sidecars_as_processes_and_know_grpc_in_the_front_door_alone() -> None:
    """shards/ never holds a sidecar in-process: nothing of the server, the data plane or torch (the
    front door stays a light process); gRPC only where it serves (front_door.py)."""
    inside = ("kv_sidecar.server", *(f"kv_sidecar.{p}" for p in LOWER_LAYERS if p != "plan"))
    for path in sorted((PACKAGE / "shards").rglob("*.py")):
        names = imports(path)
        bad = {n for n in names if n.startswith(inside) or n.split(".")[0] in ("torch", "triton", "nixl")}
        assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}"
        if path.name != "front_door.py":
            assert not any(is_grpc(n) for n in names), f"{path.relative_to(PACKAGE)} imports grpc"
