"""Prometheus metrics. Names carry units; label values come from small fixed sets."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

# Every pull path and outcome (docs/operations.md lists them): their series exist from the first scrape,
# at 0, so that rate() and alerts on a path that has not failed yet see a rate of 0, not no data.
PATHS = (
    "host-direct",
    "host-nixl",
    "host-nixl-staged",
    "host-nixl-state",
    "host-ring",
    "gpu-direct",
    "gpu-staged",
)
OUTCOMES = ("ok", "error", "cancelled", "timeout")

_SIZE_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_THROUGHPUT_BUCKETS = tuple(x * 1e9 for x in (0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 400))


# What a data-plane worker process counts in its own registry, re-exported by the sidecar as
# kvsidecar_worker_<name>{device, ...} (the sidecar's own series of these leave the workers out).
WORKER_FAMILIES = (
    "kvsidecar_staging_bytes_in_use",
    "kvsidecar_staging_bytes_capacity",
    "kvsidecar_nixl_descriptors_per_transfer",
    "kvsidecar_failures",
    "kvsidecar_ucx_emulation_detected",
    "kvsidecar_gpu_launches",
    "kvsidecar_nixl_held",
    "kvsidecar_nixl_release_failures",
    "kvsidecar_nixl_lone_polls",
)
# A family as it crosses the pipe: name, type, help, samples (name, labels, value).
Family = tuple[str, str, str, list[tuple[str, dict[str, str], float]]]


class OkPull(NamedTuple):
    """A path's series that a pull which ended well moves."""

    pulls: Counter  # not `count`, which a tuple has already
    bytes: Counter
    duration: Histogram
    throughput: Histogram

    def moved(self, nbytes: int, elapsed_s: float) -> None:
        """One pull that moved `nbytes` in `elapsed_s` (counted after its answer: ~6 us a pull)."""
        self.pulls.inc()
        self.bytes.inc(nbytes)
        self.duration.observe(elapsed_s)
        self.throughput.observe(nbytes / elapsed_s if elapsed_s > 0 else 0)


