"""Refused Publishes are counted by engine and reason, for the metric and `kv-sidecar status`."""

from __future__ import annotations

import pytest

from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.metrics import Metrics
from kv_sidecar.server import publish_refusals
from kv_sidecar.server.publish_refusals import PublishRefusals


def metric(m: Metrics, reason: str) -> float:
    return m.registry.get_sample_value("kvsidecar_publishes_refused_total", {"reason": reason}) or 0.0


def test_refusals_are_counted_by_engine_and_reason_with_the_last_message() -> None:
    m, now = Metrics(), [100.0]
    r = PublishRefusals(m, clock=lambda: now[0])
    r.record("p", SidecarError(Code.INVALID_ARGUMENT, "prefill block id 0 appears twice"))
    now[0] = 101.0
    r.record("p", SidecarError(Code.INVALID_ARGUMENT, "block id 9 out of range"))
    r.record("q", SidecarError(Code.NOT_FOUND, "unknown engine 'q'"))
    got = [(x.engine_id, x.reason, x.count, x.last_message, x.last_unix_s) for x in r.snapshot()]
    assert got == [
        ("p", "invalid_argument", 2, "block id 9 out of range", 101.0),
        ("q", "not_found", 1, "unknown engine 'q'", 101.0),
    ]
    assert (metric(m, "invalid_argument"), metric(m, "not_found")) == (2, 1)


def test_the_status_keeps_the_most_recent_pairs_and_the_metric_counts_them_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(publish_refusals, "MAX_KEPT", 3)
    m = Metrics()
    r = PublishRefusals(m)
    for i in range(5):
        r.record(f"e{i}", SidecarError(Code.FAILED_PRECONDITION, "x"))
    r.record("e2", SidecarError(Code.FAILED_PRECONDITION, "again"))  # refreshed: now the most recent
    assert [x.engine_id for x in r.snapshot()] == ["e3", "e4", "e2"]
    assert metric(m, "failed_precondition") == 6
