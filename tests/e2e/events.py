"""Waiting for a reference engine's events (consumed, lease_expired, released) in end-to-end tests."""

from __future__ import annotations

import time
from typing import Any

from kv_sidecar.refengine.procs import EngineProcess


def wait_event(engine: EngineProcess, kind: str, request_id: str, timeout_s: float = 10) -> dict[str, Any]:
    """The next event of `kind` for `request_id`; fails if another event for that request comes first."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        ev = engine.send({"cmd": "next_event", "timeout_s": left})
        if not ev["ok"]:
            break
        if ev.get("request_id") == request_id:
            assert ev["kind"] == kind, f"expected {kind} for {request_id}, got {ev}"
            return ev
    raise AssertionError(f"no {kind} event for {request_id} within {timeout_s}s")


def no_event(engine: EngineProcess, request_id: str, wait_s: float = 1.0) -> None:
    """Assert that no event about `request_id` arrives within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        ev = engine.send({"cmd": "next_event", "timeout_s": left})
        if not ev["ok"]:
            return
        assert ev.get("request_id") != request_id, f"unexpected event {ev}"
