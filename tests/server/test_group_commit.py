"""Group commit (server/group_commit.py): what waits while a key's work runs goes next as one group."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kv_sidecar.server.group_commit import GroupCommit, _Done


def test_alone_an_item_runs_at_once_by_itself() -> None:
    groups: list[list[int]] = []
    gc: GroupCommit[int, int] = GroupCommit(most=8, at_once=1)
    for i in range(3):
        assert gc.run("k", i, lambda items: groups.append(items) or [10 * x for x in items]) == 10 * i
    assert groups == [[0], [1], [2]]


def test_what_arrives_while_a_run_goes_is_one_group_next_each_with_its_own_outcome() -> None:
    gc: GroupCommit[int, int] = GroupCommit(most=8, at_once=1)
    groups: list[list[int]] = []
    first_running, release = threading.Event(), threading.Event()

    def lead(items: list[int]) -> list[int | BaseException]:
        groups.append(items)
        if items == [0]:
            first_running.set()
            release.wait(10)
        return [ValueError(f"bad {x}") if x == 3 else x * 10 for x in items]

    with ThreadPoolExecutor(6) as pool:
        first = pool.submit(gc.run, "k", 0, lead)
        assert first_running.wait(10)
        rest = {i: pool.submit(gc.run, "k", i, lead) for i in range(1, 6)}
        while len(gc._keys["k"].queue) < 5:  # every other item waits
            time.sleep(0.001)
        release.set()
        assert first.result(10) == 0
        for i, fut in rest.items():
            if i == 3:
                with pytest.raises(ValueError, match="bad 3"):
                    fut.result(10)
            else:
                assert fut.result(10) == i * 10
    assert groups[0] == [0] and sorted(groups[1]) == [1, 2, 3, 4, 5] and len(groups) == 2
    assert not gc._keys  # nothing left behind


def test_groups_hold_at_most_most_and_keys_do_not_wait_for_each_other() -> None:
    gc: GroupCommit[int, int] = GroupCommit(most=2, at_once=1)
    sizes: list[int] = []
    gate = threading.Event()

    def lead(items: list[int]) -> list[int | BaseException]:
        sizes.append(len(items))
        gate.wait(10)
        return list(items)

    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(gc.run, "a", i, lead) for i in range(5)]
        while not gc._keys.get("a") or len(gc._keys["a"].queue) < 4:
            time.sleep(0.001)
        assert gc.run("b", 99, lambda items: [7 for _ in items]) == 7  # another key goes at once
        gate.set()
        assert sorted(f.result(10) for f in futs) == list(range(5))
    assert max(sizes) <= 2 and sum(sizes) == 5


def test_a_group_that_raises_raises_for_each_of_its_items() -> None:
    gc: GroupCommit[int, int] = GroupCommit(most=4, at_once=1)

    def lead(items: list[int]) -> list[int | BaseException]:
        raise RuntimeError("the transfer broke")

    with pytest.raises(RuntimeError, match="the transfer broke"):
        gc.run("k", 1, lead)
    assert not gc._keys


def test_an_item_stopped_while_it_waits_leaves_the_queue_at_once() -> None:
    """A waiting read whose pull is aborted (or times out) ends now, not when the runs before it end
    (which may hang until their own deadline)."""
    gc: GroupCommit[int, int] = GroupCommit(most=8, at_once=1)
    running, release = threading.Event(), threading.Event()
    stopped = threading.Event()
    groups: list[list[int]] = []

    def lead(items: list[int]) -> list[int | BaseException]:
        groups.append(items)
        running.set()
        release.wait(10)
        return list(items)

    def check() -> None:
        if stopped.is_set():
            raise TimeoutError("stopped")

    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(gc.run, "k", 0, lead)
        assert running.wait(10)
        waiting = pool.submit(gc.run, "k", 1, lead, check)
        other = pool.submit(gc.run, "k", 2, lead)
        while len(gc._keys["k"].queue) < 2:
            time.sleep(0.001)
        t0 = time.monotonic()
        stopped.set()
        with pytest.raises(TimeoutError):
            waiting.result(5)
        assert time.monotonic() - t0 < 1 and not first.done()
        release.set()
        assert first.result(10) == 0 and other.result(10) == 2
    assert groups == [[0], [2]]  # the stopped item never ran


def test_a_waiter_woken_from_another_thread_at_any_moment_of_its_wait_wakes() -> None:
    """Its news set before, while or after its thread makes the Event it waits on: the wait ends at
    once, never at its timeout."""
    for delay in [0.0, 1e-6, 1e-5, 1e-4, 1e-3] * 40:
        done = _Done()
        t = threading.Timer(delay, done.set)
        t.start()
        start = time.monotonic()
        assert done.wait(2.0)
        assert time.monotonic() - start < 1.0 and done.is_set()
        t.join()
