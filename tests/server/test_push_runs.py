"""The staged Push by notification, its pure part: the message, the keys, that of a Push's two
copies (notification and call) exactly one starts the transfer, whatever order they come in, and when
a Publish gets ready for one."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_sidecar.config import Settings
from kv_sidecar.dataplane.plane import DataPlane
from kv_sidecar.metrics import Metrics
from kv_sidecar.server.notified_opens import NotifiedOpens
from kv_sidecar.server.peers import Holder, Peers
from kv_sidecar.server.published import Published
from kv_sidecar.server.push_runs import KEY_BYTES, READERS_S, DuplicateTransfer, PushKeys, PushRun, PushRuns
from kv_sidecar.server.push_threads import PushThreads
from kv_sidecar.transport import notifications
from kv_sidecar.transport.nixl_driver import NixlDriver
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_push_notification_round_trips_and_rejects_malformed() -> None:
    key = bytes(range(KEY_BYTES))
    body = b"\x1f\x00any proto bytes, separators included\x1f"
    msg = notifications.signed_notif(notifications.PUSH_TAG, key, body)
    assert msg.startswith(notifications.PUSH_TAG) and not msg.startswith(notifications.TRANSFER_TAG)
    assert notifications.parse_signed_notif(notifications.PUSH_TAG, msg, KEY_BYTES) == (key, body)
    head = len(notifications.PUSH_TAG) + 2 + 2 * KEY_BYTES
    for bad in (
        b"",
        msg[:head],  # no request
        notifications.TRANSFER_TAG + msg[len(notifications.PUSH_TAG) :],  # a chunk notification's tag
        msg[: len(notifications.PUSH_TAG) + 1]
        + b"zz"
        + msg[len(notifications.PUSH_TAG) + 3 :],  # key not hex
        msg[: head - 1] + b"!" + msg[head:],  # key of the wrong length
    ):
        assert notifications.parse_signed_notif(notifications.PUSH_TAG, bad, KEY_BYTES) is None, bad


def test_keys_are_per_agent_stable_and_checked_in_full() -> None:
    keys = PushKeys()
    a = keys.grant("reader-a", "ipv4:10.0.0.1:1234")
    assert len(a) == KEY_BYTES
    assert keys.grant("reader-a", "ipv4:10.0.0.9:1") == a  # the same key, and the first peer kept
    b = keys.grant("reader-b", "ipv4:10.0.0.2:1")
    assert a != b
    assert keys.check("reader-a", a) == "ipv4:10.0.0.1:1234"
    assert keys.check("reader-a", b) is None  # another agent's key
    assert keys.check("reader-a", a[:-1] + bytes([a[-1] ^ 1])) is None
    assert keys.check("reader-a", a[:8]) is None
    assert keys.check("stranger", a) is None  # never granted


def test_notification_first_the_call_joins() -> None:
    clock = Clock()
    runs = PushRuns(clock=clock)
    run = runs.start_by_notif("t1")
    assert run is not None and run.started == clock.now
    assert not run.called  # until its call joins, only ALONE_S tells the source its reader lives
    assert runs.start_by_notif("t1") is None  # a second copy of the notification starts nothing
    assert runs.claim_by_call("t1") is run
    assert run.called
    run.finish("answer", None, True)
    runs.ended(run)
    runs.joined(run)
    assert runs.start_by_notif("t1") is None  # replayed after both came: still nothing
    with pytest.raises(DuplicateTransfer):
        runs.claim_by_call("t1")


def test_call_first_the_notification_starts_nothing() -> None:
    runs = PushRuns(clock=Clock())
    assert runs.claim_by_call("t2") is None  # the call starts the transfer itself
    assert runs.start_by_notif("t2") is None
    with pytest.raises(DuplicateTransfer):
        runs.claim_by_call("t2")


def test_ids_are_forgotten_only_after_their_transfer_ended_and_time_passed() -> None:
    clock = Clock()
    runs = PushRuns(remember_s=60, max_remembered=2, clock=clock)
    long_run = runs.start_by_notif("long")
    assert long_run is not None
    for i in range(5):  # past the bound: the oldest ended entries go, never the running one
        assert runs.claim_by_call(f"c{i}") is None
    clock.now += 3600
    runs.claim_by_call("later")
    assert runs.start_by_notif("long") is None  # still running: its id is still taken
    assert runs.claim_by_call("long") is long_run
    long_run.finish(None, None, True)
    runs.ended(long_run)
    clock.now += 59
    assert runs.start_by_notif("long") is None
    clock.now += 2
    assert runs.start_by_notif("long") is not None  # forgotten a minute after it ended
    assert runs.start_by_notif("c0") is not None  # forgotten long ago


def test_recent_follows_the_last_push() -> None:
    clock = Clock()
    runs = PushRuns(clock=clock)
    assert not runs.recent()
    runs.touch()
    assert runs.recent()
    clock.now += 2
    assert not runs.recent()
    runs.start_by_notif("x")
    assert runs.recent()


def test_pushes_becoming_recent_wake_the_poll_loop_once() -> None:
    """The NIXL loop of a sidecar quiet for a second sleeps 50 ms between polls; a Push notification
    or an open due now would wait that long (a reader calls after 2 to 5 ms instead). Each time Pushes
    become recent the loop is woken, once: while they stay recent it already polls every 0.1 ms."""
    clock = Clock()
    wakes: list[float] = []
    runs = PushRuns(clock=clock, on_recent=lambda: wakes.append(clock.now))
    runs.touch()  # a publish while readers are about
    runs.touch()
    clock.now += 0.5
    runs.reader_seen()
    runs.start_by_notif("a")
    assert wakes == [100.0]
    clock.now += 2  # quiet again
    runs.reader_seen()  # a handshake
    clock.now += 2
    runs.claim_by_call("b")
    clock.now += 0.9
    runs.touch()
    assert wakes == [100.0, 102.5, 104.5]


def test_readers_lately_follows_readers_not_publishes() -> None:
    """A publish (touch) polls faster but is no sign of a staged reader; a Push or a handshake is, for
    READERS_S: only then does a publish get ready for one (PushThreads.expect_read)."""
    clock = Clock()
    runs = PushRuns(clock=clock)
    runs.touch()
    assert runs.recent() and not runs.readers_lately()
    runs.reader_seen()  # a handshake, or a Push call without a notification
    assert runs.readers_lately()
    clock.now += READERS_S + 1
    assert not runs.readers_lately() and not runs.recent()
    runs.claim_by_call("y")
    assert runs.readers_lately() and runs.recent()
    clock.now += READERS_S + 1
    runs.start_by_notif("z")
    assert runs.readers_lately()


def test_a_run_cancelled_by_its_call_stops_once_and_not_after_it_finished() -> None:
    run = PushRun("t")
    fired: list[str] = []
    run.add_callback(lambda: fired.append("a"))
    run.cancel()
    run.cancel()
    assert fired == ["a"]
    run.add_callback(lambda: fired.append("late"))  # registered after the cancel: runs at once
    assert fired == ["a", "late"]
    done = PushRun("u")
    done.add_callback(lambda: fired.append("never"))
    done.finish(None, None, True)
    done.cancel()  # the call's end after the transfer's end stops nothing
    assert "never" not in fired and done.wait(0)


@given(st.lists(st.tuples(st.integers(0, 7), st.booleans()), max_size=60))
def test_each_id_starts_at_most_once_in_any_order(events: list[tuple[int, bool]]) -> None:
    """Copies of Pushes in any order, repeated: one start per id, by the first copy that came."""
    runs = PushRuns(clock=Clock())
    starts: dict[int, str] = {}
    for tid, by_call in events:
        if by_call:
            try:
                run = runs.claim_by_call(str(tid))
            except DuplicateTransfer:
                assert tid in starts
                continue
            if run is None:
                assert tid not in starts
                starts[tid] = "call"
            else:
                assert starts[tid] == "notif"
        elif runs.start_by_notif(str(tid)) is not None:
            assert tid not in starts
            starts[tid] = "notif"


def test_racing_copies_start_each_transfer_exactly_once() -> None:
    runs = PushRuns()
    started: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(2)

    def notifs() -> None:
        barrier.wait()
        for i in range(2000):
            if runs.start_by_notif(f"{i}") is not None:
                with lock:
                    started.append(f"{i}")

    def calls() -> None:
        barrier.wait()
        for i in range(2000):
            if runs.claim_by_call(f"{i}") is None:
                with lock:
                    started.append(f"{i}")

    threads = [threading.Thread(target=notifs), threading.Thread(target=calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(started) == sorted(f"{i}" for i in range(2000))


@pytest.mark.parametrize("notifications", [True, False])
def test_a_publish_gets_ready_for_a_push_only_while_readers_are_about(notifications: bool) -> None:
    """PushThreads.expect_read (a Publish) makes the NIXL thread poll for a Push notification only while
    a reader pushed or handshook within READERS_S, and never with push_notifications off: a sidecar
    whose readers are all on its node pays nothing per pull (docs/benchmarks.md)."""
    clock = Clock()
    runs = PushRuns(clock=clock)
    settings = Settings(push_notifications=notifications)
    staging = PushThreads(settings, DataPlane(settings, NixlDriver("t"), Metrics()), runs)
    item = Published("e", "r", [1, 2], 20, 30.0, clock.now + 30)

    staging.expect_read(item, [])  # no reader yet
    assert not runs.recent()
    runs.reader_seen()  # a handshake
    clock.now += 5  # past RECENT_S: no longer polling for it
    assert not runs.recent()
    staging.expect_read(item, [])
    assert runs.recent() is notifications
    clock.now += READERS_S  # the readers went quiet
    staging.expect_read(item, [])
    assert not runs.recent()


class _NoCalls:
    """A peer that is never called: these tests look only at when a link sends notifications."""

    def __init__(self, address: str) -> None:
        self.address = address

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"no peer call expected, got {name}")

    def close(self) -> None:
        pass


def test_a_reader_notifies_only_a_source_that_still_expects_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A source gets ready for notifications (polls for them) only for READERS_S after it last heard
    from a reader; past that a notification would wait 2 or 5 ms for a call that then goes anyway. So a
    reader that has not read from a source for READERS_S less 10 s opens (and pushes) by call at once."""
    clock = Clock()
    monkeypatch.setattr("kv_sidecar.server.peers.time.monotonic", clock)
    monkeypatch.setattr("kv_sidecar.server.notified_opens.time.monotonic", clock)
    metrics, nixl = Metrics(), NixlDriver("reader")
    peers = Peers("reader", nixl, metrics, _NoCalls)  # type: ignore[arg-type]
    opens = NotifiedOpens(True, 0.002, peers, nixl, metrics)
    holder = Holder("src", "127.0.0.1:1", "src-agent")
    link = peers.link(holder.address)
    link.push_key, link.reads_done = b"k" * KEY_BYTES, True
    assert not link.read_lately()  # never read from it
    assert opens.send(holder, peer_pb2.OpenReadRequest()) is None
    link.last_read = clock.now
    clock.now += READERS_S - 11
    assert link.read_lately()
    nixl.route(notifications.TRANSFER_TAG + notifications.SEP)
    nixl.start()
    try:
        sent = opens.send(holder, peer_pb2.OpenReadRequest())
        assert sent is not None  # sent (to an agent NIXL does not know: the call would answer)
        sent.abandon()
    finally:
        nixl.stop()
    clock.now += 2
    assert not link.read_lately()
    assert opens.send(holder, peer_pb2.OpenReadRequest()) is None