class Metrics:
    """One registry per sidecar (tests run several sidecars in one process)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.pulls = Counter(
            "kvsidecar_pulls", "Pulls finished, by path and outcome", ["path", "outcome"], registry=r
        )
        self.pull_bytes = Counter(
            "kvsidecar_pull_bytes", "Bytes written into local KV blocks", ["path"], registry=r
        )
        self.pull_duration = Histogram(
            "kvsidecar_pull_duration_seconds", "Pull latency", ["path"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.pull_throughput = Histogram(
            "kvsidecar_pull_throughput_bytes_per_second",
            "Per-pull throughput",
            ["path"],
            buckets=_THROUGHPUT_BUCKETS,
            registry=r,
        )
        for path in PATHS:
            self.pull_bytes.labels(path)
            for outcome in OUTCOMES:
                self.pulls.labels(path, outcome)
        self._ok_pulls: dict[str, OkPull] = {}
        self.nixl_descriptors = Histogram(
            "kvsidecar_nixl_descriptors_per_transfer",
            "NIXL descriptors per transfer",
            buckets=_SIZE_BUCKETS,
            registry=r,
        )
        self.handshakes = Counter(
            "kvsidecar_handshakes", "Handshakes with peer sidecars", ["outcome"], registry=r
        )
        self.handshake_duration = Histogram(
            "kvsidecar_handshake_duration_seconds", "Handshake latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.opens = Counter(
            "kvsidecar_peer_opens",
            "Requests this sidecar opened on a source sidecar before reading them, by how the source "
            "answered: a NIXL notification, or the OpenRead call",
            ["by"],
            registry=r,
        )
        self.done_notifications = Counter(
            "kvsidecar_done_notifications_received",
            "Source side: done notifications received from readers, each of one request and rank, or "
            "joined (a PullBatch's members that ended together, several requests in one)",
            ["form"],
            registry=r,
        )
        for form in ("one", "joined"):
            self.done_notifications.labels(form)
        self.push_starts = Counter(
            "kvsidecar_push_starts",
            "Staged transfers this sidecar sent, by what started them: the reader's NIXL notification "
            "or its Push call",
            ["by"],
            registry=r,
        )
        self.push_calls = Counter(
            "kvsidecar_push_calls",
            "Push calls this sidecar made as a reader, by why: no_key (the source gave no push key), "
            "slow (the notified transfer had not finished 5 ms, under load up to 100 ms, after its notification), stop "
            "(the reader gave a notified transfer up before its call went out)",
            ["why"],
            registry=r,
        )
        self.lease_expiries = Counter(
            "kvsidecar_lease_expiries", "Published requests whose lease expired", registry=r
        )
        self.registered_engines = Gauge(
            "kvsidecar_registered_engines", "Engines with a registered rank", registry=r
        )
        self.registered_ranks = Gauge("kvsidecar_registered_ranks", "Registered engine ranks", registry=r)
        self.host_ranks_leaving = Gauge(
            "kvsidecar_host_ranks_leaving",
            "Host ranks whose engine left, still mapped while a copy or a peer's READ may use them",
            registry=r,
        )
        self.published_requests = Gauge(
            "kvsidecar_published_requests", "Requests held for readers", registry=r
        )
        self.staging_in_use = Gauge("kvsidecar_staging_bytes_in_use", "Staging bytes in use", registry=r)
        self.staging_capacity = Gauge("kvsidecar_staging_bytes_capacity", "Staging bytes owned", registry=r)
        self.inflight = Gauge("kvsidecar_inflight_transfers", "Pulls in progress", registry=r)
        self.pull_batch_pulls = Histogram(
            "kvsidecar_pull_batch_pulls",
            "Pulls per PullBatch call (its members also count in kvsidecar_pulls_total)",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.staged_transfer_reads = Histogram(
            "kvsidecar_staged_transfer_reads",
            "Reads per staged transfer this sidecar received (more than 1: reads of other requests between "
            "the same two ranks went as one transfer; staged_group_reads)",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.engine_lane_connections = Gauge(
            "kvsidecar_engine_lane_connections", "Open connections to the engine lane", registry=r
        )
        self.failures = Counter("kvsidecar_failures", "Failed operations by reason", ["reason"], registry=r)
        self.publishes_refused = Counter(
            "kvsidecar_publishes_refused",
            "Publishes refused, by the status code (lower case): requests their decode engines compute",
            ["reason"],
            registry=r,
        )
        self.worker_restarts = Counter(
            "kvsidecar_worker_restarts",
            "Data-plane worker processes (device_workers, staged_workers) started again after they died, by device "
            "(-1: the host)",
            ["device"],
            registry=r,
        )
        self.gpu_memory = Gauge("kvsidecar_gpu_memory_bytes", "GPU memory held by the sidecar", registry=r)
        self.gpu_mps = Gauge(
            "kvsidecar_gpu_mps",
            "1 where the sidecar's CUDA contexts on the GPU are clients of CUDA MPS (its copies run beside the "
            "engines' kernels), 0 where they take turns with them by time slices; per GPU the sidecar serves",
            ["device"],
            registry=r,
        )
        self.ucx_emulation = Counter(
            "kvsidecar_ucx_emulation_detected",
            "Transfers UCX could not do natively while TCP emulation is disabled: failed VRAM WRITEs (source), "
            "host pulls whose peer answers but whose READs cannot start (reader)",
            registry=r,
        )
        # What the NIXL agent holds; bound to the driver by bind_nixl (flat under steady load).
        self.nixl_held = Gauge(
            "kvsidecar_nixl_held",
            "NIXL objects the agent holds now: registrations, prepped dlists, remote agents, "
            "transfer handles not yet released",
            ["kind"],
            registry=r,
        )
        self.nixl_release_failures = Gauge(
            "kvsidecar_nixl_release_failures",
            "Transfer handles NIXL refused to release (left for NIXL to free at exit)",
            registry=r,
        )

    def pull_ok(self, path: str) -> OkPull:
        """The series of a pull on `path` that ended well, looked up once (labels() costs ~2 us a call)."""
        series = self._ok_pulls.get(path)
        if series is None:
            series = OkPull(
                self.pulls.labels(path, "ok"),
                self.pull_bytes.labels(path),
                self.pull_duration.labels(path),
                self.pull_throughput.labels(path),
            )
            self._ok_pulls[path] = series
        return series

    def bind_gpu_launches(self, counts: Callable[[], dict[str, int]]) -> None:
        """Expose the GPU copy kernel's launches by how they were made (counted by the launcher)."""
        self.registry.register(_GpuLaunches(counts))

    def bind_workers(self, families: Callable[[], dict[int, list[Family]]]) -> None:
        """Expose what the data-plane workers count (`worker_families`, asked at each scrape: device ->
        families) as kvsidecar_worker_<name>{device}: their rings, WRITEs, failures, kernel launches and
        NIXL objects are not in this registry's series."""
        self.registry.register(_WorkerMetrics(families))

    def worker_families(self) -> list[Family]:
        """A worker process's side: its `WORKER_FAMILIES`, plain data for the pipe."""
        out: list[Family] = []
        for m in self.registry.collect():
            if m.name in WORKER_FAMILIES:
                samples = [
                    (x.name, dict(x.labels), x.value) for x in m.samples if not x.name.endswith("_created")
                ]
                out.append((m.name, m.type, m.documentation, samples))
        return out

    def bind_registry(self, ranks: Callable[[], list[Any]], published: Callable[[], int]) -> None:
        """Registered ranks and engines, and published requests, read when scraped: always current,
        and no component has to remember to refresh them (`ranks()` returns the ranks' entries)."""
        self.registered_ranks.set_function(lambda: len(ranks()))
        self.registered_engines.set_function(lambda: len({e.engine_id for e in ranks()}))
        self.published_requests.set_function(published)

    def bind_nixl(self, counts: Callable[[], dict[str, int]]) -> None:
        for kind in ("registrations", "dlists", "remote_agents", "transfers_open"):
            self.nixl_held.labels(kind).set_function(functools.partial(_count_of, counts, kind))
        self.nixl_release_failures.set_function(lambda: counts()["release_failures"])
        self.registry.register(_LonePolls(counts))


