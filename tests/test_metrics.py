"""The pull series a dashboard or alert names exist from the first scrape, at 0."""

from __future__ import annotations

from prometheus_client import generate_latest

from kv_sidecar.metrics import OUTCOMES, PATHS, WORKER_FAMILIES, Metrics
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


def test_a_workers_families_are_exported_by_device_under_worker_names() -> None:
    """What a data-plane worker counts crosses the pipe as plain data and comes out of the sidecar's
    scrape as kvsidecar_worker_<name>{device, ...}: counters as _total, histograms with their buckets,
    gauges as they are; nothing outside WORKER_FAMILIES, no _created sample."""
    import pickle

    worker = Metrics()
    worker.failures.labels("staging_quarantined").inc(2)
    worker.nixl_descriptors.observe(1)
    worker.nixl_descriptors.observe(3)
    worker.staging_capacity.inc(4096)
    worker.pulls.labels("host-ring", "ok").inc()  # the sidecar counts pulls itself: not a worker family
    worker.bind_gpu_launches(lambda: {"direct": 5})
    families = pickle.loads(pickle.dumps(worker.worker_families()))  # as over the pipe
    assert {f[0] for f in families} <= set(WORKER_FAMILIES)

    sidecar = Metrics()
    sidecar.bind_workers(lambda: {-1: families, 3: families})
    text = generate_latest(sidecar.registry).decode()
    for device in ("-1", "3"):
        assert (
            f'kvsidecar_worker_failures_total{{device="{device}",reason="staging_quarantined"}} 2.0' in text
        )
        assert f'kvsidecar_worker_nixl_descriptors_per_transfer_count{{device="{device}"}} 2.0' in text
        assert f'kvsidecar_worker_nixl_descriptors_per_transfer_sum{{device="{device}"}} 4.0' in text
        assert (
            f'kvsidecar_worker_nixl_descriptors_per_transfer_bucket{{device="{device}",le="4.0"}} 2.0' in text
        )
        assert f'kvsidecar_worker_staging_bytes_capacity{{device="{device}"}} 4096.0' in text
        assert f'kvsidecar_worker_gpu_launches_total{{by="direct",device="{device}"}} 5.0' in text
    assert "# TYPE kvsidecar_worker_failures_total counter" in text
    assert "# TYPE kvsidecar_worker_nixl_descriptors_per_transfer histogram" in text
    assert "kvsidecar_worker_pulls" not in text and "kvsidecar_worker_failures_created" not in text
    # The sidecar's own series leave the workers' counts out.
    assert 'kvsidecar_failures_total{reason="staging_quarantined"}' not in text
    assert "kvsidecar_nixl_descriptors_per_transfer_count 0.0" in text


def test_no_worker_no_worker_series() -> None:
    sidecar = Metrics()
    sidecar.bind_workers(dict)
    text = generate_latest(sidecar.registry).decode()
    assert "kvsidecar_worker_staging" not in text and "kvsidecar_worker_failures" not in text
