"""The staged Push by NIXL notification, free of gRPC and NIXL: push keys, and which of a Push's two
copies starts its transfer.

A reader that holds this sidecar's push key sends each Push twice: as a NIXL
notification to our agent, which our driver thread sees within its poll
interval (~0.1 ms while pushes are recent), and as the gRPC call (~0.6 ms
between sidecars), which still carries the answer, the errors and the reader's
liveness. Exactly one copy may start the transfer: a second start would WRITE
into receive slots the reader may already have given to another transfer.
`PushRuns` records which copy did. A notification is trusted only with the key
that an authenticated Push call gave its reader agent (`PushKeys`): NIXL
notifications carry no TLS and no token.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from kv_sidecar.transport.notifications import parse_signed_notif

T = TypeVar("T")

KEY_BYTES = 16
# A run or a call's claim is remembered this long after it ended, so that the other copy of its Push,
# arriving late, is recognised and dropped. NIXL delivers a notification in microseconds to
# milliseconds; one later than this would start a second transfer, which nothing else would stop.
REMEMBER_S = 60.0
MAX_REMEMBERED = 100_000  # past this, the oldest ended entries are forgotten early (memory bound)
RECENT_S = 1.0  # after a Push, poll for notifications at the serving rate this long
# Readers that pushed, opened or handshook this recently may again: a publish then gets ready for them.
# Past it, a sidecar serving only same-node (gpu-direct) readers does no such work per publish.
READERS_S = 60.0


class DuplicateTransfer(Exception):
    """A Push call named a transfer id that another call of it already claimed."""


class PushKeys:
    """One random key per reader agent, given out in Push answers; what its notifications must carry."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[str, tuple[bytes, str]] = {}  # reader agent -> (key, gRPC peer it was given to)

    def grant(self, agent: str, peer: str) -> bytes:
        """The key of `agent` (made on first use); only an authenticated Push call may ask."""
        with self._lock:
            known = self._keys.get(agent)
            if known is None:
                known = (secrets.token_bytes(KEY_BYTES), peer)
                self._keys[agent] = known
            return known[0]

    def verify(
        self, agent: str, tag: bytes, msg: bytes, decode: Callable[[bytes], T]
    ) -> tuple[str, T] | None:
        """A reader's notification of kind `tag` (a Push, an OpenRead) from `agent`: the peer its key was
        given to and the decoded request, or None if it is malformed, undecodable or not signed with
        `agent`'s key."""
        parsed = parse_signed_notif(tag, msg, KEY_BYTES)
        peer = self.check(agent, parsed[0]) if parsed is not None else None
        if parsed is None or peer is None:
            return None
        try:
            return peer, decode(parsed[1])
        except DecodeError:
            return None

    def key_of(self, agent: str) -> bytes | None:
        """The key given to `agent`, if any (what a refusal sent back to it is signed with)."""
        with self._lock:
            known = self._keys.get(agent)
        return None if known is None else known[0]

    def check(self, agent: str, key: bytes) -> str | None:
        """The peer `agent`'s key was given to, if `key` is that key; else None."""
        with self._lock:
            known = self._keys.get(agent)
        if known is None or not hmac.compare_digest(known[0], key):
            return None
        return known[1]


