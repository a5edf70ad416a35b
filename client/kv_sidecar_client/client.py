"""The engine-side thin client: a few calls over the sidecar's unix socket (Publish and Pull over its
engine lane when the sidecar serves one: lane.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import json_format

from kv_sidecar_client._proto.kvsidecar.v1 import common_pb2, engine_pb2, status_pb2
from kv_sidecar_client.lane import Lane, LaneBatch, LanePull, raise_for_answer
from kv_sidecar_client.results import (
    BatchMember,
    EndedPull,
    KVSidecarError,
    PendingBatch,
    PendingPull,
    PullResult,
    WholeBatch,
    batch_failed,
    batch_results,
    pull_failure,
    pull_success,
)
from kv_sidecar_client.routes import Conn, Routes

__all__ = ["BatchPull", "KVSidecarError", "PendingPull", "PullResult", "pull_failure"]

DEFAULT_SOCKET = "/run/kv-sidecar/engine.sock"
TransferParams = common_pb2.TransferParams
EngineSpec = common_pb2.EngineSpec
TensorHandle = common_pb2.TensorHandle


# How gRPC says that it reached no sidecar at all (its words, not the sidecar's).
_NO_CONNECTION = "failed to connect to all addresses"


def _error(e: grpc.RpcError, target: str = "") -> KVSidecarError:
    """`target`: the sidecar called, named where gRPC reached none there (a sidecar down or restarting),
    as the engine's operator needs to know which."""
    if isinstance(e, grpc.Call):
        details = e.details() or ""
        if target and e.code() == grpc.StatusCode.UNAVAILABLE and details.startswith(_NO_CONNECTION):
            details = f"sidecar at {target} is not reachable (not running, or restarting): {details}"
        return KVSidecarError(e.code().name, details)
    return KVSidecarError("UNKNOWN", str(e))


def target_of(target: str) -> str:
    """A gRPC target: a bare path is a unix socket."""
    if "://" not in target and not target.startswith("unix:") and ":" not in target:
        return f"unix:{target}"
    return target


# The sidecar times out a pull first, with details; the client's own deadline is this much later and
# only covers a sidecar that went silent.
PULL_GRACE_S = 5.0


def pull_request(
    params: TransferParams,
    engine_id: str,
    block_ids: Sequence[int],
    ranks: Sequence[int],
    start_token: int,
    timeout_s: float,
    group: int | None = None,
) -> engine_pb2.PullRequest:
    """The Pull call's request (the sync, future and polled clients send the same one). `group`: the KV
    cache group of a hybrid model the pull fills (needed where the sidecar converts Mamba state)."""
    return engine_pb2.PullRequest(
        params=params,
        engine_id=engine_id,
        ranks=list(ranks),
        block_ids=list(block_ids),
        start_token=start_token,
        timeout_ms=int(timeout_s * 1000),
        group=group,
    )


@dataclass(frozen=True)
class BatchPull:
    """One member of SidecarClient.pull_batch: what `pull` takes for one request."""

    params: TransferParams
    block_ids: Sequence[int]
    ranks: Sequence[int] = ()
    start_token: int = 0
    group: int | None = None


def start_batch(
    lane: Lane | None,
    engine_id: str,
    pulls: Sequence[BatchPull],
    timeout_s: float,
    over_grpc: Callable[[engine_pb2.PullBatchRequest, list[list[int]]], PendingBatch],
) -> list[PendingPull]:
    """A PullBatch sent over the engine lane (members' outcomes streamed as they end), or, where the
    lane does not take it, by `over_grpc` (the request, each member's blocks); a PendingPull per member.
    Cancelling one cancels the batch (they share one call); to stop one member, `abort` its request."""
    req = engine_pb2.PullBatchRequest(
        pulls=[
            pull_request(m.params, engine_id, m.block_ids, m.ranks, m.start_token, timeout_s, m.group)
            for m in pulls
        ]
    )
    blocks = [list(m.block_ids) for m in pulls]
    batch: PendingBatch | None = None
    if lane is not None:
        streamed = engine_pb2.PullBatchRequest(pulls=req.pulls, stream_outcomes=True, group_outcomes=True)
        conn = lane.send(engine_pb2.LaneCall(pull_batch=streamed))
        if conn is not None:
            batch = LaneBatch(lane, conn, blocks, time.monotonic() + timeout_s + PULL_GRACE_S)
    if batch is None:
        batch = over_grpc(req, blocks)
    return [BatchMember(batch, i) for i in range(len(blocks))]


