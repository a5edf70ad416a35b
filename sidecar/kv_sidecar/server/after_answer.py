"""Work a call leaves for after its answer is sent: a pull's log record, done notifications, "consumed"
events.

The engine waits for the answer, not for these; each call's adapter runs them once the answer is out
(a PullBatch member streamed over the engine lane: once its own outcome is out, with the work of the
members that ended with it). Work that is cheaper done for several calls at once (`Joined`: a pull's
done notifications, one per source agent for all of them) runs so, first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

Later = list[Callable[[], None]]


class Joined:
    """Work after an answer that `run_all` does at once with the same kind of work of other calls run
    with it (`run_later`); alone, called, it runs as itself."""

    def __init__(self, run_all: Callable[[list[Any]], None]) -> None:
        self.run_all = run_all

    def __call__(self) -> None:
        self.run_all([self])


def run_later(later: Later) -> None:
    """Run what a call (or calls that ended together) left for after its answer: joined work first, each
    kind at once, then the rest in order; one failure neither stops the rest nor the caller."""
    kinds: dict[Callable[[list[Any]], None], list[Joined]] = {}
    rest: Later = []
    for fn in later:
        if isinstance(fn, Joined):
            kinds.setdefault(fn.run_all, []).append(fn)
        else:
            rest.append(fn)
    for run_all, joined in kinds.items():
        try:
            run_all(joined)
        except Exception:
            log.exception("work after an answer failed")
    for fn in rest:
        try:
            fn()
        except Exception:
            log.exception("work after an answer failed")
    later.clear()
