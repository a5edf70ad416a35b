"""A process's Prometheus samples, as tests and benchmarks read a sidecar's (or a vLLM server's) /metrics:
one reader, prometheus_client's own parser, instead of a regex per caller."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def samples(port: int, timeout_s: float = 10) -> list[Sample]:
    """Every sample that http://127.0.0.1:port/metrics exposes now."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as resp:
        text = resp.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(port: int, name: str, **labels: str) -> float:
    """The sum of the samples called `name` (as exposed: with `_total`, `_count`, `_sum`) whose labels
    include these; 0 where there is none."""
    return sum(
        s.value
        for s in samples(port)
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def present(port: int, name: str) -> bool:
    """Whether the process exposes a sample called `name` (an older revision may not)."""
    return any(s.name == name for s in samples(port))


def labels(exposed: str) -> dict[str, str]:
    """Labels written as /metrics shows them (`{reason="x",path="y"}`), as keyword arguments for `value`."""
    return dict(re.findall(r'(\w+)="([^"]*)"', exposed))
