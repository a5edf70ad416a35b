"""The front door's /metrics: every shard's series, each with a `shard` label, and the shards' own state.

Prometheus scrapes one port per node sidecar, as without shards; the front door reads each shard's
exposition over loopback when it is scraped, so the numbers are the shards' own (no copy to go stale).
A shard that does not answer in time is left out of that scrape, and `kvsidecar_shard_up` says so.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from kv_sidecar.shards.children import Shard

SCRAPE_TIMEOUT_S = 2.0


class ShardMetrics(Collector):
    def __init__(self, shards: list[Shard], host: str) -> None:
        """`host`: where the shards' metrics listen, seen from here."""
        self._shards = shards
        self._host = host

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "kvsidecar_shard_up", "1 while the shard runs and its metrics answer", labels=["shard"]
        )
        restarts = GaugeMetricFamily(
            "kvsidecar_shard_restarts", "times the shard was started again after it died", labels=["shard"]
        )
        merged: dict[str, Metric] = {}
        for shard in self._shards:
            label = str(shard.index)
            restarts.add_metric([label], shard.restarts)
            info = shard.info
            text = None
            if info is not None and info.metrics_port > 0:
                try:
                    text = _read_url(f"http://{self._host}:{info.metrics_port}/metrics")
                except OSError:
                    text = None
            up.add_metric([label], 1.0 if text is not None else 0.0)
            if text is None:
                continue
            for family in text_string_to_metric_families(text):
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                into.samples += [s._replace(labels={**s.labels, "shard": label}) for s in family.samples]
        yield up
        yield restarts
        yield from merged.values()


def _read_url(url: str) -> str:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as answer:
        return answer.read().decode()
