"""Components that call peers, each built alone with a fake PeerClient (server/peer_calls.py): what they
send, to whom, and what a peer's failure becomes. No gRPC, no NIXL agent, no `Sidecar`."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kv_sidecar.dataplane.plane import MappedRanks
from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.metrics import Metrics
from kv_sidecar.server.engine_calls import EngineCalls
from kv_sidecar.server.engines import EngineRegistry
from kv_sidecar.server.identity import Identity
from kv_sidecar.server.inflight import InflightPulls
from kv_sidecar.server.lease_view import LeaseView
from kv_sidecar.server.membership import Membership
from kv_sidecar.server.notified_opens import NotifiedOpens
from kv_sidecar.server.peer_calls import PeerCallError, peer_error, stoppable
from kv_sidecar.server.peers import Holder, Peers
from kv_sidecar.server.publish_refusals import PublishRefusals
from kv_sidecar.server.published import PublishedStore
from kv_sidecar.server.release import Releases
from kv_sidecar.server.routing import Opener
from kv_sidecar.transport.nixl_driver import NixlDriver
from kv_sidecar_client._proto.kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2

ME = Identity("here", "127.0.0.1:5000")


class FakePeer:
    """Records every call; answers from `answers` (method -> response or PeerCallError to raise)."""

    def __init__(self, address: str, calls: list[tuple[str, str, Any]], answers: dict[str, Any]) -> None:
        self.address = address
        self._calls = calls
        self._answers = answers
        self.closed = False

    def _answer(self, method: str, req: Any) -> Any:
        self._calls.append((self.address, method, req))
        got = self._answers.get((self.address, method), self._answers.get(method))
        if isinstance(got, PeerCallError):
            raise got
        return got

    def close_read(self, req: peer_pb2.CloseReadRequest, timeout_s: float) -> None:
        self._answer("close_read", req)

    def keep_alive(self, req: peer_pb2.PeerKeepAliveRequest, timeout_s: float) -> Any:
        return self._answer("keep_alive", req)

    def close(self) -> None:
        self.closed = True


class World:
    """The small real parts the components under test share, and the fake peers they call."""

    def __init__(self, answers: dict[Any, Any] | None = None) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.answers = answers or {}
        self.metrics = Metrics()
        self.nixl = NixlDriver(ME.sidecar_id)  # never started: these paths do not touch NIXL
        self.peers = Peers(ME.sidecar_id, self.nixl, self.metrics, self._connect)  # type: ignore[arg-type]
        self.engines = EngineRegistry(MappedRanks(None))
        self.published = PublishedStore(lambda *a: None, lambda item: None)
        self.lease_view = LeaseView()
        self.membership = Membership(
            ME, self.engines, self.published, self.peers, self.nixl, 30_000, lambda item, ranks: None
        )
        self.releases = Releases(
            ME.sidecar_id, self.published, self.engines, self.membership, self.peers, self.lease_view
        )

    def _connect(self, address: str) -> FakePeer:
        return FakePeer(address, self.calls, self.answers)

    def engine_calls(self) -> EngineCalls:
        def no_pull(*_: Any) -> engine_pb2.PullResponse:
            raise AssertionError("no pull expected")

        return EngineCalls(
            ME,
            30_000,
            30.0,
            self.engines,
            self.published,
            self.membership,
            InflightPulls(),
            no_pull,
            no_pull,
            no_pull,
            no_pull,
            self.releases,
            self.peers,
            self.lease_view,
            lambda item, ranks: None,
            PublishRefusals(self.metrics),
            max_pull_batch=8,
            batch_threads=4,
        )


def params(sidecar_id: str = "src", address: str = "10.0.0.2:5000") -> common_pb2.TransferParams:
    return common_pb2.TransferParams(
        engine_id="p",
        sidecar_id=sidecar_id,
        sidecar_address=address,
        request_id="r1",
        block_ids=[3],
        num_tokens=4,
    )


def test_a_reader_gives_up_a_remote_request_by_closing_it_with_release_on_its_source() -> None:
    w = World()
    assert w.releases.source(params(), "decode-engine", "aborted by the reader")
    ((address, method, req),) = w.calls
    assert (address, method) == ("10.0.0.2:5000", "close_read")
    assert (req.engine_id, req.request_id, req.reader_engine_id, req.release) == (
        "p",
        "r1",
        "decode-engine",
        True,
    )
    # The lease view forgets it: a later pull of it does not READ before OpenRead answers.
    assert not w.lease_view.surely_held("src", "p", "r1", int(time.time() * 1000) + 60_000)


def test_a_source_that_cannot_be_reached_does_not_fail_the_release() -> None:
    w = World({"close_read": PeerCallError(Code.UNAVAILABLE, "connection refused")})
    assert w.releases.source(params(), "decode-engine", "aborted by the reader")  # logged, not raised
    assert [m for _, m, _ in w.calls] == ["close_read"]


def test_a_release_with_a_bad_address_calls_nobody() -> None:
    w = World()
    with pytest.raises(SidecarError) as e:
        w.releases.source(params(address="no port"), "decode-engine", "x")
    assert e.value.code is Code.INVALID_ARGUMENT and not w.calls


def test_keep_alive_asks_each_source_and_remembers_the_deadline_it_gives() -> None:
    deadline = int(time.time() * 1000) + 60_000
    w = World({"keep_alive": peer_pb2.PeerKeepAliveResponse(lease_deadline_unix_ms=[deadline])})
    assert w.engine_calls().keep_alive([params()]) == [deadline]
    ((address, method, req),) = w.calls
    assert (address, method, list(req.request_ids)) == ("10.0.0.2:5000", "keep_alive", ["r1"])
    assert w.lease_view.surely_held("src", "p", "r1", deadline)


def test_keep_alive_names_the_peer_that_refused() -> None:
    w = World({"keep_alive": PeerCallError(Code.NOT_FOUND, "unknown request 'r1'")})
    with pytest.raises(SidecarError) as e:
        w.engine_calls().keep_alive([params()])
    assert e.value.code is Code.NOT_FOUND
    assert e.value.message == "peer sidecar 10.0.0.2:5000 refused keep-alive: unknown request 'r1'"


def test_keep_alive_checks_every_params_before_calling_anyone() -> None:
    w = World()
    with pytest.raises(SidecarError) as e:
        w.engine_calls().keep_alive([params(), params(address="nowhere")])
    assert e.value.code is Code.INVALID_ARGUMENT and "params[1].sidecar_address" in e.value.message
    assert not w.calls


def test_a_failed_pull_closes_its_reads_on_every_holder_even_when_one_is_down() -> None:
    w = World({("10.0.0.2:5000", "close_read"): PeerCallError(Code.UNAVAILABLE, "down")})
    opener = Opener(ME, w.peers, NotifiedOpens(False, 0.002, w.peers, w.nixl, w.metrics), w.metrics)
    holders = [Holder("a", "10.0.0.2:5000", "a"), Holder("b", "10.0.0.3:5000", "b")]
    req = engine_pb2.PullRequest(engine_id="d", params=params())
    opener.close_reads(holders, req, [0, 1], failed=True)
    assert [(a, m) for a, m, _ in w.calls] == [
        ("10.0.0.2:5000", "close_read"),
        ("10.0.0.3:5000", "close_read"),
    ]
    assert all(r.failed and not r.release and list(r.reader_ranks) == [0, 1] for _, _, r in w.calls)


def test_closing_the_links_closes_each_client_and_a_closed_peers_dials_no_more() -> None:
    w = World()
    link = w.peers.link("10.0.0.2:5000")
    w.peers.close()
    assert link.client.closed  # type: ignore[attr-defined]
    with pytest.raises(SidecarError) as e:
        w.peers.remote_engine("10.0.0.9:5000", "p", "d", None, 1.0, threading.Event(), RuntimeError)  # type: ignore[arg-type]
    assert e.value.code is Code.UNAVAILABLE and "shutting down" in e.value.message


@pytest.mark.parametrize(
    ("code", "details", "ours", "want", "words"),
    [
        (Code.UNAVAILABLE, "connection refused", False, Code.UNAVAILABLE, "is not reachable (the handshake)"),
        (Code.UNAVAILABLE, "connection refused", True, Code.UNAVAILABLE, "is not reachable (the handshake)"),
        # A call timed by a fixed limit (a keep-alive): the peer did not answer in time.
        (Code.DEADLINE_EXCEEDED, "deadline", False, Code.UNAVAILABLE, "is not reachable"),
        # A call timed by what remained of the pull's deadline: that deadline passed.
        (
            Code.DEADLINE_EXCEEDED,
            "deadline",
            True,
            Code.DEADLINE_EXCEEDED,
            "deadline passed waiting for peer",
        ),
        (Code.UNAVAILABLE, "ssl: CERTIFICATE_VERIFY_FAILED", False, Code.UNAUTHENTICATED, "TLS handshake"),
        (Code.FAILED_PRECONDITION, "plan mismatch", True, Code.FAILED_PRECONDITION, "refused the handshake"),
    ],
)
def test_what_a_peers_failure_tells_the_caller(
    code: Code, details: str, ours: bool, want: Code, words: str
) -> None:
    err = PeerCallError(code, details).explain("10.0.0.2:5000", "the handshake", caller_deadline=ours)
    assert err.code is want and words in err.message and "10.0.0.2:5000" in err.message
    again = peer_error(code, details, "10.0.0.2:5000", "the handshake", caller_deadline=ours)
    assert again.message == err.message


class NeverAnswers:
    def __init__(self) -> None:
        self.cancelled = False

    def result(self, timeout: float | None = None) -> Any:
        time.sleep(timeout or 0)
        raise TimeoutError()

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    def done(self) -> bool:
        return False

    def add_done_callback(self, fn: Any) -> None:
        pass


def test_a_stopped_pull_gives_up_a_hung_peer_call_at_once() -> None:
    stop, future = threading.Event(), NeverAnswers()
    threading.Timer(0.1, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(SidecarError) as e:
        stoppable(future, stop, lambda: SidecarError(Code.CANCELLED, "stopped"))
    assert e.value.code is Code.CANCELLED and future.cancelled
    assert time.monotonic() - t0 < 1.0
