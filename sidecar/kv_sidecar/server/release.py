"""Releasing published blocks early because their reader is gone, and telling the source engine."""

from __future__ import annotations

import logging

from kv_sidecar.errors import check_address
from kv_sidecar.server.engines import EngineRegistry
from kv_sidecar.server.lease_view import LeaseView
from kv_sidecar.server.membership import Membership
from kv_sidecar.server.peer_calls import PeerCallError
from kv_sidecar.server.peers import Peers
from kv_sidecar.server.published import PublishedStore
from kv_sidecar_client._proto.kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2

log = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 5.0


class Releases:
    def __init__(
        self,
        sidecar_id: str,
        published: PublishedStore,
        engines: EngineRegistry,
        membership: Membership,
        peers: Peers,
        lease_view: LeaseView,
    ) -> None:
        self._sidecar_id = sidecar_id
        self._published = published
        self._engines = engines
        self._membership = membership
        self._peers = peers
        self._lease_view = lease_view

    def here(self, engine_id: str, request_id: str, reader: str, reason: str) -> bool:
        """End a request published on this sidecar; every rank of its engine gets a "released" event."""
        item = self._published.release(engine_id, request_id, reader, reason)
        if item is None:
            return False
        log.info("request %s of engine %s released by reader %s: %s", request_id, engine_id, reader, reason)
        ev = engine_pb2.Event(
            released=engine_pb2.RequestReleased(
                request_id=request_id, block_ids=item.block_ids, reason=reason
            )
        )
        for entry in self._engines.all():
            if entry.engine_id == engine_id:
                entry.emit(ev)
        # A multi-node engine: the members hold the request for their own ranks; they release and tell them.
        for m in self._membership.members(engine_id):
            self._close_released(m.peer_address, engine_id, request_id, reader)
        return True

    def source(self, params: common_pb2.TransferParams, reader: str, reason: str) -> bool:
        """The reader `reader` gives up the request of `params`: release it where it was published."""
        if params.sidecar_id == self._sidecar_id:
            return self.here(params.engine_id, params.request_id, reader, reason)
        check_address("params.sidecar_address", params.sidecar_address)
        self._lease_view.released(params.sidecar_id, params.engine_id, params.request_id)
        self._close_released(params.sidecar_address, params.engine_id, params.request_id, reader)
        return True

    def _close_released(self, address: str, engine_id: str, request_id: str, reader: str) -> None:
        msg = peer_pb2.CloseReadRequest(
            engine_id=engine_id, request_id=request_id, reader_engine_id=reader, release=True
        )
        try:
            self._peers.link(address).client.close_read(msg, RELEASE_TIMEOUT_S)
        except PeerCallError as e:
            log.warning(
                "could not release request %s: %s", request_id, e.explain(address, "the release").message
            )
