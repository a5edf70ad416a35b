"""A use count for memory that copies address by raw pointers (a host rank's shared memory, a GPU
rank's CUDA IPC mappings).

A pointer keeps no mapping alive: a copy still reading memory unmapped under it crashes the sidecar
(SIGSEGV on the host) or faults its whole CUDA context (GPU). So a copy holds the memory while it
runs; closing it (the engine unregistered or died) refuses new holders at once and releases the
memory when the last holder ends.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


class HeldMemory:
    def __init__(self, gone: Callable[[], Exception], lock: threading.Lock | None = None) -> None:
        """gone: what a copy that comes after closing gets; lock: the owner's, where it checks
        `closed` under it too (no new mapping once closed)."""
        self.lock = lock or threading.Lock()
        self._gone = gone
        self._users = 0
        self._release: Callable[[], None] | None = None  # set once closed

    @property
    def closed(self) -> bool:
        """Read it under `lock`."""
        return self._release is not None

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Hold the memory for the duration of a copy, even if it is closed meanwhile."""
        self.acquire()
        try:
            yield
        finally:
            release = self.let_go()
            if release is not None:
                release()

    def acquire(self) -> None:
        """Hold it until `let_go` (a hold that no one block spans: a peer's read, ended by a message)."""
        with self.lock:
            if self._release is not None:
                raise self._gone()
            self._users += 1

    def let_go(self) -> Callable[[], None] | None:
        """End one `acquire`; returns the release to run where this was the last holder of closed
        memory (the caller picks the thread: the release may call into NIXL's own)."""
        with self.lock:
            self._users -= 1
            return self._release if self._users == 0 else None

    def close(self, release: Callable[[], None]) -> None:
        """No new holder; `release` runs now, or once the last holder ends. Again: nothing."""
        with self.lock:
            if self._release is not None:
                return
            self._release = release
            now = self._users == 0
        if now:
            release()
