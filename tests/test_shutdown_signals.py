"""SIGTERM handling that cannot deadlock the main thread (kv_sidecar/commands/signals.py).

Each case is a process whose main thread waits for SIGTERM the way `kv-sidecar serve` does, polling as
fast as it can (poll 0) while two threads keep the GIL busy: the handler then runs at nearly every
point of the main thread's loop. With the old wait (`threading.Event.wait` in the loop, `Event.set()`
in the handler) about half of such processes hung for good; the check fails if any does."""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import time

import pytest

from kv_sidecar.server.drain import Drain

CHILD = """
import sys, threading
sys.setswitchinterval(1e-6)
from kv_sidecar.commands.signals import ShutdownSignals
from kv_sidecar.server.drain import Drain

drain = Drain()
signals = ShutdownSignals(on_again=drain.cut_short)
signals.install()

def busy():
    while True:
        pass

for _ in range(2):
    threading.Thread(target=busy, daemon=True).start()
print("ready", flush=True)
signals.wait(poll_s=0)
drain.begin()
print("draining", flush=True)
sys.exit(0 if drain.wait(600, lambda: 1) == 1 else 3)  # only a second signal ends this wait
"""


def _line(proc: subprocess.Popen[str], timeout_s: float = 10) -> str:
    """The child's next line, or "" if none comes in time (it hung)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline() if ready else ""


@pytest.mark.parametrize("run", range(12))
def test_sigterm_ends_the_wait_and_a_second_one_cuts_the_drain_short(run: int) -> None:
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert _line(proc) == "ready\n"
        time.sleep(0.02 + 0.003 * run)  # the signal lands at other points of the loop
        proc.send_signal(signal.SIGTERM)
        assert _line(proc) == "draining\n", "the first SIGTERM did not end the wait"
        time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cut_short_returns_while_the_drains_lock_is_held() -> None:
    """The second signal's handler runs on the main thread, which may be inside Drain.wait holding its lock."""
    drain = Drain()
    with drain._cond:  # as the main thread holds it between two polls of its wait
        drain.cut_short()
    assert drain.wait(600, lambda: 1) == 1
