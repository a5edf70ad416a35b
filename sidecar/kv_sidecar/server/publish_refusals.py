"""Publishes this sidecar refused, by engine and reason: each one is a request whose decode engine
computes it itself, which an operator must be able to see (the metric, `kv-sidecar status`)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kv_sidecar.errors import SidecarError
from kv_sidecar.metrics import Metrics

MAX_KEPT = 256  # (engine, reason) pairs kept for the status: the oldest go first; the metric keeps counting


@dataclass
class Refusals:
    engine_id: str
    reason: str
    count: int
    last_message: str
    last_unix_s: float


class PublishRefusals:
    def __init__(self, metrics: Metrics, clock: Callable[[], float] = time.time) -> None:
        self._metrics = metrics
        self._clock = clock
        self._lock = threading.Lock()
        self._kept: OrderedDict[tuple[str, str], Refusals] = OrderedDict()

    def record(self, engine_id: str, err: SidecarError) -> None:
        reason = err.code.name.lower()
        self._metrics.publishes_refused.labels(reason).inc()
        with self._lock:
            kept = self._kept.pop((engine_id, reason), None) or Refusals(engine_id, reason, 0, "", 0.0)
            kept.count += 1
            kept.last_message, kept.last_unix_s = err.message, self._clock()
            self._kept[(engine_id, reason)] = kept  # most recent last
            while len(self._kept) > MAX_KEPT:
                self._kept.popitem(last=False)

    def snapshot(self) -> list[Refusals]:
        """Most recent last."""
        with self._lock:
            return [Refusals(**vars(r)) for r in self._kept.values()]