class PushRun:
    """A transfer that a notification started; the Push call that follows joins it for the answer."""

    def __init__(self, transfer_id: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.transfer_id = transfer_id
        self.started = clock()
        self.called = False  # its Push call came and joins it: the call carries the reader's liveness
        self.response: Any = None
        self.error: BaseException | None = None
        self.quiet = True  # nothing of the transfer is in flight any more (the answer may say so)
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self._cancelled = False

    def add_callback(self, fn: Callable[[], None]) -> None:
        """Run `fn` when the reader goes away (its call ends before the transfer does)."""
        with self._lock:
            if not self._cancelled:
                self._callbacks.append(fn)
                return
        fn()

    def cancel(self) -> None:
        with self._lock:
            if self._cancelled or self._done.is_set():
                return
            self._cancelled = True
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()

    def finish(self, response: Any, error: BaseException | None, quiet: bool) -> None:
        self.response, self.error, self.quiet = response, error, quiet
        self._done.set()

    def wait(self, timeout: float | None) -> bool:
        return self._done.wait(timeout)


_CLAIMED = object()  # the call came first and started the transfer itself
_JOINED = object()  # the call joined the run its notification started: both copies came


class PushRuns:
    """Which copy of each Push started its transfer.

    Every transfer id is remembered for REMEMBER_S after its transfer ended (never while it runs), so a
    copy that comes late, twice, or replayed starts nothing; MAX_REMEMBERED bounds that memory, at the
    cost of a shorter memory at very high Push rates.
    """

    def __init__(
        self,
        remember_s: float = REMEMBER_S,
        max_remembered: int = MAX_REMEMBERED,
        clock: Callable[[], float] = time.monotonic,
        on_recent: Callable[[], None] | None = None,
    ) -> None:
        self._remember_s = remember_s
        self._max = max_remembered
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, Any] = {}  # transfer id -> PushRun | _CLAIMED | _JOINED
        self._forget: deque[tuple[float, str, Any]] = deque()  # (when, id, entry), oldest first
        self.last_push = float("-inf")
        self.last_reader = float("-inf")
        # Called when Pushes become recent after a quiet spell: the NIXL loop, then in a long idle wait
        # (50 ms once quiet for a second), would hear the coming notification only at its next poll.
        self._on_recent = on_recent

    def start_by_notif(self, transfer_id: str) -> PushRun | None:
        """A new run for the notification's transfer, or None: its call came first, or it came before."""
        with self._lock:
            self._expire()
            self.reader_seen()
            if transfer_id in self._entries:
                return None
            run = PushRun(transfer_id, self._clock)
            self._entries[transfer_id] = run
            return run

    def claim_by_call(self, transfer_id: str) -> PushRun | None:
        """The run its notification started (the call joins it), or None: the call starts the transfer,
        and its notification, if it comes, starts nothing."""
        with self._lock:
            self._expire()
            self.reader_seen()
            entry = self._entries.get(transfer_id)
            if isinstance(entry, PushRun):
                entry.called = True
                return entry
            if entry is not None:
                raise DuplicateTransfer(transfer_id)
            self._set(transfer_id, _CLAIMED)
            return None

    def joined(self, run: PushRun) -> None:
        """The call joined `run` and answered."""
        with self._lock:
            if self._entries.get(run.transfer_id) is run:
                self._set(run.transfer_id, _JOINED)

    def ended(self, run: PushRun) -> None:
        """`run` finished; if its call never joins, it is forgotten in time like the others."""
        with self._lock:
            if self._entries.get(run.transfer_id) is run:
                self._forget.append((self._clock() + self._remember_s, run.transfer_id, run))

    def touch(self) -> None:
        """A Push is due soon: a request was published while `readers_lately`."""
        self._pushed(self._clock())

    def reader_seen(self) -> None:
        """A reader handshook, or sent a Push or an OpenRead (call or notification): it may push or open
        soon, and again."""
        now = self._clock()
        self.last_reader = now
        self._pushed(now)

    def _pushed(self, now: float) -> None:
        was_recent = now - self.last_push < RECENT_S
        self.last_push = now
        if not was_recent and self._on_recent is not None:
            self._on_recent()

    def readers_lately(self) -> bool:
        """A reader pushed, opened or handshook in the last READERS_S."""
        return self._clock() - self.last_reader < READERS_S

    def recent(self) -> bool:
        """A Push came in the last RECENT_S (cheap, no lock: the NIXL driver's poll loop asks)."""
        return self._clock() - self.last_push < RECENT_S

    def _set(self, transfer_id: str, entry: Any) -> None:
        self._entries[transfer_id] = entry
        self._forget.append((self._clock() + self._remember_s, transfer_id, entry))

    def _expire(self) -> None:
        now = self._clock()
        while self._forget and (self._forget[0][0] <= now or len(self._forget) > self._max):
            _, tid, entry = self._forget.popleft()
            if self._entries.get(tid) is entry:
                del self._entries[tid]
