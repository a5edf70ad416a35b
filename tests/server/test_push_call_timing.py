"""When a reader's Push call follows its notification: CALL_AFTER_S when transfers from that source are
quick, a few times what they lately took under load (a call then only adds work to both sidecars), never
later than CALL_AFTER_MAX_S (how late a reader learns that its source died)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kv_sidecar.server.peers import PeerLink
from kv_sidecar.server.staged_reader import CALL_AFTER_FACTOR, CALL_AFTER_MAX_S, CALL_AFTER_S, call_after_s


def _link() -> PeerLink:
    return PeerLink("127.0.0.1:1", client=None)  # type: ignore[arg-type]  # no call is made here


@given(st.floats(min_value=0.0, max_value=10.0, allow_nan=False))
def test_the_call_waits_between_its_floor_and_its_ceiling(recent_s: float) -> None:
    after = call_after_s(recent_s)
    assert CALL_AFTER_S <= after <= CALL_AFTER_MAX_S
    assert after in (CALL_AFTER_S, CALL_AFTER_MAX_S, CALL_AFTER_FACTOR * recent_s)


def test_a_quiet_link_calls_after_the_floor_and_a_loaded_one_later() -> None:
    link = _link()
    assert call_after_s(link.notified_push_s) == CALL_AFTER_S  # nothing learned yet
    for _ in range(40):  # 16 pulls in flight: each takes ~30 ms from notification to last byte
        link.notified_push_done(0.030)
    assert abs(link.notified_push_s - 0.030) < 0.001
    assert call_after_s(link.notified_push_s) > 0.085
    for _ in range(40):  # the load went: quick transfers bring the call back to the floor
        link.notified_push_done(0.001)
    assert call_after_s(link.notified_push_s) == CALL_AFTER_S


def test_one_slow_transfer_moves_the_average_by_an_eighth() -> None:
    link = _link()
    link.notified_push_done(0.8)  # e.g. one pull that waited for a restarted source
    assert abs(link.notified_push_s - 0.1) < 1e-9
    assert call_after_s(link.notified_push_s) == CALL_AFTER_MAX_S
