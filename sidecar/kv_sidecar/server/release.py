"""Releasing published blocks early because their reader is gone, and telling the source engine."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc

from kv_sidecar.server.errors import check_address
from kv_sidecar.server.peers import rpc_error
from kv_sidecar_client._proto.kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2

if TYPE_CHECKING:
    from kv_sidecar.server.sidecar import Sidecar

log = logging.getLogger(__name__)


def release_here(sc: Sidecar, engine_id: str, request_id: str, reader: str, reason: str) -> bool:
    """End a request published on this sidecar; every rank of its engine gets a "released" event."""
    item = sc.published.release(engine_id, request_id, reader, reason)
    if item is None:
        return False
    log.info("request %s of engine %s released by reader %s: %s", request_id, engine_id, reader, reason)
    ev = engine_pb2.Event(
        released=engine_pb2.RequestReleased(request_id=request_id, block_ids=item.block_ids, reason=reason)
    )
    for entry in sc.engines.all():
        if entry.engine_id == engine_id:
            entry.emit(ev)
    # A multi-node engine: the members hold the request for their own ranks; they release and tell them.
    for m in sc.membership.members(engine_id):
        _close_released(sc, m.peer_address, engine_id, request_id, reader)
    return True


def _close_released(sc: Sidecar, address: str, engine_id: str, request_id: str, reader: str) -> None:
    try:
        sc.peers.link(address).stub.CloseRead(
            peer_pb2.CloseReadRequest(
                engine_id=engine_id, request_id=request_id, reader_engine_id=reader, release=True
            ),
            timeout=5,
            metadata=sc.peer_metadata(),
        )
    except grpc.RpcError as e:
        err = rpc_error(e, address, "the release")
        log.warning("could not release request %s: %s", request_id, err.message)


def release_source(sc: Sidecar, params: common_pb2.TransferParams, reader: str, reason: str) -> bool:
    """The reader `reader` gives up the request of `params`: release it where it was published."""
    if params.sidecar_id == sc.sidecar_id:
        return release_here(sc, params.engine_id, params.request_id, reader, reason)
    check_address("params.sidecar_address", params.sidecar_address)
    sc.lease_view.released(params.sidecar_id, params.engine_id, params.request_id)
    _close_released(sc, params.sidecar_address, params.engine_id, params.request_id, reader)
    return True