def start_lane_pull(lane: Lane, request: engine_pb2.PullRequest, timeout_s: float) -> LanePull | None:
    """Send a Pull over the engine lane; None: it goes over gRPC."""
    conn = lane.send(engine_pb2.LaneCall(pull=request))
    if conn is None:
        return None
    return LanePull(lane, conn, list(request.block_ids), time.monotonic() + timeout_s + PULL_GRACE_S)


def params_to_json(params: TransferParams) -> str:
    """Transfer params as JSON, to carry through a router (kv_transfer_params)."""
    return json_format.MessageToJson(params, indent=None, preserving_proto_field_name=True)


def params_from_json(text: str | Mapping[str, Any]) -> TransferParams:
    """Params a router carried; fields this client does not know (a newer prefill sidecar's) are left
    out rather than refused, so that a decode side upgraded later still pulls."""
    msg = TransferParams()
    if isinstance(text, str):
        json_format.Parse(text, msg, ignore_unknown_fields=True)
    else:
        json_format.ParseDict(dict(text), msg, ignore_unknown_fields=True)
    return msg


def spec_message(spec: Mapping[str, Any] | EngineSpec) -> EngineSpec:
    if isinstance(spec, EngineSpec):
        return spec
    d = dict(spec)
    if d.get("kernel_block_size") is None:
        d.pop("kernel_block_size", None)
    groups = [common_pb2.KVCacheGroup(**g) for g in d.pop("groups", None) or ()]
    return EngineSpec(**d, groups=groups)


@dataclass
class Event:
    # "ready" | "consumed" | "lease_expired" | "released"; EngineSession adds "reconnected"
    kind: str
    request_id: str = ""
    block_ids: list[int] = field(default_factory=list)
    reason: str = ""  # "released": why the reader gave the request up


class _FutureCall:
    """A call in flight over gRPC, as a future."""

    def __init__(self, future: Any) -> None:
        self._future = future
        self.done_at = 0.0  # time.monotonic() when the answer arrived
        future.add_done_callback(self._stamp)

    def _stamp(self, _: Any) -> None:
        self.done_at = time.monotonic()

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> None:
        """Give up waiting; the sidecar stops the call's pulls and releases the source blocks."""
        self._future.cancel()


class PullCall(_FutureCall):
    """A pull in flight (SidecarClient.pull_async)."""

    def __init__(self, future: Any, block_ids: list[int], target: str = "") -> None:
        super().__init__(future)
        self._block_ids = block_ids
        self._target = target

    def result(self) -> PullResult:
        """The outcome (waits if not done). Never raises for a failed transfer: see PullResult."""
        try:
            resp = self._future.result()
        except grpc.FutureCancelledError:
            return PullResult(
                False, error_code="CANCELLED", error="cancelled", unfilled_blocks=self._block_ids
            )
        except grpc.RpcError as e:
            err = _error(e, self._target)
            trailers = e.trailing_metadata() if isinstance(e, grpc.Call) else ()
            return pull_failure(err.code, err.message, trailers, self._block_ids)
        return pull_success(resp)


class BatchCall(_FutureCall, WholeBatch):
    """A PullBatch in flight over gRPC (a PendingBatch)."""

    def __init__(self, future: Any, blocks: list[list[int]], target: str = "") -> None:
        super().__init__(future)
        self._blocks = blocks
        self._target = target

    def results(self) -> list[PullResult]:
        try:
            resp = self._future.result()
        except grpc.FutureCancelledError:
            return batch_failed("CANCELLED", "cancelled", self._blocks)
        except grpc.RpcError as e:
            err = _error(e, self._target)
            return batch_failed(err.code, err.message, self._blocks)
        return batch_results(resp.outcomes, self._blocks)


