"""The Status RPC: a snapshot of one running sidecar for `kv-sidecar status`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kv_sidecar import __version__
from kv_sidecar_client._proto.kvsidecar.v1 import status_pb2

if TYPE_CHECKING:
    from kv_sidecar.server.sidecar import Sidecar


def build_status(sc: Sidecar) -> status_pb2.StatusResponse:
    ranks = sorted(sc.engines.all(), key=lambda e: (e.engine_id, e.rank))
    peers = [
        status_pb2.PeerStatus(
            address=link.address,
            sidecar_id=remote.sidecar_id,
            direction="outgoing",
            engine_id=engine_id,
            reader_engine_id=reader,
            plan_hash=remote.plan.hash(),
        )
        for link in sc.peers.links()
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
        for h in sc.transfers.incoming_handshakes()
    ]
    recent = sc.transfers.recent()
    return status_pb2.StatusResponse(
        sidecar_id=sc.sidecar_id,
        version=__version__,
        peer_address=sc.peer_address,
        peer_security=sc.security.describe(),
        draining=sc.drain.draining,
        uptime_s=time.monotonic() - sc.started_at,
        engine_lane=sc.engine_lane.path if sc.engine_lane is not None else "",
        engine_lane_connections=sc.engine_lane.connections if sc.engine_lane is not None else 0,
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
        published_requests=len(sc.published),
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
            for t in sc.transfers.inflight()
        ],
        recent=status_pb2.RecentThroughput(
            window_s=recent.window_s,
            pulls=recent.pulls,
            failed_pulls=recent.failed,
            bytes=recent.bytes,
            busy_s=recent.busy_s,
            served_reads=recent.served,
        ),
    )
