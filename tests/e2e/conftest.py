"""Real sidecar processes on loopback, shared by the end-to-end tests of a session."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess

P = TypeVar("P", EngineProcess, SidecarProcess)
Spawn = Callable[[P], P]


@pytest.fixture(scope="session")
def sidecar_pair() -> Iterator[tuple[SidecarProcess, SidecarProcess]]:
    a, b = SidecarProcess("prefill-node"), SidecarProcess("decode-node")
    yield a, b
    codes = a.stop(), b.stop()
    assert not os.path.exists(a.socket) and not os.path.exists(b.socket), (
        "SIGTERM must remove the engine socket"
    )
    assert codes == (0, 0), f"sidecars exited with {codes}:\n" + "\n".join(
        list(a.stderr_tail) + list(b.stderr_tail)
    )


def spec_dict(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "tp_size": 1,
        "num_layers": 2,
        "num_kv_heads": 4,
        "head_dim": 16,
        "dtype": "float16",
        "block_size": 16,
        "num_blocks": 64,
        "layout": "flash_attn_nhd",
    }
    return base | over


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """spawn(EngineProcess(...)) stops the process after the test, even when a later start fails."""
    procs: list[EngineProcess | SidecarProcess] = []

    def keep(proc: P) -> P:
        procs.append(proc)
        return proc

    yield keep
    for proc in sorted(procs, key=lambda p: isinstance(p, SidecarProcess)):  # engines first
        if isinstance(proc, EngineProcess):
            proc.stop()
        else:
            proc.stop(10)
