"""PeerClient over gRPC: one channel and stub per peer sidecar, its failures turned into PeerCallError.

Also the Push call's wire marker (PUSH_ENDED): the source sets it in its answer's trailing metadata
when nothing of the transfer is in flight any more; here the reader's side reads it back.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from typing import Any

import grpc

from kv_sidecar.config import Settings
from kv_sidecar.errors import Code
from kv_sidecar.security import PeerSecurity
from kv_sidecar.server.adapters.grpc_status import from_grpc
from kv_sidecar.server.gone_readers import Probe, Probed, ReaderSidecar, Seen
from kv_sidecar.server.peer_calls import Connect, PeerCallError, PeerClient, PeerFuture
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2, peer_pb2_grpc, status_pb2

# Trailing metadata of a Push answer given while nothing of its transfer is in flight.
PUSH_ENDED = ("kvsidecar-push-ended", "1")


def call_error(e: grpc.RpcError) -> PeerCallError:
    if not isinstance(e, grpc.Call):  # e.g. a channel that could not be made
        return PeerCallError(Code.UNAVAILABLE, str(e))
    trailers = tuple((str(k), v) for k, v in e.trailing_metadata() or () if isinstance(v, str))
    return PeerCallError(from_grpc(e.code()), e.details() or "", PUSH_ENDED in trailers, trailers)


class _Future:
    """A gRPC call's future that raises PeerCallError and TimeoutError, as PeerFuture promises."""

    def __init__(self, future: grpc.Future) -> None:
        self._f = future

    def result(self, timeout: float | None = None) -> Any:
        try:
            return self._f.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise TimeoutError() from None
        except grpc.RpcError as e:
            raise call_error(e) from None

    def cancel(self) -> bool:
        return bool(self._f.cancel())

    def done(self) -> bool:
        return bool(self._f.done())

    def add_done_callback(self, fn: Callable[[PeerFuture[Any]], None]) -> None:
        self._f.add_done_callback(lambda _: fn(self))


