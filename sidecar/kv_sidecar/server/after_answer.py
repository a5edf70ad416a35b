"""Work a call leaves for after its answer is sent: a pull's log record, "consumed" events.

The engine waits for the answer, not for these; each call's adapter runs them once the answer is out
(a PullBatch member streamed over the engine lane: once its own outcome is out).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

Later = list[Callable[[], None]]


def run_later(later: Later) -> None:
    """Run what a call left for after its answer; one failure neither stops the rest nor the caller."""
    for fn in later:
        try:
            fn()
        except Exception:
            log.exception("work after an answer failed")
    later.clear()
