"""A published request's bytes come only from the rank registrations that held it when it was published.

A rank whose process registered again (a restart while the engine's other ranks ran on), or a rank that
moved here from another sidecar, has other bytes in blocks of the same ids: a read of them must be
refused (NOT_FOUND), before anything of the request changes, not answered with those bytes.
"""

from __future__ import annotations

import pytest

from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.plan.pair import plan_pair
from kv_sidecar.server.published import PublishedStore

from .test_served_reads import tp_spec

SPEC = tp_spec(2)


def _store() -> PublishedStore:
    return PublishedStore(on_consumed=lambda *_: None, on_expired=lambda _: None)


def test_the_registrations_that_held_it_are_read() -> None:
    store = _store()
    store.publish("p", "r", [3, 4], 20, 30.0, generations={0: 7, 1: 8})
    item = store.open_read("p", "r", "d", plan_pair(SPEC, SPEC), [0, 1], 30.0, sources={0: 7, 1: 8})
    assert item.reader == "d"


@pytest.mark.parametrize(
    ("held", "now", "why"),
    [
        ({0: 7, 1: 8}, {0: 7, 1: 9}, "rank 1 registered here again after the request was published"),
        ({0: 7}, {0: 7, 1: 9}, "rank 1 registered here after the request was published"),
    ],
    ids=["registered-again", "moved-here"],
)
def test_another_registration_is_refused_and_nothing_changes(
    held: dict[int, int], now: dict[int, int], why: str
) -> None:
    store = _store()
    item = store.publish("p", "r", [3, 4], 20, 30.0, ranks=sorted(held), generations=held)
    deadline = item.deadline
    with pytest.raises(SidecarError) as info:
        store.open_read("p", "r", "d", plan_pair(SPEC, SPEC), [0, 1], 60.0, sources=now)
    assert info.value.code is Code.NOT_FOUND
    assert "request 'r' of engine 'p' is not held by its rank 1 here" in info.value.message
    assert why in info.value.message and "prefill it again" in info.value.message
    # The refusal opened nothing: no reader, no longer lease, and the ranks that hold it still may.
    assert item.reader is None and item.deadline == deadline and not item.pending
    item.check_sources({0: 7})


def test_a_rank_that_sends_is_checked_alone() -> None:
    """A staged Push sends one source rank: only its registration is asked for."""
    item = _store().publish("p", "r", [3, 4], 20, 30.0, ranks=[0], generations={0: 7})
    item.check_sources({0: 7})
    with pytest.raises(SidecarError, match="registered here after"):
        item.check_sources({1: 7})
