"""Pulls that the caller's own thread drives by polling: no other Python thread touches them.

An engine's loop (vLLM's scheduler and workers) keeps the GIL busy. A pull
answered on another Python thread (the sync client's future, a worker pool)
waits for the GIL at every hand-off, up to a switch interval (5 ms) each: a
one-block pull measured 13-15 ms next to a busy loop instead of 4 ms idle.
Here the calls run on a private asyncio loop (grpc.aio) that `poll()` advances
one pass at a time from the caller's thread; gRPC's core receives the answer
on its own (C++) thread, so no Python thread switch is on the pull's path.
Where the sidecar serves an engine lane (lane.py), pulls go there instead:
the answer waits in a plain socket that `done()` polls, with no loop at all.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc

from kv_sidecar_client._proto.kvsidecar.v1 import engine_pb2, engine_pb2_grpc
from kv_sidecar_client.client import (
    PULL_GRACE_S,
    BatchPull,
    PullResult,
    TransferParams,
    pull_request,
    start_batch,
    start_lane_pull,
    target_of,
)
from kv_sidecar_client.lane import lane_for
from kv_sidecar_client.results import (
    PendingBatch,
    PendingPull,
    WholeBatch,
    batch_failed,
    batch_results,
    pull_failure,
    pull_success,
)

_local = threading.local()


def _thread_loop() -> asyncio.AbstractEventLoop:
    """One loop per thread, shared by its channels: grpc.aio binds itself to the first loop it runs on."""
    loop = getattr(_local, "loop", None)
    if loop is None or loop.is_closed():
        loop = _local.loop = asyncio.new_event_loop()
    return loop


class _PolledCall:
    """A call in flight on the loop, done when a poll sees its task finish."""

    def __init__(self, owner: PolledPulls, task: asyncio.Task[Any]) -> None:
        self._owner = owner
        self._task = task
        self.done_at = 0.0  # time.monotonic() of the poll that saw it finish
        task.add_done_callback(lambda _: setattr(self, "done_at", time.monotonic()))

    def done(self) -> bool:
        return self._task.done()

    def cancel(self) -> None:
        """Give up; the sidecar stops the call's pulls and releases the source blocks."""
        self._task.cancel()
        self._owner.poll()

    def _outcome(self) -> tuple[Any, str, str, Any]:
        """(the answer, or None with the failure's code, message and trailers); runs the loop until done."""
        if not self._task.done():
            self._owner.wait(self._task)
        if self._task.cancelled():
            return None, "CANCELLED", "cancelled", ()
        exc = self._task.exception()
        if isinstance(exc, grpc.aio.AioRpcError):
            return None, exc.code().name, exc.details() or "", exc.trailing_metadata()
        if exc is not None:
            return None, "UNKNOWN", str(exc), ()
        return self._task.result(), "", "", ()


class PolledPull(_PolledCall):
    """One pull in flight; `done()` and `result()` as on a future."""

    def __init__(self, owner: PolledPulls, task: asyncio.Task[Any], block_ids: list[int]) -> None:
        super().__init__(owner, task)
        self._block_ids = block_ids

    def result(self) -> PullResult:
        """The outcome (runs the loop until it is there). Never raises for a failed transfer."""
        resp, code, message, trailers = self._outcome()
        if resp is None:
            return pull_failure(code, message, trailers, self._block_ids)
        return pull_success(resp)


class PolledBatch(_PolledCall, WholeBatch):
    """A PullBatch in flight on the loop (a PendingBatch)."""

    def __init__(self, owner: PolledPulls, task: asyncio.Task[Any], blocks: list[list[int]]) -> None:
        super().__init__(owner, task)
        self._blocks = blocks

    def results(self) -> list[PullResult]:
        resp, code, message, _ = self._outcome()
        if resp is None:
            return batch_failed(code, message, self._blocks)
        return batch_results(resp.outcomes, self._blocks)


class PolledPulls:
    """A grpc.aio channel to a sidecar's engine socket on a loop that only `poll()` runs."""

    def __init__(self, target: str, lane: bool | None = None) -> None:
        """`lane`: pulls go over the sidecar's engine lane when it serves one (as SidecarClient's)."""
        self.lane = lane_for(target_of(target), lane)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError(
                "PolledPulls needs a thread with no running asyncio loop; use SidecarClient.pull_async"
            )
        self._loop = _thread_loop()
        self._channel: grpc.aio.Channel = self._loop.run_until_complete(self._open(target_of(target)))
        self._stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    @staticmethod
    async def _open(target: str) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(target)

    def start(
        self,
        params: TransferParams,
        engine_id: str,
        block_ids: Sequence[int],
        ranks: Sequence[int] = (),
        start_token: int = 0,
        timeout_s: float = 30.0,
        group: int | None = None,
    ) -> PendingPull:
        req = pull_request(params, engine_id, block_ids, ranks, start_token, timeout_s, group)
        if self.lane is not None:
            pending = start_lane_pull(self.lane, req, timeout_s)
            if pending is not None:
                return pending

        async def call() -> Any:
            return await self._stub.Pull(req, timeout=timeout_s + PULL_GRACE_S)

        pull = PolledPull(self, self._run(call()), list(block_ids))
        self.poll()  # send it now
        return pull

    def start_batch(
        self, engine_id: str, pulls: Sequence[BatchPull], timeout_s: float = 30.0
    ) -> list[PendingPull]:
        """Many pulls in one PullBatch call: a PendingPull per member (see client.start_batch)."""

        def over_grpc(req: engine_pb2.PullBatchRequest, blocks: list[list[int]]) -> PendingBatch:
            async def call() -> Any:
                return await self._stub.PullBatch(req, timeout=timeout_s + PULL_GRACE_S)

            batch = PolledBatch(self, self._run(call()), blocks)
            self.poll()  # send it now
            return batch

        return start_batch(self.lane, engine_id, pulls, timeout_s, over_grpc)

    def _run(self, coro: Any) -> asyncio.Task[Any]:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def poll(self) -> None:
        """One pass of the loop: send what is queued, take in what has arrived. Does not block."""
        self._loop.run_until_complete(asyncio.sleep(0))

    def wait(self, task: asyncio.Task[Any]) -> None:

        async def until_done() -> None:
            await asyncio.wait([task])

        self._loop.run_until_complete(until_done())

    def close(self) -> None:
        """Cancel this channel's pulls in flight and close it (the thread's loop stays for others)."""
        if self._closed:
            return
        self._closed = True
        if self.lane is not None:
            self.lane.close()
        pending = [t for t in self._tasks if not t.done()]
        for t in pending:
            t.cancel()

        async def drain() -> None:
            await asyncio.gather(*pending, return_exceptions=True)
            await self._channel.close()

        self._loop.run_until_complete(drain())