class EventStream:
    """Iterate events of one rank; close() ends the session."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> Iterator[Event]:
        try:
            for msg in self._call:
                kind = msg.WhichOneof("kind")
                if kind == "ready":
                    yield Event("ready")
                elif kind == "consumed_many":  # several at once, one event each here
                    for c in msg.consumed_many.requests:
                        yield Event("consumed", c.request_id, list(c.block_ids))
                else:
                    body = getattr(msg, kind)
                    yield Event(kind, body.request_id, list(body.block_ids), getattr(body, "reason", ""))
        except grpc.RpcError as e:
            if isinstance(e, grpc.Call) and e.code() == grpc.StatusCode.CANCELLED:
                return
            raise _error(e) from None

    def close(self) -> None:
        self._call.cancel()


def _grpc_batch(
    conn: Conn, timeout_s: float
) -> Callable[[engine_pb2.PullBatchRequest, list[list[int]]], PendingBatch]:
    """How `start_batch` sends a PullBatch to `conn` over gRPC, where the lane does not take it."""

    def over_grpc(req: engine_pb2.PullBatchRequest, blocks: list[list[int]]) -> PendingBatch:
        return BatchCall(
            conn.stub.PullBatch.future(req, timeout=timeout_s + PULL_GRACE_S), blocks, conn.target
        )

    return over_grpc


class SidecarClient:
    """Synchronous client. `target` is a unix socket path or a gRPC target string."""

    def __init__(
        self,
        target: str = DEFAULT_SOCKET,
        timeout_s: float = 30.0,
        channel_options: Sequence[tuple[str, Any]] = (),
        lane: bool | None = None,
        placement: str = "",
    ) -> None:
        """`lane`: send Publish and Pull over the sidecar's engine lane when it serves one (default:
        yes, unless the environment sets KV_SIDECAR_ENGINE_LANE=0). `placement`: where the sidecar runs
        control shards, host engines of this client that name the same key as others go to their shard
        (a P/D pair of one node: its pulls are then copies in one process); empty: by engine id."""
        self.target = target = target_of(target)
        self.timeout_s = timeout_s
        options = list(channel_options)
        home = Conn.open(target, options, lane)
        self.lane = home.lane
        # Where the sidecar given runs control shards, each engine's calls go to its shard (routes.py).
        self.routes = Routes(home, lambda shard: Conn.open(shard, options, lane), placement)

    def close(self) -> None:
        self.routes.close()
        self.routes.home.close()

    def _route(
        self,
        engine_id: str,
        rank: int | None = None,
        timeout_s: float | None = None,
        device_uuid: str = "",
        own_leader: bool = False,
    ) -> Conn:
        """The connection that serves `engine_id`'s `rank` (routes.py); KVSidecarError as a call's."""
        try:
            return self.routes.route(engine_id, rank, timeout_s or self.timeout_s, device_uuid, own_leader)
        except grpc.RpcError as e:
            raise _error(e, self.target) from None

    def engine_target(self, engine_id: str, rank: int | None = None) -> str:
        """The gRPC target that serves `engine_id` (its `rank`): the sidecar given, or its shard. For a
        client of one's own on the same sidecar (e.g. `PolledPulls`)."""
        return self._route(engine_id, rank).target

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Block until the sidecar's socket accepts connections."""
        try:
            grpc.channel_ready_future(self.routes.home.channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise KVSidecarError("UNAVAILABLE", f"sidecar at {self.target} is not reachable") from None

    def _call(
        self, method: str, request: Any, timeout_s: float | None = None, conn: Conn | None = None
    ) -> Any:
        """`conn`: the sidecar process to call (an engine's shard); default the one given."""
        conn = conn or self.routes.home
        try:
            return getattr(conn.stub, method)(request, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as e:
            raise _error(e, conn.target) from None

    # -- registration -------------------------------------------------------------
    def register_rank(
        self,
        engine_id: str,
        rank: int,
        spec: Mapping[str, Any] | EngineSpec,
        tensors: Sequence[TensorHandle],
        leader_address: str = "",
    ) -> engine_pb2.RegisterRankResponse:
        """`leader_address`: peer address of the engine's leader sidecar when its ranks span several nodes.
        On a front door of control shards the rank registers on its engine's shard (that of its rank 0's
        GPU), or, where the front door spreads ranks, on its own GPU's shard, led by its rank 0's."""
        tensors = list(tensors)
        device = next((t.cuda_ipc.device_uuid for t in tensors if t.HasField("cuda_ipc")), "")
        conn = self._route(engine_id, rank, None, device, bool(leader_address))
        leader_address = leader_address or self.routes.leader(engine_id, rank)
        req = engine_pb2.RegisterRankRequest(
            engine_id=engine_id,
            rank=rank,
            spec=spec_message(spec),
            tensors=tensors,
            leader_address=leader_address,
        )
        return self._call("RegisterRank", req, conn=conn)

    def unregister_rank(self, engine_id: str, rank: int) -> None:
        req = engine_pb2.UnregisterRankRequest(engine_id=engine_id, rank=rank)
        self._call("UnregisterRank", req, conn=self._route(engine_id, rank))

    def events(self, engine_id: str, rank: int, unregister_on_close: bool = True) -> EventStream:
        call = self._route(engine_id, rank).stub.Events(
            engine_pb2.EventsRequest(
                engine_id=engine_id, rank=rank, unregister_on_close=unregister_on_close, batched=True
            )
        )
        return EventStream(call)

    # -- prefill ----------------------------------------------------------------------
    def publish(
        self,
        engine_id: str,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        lease_ms: int = 0,
        timeout_s: float | None = None,
        first_token: int = 0,
    ) -> TransferParams:
        """`block_ids` hold tokens [first_token, num_tokens): all of them, or a sliding-window request's
        window from a block boundary (the blocks before it are not published). On a GPU, publish
        once the kernels that wrote them have completed: the sidecar's copies, in another process,
        see nothing still queued. `timeout_s`: how long to wait for the answer (default: the
        client's timeout)."""
        timeout_s = timeout_s or self.timeout_s
        deadline = time.monotonic() + timeout_s
        req = engine_pb2.PublishRequest(
            engine_id=engine_id,
            request_id=request_id,
            block_ids=list(block_ids),
            num_tokens=num_tokens,
            lease_ms=lease_ms,
            first_token=first_token,
        )
        conn = self._route(engine_id, None, timeout_s)
        if conn.lane is not None:
            answer = conn.lane.call(engine_pb2.LaneCall(publish=req), max(0.001, deadline - time.monotonic()))
            if answer is not None:
                return raise_for_answer(answer).publish.params
        # What the lane's wait for a hello left of the timeout (a sidecar that does not answer).
        return self._call("Publish", req, max(0.001, deadline - time.monotonic()), conn).params

    # -- decode -----------------------------------------------------------------------
    def pull(
        self,
        params: TransferParams,
        engine_id: str,
        block_ids: Sequence[int],
        ranks: Sequence[int] = (),
        start_token: int = 0,
        timeout_s: float | None = None,
        group: int | None = None,
    ) -> PullResult:
        """Fill local blocks; never raises for a failed transfer (see PullResult)."""
        return self.pull_async(params, engine_id, block_ids, ranks, start_token, timeout_s, group).result()

    def pull_async(
        self,
        params: TransferParams,
        engine_id: str,
        block_ids: Sequence[int],
        ranks: Sequence[int] = (),
        start_token: int = 0,
        timeout_s: float | None = None,
        group: int | None = None,
    ) -> PendingPull:
        """Start a pull and return at once: poll `done()`, then `result()`. No thread of ours waits on it,
        so an engine loop that holds the GIL is not interrupted to hand the answer over."""
        timeout = timeout_s or self.timeout_s
        req = pull_request(params, engine_id, block_ids, ranks, start_token, timeout, group)
        try:
            # A worker pulls its own rank: its rank's route (that of the engine's shard, as a rank of an
            # engine goes whole to one shard, but for one led from another node, placed by its GPU).
            conn = self._route(engine_id, ranks[0] if ranks else None, timeout)
        except KVSidecarError as e:  # not even asked where it goes: failed, every block unfilled
            return EndedPull(
                PullResult(False, error_code=e.code, error=e.message, unfilled_blocks=list(block_ids))
            )
        return self._start_pull(conn, req)

    @staticmethod
    def _start_pull(conn: Conn, req: engine_pb2.PullRequest) -> PendingPull:
        timeout = req.timeout_ms / 1000
        if conn.lane is not None:
            pending = start_lane_pull(conn.lane, req, timeout)
            if pending is not None:
                return pending
        return PullCall(
            conn.stub.Pull.future(req, timeout=timeout + PULL_GRACE_S), list(req.block_ids), conn.target
        )

    def pull_batch(
        self, engine_id: str, pulls: Sequence[BatchPull], timeout_s: float | None = None
    ) -> list[PullResult]:
        """Many pulls (a step's requests) in one call; a result per member, in order. The members run side
        by side and each fails alone; a call that fails as a whole (draining, too many members, the
        sidecar gone) fails every member with its error. Never raises for a failed transfer."""
        members = self.pull_batch_async(engine_id, pulls, timeout_s)
        return [m.result() for m in members]

    def pull_batch_async(
        self, engine_id: str, pulls: Sequence[BatchPull], timeout_s: float | None = None
    ) -> list[PendingPull]:
        """Start a PullBatch and return at once: a PendingPull per member (see `start_batch`). On a front
        door of control shards whose engine's ranks are spread over several shards, the members go as
        one PullBatch per shard, each to the shard of its first rank (a member that names none: the
        engine's rank 0's); a member whose shard could not be asked fails alone."""
        if not pulls:  # the sidecar refuses an empty batch; there is no member to fail
            return []
        timeout = timeout_s or self.timeout_s
        out: list[PendingPull | None] = [None] * len(pulls)
        shards: dict[str, tuple[Conn, list[int]]] = {}
        for i, m in enumerate(pulls):
            try:
                conn = self._route(engine_id, m.ranks[0] if m.ranks else None, timeout)
            except KVSidecarError as e:  # not even asked where it goes
                (failed,) = batch_failed(e.code, e.message, [list(m.block_ids)])
                out[i] = EndedPull(failed)
                continue
            shards.setdefault(conn.target, (conn, []))[1].append(i)
        for conn, members in shards.values():
            sent = start_batch(
                conn.lane, engine_id, [pulls[i] for i in members], timeout, _grpc_batch(conn, timeout)
            )
            for i, pending in zip(members, sent, strict=True):
                out[i] = pending
        return [p for p in out if p is not None]

    def keep_alive(self, params: Sequence[TransferParams], engine_id: str = "") -> list[int]:
        """Extend the leases of requests this engine will pull later (its sidecar asks their sources).
        `engine_id`: the decode engine; on a front door of shards, its shard asks (default: any)."""
        req = engine_pb2.KeepAliveRequest(params=list(params))
        return list(self._call("KeepAlive", req, conn=self._route(engine_id)).lease_deadline_unix_ms)

    # -- either side -----------------------------------------------------------------
    def abort(self, engine_id: str, request_id: str, params: TransferParams | None = None) -> bool:
        """Give a request up. Prefill: free its blocks. Decode: stop its pull; with `params`, the
        prefill side also releases its blocks now (it gets a "released" event)."""
        req = engine_pb2.AbortRequest(engine_id=engine_id, request_id=request_id, params=params)
        return self._call("Abort", req, conn=self._route(engine_id)).found

    def status(self, timeout_s: float | None = None) -> status_pb2.StatusResponse:
        """What the sidecar is doing: registered ranks, peers, transfers in flight (`kv-sidecar status`)."""
        return self._call("Status", status_pb2.StatusRequest(), timeout_s)
