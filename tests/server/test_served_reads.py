"""A served read's life on the source: which reader ranks it waits for, and that it ends with its request.

PublishedStore and TransferTracker are pure (no gRPC, NIXL or processes); they
are wired here as the sidecar wires them.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.plan.pair import PairPlan, plan_pair
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.server.published import PublishedStore
from kv_sidecar.server.reads import begin_serve
from kv_sidecar.server.transfers import TransferTracker


def tp_spec(tp: int) -> EngineSpec:
    return EngineSpec.from_dict(
        {
            "tp_size": tp,
            "num_layers": 2,
            "num_kv_heads": 4,
            "head_dim": 64,
            "dtype": "bfloat16",
            "block_size": 16,
            "num_blocks": 32,
            "layout": "flash_attn_nhd",
        }
    )


class Source:
    """One source sidecar's stores; `ranks`: the prefill ranks it holds (None: all)."""

    def __init__(self, ranks: list[int] | None = None) -> None:
        self.tracker = TransferTracker()
        self.consumed: list[int] = []
        self.store = PublishedStore(
            lambda _e, rank, _item: self.consumed.append(rank),
            lambda _item: None,
            on_ended=self.tracker.end_serves,
        )
        self.ranks = ranks

    def open(
        self, plan: PairPlan, reader_ranks: list[int], meanwhile: Callable[[], object] = lambda: None
    ) -> list[int]:
        """OpenRead's bookkeeping (server/reads.py): returns the reader ranks the read waits for.
        `meanwhile` runs between the open and the serve's start (another thread's turn)."""
        item = self.store.open_read("p", "r", "d", plan, reader_ranks, 30.0)
        served = self.store.readers_here(item, reader_ranks)
        meanwhile()
        if served:
            begin_serve(self.store, self.tracker, item, "d", "peer", served, 0, "host-nixl")
        return served

    def in_flight(self) -> list[str]:
        return [f"{t.kind} {t.request_id}" for t in self.tracker.inflight()]


@pytest.mark.parametrize("why", ["release", "abort"])
def test_a_request_ending_early_ends_its_open_reads(why: str) -> None:
    src = Source()
    plan = plan_pair(tp_spec(1), tp_spec(1))
    src.store.publish("p", "r", [3, 4], 20, 30.0)
    assert src.open(plan, [0]) == [0]
    assert src.in_flight() == ["serve r"]
    if why == "release":
        assert src.store.release("p", "r", "d", "the reader gave it up") is not None
    else:
        assert src.store.abort("p", "r")
    assert src.in_flight() == []


def test_a_request_that_ends_between_its_open_and_its_serve_leaves_no_read_open() -> None:
    """A reader gives a request up (release) while the source, slow, is still opening a read of it that
    the reader sent before: the release ends the reads open then, and the one whose serve starts
    after it must end too, not wait 30 s for a done notification (a CI flake of
    tests/e2e/test_concurrent_ranks.py::test_abort_stops_every_pull_of_the_request)."""
    src = Source()
    plan = plan_pair(tp_spec(1), tp_spec(1))
    src.store.publish("p", "r", [3, 4], 20, 30.0)
    released = src.open(
        plan, [0], meanwhile=lambda: src.store.release("p", "r", "d", "the reader gave it up")
    )
    assert released == [0]
    assert src.in_flight() == []


def test_a_consumed_request_ends_its_read_through_the_notifications_only() -> None:
    src = Source()
    plan = plan_pair(tp_spec(2), tp_spec(2))
    src.store.publish("p", "r", [3, 4], 20, 30.0)
    assert src.open(plan, [0, 1]) == [0, 1]
    src.store.mark_done("p", "r", "d", 0, [0])
    src.tracker.serve_rank_done("p", "r", "d", 0)
    assert src.in_flight() == ["serve r"]  # decode rank 1 has not notified yet
    src.store.mark_done("p", "r", "d", 1, [1])  # the request ends here as "consumed"...
    assert src.in_flight() == ["serve r"]  # ...which leaves the read to its last notification
    src.tracker.serve_rank_done("p", "r", "d", 1)
    assert (src.in_flight(), sorted(src.consumed)) == ([], [0, 1])


def test_a_member_waits_only_for_the_reader_ranks_that_read_its_ranks() -> None:
    # Prefill TP 2 spread over two sidecars, decode TP 2: decode rank r reads prefill rank r.
    plan = plan_pair(tp_spec(2), tp_spec(2))
    holders = {0: Source(ranks=[0]), 1: Source(ranks=[1])}
    for rank, src in holders.items():
        src.store.publish("p", "r", [3, 4], 20, 30.0, ranks=[rank])
        assert src.open(plan, [0, 1]) == [rank]  # every holder is opened with all reader ranks
    for rank, src in holders.items():
        src.store.mark_done("p", "r", "d", rank, [rank])
        src.tracker.serve_rank_done("p", "r", "d", rank)
        assert (src.in_flight(), src.consumed) == ([], [rank])


