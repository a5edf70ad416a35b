"""The NIXL driver thread: its timed waits, notifications sent from it, and parked pollers."""

from __future__ import annotations

import ctypes
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from kv_sidecar.transport import nixl_driver
from kv_sidecar.transport.nixl_driver import PARK, NixlDriver, TransferError, ended

_PR_GET_TIMERSLACK = 30


def _timer_slack_ns() -> int:
    return int(ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timer slack is Linux's")
def test_the_driver_thread_waits_without_timer_slack_and_leaves_other_threads_alone() -> None:
    before = _timer_slack_ns()
    driver = NixlDriver("slack-test", on_notif=lambda agent, msg: None)
    driver.start()
    try:
        # Measured on the driver thread itself: a 20 us poll there took ~100 us under the default 50 us.
        assert driver.call(lambda _agent: _timer_slack_ns()) == 1_000
        assert _timer_slack_ns() == before  # the caller's threads keep theirs
    finally:
        driver.stop()


def test_a_notification_that_cannot_be_sent_is_logged_and_its_future_still_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    driver = NixlDriver("notify-test", on_notif=lambda agent, msg: None)
    driver.start()
    try:
        # A reader waits on this future before preparing its copies: it must end, sent or not.
        sent = driver.notify("no-such-agent", b"hello")
        assert sent.result(timeout=10) is None
        assert "could not send a NIXL notification to no-such-agent" in caplog.text
    finally:
        driver.stop()


def test_a_notification_only_if_loaded_goes_to_a_loaded_agent_and_skips_any_other_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    heard: queue.Queue[tuple[str, bytes]] = queue.Queue()
    sender = NixlDriver("if-loaded-sender", on_notif=lambda agent, msg: None)
    receiver = NixlDriver("if-loaded-receiver", on_notif=lambda agent, msg: heard.put((agent, msg)))
    sender.start()
    receiver.start()
    try:
        sender.notify("if-loaded-receiver", b"before", only_loaded=True)  # not loaded: skipped, no warning
        sender.add_remote(receiver.metadata(), "if-loaded-receiver")
        sender.notify("if-loaded-receiver", b"after", only_loaded=True)
        assert heard.get(timeout=10) == ("if-loaded-sender", b"after")
        with pytest.raises(queue.Empty):
            heard.get(timeout=0.3)
        assert "could not send" not in caplog.text
    finally:
        sender.stop()
        receiver.stop()


def test_a_parked_poller_is_not_run_until_resumed_and_is_told_of_shutdown() -> None:
    """A reception waiting for its next chunk parks (dataplane/receive.py): the loop must not poll it
    every turn, must poll it again once resumed, and must still tell it that the agent is going."""
    driver = NixlDriver("park-test", on_notif=lambda agent, msg: None)
    driver.start()
    calls: list[object] = []
    answers = [PARK, PARK, False, PARK]  # park; (resumed) park; poll again; park

    def poller(agent: object) -> bool | str:
        calls.append(agent)
        return answers[len(calls) - 1] if len(calls) <= len(answers) else PARK

    try:
        assert driver.poller_state(poller) == "not registered"
        driver.add_poller(poller)
        wait_until(lambda: len(calls) == 1)
        time.sleep(0.05)  # hundreds of loop turns
        assert len(calls) == 1, "a parked poller was polled"
        assert driver.poller_state(poller) == "parked"  # what a stalled transfer's error says
        driver.resume(poller)
        wait_until(lambda: len(calls) == 2)
        driver.resume(poller)  # parked again: runs, answers False, runs the next turn, parks
        wait_until(lambda: len(calls) == 4)
        time.sleep(0.05)
        assert len(calls) == 4
        assert all(a is not None for a in calls)
    finally:
        driver.stop()
    assert calls[-1] is None, "a parked poller must hear that the driver is shutting down"


def test_an_eager_poller_alone_is_polled_at_the_lone_period_and_with_others_at_the_busy_one() -> None:
    """A lone staged transfer of several chunks polls faster (nixl_lone_poll_us); once another
    transfer's poller joins, both go at the busy period, and the lone one speeds up again when it
    leaves. Periods far apart (1 ms against 50 ms) so that the rates tell them apart on a loaded host."""
    driver = NixlDriver("lone-test", on_notif=lambda agent, msg: None, busy_wait_s=0.05, lone_wait_s=0.001)
    driver.start()
    eager: list[float] = []
    other_done = threading.Event()

    def fast(_agent: object) -> bool:
        eager.append(time.monotonic())
        return False

    def other(agent: object) -> bool:
        return agent is None or other_done.is_set()

    def turns(seconds: float) -> int:
        start = len(eager)
        time.sleep(seconds)
        return len(eager) - start

    try:
        driver.add_poller(fast, eager=True)
        wait_until(lambda: len(eager) > 0)
        alone = turns(0.3)
        driver.add_poller(other)
        time.sleep(0.06)  # one busy wait for the loop to take it
        shared = turns(0.3)
        other_done.set()
        time.sleep(0.06)
        alone_again = turns(0.3)
    finally:
        driver.stop()
    assert alone > 60, alone  # ~300 at 1 ms
    assert shared < 15, shared  # ~6 at 50 ms
    assert alone_again > 60, alone_again

    plain = NixlDriver("plain-test", on_notif=lambda agent, msg: None, busy_wait_s=0.05, lone_wait_s=0.001)
    plain.start()
    calls: list[float] = []
    try:
        plain.add_poller(lambda _a: calls.append(0.0) or False)  # not eager: a one-chunk transfer
        wait_until(lambda: len(calls) > 0)
        start = len(calls)
        time.sleep(0.3)
        assert len(calls) - start < 15
    finally:
        plain.stop()


def test_a_transfer_past_its_own_deadline_has_ended_and_only_a_pending_one_has_not() -> None:
    """The driver fails a transfer whose NIXL deadline passed with TimeoutError, having released its
    handle: it has ended, like a done or failed one. A source that took that TimeoutError for its own
    wait running out kept its send slots out of the ring for QUARANTINE_S (seen once on CI)."""
    timed_out: Future[None] = Future()
    timed_out.set_exception(TimeoutError("NIXL transfer did not finish before its deadline"))
    failed: Future[None] = Future()
    failed.set_exception(TransferError("NIXL transfer cancelled"))
    done: Future[None] = Future()
    done.set_result(None)
    assert ended([timed_out, failed, done], 0)
    assert ended([], 0)

    pending: Future[None] = Future()
    t0 = time.monotonic()
    assert not ended([done, pending], 0.05)
    assert time.monotonic() - t0 >= 0.05, "it waited its timeout for the pending one"
    threading.Timer(0.05, pending.set_exception, [TimeoutError("past its deadline")]).start()
    assert ended([timed_out, pending], 5), "one that ends while waited for has ended"


class _Uncancellable:
    """A transfer handle NIXL refuses to release (an active transfer it cannot cancel), `refusals`
    times; no CPU transfer can be made to do this, so the handle stands in for one."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.tries = 0

    def release(self) -> None:
        self.tries += 1
        if self.tries <= self.refusals:
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")


def test_a_transfer_nixl_cannot_cancel_at_its_deadline_stays_polled_then_is_given_up() -> None:
    """Past its deadline a transfer whose handle NIXL will not release stays polled (its future
    pending: bytes may still land), tried again every CANCEL_RETRY_S, not at every poll turn; once it
    can be released it ends; OVERDUE_GIVE_UP_S past its deadline it is dropped from the polls."""
    driver = NixlDriver("overdue")  # not started: the bookkeeping alone
    handle = _Uncancellable(refusals=2)
    x = nixl_driver._Inflight(handle, Future(), 0.0, deadline=100.0)
    assert not driver._cancel_overdue(x, 100.0)
    assert not driver._cancel_overdue(x, 100.0 + nixl_driver.CANCEL_RETRY_S / 2)
    assert handle.tries == 1, "not tried again before CANCEL_RETRY_S"
    assert not driver._cancel_overdue(x, 100.0 + nixl_driver.CANCEL_RETRY_S)
    assert driver._cancel_overdue(x, 100.0 + 2 * nixl_driver.CANCEL_RETRY_S)  # released at last
    assert handle.tries == 3 and driver.counts()["release_failures"] == 1  # counted once a transfer

    stuck = nixl_driver._Inflight(_Uncancellable(refusals=10**9), Future(), 0.0, deadline=100.0)
    assert not driver._cancel_overdue(stuck, 100.0 + nixl_driver.OVERDUE_GIVE_UP_S / 2)
    assert driver._cancel_overdue(stuck, 100.0 + nixl_driver.OVERDUE_GIVE_UP_S)


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


# A peer sidecar's NIXL agent in a process of its own (two agents of one process do not reach each
# other's memory over UCX): it registers 64 bytes of value `fill` and prints its metadata and address.
_PEER = """
import sys, torch
from kv_sidecar.transport.nixl_driver import NixlDriver
buf = torch.full((64,), int(sys.argv[2]), dtype=torch.uint8)
d = NixlDriver(sys.argv[1], on_notif=lambda agent, msg: None)  # its loop progresses the agent
d.start()
d.register([(buf.data_ptr(), 64, 0)])
print("PEER", d.metadata().hex(), buf.data_ptr(), flush=True)
sys.stdin.read()
"""


def _peer(name: str, fill: int) -> tuple[subprocess.Popen[str], bytes, int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _PEER, name, str(fill)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = ""
    while not line.startswith("PEER "):  # NIXL logs to stdout too
        line = proc.stdout.readline()
        assert line, "the peer process ended"
    _, blob, addr = line.split()
    return proc, bytes.fromhex(blob), int(addr)


def test_a_peer_loaded_again_under_its_name_voids_the_lists_prepared_against_its_old_agent() -> None:
    """A peer sidecar restarted under the same id: NIXL refuses lists prepared against its old agent
    ("prepped descriptor lists must be re-created"), so loading it again releases them and bumps the
    agent's generation (server/nixl_reads.py keys its lists on it), and a list prepared again reads
    the new peer's memory."""
    dst = torch.zeros(64, dtype=torch.uint8)
    local_table = np.array([[dst.data_ptr(), 64, 0]], dtype=np.uint64)
    one = np.array([0])
    reader = NixlDriver("generation-reader", on_notif=lambda agent, msg: None)
    reader.start()
    procs: list[subprocess.Popen[str]] = []
    try:
        reader.register([(dst.data_ptr(), 64, 0)])
        local = reader.prep_dlist("", local_table)
        first, blob, addr = _peer("generation-peer", 3)
        procs.append(first)
        assert reader.add_remote(blob, "generation-peer") == "generation-peer"
        assert reader.add_remote(blob, "generation-peer") == "generation-peer"  # the same blob: no change
        assert reader.generation("generation-peer") == 0
        old = reader.prep_dlist("generation-peer", np.array([[addr, 64, 0]], dtype=np.uint64))
        reader.read_prepped(local, one, old, one, b"", 10).result(timeout=10)
        assert (dst == 3).all()

        first.kill()
        first.wait()
        second, blob, addr = _peer("generation-peer", 7)
        procs.append(second)
        dst.zero_()
        assert reader.add_remote(blob, "generation-peer") == "generation-peer"
        assert reader.generation("generation-peer") == 1
        with pytest.raises(TransferError, match="loaded again"):
            reader.read_prepped(local, one, old, one, b"", 10).result(timeout=10)
        assert not dst.any(), "a refused read wrote nothing"
        again = reader.prep_dlist("generation-peer", np.array([[addr, 64, 0]], dtype=np.uint64))
        reader.read_prepped(local, one, again, one, b"", 10).result(timeout=10)
        assert (dst == 7).all()
    finally:
        reader.stop()
        for p in procs:
            p.kill()
            p.wait()


def test_slot_writes_from_kept_lists_land_exactly_and_survive_eviction_and_a_peer_restart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """write_slot_now WRITEs one region into a peer's from one-descriptor lists it prepares once and
    keeps: the bytes land where asked and nowhere else; the same regions again make no new list; past
    WRITE_LISTS_MAX the least recently used list is released and later WRITEs still land; a peer that
    restarted under its name gets lists made again against its new agent."""
    monkeypatch.setattr(nixl_driver, "WRITE_LISTS_MAX", 3)
    src = torch.arange(64, dtype=torch.uint8)
    back = torch.zeros(64, dtype=torch.uint8)
    writer = NixlDriver("slot-writer", on_notif=lambda agent, msg: None)
    writer.start()
    procs: list[subprocess.Popen[str]] = []
    try:
        writer.register([(src.data_ptr(), 64, 0), (back.data_ptr(), 64, 0)])
        whole = writer.prep_dlist("", np.array([[back.data_ptr(), 64, 0]], dtype=np.uint64))

        def write(addr: int, at: int, n: int) -> None:
            local, remote = (src.data_ptr() + at, n, 0), (addr + at, n, 0)
            writer.call(
                lambda a: writer.write_slot_now(a, "slot-peer", local, remote, b"", 10, "DRAM")
            ).result(timeout=10)

        def peer_bytes(addr: int) -> torch.Tensor:
            remote = writer.prep_dlist("slot-peer", np.array([[addr, 64, 0]], dtype=np.uint64))
            writer.read_prepped(whole, np.array([0]), remote, np.array([0]), b"", 10).result(timeout=10)
            writer.release_dlist(remote)
            return back.clone()

        def peer(fill: int) -> int:
            proc, blob, addr = _peer("slot-peer", fill)
            procs.append(proc)
            assert writer.add_remote(blob, "slot-peer") == "slot-peer"
            return addr

        addr = peer(3)
        lists = writer.counts()["dlists"]
        write(addr, 0, 16)
        assert writer.counts()["dlists"] == lists + 2  # ours and the peer's
        write(addr, 0, 16)
        assert writer.counts()["dlists"] == lists + 2, "the same regions again reuse their lists"
        want = torch.full((64,), 3, dtype=torch.uint8)
        want[:16] = src[:16]
        assert torch.equal(peer_bytes(addr), want)

        write(addr, 32, 8)  # two more lists: past the limit of 3, the least recently used goes
        write(addr, 48, 16)
        assert writer.counts()["dlists"] <= lists + 3
        write(addr, 0, 16)  # its lists were released: made again
        want[32:40], want[48:] = src[32:40], src[48:]
        assert torch.equal(peer_bytes(addr), want)

        procs[0].kill()
        procs[0].wait()
        addr = peer(7)  # restarted under its name: the lists against its old agent are void
        write(addr, 0, 16)
        want = torch.full((64,), 7, dtype=torch.uint8)
        want[:16] = src[:16]
        assert torch.equal(peer_bytes(addr), want)
    finally:
        writer.stop()
        for p in procs:
            p.kill()
            p.wait()
