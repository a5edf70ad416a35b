"""Pulls in progress: which local ranks of a request each fills, and stopping them.

A decode engine with TP=N has N worker processes, and each pulls its own rank
of the same request at the same time (`PullRequest.ranks=[r]`). Pulls of one
request into one engine may therefore run side by side as long as their rank
sets are disjoint; a pull whose ranks overlap a running one is refused.

Abort stops every pull of the request; unregistering a rank stops the pulls
that fill it. A stopped pull may let the source free the blocks early
(`release_source`), but only when no other pull of the same request is still
moving bytes: the last one to end decides (`last_to_end`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Protocol

from kv_sidecar.errors import Code, SidecarError, ranks_text


class Stop(Protocol):
    """What a pull's steps and its calls to peers look at to learn that it must stop: a PullTicket, or
    a threading.Event where something waits on it."""

    def is_set(self) -> bool: ...


class PullTicket:
    """Set when its pull must stop. Passed to the puller as its cancel flag (`Stop`).

    `release_source` says whether the reader is gone for good (abort, dead
    engine), so the source sidecar may free the blocks now rather than keep
    them for a retry until the lease runs out.

    Not a threading.Event: nothing waits on a ticket (a pull looks at it between its steps, a peer call
    each time its poll wakes), and making an Event (and its Condition) for each was a few per cent of
    the decode sidecar's GIL samples in PullBatches of 16 (py-spy on 2x H200, 2026-11-30).
    """

    def __init__(self, engine_id: str, request_id: str, ranks: Iterable[int] = ()) -> None:
        self._set = False
        self.engine_id = engine_id
        self.request_id = request_id
        self.ranks = tuple(ranks)  # as the engine asked (validated by the puller)
        self.reason = ""
        self.release_source = False
        self.ending = False  # failed: moves no byte any more, only reports
        self.finished = False  # returned (InflightPulls.end); waited for by InflightPulls.wait_finished

    def is_set(self) -> bool:
        return self._set

    def stop(self, reason: str, release_source: bool) -> None:
        if not self._set:
            self.reason, self.release_source = reason, release_source
        self._set = True


def stopped_error(cancel: Stop, request_id: str) -> SidecarError:
    """What a pull that was stopped (a PullTicket set) answers."""
    why = getattr(cancel, "reason", "") or "aborted"
    return SidecarError(Code.CANCELLED, f"pull of request {request_id!r} stopped: {why}")


class InflightPulls:
    """The pulls running on this sidecar, by (decode engine, request)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # One condition for every pull's end, not an Event per pull: ~4 us a pull, for a wait that only
        # unregistering a rank does.
        self._ended = threading.Condition(self._lock)
        self._pulls: dict[tuple[str, str], list[PullTicket]] = {}

    def begin(self, engine_id: str, request_id: str, ranks: Iterable[int]) -> PullTicket:
        """Track a new pull of these local ranks; ALREADY_EXISTS if a running one fills any of them."""
        ticket = PullTicket(engine_id, request_id, ranks)
        with self._lock:
            running = self._pulls.setdefault((engine_id, request_id), [])
            clash = {r for t in running for r in t.ranks} & set(ticket.ranks)
            if clash:
                raise SidecarError(
                    Code.ALREADY_EXISTS,
                    f"a pull of request {request_id!r} into engine {engine_id!r} is already running for "
                    f"rank(s) {ranks_text(clash)}",
                )
            running.append(ticket)
        return ticket

    def end(self, ticket: PullTicket) -> None:
        with self._lock:
            key = (ticket.engine_id, ticket.request_id)
            running = self._pulls.get(key, [])
            if ticket in running:
                running.remove(ticket)
            if not running:
                self._pulls.pop(key, None)
            ticket.finished = True
            self._ended.notify_all()

    def wait_finished(self, tickets: list[PullTicket], timeout_s: float) -> bool:
        """Wait until these pulls have returned, so no byte moves for them any more."""
        with self._ended:
            return self._ended.wait_for(lambda: all(t.finished for t in tickets), timeout_s)

    def last_to_end(self, ticket: PullTicket) -> bool:
        """The failed pull `ticket` moves no byte any more: is every other pull of its request
        done moving bytes too (ended, or failed)? Exactly one of several failing pulls gets True."""
        with self._lock:
            ticket.ending = True
            running = self._pulls.get((ticket.engine_id, ticket.request_id), [])
            return all(t.ending for t in running)

    def of_request(self, engine_id: str, request_id: str) -> list[PullTicket]:
        with self._lock:
            return list(self._pulls.get((engine_id, request_id), []))

    def stop_request(self, engine_id: str, request_id: str, reason: str) -> list[PullTicket]:
        """Stop every pull of this request (the engine aborted it); the source may free its blocks."""
        tickets = self.of_request(engine_id, request_id)
        for t in tickets:
            t.stop(reason, release_source=True)
        return tickets

    def stop_rank(self, engine_id: str, rank: int, reason: str) -> list[PullTicket]:
        """Stop every pull that fills this rank (it is going away); the sources may free their blocks."""
        with self._lock:
            tickets = [
                t for (eid, _), ts in self._pulls.items() if eid == engine_id for t in ts if rank in t.ranks
            ]
        for t in tickets:
            t.stop(reason, release_source=True)
        return tickets
