"""A PullBatch's staged reads held at the staged reader until all of them are there, so that they go
as one transfer per (source rank, decode rank) pair.

Group commit (server/group_commit.py) groups the reads that arrive while a transfer of their pair
runs; the first read on an idle pair goes at once, alone. A batch's members reach the staged reader
one by one from the batch's pool, so a batch of 16 went as transfers of 1, 1 and 14 and waited for
two of them (`bench/node_scaling.py --per-call 16`: 5.2 reads per transfer on host rings). Here each
member's read waits until every member of its batch that may still read this way has arrived or said
it will not (`leave`), at most HOLD_S (a member held up, by a first handshake say, does not hold the
others longer), and then they are queued together, pair by pair.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

from kv_sidecar.server.group_commit import Waiter

# The longest a member's read waits for the rest of its batch. Members reach the reader within a few
# milliseconds of each other; this bounds what a slow one costs the others.
HOLD_S = 0.05

Enqueue = Callable[[Hashable, list[Waiter[Any, Any]]], None]


class BatchReads:
    """The staged reads of one PullBatch's members from other sidecars (`members` of them)."""

    def __init__(self, members: int, hold_s: float = HOLD_S) -> None:
        self._members = members
        self._hold_s = hold_s
        self._lock = threading.Lock()
        # Members (their PullTickets) that arrived or left, kept by id and held, so that no id is reused
        # while the batch lasts; and how many left without a ticket.
        self._seen: dict[int, object] = {}
        self._unnamed = 0
        self._arrived: list[tuple[Hashable, Waiter[Any, Any]]] = []
        self._enqueue: Enqueue | None = None  # the reader's GroupCommit.enqueue, as the arrivals give it
        self._letting_go = False
        self._let_go = threading.Event()

    def arrive(self, member: object, key: Hashable, waiter: Waiter[Any, Any], enqueue: Enqueue) -> bool:
        """Hold `member`'s read (`waiter`, on pair `key`) for the rest of the batch; True once it is queued
        with them (`enqueue(key, waiters)`: GroupCommit.enqueue). False: the batch's reads went already,
        or this member's did (a pull that runs its read again): the caller queues it alone."""
        with self._lock:
            if self._letting_go or id(member) in self._seen:
                return False
            self._seen[id(member)] = member
            self._arrived.append((key, waiter))
            self._enqueue = enqueue
            last = self._gone() >= self._members
        if last or not self._let_go.wait(self._hold_s):
            self._go()
        self._let_go.wait()  # another thread is queueing them: until it has
        return True

    def leave(self, member: object | None) -> None:
        """`member` will not come (another path, or it failed first; None: one refused before it had a
        ticket): the others stop waiting for it."""
        with self._lock:
            if self._letting_go or id(member) in self._seen:
                return
            if member is None:
                self._unnamed += 1
            else:
                self._seen[id(member)] = member
            last = self._gone() >= self._members
        if last:
            self._go()

    def _gone(self) -> int:
        return len(self._seen) + self._unnamed

    def _go(self) -> None:
        with self._lock:
            if self._letting_go:
                return
            self._letting_go = True
            arrived, self._arrived, enqueue = self._arrived, [], self._enqueue
        by_pair: dict[Hashable, list[Waiter[Any, Any]]] = {}
        for key, waiter in arrived:
            by_pair.setdefault(key, []).append(waiter)
        try:
            if enqueue is not None:  # else none arrived: every member left
                for key, waiters in by_pair.items():
                    enqueue(key, waiters)
        finally:
            self._let_go.set()
