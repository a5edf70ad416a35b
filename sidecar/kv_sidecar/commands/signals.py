"""SIGTERM and SIGINT for `kv-sidecar serve`, counted by a handler that takes no lock.

Python runs a signal's handler on the main thread between two bytecodes, including while that thread
holds a lock. A handler that takes the same lock waits for itself forever: `threading.Event.set()` in
the handler while the main thread is inside `Event.wait()` (between its condition's re-acquire and
release, a window that a busy GIL widens to milliseconds) leaves the sidecar alive and never draining
until it is killed, as CI once saw (tests/test_shutdown_signals.py reproduces it). So the handler only
counts, and the main thread polls the count.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable


class ShutdownSignals:
    """The first signal asks the main thread to shut down (`wait` returns); each later one calls
    `on_again` from the handler, which must therefore take no lock either (Drain.cut_short)."""

    def __init__(self, on_again: Callable[[], None]) -> None:
        self.count = 0
        self._on_again = on_again

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, *_: object) -> None:
        self.count += 1
        if self.count > 1:
            self._on_again()

    def wait(self, poll_s: float = 0.02) -> None:
        """Until the first signal. Its handler runs in the sleep, where the main thread holds no lock;
        the sleep then goes on to its end (PEP 475), so `poll_s` is how late a drain may start."""
        while not self.count:
            time.sleep(poll_s)
