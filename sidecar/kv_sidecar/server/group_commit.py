"""Group commit per key: work that arrives while a key's work runs waits, and then goes as one group.

The first arrival on a key runs at once, alone (a pull alone waits for nobody); up to `at_once` runs of
one key go side by side. What arrives while they run queues, and when a run ends its thread hands the
whole queue (up to `most`) to the first in it, which runs it as one group for all. Under load the
groups grow with what waits; with no load nothing changes. Used for staged reads
(server/staged_reader.py): the reads of one (source rank, decode rank) go as one transfer.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

# How often an item waiting in the queue asks whether it was stopped.
_CHECK_EVERY_S = 0.05

T = TypeVar("T")
R = TypeVar("R")


class _Done:
    """A waiter's news (it leads, or its outcome is in): a flag, and a threading.Event made only when its
    thread must wait for it. A PullBatch's staged members are finished on the thread that runs their
    group and never wait: an Event each was a few per cent of the decode sidecar's GIL samples (py-spy,
    2x H200).
    One thread waits on a waiter, its own; `set` comes from another."""

    __slots__ = ("_event", "_set")

    def __init__(self) -> None:
        self._set = False
        self._event: threading.Event | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        event = self._event
        if event is not None:
            event.set()

    def wait(self, timeout: float) -> bool:
        if self._set:
            return True
        if self._event is None:
            self._event = threading.Event()
            if self._set:  # set while the event was made: `set` found none to wake
                return True
        return self._event.wait(timeout)


class Waiter(Generic[T, R]):
    """One item in a key's queue, and what its thread waits for: the lead of a group, or its outcome."""

    def __init__(self, item: T) -> None:
        self.item = item
        self.done = _Done()
        self.outcome: R | BaseException | None = None
        self.lead: list[Waiter[T, R]] | None = None  # handed the lead of this group

    @property
    def settled(self) -> bool:
        """Whether its outcome is in, so that `finish` returns at once (neither leads nor waits)."""
        return self.done.is_set() and self.lead is None


class _Key(Generic[T, R]):
    def __init__(self) -> None:
        self.running = 0
        self.queue: deque[Waiter[T, R]] = deque()


class GroupCommit(Generic[T, R]):
    def __init__(self, most: int, at_once: int) -> None:
        if most < 1 or at_once < 1:
            raise ValueError("a group holds at least one item, and at least one runs at once")
        self._most = most
        self._at_once = at_once
        self._lock = threading.Lock()
        self._keys: dict[Hashable, _Key[T, R]] = {}

    def run(
        self,
        key: Hashable,
        item: T,
        lead: Callable[[list[T]], list[R | BaseException]],
        check: Callable[[], object] = lambda: None,
    ) -> R:
        """`item`'s outcome: `lead(group)` runs a group (on the thread of its first item) and returns each
        item's outcome in order, a value or an exception (raised to that item's caller). `check()`,
        asked while the item waits in the queue, raises to give up waiting (the item was stopped): it
        then leaves the queue at once rather than when the runs before it end."""
        me: Waiter[T, R] = Waiter(item)
        self.enqueue(key, [me])
        return self.finish(key, me, lead, check)

    def enqueue(self, key: Hashable, waiters: list[Waiter[T, R]]) -> None:
        """Queue `waiters` together on `key` (one thread for several items, which `finish` each on its
        own thread): if fewer than `at_once` runs go, what is queued starts as one group at once."""
        with self._lock:
            state = self._keys.setdefault(key, _Key())
            state.queue.extend(waiters)
            if state.running < self._at_once:
                state.running += 1
                _hand_lead(self._take(state))

    def finish(
        self,
        key: Hashable,
        me: Waiter[T, R],
        lead: Callable[[list[T]], list[R | BaseException]],
        check: Callable[[], object] = lambda: None,
    ) -> R:
        """The outcome of `me`, queued by `enqueue`: as `run` (it leads, or waits for whoever does)."""
        self._wait(key, me, check)
        group = me.lead
        if group is not None:  # this thread runs the group: its own item is the first
            try:
                outcomes = lead([w.item for w in group])
                if len(outcomes) != len(group):
                    raise RuntimeError(f"a group of {len(group)} got {len(outcomes)} outcomes")
            except BaseException as e:
                outcomes = [e] * len(group)
            finally:
                self._next(key)
            for w, outcome in zip(group, outcomes, strict=True):
                w.outcome = outcome
                if w is not me:
                    w.done.set()
        if isinstance(me.outcome, BaseException):
            raise me.outcome
        return me.outcome  # type: ignore[return-value]

    def _wait(self, key: Hashable, me: Waiter[T, R], check: Callable[[], object]) -> None:
        """Until `me` leads a group or has its outcome; raises what `check` raises while `me` is queued."""
        while not me.done.wait(_CHECK_EVERY_S):
            try:
                check()
            except BaseException:
                with self._lock:
                    state = self._keys.get(key)
                    if state is not None and me in state.queue:
                        state.queue.remove(me)
                        raise
                # Already taken into a group, whose run sees the same stop: wait for its outcome.

    def _take(self, state: _Key[T, R]) -> list[Waiter[T, R]]:
        return [state.queue.popleft() for _ in range(min(self._most, len(state.queue)))]

    def _next(self, key: Hashable) -> None:
        """A run of `key` ended: the queue's first leads what waits, or one fewer runs."""
        with self._lock:
            state = self._keys[key]
            if state.queue:
                _hand_lead(self._take(state))
                return
            state.running -= 1
            if not state.running:
                del self._keys[key]


def _hand_lead(group: list[Waiter[T, R]]) -> None:
    """The group's first item's thread runs it for all (it wakes, or finds this when it waits)."""
    group[0].lead = group
    group[0].done.set()
