"""What a reading sidecar knows about the leases of the requests it reads.

A pull across sidecars may start its NIXL READ while OpenRead is still on its
way to the source (server/pull.py), so the READ overlaps the round trip. It
does so only when the request is surely still held there: its lease deadline
(from the params, or a later keep-alive that went through this sidecar) is
comfortably in the future, and this sidecar has not released it itself. Such a
READ never reads blocks whose lease ran out. The source can still have ended
the request early (the prefill engine aborted it, another pull consumed it):
then OpenRead refuses, the pull fails naming its blocks unfilled as always,
and the READ that already ran may have written them.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

_REMEMBERED = 10_000  # requests whose keep-alive or release we remember


class LeaseView:
    def __init__(self, margin_s: float = 2.0, clock: Callable[[], float] = time.time) -> None:
        self.margin_s = margin_s  # covers clock skew between nodes
        self._clock = clock
        self._lock = threading.Lock()
        self._extended: OrderedDict[tuple[str, str, str], int] = OrderedDict()
        self._released: OrderedDict[tuple[str, str, str], None] = OrderedDict()

    def extended(self, sidecar_id: str, engine_id: str, request_id: str, deadline_unix_ms: int) -> None:
        """A keep-alive through this sidecar moved the lease's deadline."""
        key = (sidecar_id, engine_id, request_id)
        with self._lock:
            self._extended[key] = max(deadline_unix_ms, self._extended.get(key, 0))
            self._extended.move_to_end(key)
            while len(self._extended) > _REMEMBERED:
                self._extended.popitem(last=False)

    def released(self, sidecar_id: str, engine_id: str, request_id: str) -> None:
        """This sidecar released the request on its source (a decode Abort with its params)."""
        key = (sidecar_id, engine_id, request_id)
        with self._lock:
            self._released[key] = None
            self._released.move_to_end(key)
            while len(self._released) > _REMEMBERED:
                self._released.popitem(last=False)

    def surely_held(self, sidecar_id: str, engine_id: str, request_id: str, deadline_unix_ms: int) -> bool:
        key = (sidecar_id, engine_id, request_id)
        with self._lock:
            if key in self._released:
                return False
            deadline = max(deadline_unix_ms, self._extended.get(key, 0))
        return deadline / 1000 - self._clock() >= self.margin_s
