"""Graceful drain: refuse new work, let in-flight work finish up to a deadline.

One `Drain` per sidecar. Each gRPC server gets a gate (server/adapters/drain_gate.py) that refuses
the methods that start new work with UNAVAILABLE once draining began, and counts the in-flight calls
of the methods the drain waits for through `enter`/`leave`: under the same lock as the draining flag,
so no call can slip in between "checked the flag" and "counted as in flight".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Drain:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._draining = False
        self._cut_short = False
        self._inflight = 0

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def inflight(self) -> int:
        return self._inflight

    def begin(self) -> None:
        with self._cond:
            self._draining = True
            self._cond.notify_all()

    def cut_short(self) -> None:
        """A second signal: stop waiting. Called from the signal handler, on the main thread, which may be
        inside `wait` holding the condition's lock: a bare flag, no lock (commands/signals.py says why);
        `wait` reads it within its 50 ms poll."""
        self._cut_short = True

    def wait(self, timeout_s: float, other_busy: Callable[[], int] = lambda: 0) -> int:
        """Wait until no waited call (and no `other_busy` work) is left; returns what is left."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._cut_short:
                left = self._inflight + other_busy()
                remaining = deadline - time.monotonic()
                if left == 0 or remaining <= 0:
                    return left
                # other_busy() changes without notifying us: poll it.
                self._cond.wait(min(remaining, 0.05))
            return self._inflight + other_busy()

    def enter(self) -> bool:
        """Count a call as in flight, unless draining began (then False: refuse it)."""
        with self._cond:
            if self._draining:
                return False
            self._inflight += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()


def draining_message(method: str) -> str:
    name = method.rsplit("/", 1)[-1]
    return f"sidecar is draining (shutting down): {name} is refused; retry on another sidecar"