class GrpcPeerClient:
    def __init__(self, address: str, channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> None:
        self.address = address
        self._channel = channel
        self._stub = peer_pb2_grpc.PeerServiceStub(channel)
        self._md = metadata

    def _call(self, method: grpc.UnaryUnaryMultiCallable, req: Any, timeout_s: float) -> Any:
        try:
            return method(req, timeout=timeout_s, metadata=self._md)
        except grpc.RpcError as e:
            raise call_error(e) from None

    def handshake(self, req: peer_pb2.HandshakeRequest, timeout_s: float) -> PeerFuture[Any]:
        return _Future(self._stub.Handshake.future(req, timeout=timeout_s, metadata=self._md))

    def open_read(self, req: peer_pb2.OpenReadRequest, timeout_s: float) -> peer_pb2.OpenReadResponse:
        # The blocking form: a future's answer comes through gRPC's own thread, one hand-off more.
        return self._call(self._stub.OpenRead, req, timeout_s)

    def open_read_future(self, req: peer_pb2.OpenReadRequest, timeout_s: float) -> PeerFuture[Any]:
        return _Future(self._stub.OpenRead.future(req, timeout=timeout_s, metadata=self._md))

    def close_read(self, req: peer_pb2.CloseReadRequest, timeout_s: float) -> None:
        self._call(self._stub.CloseRead, req, timeout_s)

    def push(self, req: peer_pb2.PushRequest, timeout_s: float) -> peer_pb2.PushResponse:
        return self._call(self._stub.Push, req, timeout_s)

    def report_ranks(self, req: peer_pb2.ReportRanksRequest, timeout_s: float) -> None:
        self._call(self._stub.ReportRanks, req, timeout_s)

    def publish(self, req: peer_pb2.PeerPublishRequest, timeout_s: float) -> None:
        self._call(self._stub.Publish, req, timeout_s)

    def abort(self, req: peer_pb2.PeerAbortRequest, timeout_s: float) -> None:
        self._call(self._stub.Abort, req, timeout_s)

    def keep_alive(
        self, req: peer_pb2.PeerKeepAliveRequest, timeout_s: float
    ) -> peer_pb2.PeerKeepAliveResponse:
        return self._call(self._stub.KeepAlive, req, timeout_s)

    def close(self) -> None:
        self._channel.close()


def message_limits(settings: Settings) -> list[tuple[str, int]]:
    """gRPC options for max_message_bytes both ways: our servers and our channels to peers use the same."""
    return [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
    ]


def probe_sidecar(settings: Settings, security: PeerSecurity) -> Probe:
    """Whether sidecar `sidecar_id` still runs where it said it answers (server/gone_readers.py): only
    where that address names the one host its calls came from; then a TCP connect, which a port nothing
    listens on refuses, then the Status call, which names who answers there. A new channel each time,
    not the peer's: a probe must see the port as it is now, and is rare."""
    opts = message_limits(settings)
    metadata = security.call_metadata()

    def probe(sidecar_id: str, where: ReaderSidecar, timeout_s: float) -> Probed:
        host, _, port = where.address.rpartition(":")
        host = host.strip("[]")
        try:
            mismatch = _not_where_calls_came_from(host, int(port), where.calls_from)
        except (OSError, ValueError) as e:
            return Probed(Seen.UNKNOWN, f"its address, or where its calls came from, cannot be read: {e}")
        if mismatch:
            return Probed(Seen.UNKNOWN, mismatch)
        try:
            with socket.create_connection((host, int(port)), timeout=timeout_s):
                pass
        except ConnectionRefusedError:
            return Probed(Seen.GONE, "its port refuses connections")
        except OSError as e:
            return Probed(Seen.UNKNOWN, f"no connection within {timeout_s:g} s: {e}")
        channel = security.channel(where.address, opts)
        try:
            status = peer_pb2_grpc.PeerServiceStub(channel).Status(
                status_pb2.StatusRequest(), timeout=timeout_s, metadata=metadata
            )
        except grpc.RpcError as e:
            err = call_error(e)
            return Probed(Seen.UNKNOWN, f"its Status call failed within {timeout_s:g} s: {err.code.name}")
        finally:
            channel.close()
        if status.sidecar_id != sidecar_id:
            return Probed(Seen.GONE, f"sidecar {status.sidecar_id} answers there now")
        return Probed(Seen.RUNS, "it answers")

    return probe


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(text.split("%", 1)[0])  # a zone index is not part of the address
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return mapped or ip


def _not_where_calls_came_from(host: str, port: int, calls_from: str) -> str:
    """Why the address (host, port) may not be the sidecar whose calls came from gRPC peer `calls_from`
    ("ipv4:10.0.0.5:43120", "ipv6:[fd00::5]:43120"); "" where it is: the host resolves to that IP alone
    (loopback addresses counting as one)."""
    kind, _, rest = calls_from.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return f"its calls came from {calls_from or 'nowhere known'}, not over TCP"
    came = _ip(rest.rpartition(":")[0].strip("[]"))
    names = {_ip(str(info[4][0])) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    if came.is_loopback and names and all(n.is_loopback for n in names):
        return ""
    if names != {came}:
        shown = ", ".join(sorted(str(n) for n in names))
        return f"its address resolves to {shown} but its calls came from {came}: not asked there"
    return ""


def grpc_connect(settings: Settings, security: PeerSecurity) -> Connect:
    """Dial peers with this sidecar's message limits, TLS and token."""
    opts = message_limits(settings)
    metadata = security.call_metadata()

    def connect(address: str) -> PeerClient:
        return GrpcPeerClient(address, security.channel(address, opts), metadata)

    return connect


class GrpcPushCall:
    """A Push call as the source's core sees it (staged_source.PushCall)."""

    def __init__(self, context: grpc.ServicerContext) -> None:
        self._context = context

    def peer(self) -> str:
        return self._context.peer()

    def time_remaining(self) -> float | None:
        return self._context.time_remaining()

    def add_callback(self, fn: Callable[[], None]) -> bool:
        return bool(self._context.add_callback(fn))

    def ended(self) -> None:
        self._context.set_trailing_metadata((PUSH_ENDED,))
