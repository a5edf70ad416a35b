"""The pull series a dashboard or alert names exist from the first scrape, at 0."""

from __future__ import annotations

from prometheus_client import generate_latest

from kv_sidecar.metrics import OUTCOMES, PATHS, Metrics
from kv_sidecar.server.pull import PATH_STATE
from kv_sidecar.server.pull_direct import PATH_DIRECT
from kv_sidecar.server.staged_common import PATH_HOST_RING, PATH_STAGED


def test_every_path_and_outcome_is_exposed_before_any_pull() -> None:
    text = generate_latest(Metrics().registry).decode()
    for path in PATHS:
        assert f'kvsidecar_pull_bytes_total{{path="{path}"}} 0.0' in text
        for outcome in OUTCOMES:
            assert f'kvsidecar_pulls_total{{outcome="{outcome}",path="{path}"}} 0.0' in text


def test_the_paths_the_puller_reports_are_all_listed() -> None:
    assert {PATH_STATE, PATH_DIRECT, PATH_HOST_RING, PATH_STAGED, "host-direct", "host-nixl"} <= set(PATHS)
