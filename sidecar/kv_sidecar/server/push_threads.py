"""The threads the staged protocol's control runs on: a reader's Push calls, a source's transfers
started by notification, and what a Publish does to get ready for a staged reader."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from kv_sidecar.config import Settings
from kv_sidecar.dataplane.plane import DataPlane
from kv_sidecar.server.push_runs import PushRuns

if TYPE_CHECKING:
    from kv_sidecar.server.engines import RankEntry
    from kv_sidecar.server.published import Published

T = TypeVar("T")
_CALL_START_WAIT_S = 0.002


class PushThreads:
    """Threads kept for Push calls and the transfers they run, created on first use."""

    def __init__(self, settings: Settings, plane: DataPlane, push_runs: PushRuns) -> None:
        """settings: engine_workers (how many threads call and serve Pushes) and push_notifications."""
        self._settings = settings
        self._plane = plane
        self._push_runs = push_runs
        self._lock = threading.Lock()
        self._callers: ThreadPoolExecutor | None = None
        self._sources: ThreadPoolExecutor | None = None

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Run a blocking peer call (a reader's Push) on a thread kept for that, and return its future.

        Not `stub.Method.future()`: gRPC starts a new thread for every such call made on a channel
        with no other call of that kind in flight (its "channel spin" thread), which cost a
        one-block staged pull ~0.6-1.3 ms on 2 shared cores. Threads here are kept and reused.

        Returns once that thread runs the call (at most 2 ms): the caller goes on to prepare its
        copies, holding the GIL between CUDA calls, and the request would leave only after it.
        """
        started = threading.Event()

        def run() -> T:
            started.set()
            return fn(*args, **kwargs)

        with self._lock:
            if self._callers is None:
                self._callers = ThreadPoolExecutor(
                    max_workers=max(8, self._settings.engine_workers), thread_name_prefix="push"
                )
            future = self._callers.submit(run)
        started.wait(_CALL_START_WAIT_S)
        return future

    def expect_read(self, item: Published, entries: Iterable[RankEntry]) -> None:
        """`item` was just published here. If staged readers read from this sidecar lately, get ready
        for one: upload its ids to its GPUs (`DataPlane.prefetch_ids`) and poll for its Push
        notification at the serving rate.
        Otherwise do neither: a sidecar whose readers are all on its node (gpu-direct) would pay for
        them on every pull, the polling's GIL hand-offs most (~0.1 ms a pull, docs/benchmarks.md)."""
        runs = self._push_runs
        if not runs.readers_lately():
            return
        ranks = [e.key for e in entries if e.on_gpu and (item.ranks is None or e.rank in item.ranks)]
        self._plane.prefetch_ids((item.engine_id, item.request_id), item.source_blocks, ranks)
        if self._settings.push_notifications:
            runs.touch()

    def run_source(self, fn: Callable[[], None]) -> None:
        """Run a source's transfer (its whole Push) on a kept thread: the NIXL thread that received its
        notification must not block on it. With every thread busy (most of them waiting for send
        slots) it waits its turn in the pool's queue, as its call would wait for slots; dropping it
        would cost its reader CALL_AFTER_S, until its call started it. Only readers holding a push
        key queue here, each at most as many transfers as it has receive slots."""
        with self._lock:
            if self._sources is None:
                self._sources = ThreadPoolExecutor(
                    max_workers=self._source_threads(), thread_name_prefix="push-source"
                )
            self._sources.submit(fn)

    def _source_threads(self) -> int:
        return max(8, self._settings.engine_workers // 4)

    def close(self) -> None:
        with self._lock:
            pools = [self._callers, self._sources]
            self._callers = self._sources = None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
