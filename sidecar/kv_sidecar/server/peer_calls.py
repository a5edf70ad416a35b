"""What the core asks of a peer sidecar, without a transport: the calls, their futures and their errors.

`server/adapters/peer_client.py` implements `PeerClient` over gRPC; tests may give a fake. A call that
fails raises `PeerCallError` (the peer's status, or UNAVAILABLE where none came); the caller turns it
into the error its own caller sees with `explain`, naming the peer and what it asked for.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.server.inflight import Stop
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2

T = TypeVar("T", covariant=True)

# How soon a peer call notices that its pull was stopped.
STOP_POLL_S = 0.05
# How grpc core words a failed TLS handshake (certificate not trusted, wrong name).
_TLS_FAILURE = re.compile(r"handshake failed|verification check failed|CERTIFICATE_VERIFY_FAILED", re.I)


class PeerCallError(Exception):
    """A peer call that failed. `ended`: the source itself ended a Push with this status, with nothing
    of the transfer in flight (its verdict: the reader may reuse its slots at once). `trailers`: the
    answer's trailing metadata (a group's refusal lists its refused members there)."""

    def __init__(
        self, code: Code, details: str, ended: bool = False, trailers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.ended = ended
        self.trailers = trailers

    def explain(self, peer: str, what: str, *, caller_deadline: bool = False) -> SidecarError:
        """`caller_deadline`: the call's timeout was what remained of the caller's own deadline (a
        pull's), so a DEADLINE_EXCEEDED is that deadline passing, not a peer out of reach."""
        return peer_error(self.code, self.details, peer, what, caller_deadline=caller_deadline)


class PeerUnreachable(SidecarError):
    """A call that reached no answer from the peer (down, restarting, the connection reset or timed out):
    the peer's state, not the request's, so every other call to it now would fail the same way."""


def peer_error(
    code: Code, details: str, peer: str, what: str, *, caller_deadline: bool = False
) -> SidecarError:
    """What a peer's refusal (a failed call, or a refusal it sent by notification) tells our caller."""
    if code is Code.DEADLINE_EXCEEDED and caller_deadline:
        # Not UNAVAILABLE: a pull that retries an unreachable peer, or forgets its handshake with it,
        # must not do so because its own short deadline ran out while the peer answered.
        return SidecarError(
            Code.DEADLINE_EXCEEDED, f"the deadline passed waiting for peer sidecar {peer} ({what}): {details}"
        )
    if code is Code.UNAVAILABLE and _TLS_FAILURE.search(details or ""):
        # A certificate problem does not heal on retry, unlike a peer that is down.
        return SidecarError(
            Code.UNAUTHENTICATED,
            f"TLS handshake with peer sidecar {peer} failed ({what}); check tls_ca, tls_server_name and "
            f"the certificates: {details}",
        )
    if code in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED):
        return PeerUnreachable(Code.UNAVAILABLE, f"peer sidecar {peer} is not reachable ({what}): {details}")
    return SidecarError(code, f"peer sidecar {peer} refused {what}: {details}")


class PeerFuture(Protocol[T]):
    """A call in flight. `result` raises PeerCallError for a failed call, TimeoutError while none came."""

    def result(self, timeout: float | None = None) -> T: ...

    def cancel(self) -> bool: ...

    def done(self) -> bool: ...

    def add_done_callback(self, fn: Callable[[PeerFuture[T]], None]) -> None: ...


class PeerClient(Protocol):
    """One peer sidecar's PeerService. Every call raises PeerCallError when it fails."""

    address: str

    def handshake(self, req: peer_pb2.HandshakeRequest, timeout_s: float) -> PeerFuture[Any]: ...

    def open_read(self, req: peer_pb2.OpenReadRequest, timeout_s: float) -> peer_pb2.OpenReadResponse: ...

    def open_read_future(
        self, req: peer_pb2.OpenReadRequest, timeout_s: float
    ) -> PeerFuture[peer_pb2.OpenReadResponse]: ...

    def close_read(self, req: peer_pb2.CloseReadRequest, timeout_s: float) -> None: ...

    def push(self, req: peer_pb2.PushRequest, timeout_s: float) -> peer_pb2.PushResponse: ...

    def report_ranks(self, req: peer_pb2.ReportRanksRequest, timeout_s: float) -> None: ...

    def publish(self, req: peer_pb2.PeerPublishRequest, timeout_s: float) -> None: ...

    def abort(self, req: peer_pb2.PeerAbortRequest, timeout_s: float) -> None: ...

    def keep_alive(
        self, req: peer_pb2.PeerKeepAliveRequest, timeout_s: float
    ) -> peer_pb2.PeerKeepAliveResponse: ...

    def close(self) -> None: ...


# address -> its client (the composition root gives the gRPC one, with this sidecar's channel options).
Connect = Callable[[str], PeerClient]


def stoppable(future: PeerFuture[Any], stop: Stop, on_stop: Callable[[], Exception]) -> Any:
    """A peer call's answer, given up at once (raising on_stop()) when its pull is stopped, not at its
    deadline: a peer that hangs must not hold the pull, its engine's rank or a drain for the whole timeout."""
    while True:
        try:
            return future.result(timeout=STOP_POLL_S)  # wakes at the answer, not at the poll
        except TimeoutError:
            if stop.is_set():
                future.cancel()
                raise on_stop() from None
