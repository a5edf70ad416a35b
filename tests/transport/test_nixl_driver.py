"""The NIXL driver thread: its timed waits, and notifications sent from it."""

from __future__ import annotations

import ctypes
import sys

import pytest

from kv_sidecar.transport.nixl_driver import NixlDriver

_PR_GET_TIMERSLACK = 30


def _timer_slack_ns() -> int:
    return int(ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timer slack is Linux's")
def test_the_driver_thread_waits_without_timer_slack_and_leaves_other_threads_alone() -> None:
    before = _timer_slack_ns()
    driver = NixlDriver("slack-test", on_notif=lambda agent, msg: None)
    driver.start()
    try:
        # Measured on the driver thread itself: a 20 us poll there took ~100 us under the default 50 us.
        assert driver.call(lambda _agent: _timer_slack_ns()) == 1_000
        assert _timer_slack_ns() == before  # the caller's threads keep theirs
    finally:
        driver.stop()


def test_a_notification_that_cannot_be_sent_is_logged_and_its_future_still_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    driver = NixlDriver("notify-test", on_notif=lambda agent, msg: None)
    driver.start()
    try:
        # A reader waits on this future before preparing its copies: it must end, sent or not.
        sent = driver.notify("no-such-agent", b"hello")
        assert sent.result(timeout=10) is None
        assert "could not send a NIXL notification to no-such-agent" in caplog.text
    finally:
        driver.stop()