class _LonePolls(Collector):
    """kvsidecar_nixl_lone_polls_total: read from the NIXL driver's own count at each scrape."""

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "kvsidecar_nixl_lone_polls",
            "Polls of the NIXL thread at nixl_lone_poll_us: while its only staged transfer was one of "
            "several chunks (a large pull alone); the others wait nixl_busy_poll_us",
            value=self._counts()["lone_polls"],
        )


class _GpuLaunches(Collector):
    """kvsidecar_gpu_launches_total{by}: read from the launcher's own counts at each scrape."""

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "kvsidecar_gpu_launches",
            "GPU copy kernel launches, by how they were made: direct (the compiled kernel's launcher) or "
            "triton (Triton's Python launcher: first launches, launch hooks, Triton releases without direct "
            "launches)",
            labels=["by"],
        )
        counts = self._counts()
        for by in ("direct", "triton"):
            family.add_metric([by], counts.get(by, 0))
        yield family


class _WorkerMetrics(Collector):
    """kvsidecar_worker_<name>{device, ...}: each worker's `WORKER_FAMILIES`, from the worker at each
    scrape (a worker that does not answer in time is left out of that scrape)."""

    def __init__(self, families: Callable[[], dict[int, list[Family]]]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for device, families in sorted(self._families().items()):
            for name, typ, doc, samples in families:
                new = _worker_name(name)
                m = merged.get(new)
                if m is None:
                    m = merged[new] = Metric(
                        new, f"{doc} (in the data-plane workers, by device; -1: host)", typ
                    )
                for sample, labels, value in samples:
                    m.add_sample(_worker_name(sample), {"device": str(device), **labels}, value)
        yield from merged.values()


def _worker_name(name: str) -> str:
    return "kvsidecar_worker_" + name.removeprefix("kvsidecar_")


def _count_of(counts: Callable[[], dict[str, int]], kind: str) -> int:
    return counts()[kind]
