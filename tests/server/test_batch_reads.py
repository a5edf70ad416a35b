"""A PullBatch's staged reads held until all of them are there (server/batch_reads.py), then queued
together on GroupCommit (server/group_commit.py): one group per pair instead of the first ones alone."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor

from kv_sidecar.server.batch_reads import BatchReads
from kv_sidecar.server.group_commit import GroupCommit, Waiter


class _Reader:
    """What StagedReader.read does with a batch member's read, over a GroupCommit whose runs it records."""

    def __init__(self, at_once: int = 2) -> None:
        self.gc: GroupCommit[int, int] = GroupCommit(most=64, at_once=at_once)
        self.groups: list[tuple[Hashable, list[int]]] = []
        self._lock = threading.Lock()

    def lead(self, key: Hashable) -> Callable[[list[int]], list[int | BaseException]]:
        def run(items: list[int]) -> list[int | BaseException]:
            with self._lock:
                self.groups.append((key, sorted(items)))
            time.sleep(0.01)  # a transfer takes a while: later reads queue behind it
            return [10 * x for x in items]

        return run

    def read(self, batch: BatchReads | None, member: object, key: Hashable, item: int) -> int:
        me: Waiter[int, int] = Waiter(item)
        if batch is not None and batch.arrive(member, key, me, self.gc.enqueue):
            return self.gc.finish(key, me, self.lead(key))
        return self.gc.run(key, item, self.lead(key))


def _members(n: int) -> list[object]:
    return [object() for _ in range(n)]


def test_without_a_batch_the_first_reads_go_alone() -> None:
    """The behaviour this module exists for: reads arriving together on an idle pair, one by one, go as
    1, 1 and the rest (two runs at once)."""
    r = _Reader()
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: r.read(None, None, "k", i), range(8)))
    assert outs == [10 * i for i in range(8)]
    assert len(r.groups) >= 3


def test_a_batch_of_reads_on_one_pair_goes_as_one_group() -> None:
    r = _Reader()
    batch, members = BatchReads(8, hold_s=10), _members(8)
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: r.read(batch, members[i], "k", i), range(8)))
    assert outs == [10 * i for i in range(8)]
    assert r.groups == [("k", list(range(8)))]
    assert not r.gc._keys  # nothing left behind


def test_reads_on_other_pairs_go_as_a_group_per_pair() -> None:
    r = _Reader()
    batch, members = BatchReads(6, hold_s=10), _members(6)
    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda i: r.read(batch, members[i], f"pair{i % 2}", i), range(6)))
    assert outs == [10 * i for i in range(6)]
    assert sorted(r.groups) == [("pair0", [0, 2, 4]), ("pair1", [1, 3, 5])]


def test_members_that_leave_hold_nobody() -> None:
    """Members that take another path, or fail first, say so: the rest go at once, not after hold_s."""
    r = _Reader()
    batch, members = BatchReads(5, hold_s=10), _members(5)
    t0 = time.monotonic()
    with ThreadPoolExecutor(5) as pool:
        for m in members[3:]:
            pool.submit(batch.leave, m)
        outs = list(pool.map(lambda i: r.read(batch, members[i], "k", i), range(3)))
    assert time.monotonic() - t0 < 5
    assert outs == [0, 10, 20] and r.groups == [("k", [0, 1, 2])]
    batch.leave(None)  # one refused before it had a ticket, after the rest went: nothing to do


def test_a_member_that_never_comes_holds_the_others_at_most_hold_s_and_a_late_one_goes_alone() -> None:
    r = _Reader()
    batch, members = BatchReads(4, hold_s=0.3), _members(4)
    t0 = time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda i: r.read(batch, members[i], "k", i), range(3)))
    waited = time.monotonic() - t0
    assert 0.3 <= waited < 5, waited
    assert outs == [0, 10, 20] and r.groups == [("k", [0, 1, 2])]
    # The fourth comes after the others went, and a member's second read (a pull that runs it again):
    # neither is held, each is queued as any read is.
    assert r.read(batch, members[3], "k", 3) == 30
    assert r.read(batch, members[0], "k", 0) == 0
    assert r.groups[1:] == [("k", [3]), ("k", [0])]


def test_a_batch_that_arrives_while_its_pair_is_busy_waits_as_one_group_behind_the_runs() -> None:
    r = _Reader(at_once=1)
    release, running = threading.Event(), threading.Event()

    def slow(items: list[int]) -> list[int | BaseException]:
        running.set()
        release.wait(10)
        return [-1]

    with ThreadPoolExecutor(6) as pool:
        first = pool.submit(r.gc.run, "k", -1, slow)
        assert running.wait(10)
        batch, members = BatchReads(4, hold_s=10), _members(4)
        outs = [pool.submit(r.read, batch, members[i], "k", i) for i in range(4)]
        while len(r.gc._keys["k"].queue) < 4:
            time.sleep(0.001)
        release.set()
        assert first.result(10) == -1
        assert [f.result(10) for f in outs] == [0, 10, 20, 30]
    assert r.groups == [("k", [0, 1, 2, 3])]


def test_members_refused_before_they_had_a_ticket_each_count() -> None:
    r = _Reader()
    batch, members = BatchReads(4, hold_s=10), _members(2)
    t0 = time.monotonic()
    batch.leave(None)
    batch.leave(None)
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda i: r.read(batch, members[i], "k", i), range(2)))
    assert time.monotonic() - t0 < 5 and outs == [0, 10] and r.groups == [("k", [0, 1])]
