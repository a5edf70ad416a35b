"""PeerService: what other sidecars ask of this one. Decodes, calls the core
(server/peer_requests.py), encodes."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from kv_sidecar.server.adapters.grpc_status import rpc
from kv_sidecar.server.adapters.peer_client import GrpcPushCall
from kv_sidecar.server.peer_requests import PeerRequests
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2, peer_pb2_grpc, status_pb2


class PeerServicer(peer_pb2_grpc.PeerServiceServicer):
    def __init__(self, requests: PeerRequests, status: Callable[[], status_pb2.StatusResponse]) -> None:
        self._requests = requests
        self._status = status

    @rpc
    def Handshake(
        self, request: peer_pb2.HandshakeRequest, context: grpc.ServicerContext
    ) -> peer_pb2.HandshakeResponse:
        return self._requests.handshake(request, context.peer())

    @rpc
    def OpenRead(
        self, request: peer_pb2.OpenReadRequest, context: grpc.ServicerContext
    ) -> peer_pb2.OpenReadResponse:
        return self._requests.open_read(request, context.peer())

    @rpc
    def KeepAlive(
        self, request: peer_pb2.PeerKeepAliveRequest, context: grpc.ServicerContext
    ) -> peer_pb2.PeerKeepAliveResponse:
        return peer_pb2.PeerKeepAliveResponse(lease_deadline_unix_ms=self._requests.keep_alive(request))

    @rpc
    def CloseRead(
        self, request: peer_pb2.CloseReadRequest, context: grpc.ServicerContext
    ) -> peer_pb2.CloseReadResponse:
        self._requests.close_read(request)
        return peer_pb2.CloseReadResponse()

    @rpc
    def Push(self, request: peer_pb2.PushRequest, context: grpc.ServicerContext) -> peer_pb2.PushResponse:
        return self._requests.push(request, GrpcPushCall(context))

    @rpc
    def ReportRanks(
        self, request: peer_pb2.ReportRanksRequest, context: grpc.ServicerContext
    ) -> peer_pb2.ReportRanksResponse:
        return peer_pb2.ReportRanksResponse(leader_id=self._requests.report_ranks(request))

    @rpc
    def Publish(
        self, request: peer_pb2.PeerPublishRequest, context: grpc.ServicerContext
    ) -> peer_pb2.PeerPublishResponse:
        self._requests.publish(request)
        return peer_pb2.PeerPublishResponse()

    @rpc
    def Abort(
        self, request: peer_pb2.PeerAbortRequest, context: grpc.ServicerContext
    ) -> peer_pb2.PeerAbortResponse:
        return peer_pb2.PeerAbortResponse(found=self._requests.abort(request))

    @rpc
    def Status(
        self, request: status_pb2.StatusRequest, context: grpc.ServicerContext
    ) -> status_pb2.StatusResponse:
        return self._status()
