"""The hand-off queue of the NIXL thread and the staged transfers (kv_sidecar/mailbox.py).

Its timed get must end at its timeout. queue.SimpleQueue's does not always: a get that finds the
queue empty right after a successful one, and runs past its deadline before it looks again (a
preemption on a busy machine), waits for the next put instead. The stress below catches that in
SimpleQueue a few times in 20,000 rounds on a 2-core machine (2026-11-26: 6 at a 0.1 us timeout, 2
at 20 us); a Mailbox never.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any

import pytest

from kv_sidecar.mailbox import Mailbox

# A get that misses its timeout waits for the next put, i.e. until the watchdog's: forever. A get
# merely preempted on a busy machine ends on its own, and one such took over 50 ms (the first
# threshold) in a full suite run on 2 cores (2026-12-01); a second is far from both.
_STUCK_S = 1.0


def _stuck_gets(q: Any, rounds: int, timeout: float) -> int:
    """Gets on an empty queue just after a successful get that are still waiting `_STUCK_S` later (a
    watchdog puts an item to end each one)."""
    started: list[float | None] = [None]
    stuck = [0]
    stop = threading.Event()

    def watchdog() -> None:
        while not stop.wait(0.01):
            t = started[0]
            if t is not None and time.monotonic() - t > _STUCK_S:
                stuck[0] += 1
                started[0] = None
                q.put(0)

    dog = threading.Thread(target=watchdog, daemon=True)
    dog.start()
    try:
        for _ in range(rounds):
            q.put(1)
            q.get(timeout=timeout)
            started[0] = time.monotonic()
            with contextlib.suppress(queue.Empty):
                q.get(timeout=timeout)
            started[0] = None
            while True:  # a watchdog's item, if it came late
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
    finally:
        stop.set()
        dog.join()
    return stuck[0]


def test_a_timed_get_ends_at_its_timeout_under_stress() -> None:
    """The harness above catches SimpleQueue (6 and 2 stuck gets in these rounds, ~4 s, here)."""
    assert _stuck_gets(Mailbox(), 20_000, 1e-7) == 0
    assert _stuck_gets(Mailbox(), 20_000, 2e-5) == 0


def test_fifo_timeout_and_no_wait() -> None:
    box: Mailbox[int] = Mailbox()
    for i in range(5):
        box.put(i)
    assert [box.get(timeout=1) for _ in range(5)] == list(range(5))
    assert box.empty()
    with pytest.raises(queue.Empty):
        box.get_nowait()
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        box.get(timeout=0.05)
    assert 0.05 <= time.monotonic() - t0 < 1.0
    with pytest.raises(queue.Empty):
        box.get(timeout=0)


def test_a_put_wakes_a_waiting_get() -> None:
    box: Mailbox[str] = Mailbox()
    threading.Timer(0.05, box.put, args=("late",)).start()
    t0 = time.monotonic()
    assert box.get(timeout=10) == "late"
    assert time.monotonic() - t0 < 5
    threading.Timer(0.05, box.put, args=("forever",)).start()
    assert box.get() == "forever"  # no timeout: waits as long as it takes


def test_every_item_reaches_one_of_several_consumers() -> None:
    """One ring of the bell may stand for several items: no consumer is left asleep beside one."""
    box: Mailbox[int] = Mailbox()
    got: list[int] = []
    lock = threading.Lock()
    n, consumers = 2_000, 4

    def consume() -> None:
        while True:
            try:
                item = box.get(timeout=5)
            except queue.Empty:
                return
            if item < 0:
                return
            with lock:
                got.append(item)

    threads = [threading.Thread(target=consume) for _ in range(consumers)]
    for t in threads:
        t.start()
    for i in range(n):
        box.put(i)
    for _ in threads:
        box.put(-1)
    for t in threads:
        t.join(30)
    assert sorted(got) == list(range(n))
