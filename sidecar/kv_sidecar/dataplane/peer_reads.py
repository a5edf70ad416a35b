"""Host ranks kept mapped for peers that READ them by address (host-nixl, host-nixl-staged).

A reader sidecar READs a source engine's shared memory at the addresses of its handshake, after the
OpenRead answer and without another word to the source. Should the engine leave meanwhile (it died,
or its process was replaced), the source would unmap that memory, and a new registration may map
other pages at the same addresses: the READ would then succeed with another engine's bytes. So an
open pins the ranks it serves until the reader says it is done (its done notification, or a
CloseRead) or the open's lease runs out: an engine that leaves meanwhile keeps its pages mapped and
NIXL-registered until then, and the READ reads the bytes the request was published with.

A pin costs nothing while the engine stays: it only delays an unmap. The memory it keeps after an
engine left is that engine's, for at most the lease of its last read (docs/operations.md, "A
prefill engine dies").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kv_sidecar.dataplane.jobs import PeerRead

log = logging.getLogger(__name__)

_SWEEP_EVERY_S = 1.0  # pins whose reader never said it was done go at the latest this long after their lease


class Pinnable(Protocol):
    """A host rank's memory as a pin holds it (dataplane/ranks.py, HostRank)."""

    def acquire(self) -> None: ...

    def let_go(self) -> Callable[[], None] | None: ...


@dataclass
class _Pin:
    until: float  # time.monotonic()
    reader_ranks: set[int]
    held: list[Pinnable] = field(default_factory=list)


class PeerReads:
    """The pins of reads that peers may still be READing; thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._pins: dict[PeerRead, _Pin] = {}
        self._next_sweep = 0.0
        self._left: list[Pinnable] = []  # ranks that left while pins held them
        self._timer: threading.Timer | None = None  # sweeps by the first lease of their pins
        self._timer_at = 0.0

    def __len__(self) -> int:
        return len(self._pins)

    def pin(
        self, read: PeerRead, reader_ranks: Iterable[int], ranks: Sequence[Pinnable], until: float
    ) -> list[int]:
        """Hold `ranks` for `read` until its reader ranks are all done, or `until`. Raises the rank's
        "gone" error (and holds nothing new) where one left already. The same read again (its open
        came as a notification and as a call, or the reader retried) adds to its pin. Returns the
        reader ranks this pin added: what undoing it (`done`) may take away, and no more."""
        now = self._clock()
        with self._lock:
            pin = self._pins.get(read)
            if pin is None:
                pin = self._pins[read] = _Pin(until, set())
            new = [r for r in ranks if not any(r is h for h in pin.held)]
            acquired: list[Pinnable] = []
            try:
                for r in new:
                    r.acquire()
                    acquired.append(r)
            except BaseException:
                if not pin.held and not pin.reader_ranks:
                    del self._pins[read]
                self._let_go(acquired)
                raise
            pin.held += acquired
            added = sorted(set(reader_ranks) - pin.reader_ranks)
            pin.reader_ranks.update(added)
            pin.until = max(pin.until, until)
            expired = self._take_expired(now) if now >= self._next_sweep else []
        self._let_go(expired)
        return added

    def done(self, read: PeerRead, reader_ranks: Iterable[int] = ()) -> None:
        """These reader ranks (all of the read's, if none named) have READ all they will: the pin goes
        once none is left."""
        with self._lock:
            pin = self._pins.get(read)
            if pin is None:
                return
            named = set(reader_ranks)
            pin.reader_ranks -= named or pin.reader_ranks
            if pin.reader_ranks:
                return
            del self._pins[read]
        self._let_go(pin.held)

    def left(self, rank: Pinnable) -> None:
        """`rank` left (its engine unregistered): it stays mapped while pins hold it, so make sure each
        of them goes by its lease even if no other open comes to sweep it (a done sweeps nothing)."""
        with self._lock:
            if any(rank is h for p in self._pins.values() for h in p.held):
                self._left.append(rank)
                self._schedule()

    def _fire(self) -> None:
        with self._lock:
            self._timer = None
            expired = self._take_expired(self._clock())
            self._schedule()
        self._let_go(expired)

    def _schedule(self) -> None:
        """Under the lock: a timer at the first lease among the pins that hold ranks that left."""
        held = [p for p in self._pins.values() if any(h is r for h in p.held for r in self._left)]
        self._left = [r for r in self._left if any(h is r for p in held for h in p.held)]
        if not held:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            return
        at = min(p.until for p in held)
        if self._timer is not None:
            if self._timer_at <= at:
                return
            self._timer.cancel()
        self._timer, self._timer_at = threading.Timer(max(0.0, at - self._clock()) + 0.05, self._fire), at
        self._timer.daemon = True
        self._timer.start()

    def close(self) -> None:
        """The sidecar stops: no read is served any more, and every pin goes."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            held = [h for p in self._pins.values() for h in p.held]
            self._pins.clear()
            self._left.clear()
        self._let_go(held)

    def _take_expired(self, now: float) -> list[Pinnable]:
        """Under the lock: the pins whose lease ran out (their reader sent no done notification: it
        failed, or died, and nothing may READ the request any more) go; what they held."""
        self._next_sweep = now + _SWEEP_EVERY_S
        gone = [k for k, p in self._pins.items() if p.until <= now]
        held: list[Pinnable] = []
        for k in gone:
            held += self._pins.pop(k).held
        return held

    @staticmethod
    def _let_go(ranks: Iterable[Pinnable]) -> None:
        for r in ranks:
            release = r.let_go()
            if release is not None:
                # The last holder of memory that left: unmap it off this thread, which may be the NIXL
                # driver's own (a done notification), where deregistering it would wait on itself.
                threading.Thread(
                    target=_release, args=(release,), name="unmap-after-read", daemon=True
                ).start()


def _release(release: Callable[[], None]) -> None:
    try:
        release()
    except Exception:
        log.exception("could not unmap a host rank after its last peer read")
