"""Which sidecar process an engine's calls go to.

Usually the one the client was given. A node sidecar that runs control shards (`control_shards`,
docs/operations.md, "Control shards") is a front door instead: it answers `Route` (and `Status`) and
names, for each engine and rank, the shard that serves it. The client asks once per (engine, rank),
keeps the answer, and from then on calls that shard directly: its gRPC channel and its engine lane.
A sidecar without shards answers with an empty target, and an older one with UNIMPLEMENTED: both mean
"call me", and the client asks nothing more.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kv_sidecar_client._proto.kvsidecar.v1 import engine_pb2, engine_pb2_grpc
from kv_sidecar_client.lane import Lane, lane_for


@dataclass
class Conn:
    """One sidecar process's engine API: its gRPC channel and stub, and its engine lane."""

    target: str
    channel: grpc.Channel
    stub: engine_pb2_grpc.EngineServiceStub
    lane: Lane | None

    @classmethod
    def open(cls, target: str, channel_options: list[tuple[str, Any]], lane: bool | None) -> Conn:
        channel = grpc.insecure_channel(target, options=channel_options)
        return cls(target, channel, engine_pb2_grpc.EngineServiceStub(channel), lane_for(target, lane))

    def close(self) -> None:
        if self.lane is not None:
            self.lane.close()
        self.channel.close()


_Key = tuple[str, int | None]  # (engine id, rank or None for the engine's own calls)


class Routes:
    """The routes one client has learnt. Thread-safe; a Route call runs outside the lock (two threads
    that ask together get the same answer)."""

    def __init__(self, home: Conn, open_conn: Callable[[str], Conn], placement: str = "") -> None:
        """`placement`: the host engines' placement key sent with every Route (RouteRequest.placement)."""
        self.home = home
        self._open = open_conn
        self._placement = placement
        self._front: bool | None = None  # None: not known yet; False: home serves every engine
        self._routes: dict[_Key, Conn] = {}
        # Ranks the front door spreads to a shard of their own: their engine's leader there (RouteResponse).
        self._leaders: dict[_Key, str] = {}
        self._conns: dict[str, Conn] = {}
        self._lock = threading.Lock()

    @property
    def sharded(self) -> bool:
        """Whether the sidecar given is a front door of shards (known after the first route)."""
        return bool(self._front)

    def route(
        self,
        engine_id: str,
        rank: int | None,
        timeout_s: float,
        device_uuid: str = "",
        own_leader: bool = False,
    ) -> Conn:
        """The connection for `engine_id`'s `rank` (None: the engine's own calls). Raises grpc.RpcError
        as a call to the sidecar would (not reachable, the front door's refusal)."""
        if self._front is False:
            return self.home
        key = (engine_id, rank)
        with self._lock:
            known = self._routes.get(key)
        if known is not None:
            return known
        request = engine_pb2.RouteRequest(
            engine_id=engine_id,
            rank=rank,
            device_uuid=device_uuid,
            own_leader=own_leader,
            placement=self._placement,
        )
        try:
            answer = self.home.stub.Route(request, timeout=timeout_s)
        except grpc.RpcError as e:
            if isinstance(e, grpc.Call) and e.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._front = False  # a sidecar from before Route: it serves every engine
                return self.home
            raise
        if not answer.engine_target:
            self._front = False
            return self.home
        with self._lock:
            self._front = True
            conn = self._conns.get(answer.engine_target)
            if conn is None:
                conn = self._conns[answer.engine_target] = self._open(answer.engine_target)
            self._routes[key] = conn
            if answer.leader_address:
                self._leaders[key] = answer.leader_address
        return conn

    def leader(self, engine_id: str, rank: int) -> str:
        """The leader address a routed rank registers with on its shard (control_shard_ranks "spread");
        empty for a rank that registers as on a plain sidecar."""
        with self._lock:
            return self._leaders.get((engine_id, rank), "")

    def close(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
            self._routes.clear()
            self._leaders.clear()
        for c in conns:
            c.close()