def test_an_open_that_comes_again_after_its_read_is_done_opens_no_read() -> None:
    """A reader rank's open went as a notification and, its answer late on a loaded host, as the call
    too; the call arrived after that rank had read and notified. It must not begin a read that waits for
    a notification already sent (it stayed in flight until it timed out: a flake of
    tests/e2e/test_concurrent_ranks.py, the next test's "nothing in flight" seeing it)."""
    src = Source()
    plan = plan_pair(tp_spec(2), tp_spec(2))
    src.store.publish("p", "r", [3, 4], 20, 30.0)
    assert src.open(plan, [0]) == [0]
    src.store.mark_done("p", "r", "d", 0, [0])
    src.tracker.serve_rank_done("p", "r", "d", 0)
    assert src.in_flight() == []
    assert src.open(plan, [0]) == []  # the late copy of rank 0's open
    assert src.in_flight() == []
    assert src.open(plan, [1]) == [1]  # rank 1 still reads
    assert src.in_flight() == ["serve r"]


def test_the_same_open_twice_counts_its_bytes_once() -> None:
    """An open sent as a notification and then as the call too (server/notified_opens.py) opens the
    same read twice: one served read, its bytes counted once; a retry after a failure counts again."""
    tracker = TransferTracker()
    tracker.begin_serve("p", "r", "d", "peer", [0, 1], 100, "host-nixl")
    tracker.begin_serve("p", "r", "d", "peer", [0, 1], 100, "host-nixl")
    (t,) = tracker.inflight()
    assert (t.bytes, t.pending) == (100, {0, 1})
    tracker.serve_failed("p", "r", "d", [1])
    tracker.begin_serve("p", "r", "d", "peer", [1], 50, "host-nixl")
    (t,) = tracker.inflight()
    assert (t.bytes, t.pending) == (150, {0, 1})


def _wired() -> tuple[PublishedStore, TransferTracker, list[int]]:
    tracker, consumed = TransferTracker(), []
    store = PublishedStore(
        lambda _e, rank, _item: consumed.append(rank),
        lambda _item: None,
        on_ended=tracker.end_serves,
        on_taken_over=tracker.serve_failed,
    )
    return store, tracker, consumed


def test_another_reader_takes_a_request_over_only_once_its_reader_failed() -> None:
    """One reader per request, so that no engine reads blocks another's "consumed" freed: a second
    engine is refused while the first reads, and takes the request over once the first's read failed
    here (its transfer failed: its sidecar died; or it said so), its served read ending as failed. The
    first's late done notification then changes nothing, and "consumed" follows the new reader."""
    store, tracker, consumed = _wired()
    plan = plan_pair(tp_spec(1), tp_spec(1))
    store.publish("p", "r", [3, 4], 20, 30.0)
    item = store.open_read("p", "r", "d1", plan, [0], 30.0)
    begin_serve(store, tracker, item, "d1", "peer", [0], 0, "host-ring")
    with pytest.raises(SidecarError) as info:
        store.open_read("p", "r", "d2", plan, [0], 30.0)
    assert (
        info.value.code is Code.FAILED_PRECONDITION
        and "already being read by engine 'd1'" in info.value.message
    )
    store.read_failed("p", "r", "d2")  # not its reader: nothing changes
    with pytest.raises(SidecarError):
        store.open_read("p", "r", "d2", plan, [0], 30.0)
    store.read_failed("p", "r", "d1")
    item = store.open_read("p", "r", "d2", plan, [0], 30.0)
    assert item.reader == "d2" and item.pending == {0: {0}}
    assert [t.remote_engine for t in tracker.inflight()] == []  # d1's served read ended, failed
    begin_serve(store, tracker, item, "d2", "peer", [0], 0, "host-ring")
    with pytest.raises(SidecarError):  # d1, come back, does not take it back: d2 reads
        store.open_read("p", "r", "d1", plan, [0], 30.0)
    store.mark_done("p", "r", "d1", 0, [0])  # a stale done of d1
    assert consumed == [] and len(store) == 1
    store.mark_done("p", "r", "d2", 0, [0])
    assert consumed == [0] and len(store) == 0


def test_a_reader_that_failed_may_open_again_and_then_holds_the_request() -> None:
    store, _, _ = _wired()
    plan = plan_pair(tp_spec(1), tp_spec(1))
    store.publish("p", "r", [3, 4], 20, 30.0)
    store.open_read("p", "r", "d1", plan, [0], 30.0)
    store.read_failed("p", "r", "d1")
    store.open_read("p", "r", "d1", plan, [0], 30.0)  # its retry
    with pytest.raises(SidecarError):
        store.open_read("p", "r", "d2", plan, [0], 30.0)


def test_no_takeover_once_a_consumed_event_fired() -> None:
    """A reader of two ranks: one done fired "consumed" for its prefill rank (whose blocks the engine may
    free), the other failed. Another engine reading now would read freed blocks: it is refused."""
    store, _, consumed = _wired()
    plan = plan_pair(tp_spec(2), tp_spec(2))
    store.publish("p", "r", [3, 4], 20, 30.0)
    store.open_read("p", "r", "d1", plan, [0, 1], 30.0)
    store.mark_done("p", "r", "d1", 0, [0])
    assert consumed == [0]
    store.read_failed("p", "r", "d1")
    with pytest.raises(SidecarError) as info:
        store.open_read("p", "r", "d2", plan, [0, 1], 30.0)
    assert "already being read by engine 'd1'" in info.value.message
