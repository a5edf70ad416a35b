"""EngineService: the thin client's API (pod-local, on a unix socket). Decodes, calls the core
(server/engine_calls.py), encodes."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator

import grpc

from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.mailbox import Mailbox
from kv_sidecar.server.adapters.grpc_status import rpc, stream_rpc
from kv_sidecar.server.engine_calls import EngineCalls
from kv_sidecar_client._proto.kvsidecar.v1 import engine_pb2, engine_pb2_grpc, status_pb2

log = logging.getLogger(__name__)


# The most "consumed" events one message carries (a PullBatch's members, released together), and the most
# bytes: an event names the request's blocks, and a client receives at most 4 MiB a message by default.
MAX_CONSUMED_PER_MESSAGE = 256
MAX_CONSUMED_BYTES = 1 << 20


def stream_messages(
    first: engine_pb2.Event | None, events: Mailbox[engine_pb2.Event | None], batched: bool
) -> list[engine_pb2.Event | None]:
    """What an Events stream sends for `first` and what is waiting behind it, in order (None: the
    rank was unregistered, the end). For a stream opened `batched`, "consumed" events already waiting
    go as one `consumed_many`: each streamed message cost the sidecar ~57 us of CPU, 16 in one ~9 us
    each (the CPU machine), and a PullBatch's members end together. Waits for nothing more."""
    if not batched or first is None or first.WhichOneof("kind") != "consumed":
        return [first]
    run = [first.consumed]
    size = first.consumed.ByteSize()
    after: list[engine_pb2.Event | None] = []
    while len(run) < MAX_CONSUMED_PER_MESSAGE:
        try:
            event = events.get_nowait()
        except queue.Empty:
            break
        if event is None or event.WhichOneof("kind") != "consumed":
            after.append(event)  # sent after the run, so that the order holds
            break
        size += event.consumed.ByteSize()
        if size > MAX_CONSUMED_BYTES:
            after.append(event)  # alone, after the run: as large as it was before runs
            break
        run.append(event.consumed)
    if len(run) == 1:
        return [first, *after]
    return [engine_pb2.Event(consumed_many=engine_pb2.RequestsConsumed(requests=run)), *after]


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    def __init__(
        self, calls: EngineCalls, status: Callable[[], status_pb2.StatusResponse], engine_workers: int
    ) -> None:
        self._calls = calls
        self._status = status
        # A sync gRPC server runs each Events stream on one engine_workers thread for the rank's life:
        # at most this many streams, so that register/publish/pull calls always find a thread.
        self._workers = engine_workers
        self._stream_limit = engine_workers - max(4, engine_workers // 4)
        self._streams = 0
        self._streams_lock = threading.Lock()

    @rpc
    def RegisterRank(
        self, request: engine_pb2.RegisterRankRequest, context: grpc.ServicerContext
    ) -> engine_pb2.RegisterRankResponse:
        spec = request.spec if request.HasField("spec") else None
        return self._calls.register_rank(
            request.engine_id, request.rank, spec, request.tensors, request.leader_address
        )

    @rpc
    def UnregisterRank(
        self, request: engine_pb2.UnregisterRankRequest, context: grpc.ServicerContext
    ) -> engine_pb2.UnregisterRankResponse:
        self._calls.unregister(request.engine_id, request.rank)
        return engine_pb2.UnregisterRankResponse()

    @stream_rpc
    def Events(
        self, request: engine_pb2.EventsRequest, context: grpc.ServicerContext
    ) -> Iterator[engine_pb2.Event]:
        entry = self._calls.rank(request.engine_id, request.rank)
        with self._streams_lock:
            if self._streams >= self._stream_limit:
                raise SidecarError(
                    Code.RESOURCE_EXHAUSTED,
                    f"{self._streams} event streams are open, the most this sidecar takes: each holds one "
                    f"of its {self._workers} engine_workers threads, and the rest are kept for "
                    f"register, publish and pull calls; raise engine_workers",
                )
            self._streams += 1
        closed = threading.Event()
        context.add_callback(closed.set)
        entry.sessions += 1
        try:
            yield engine_pb2.Event(ready=True)
            while not closed.is_set() and context.is_active():
                try:
                    event = entry.events.get(timeout=0.2)
                except queue.Empty:
                    continue
                for message in stream_messages(event, entry.events, request.batched):
                    if message is None:
                        return  # unregistered
                    yield message
        finally:
            entry.sessions -= 1
            with self._streams_lock:
                self._streams -= 1
            if request.unregister_on_close and closed.is_set():
                try:
                    if self._calls.rank(request.engine_id, request.rank) is entry:
                        log.warning(
                            "session of engine %s rank %d ended: unregistering it",
                            request.engine_id,
                            request.rank,
                        )
                        self._calls.unregister(request.engine_id, request.rank)
                except SidecarError:
                    pass

    @rpc
    def Publish(
        self, request: engine_pb2.PublishRequest, context: grpc.ServicerContext
    ) -> engine_pb2.PublishResponse:
        return self._calls.publish(request)

    @rpc
    def Pull(self, request: engine_pb2.PullRequest, context: grpc.ServicerContext) -> engine_pb2.PullResponse:
        return self._calls.pull(request, context.add_callback)

    @rpc
    def PullBatch(
        self, request: engine_pb2.PullBatchRequest, context: grpc.ServicerContext
    ) -> engine_pb2.PullBatchResponse:
        return self._calls.pull_batch(request, context.add_callback)

    @rpc
    def KeepAlive(
        self, request: engine_pb2.KeepAliveRequest, context: grpc.ServicerContext
    ) -> engine_pb2.KeepAliveResponse:
        return engine_pb2.KeepAliveResponse(lease_deadline_unix_ms=self._calls.keep_alive(request.params))

    @rpc
    def Abort(
        self, request: engine_pb2.AbortRequest, context: grpc.ServicerContext
    ) -> engine_pb2.AbortResponse:
        params = request.params if request.HasField("params") else None
        return engine_pb2.AbortResponse(
            found=self._calls.abort(request.engine_id, request.request_id, params)
        )

    @rpc
    def Status(
        self, request: status_pb2.StatusRequest, context: grpc.ServicerContext
    ) -> status_pb2.StatusResponse:
        return self._status()

    def Route(
        self, request: engine_pb2.RouteRequest, context: grpc.ServicerContext
    ) -> engine_pb2.RouteResponse:
        """A sidecar without control shards serves every engine itself (an empty target)."""
        return engine_pb2.RouteResponse()
