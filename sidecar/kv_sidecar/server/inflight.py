"""Stopping pulls in progress: Abort, a dead engine, and why the source may free its blocks."""

from __future__ import annotations

import threading
import time


class PullTicket(threading.Event):
    """Set when its pull must stop. Passed to the puller as its cancel event.

    `release_source` says whether the reader is gone for good (abort, dead
    engine), so the source sidecar may free the blocks now rather than keep
    them for a retry until the lease runs out.
    """

    def __init__(self, engine_id: str, request_id: str) -> None:
        super().__init__()
        self.engine_id = engine_id
        self.request_id = request_id
        self.reason = ""
        self.release_source = False
        self.finished = threading.Event()

    def stop(self, reason: str, release_source: bool) -> None:
        if not self.is_set():
            self.reason, self.release_source = reason, release_source
        self.set()


def stop_engine_pulls(
    pulls: dict[tuple[str, str], threading.Event], lock: threading.Lock, engine_id: str, reason: str
) -> list[PullTicket]:
    """Stop every pull into this engine (it is going away); the sources may free their blocks."""
    with lock:
        tickets = [t for (eid, _), t in pulls.items() if eid == engine_id and isinstance(t, PullTicket)]
    for t in tickets:
        t.stop(reason, release_source=True)
    return tickets


def wait_finished(tickets: list[PullTicket], timeout_s: float) -> bool:
    """Wait until these pulls have returned, so no byte moves for them any more."""
    deadline = time.monotonic() + timeout_s
    return all(t.finished.wait(max(0.0, deadline - time.monotonic())) for t in tickets)
