"""The Status RPC: a snapshot of one running sidecar for `kv-sidecar status`."""

from __future__ import annotations

import time
from collections.abc import Callable

from kv_sidecar import __version__
from kv_sidecar.dataplane.jobs import WorkerState
from kv_sidecar.server.drain import Drain
from kv_sidecar.server.engines import EngineRegistry
from kv_sidecar.server.identity import Identity
from kv_sidecar.server.peers import Peers
from kv_sidecar.server.publish_refusals import PublishRefusals
from kv_sidecar.server.published import PublishedStore
from kv_sidecar.server.transfers import TransferTracker
from kv_sidecar_client._proto.kvsidecar.v1 import status_pb2

# The engine lane's socket path and open connections ("" and 0 where it is not served).
LaneState = Callable[[], tuple[str, int]]
# The device_workers setting, and each data-plane worker process (DataPlane.worker_states).
WorkersState = Callable[[], tuple[str, list[WorkerState]]]


class StatusReport:
    def __init__(
        self,
        identity: Identity,
        security: str,
        drain: Drain,
        engines: EngineRegistry,
        published: PublishedStore,
        peers: Peers,
        transfers: TransferTracker,
        lane: LaneState,
        refusals: PublishRefusals,
        workers: WorkersState = lambda: ("false", []),
    ) -> None:
        """security: how the peer API is secured, in words (PeerSecurity.describe)."""
        self._me = identity
        self._security = security
        self._drain = drain
        self._engines = engines
        self._published = published
        self._peers = peers
        self._transfers = transfers
        self._lane = lane
        self._refusals = refusals
        self._workers = workers
        self._started_at = time.monotonic()

    def build(self) -> status_pb2.StatusResponse:
        lane_path, lane_connections = self._lane()
        ranks = sorted(self._engines.all(), key=lambda e: (e.engine_id, e.rank))
        peers = [
            status_pb2.PeerStatus(
                address=link.address,
                sidecar_id=remote.sidecar_id,
                direction="outgoing",
                engine_id=engine_id,
                reader_engine_id=reader,
                plan_hash=remote.plan.hash(),
            )
            for link in self._peers.links()
            for (engine_id, reader), remote in sorted(link.engines.copy().items())
        ]
        peers += [
            status_pb2.PeerStatus(
                address=h.peer,
                sidecar_id=h.sidecar_id,
                direction="incoming",
                engine_id=h.engine_id,
                reader_engine_id=h.reader_engine,
                plan_hash=h.plan_hash,
            )
            for h in self._transfers.incoming_handshakes()
        ]
        recent = self._transfers.recent()
        device_workers, workers = self._workers()
        return status_pb2.StatusResponse(
            sidecar_id=self._me.sidecar_id,
            version=__version__,
            peer_address=self._me.peer_address,
            peer_security=self._security,
            draining=self._drain.draining,
            uptime_s=time.monotonic() - self._started_at,
            engine_lane=lane_path,
            engine_lane_connections=lane_connections,
            ranks=[
                status_pb2.RankStatus(
                    engine_id=e.engine_id,
                    rank=e.rank,
                    tp_size=e.spec.tp_size,
                    layout=e.spec.layout.value,
                    num_blocks=e.spec.num_blocks,
                    bytes=e.spec.rank_bytes(),
                    sessions=e.sessions,
                )
                for e in ranks
            ],
            published_requests=len(self._published),
            peers=peers,
            inflight=[
                status_pb2.TransferStatus(
                    kind=t.kind,
                    request_id=t.request_id,
                    engine_id=t.engine_id,
                    remote_engine_id=t.remote_engine,
                    peer=t.peer,
                    elapsed_s=t.elapsed(),
                    bytes=t.bytes,
                    path=t.path,
                )
                for t in self._transfers.inflight()
            ],
            recent=status_pb2.RecentThroughput(
                window_s=recent.window_s,
                pulls=recent.pulls,
                failed_pulls=recent.failed,
                bytes=recent.bytes,
                busy_s=recent.busy_s,
                served_reads=recent.served,
            ),
            publish_refusals=[
                status_pb2.PublishRefusal(
                    engine_id=r.engine_id,
                    reason=r.reason,
                    count=r.count,
                    last_message=r.last_message,
                    last_unix_s=r.last_unix_s,
                )
                for r in self._refusals.snapshot()
            ],
            device_workers=device_workers,
            workers=[
                status_pb2.WorkerStatus(
                    device=w.device,
                    pid=w.pid,
                    restarts=w.restarts,
                    local_copies=w.local_copies,
                    staged=w.staged,
                    starting=not w.ready,
                )
                for w in workers
            ],
        )
