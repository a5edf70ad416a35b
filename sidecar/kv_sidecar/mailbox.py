"""A hand-off queue between threads whose timed get keeps its timeout.

`queue.SimpleQueue.get(timeout=t)` (CPython 3.11, 3.12) can wait for the next put instead of t. Its
lock is left free after every successful get; the next get on an empty queue takes it at once,
finds nothing, and recomputes the time left. A thread that ran past its deadline in between
(preempted on a busy machine) then waits with a negative timeout, which the lock takes as "forever".
The NIXL thread waits 20 us at a time, thousands of times a second: on 2 loaded cores it hung now
and then with transfers in flight that only its own polling could move, and they stalled until their
deadline (tests/test_mailbox.py: its stress catches a SimpleQueue, never a Mailbox).

`Mailbox` keeps SimpleQueue's put and get_nowait (C, no Python lock) and waits on a plain lock used
as a doorbell, whose timed acquire ends at its timeout.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Generic, TypeVar

T = TypeVar("T")


class Mailbox(Generic[T]):
    """Any number of producers and consumers; FIFO. `get` raises `queue.Empty` on timeout."""

    def __init__(self) -> None:
        self._items: queue.SimpleQueue[T] = queue.SimpleQueue()
        self._bell = threading.Lock()
        self._bell.acquire()  # held: nothing new since a consumer last looked

    def put(self, item: T) -> None:
        self._items.put(item)
        self._ring()

    def _ring(self) -> None:
        with contextlib.suppress(RuntimeError):  # already ringing: one ring covers every item
            self._bell.release()

    def get_nowait(self) -> T:
        return self._items.get_nowait()

    def get(self, timeout: float | None = None) -> T:
        """The oldest item, waiting up to `timeout` seconds for one (None: as long as it takes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                pass
            else:
                if not self._items.empty():
                    self._ring()  # one ring may stand for several items: another consumer's turn
                return item
            if deadline is None:
                self._bell.acquire()
                continue
            left = deadline - time.monotonic()
            if left <= 0 or not self._bell.acquire(timeout=left):
                return self._items.get_nowait()  # one last look; raises queue.Empty

    def empty(self) -> bool:
        return self._items.empty()
