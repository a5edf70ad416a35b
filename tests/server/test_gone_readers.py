"""A reader proven gone (server/gone_readers.py) and what the store lets another engine do then.

GoneReaders is given a probe that answers from a table and counts its calls (the real probe, a TCP
connect and the Status call, is tested against real processes in tests/e2e/test_gone_readers.py).
"""

from __future__ import annotations

import pytest

from kv_sidecar.errors import Code
from kv_sidecar.plan.pair import plan_pair
from kv_sidecar.server.gone_readers import RECHECK_S, GoneReaders, Probed, ReaderSidecar, Seen
from kv_sidecar.server.published import PublishedStore, ReadByAnother
from tests.server.test_served_reads import tp_spec

PLAN = plan_pair(tp_spec(2), tp_spec(2))


def at(address: str) -> ReaderSidecar:
    """A reader's sidecar that answers at `address` (its calls' origin is the real probe's business)."""
    return ReaderSidecar(address, "ipv4:10.0.0.9:40000")


class Table:
    """A probe: what each sidecar id shows, and every call it got."""

    def __init__(self, seen: dict[str, Seen]) -> None:
        self.seen = seen
        self.calls: list[tuple[str, str, float]] = []

    def __call__(self, sidecar_id: str, where: ReaderSidecar, timeout_s: float) -> Probed:
        self.calls.append((sidecar_id, where.address, timeout_s))
        return Probed(self.seen[sidecar_id], f"{sidecar_id} {self.seen[sidecar_id].value}")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_gone_only_where_every_sidecar_of_the_reader_is_proven_gone() -> None:
    probe = Table({"a": Seen.GONE, "b": Seen.GONE, "c": Seen.RUNS, "d": Seen.UNKNOWN})
    gone = GoneReaders(probe, 0.5)
    both = gone.verdict({"a": at("h:1"), "b": at("h:2")})
    assert both is not None and both.seen is Seen.GONE
    assert "a at h:1 (a gone)" in both.detail and "b at h:2 (b gone)" in both.detail
    runs = gone.verdict({"a": at("h:1"), "c": at("h:3")})  # one of a TP reader's sidecars still runs
    assert runs == Probed(Seen.RUNS, "its sidecar c at h:3: c runs")
    silent = gone.verdict({"d": at("h:4")})  # hung, stopped, cut off: proves nothing
    assert silent is not None and silent.seen is Seen.UNKNOWN
    assert ("a", "h:1", 0.5) in probe.calls


def test_no_probe_without_an_address_a_sidecar_or_a_timeout() -> None:
    probe = Table({"a": Seen.GONE})
    gone = GoneReaders(probe, 0.5)
    no_address = gone.verdict(
        {"a": ReaderSidecar("", "ipv4:10.0.0.9:40000")}
    )  # a reader from before reader_address
    assert no_address is not None and no_address.seen is Seen.UNKNOWN
    assert "sent no address" in no_address.detail
    none_known = gone.verdict({})
    assert none_known is not None and none_known.seen is Seen.UNKNOWN
    off = GoneReaders(probe, 0).verdict({"a": at("h:1")})  # reader_probe_ms 0
    assert off is not None and off.seen is Seen.UNKNOWN and "reader_probe_ms 0" in off.detail
    assert probe.calls == []


def test_gone_is_remembered_and_the_rest_asked_again_after_a_while() -> None:
    probe = Table({"a": Seen.GONE, "c": Seen.RUNS})
    clock = Clock()
    gone = GoneReaders(probe, 0.5, clock)
    for _ in range(3):
        gone.verdict({"a": at("h:1")})
        gone.verdict({"c": at("h:3")})
    assert [c[0] for c in probe.calls] == ["a", "c"]  # a router's retries do not probe each time
    clock.t += RECHECK_S
    probe.seen["c"] = Seen.GONE  # it died since
    got = gone.verdict({"c": at("h:3")})
    assert got is not None and got.seen is Seen.GONE
    gone.verdict({"a": at("h:1")})
    assert [c[0] for c in probe.calls] == ["a", "c", "c"]  # a: gone for good


def test_without_probing_only_what_is_known_already() -> None:
    """The NIXL thread must not wait for a peer: it decides only from what was seen (None: ask the call)."""
    probe = Table({"a": Seen.GONE, "c": Seen.RUNS})
    gone = GoneReaders(probe, 0.5)
    assert gone.verdict({"a": at("h:1")}, probe=False) is None
    assert probe.calls == []
    gone.verdict({"a": at("h:1")})
    known = gone.verdict({"a": at("h:1")}, probe=False)
    assert known is not None and known.seen is Seen.GONE
    assert gone.verdict({"a": at("h:1"), "c": at("h:3")}, probe=False) is None  # c not asked yet
    assert len(probe.calls) == 1


def test_a_reader_proven_gone_leaves_the_request_to_another_engine() -> None:
    """The refusal names the reader's sidecars; once they are proven gone another engine takes the
    request over, and the gone reader's late done notification changes nothing."""
    taken: list[tuple[str, str, str]] = []
    consumed: list[int] = []
    store = PublishedStore(
        lambda _e, rank, _i: consumed.append(rank), lambda _i: None, on_taken_over=lambda *a: taken.append(a)
    )
    store.publish("p", "r", [3, 4], 20, 30.0)
    store.open_read("p", "r", "d1", PLAN, [0], 30.0, "s1", at("h:1"))
    store.open_read("p", "r", "d1", PLAN, [1], 30.0, "s2", at("h:2"))  # its other TP rank, on another sidecar
    with pytest.raises(ReadByAnother) as info:
        store.open_read("p", "r", "d2", PLAN, [0, 1], 30.0, "s3", at("h:3"))
    refused = info.value
    assert refused.code is Code.FAILED_PRECONDITION and "already being read by engine 'd1'" in refused.message
    assert refused.reader == "d1" and refused.sidecars == {"s1": at("h:1"), "s2": at("h:2")}
    store.reader_gone("p", "r", "d1", refused.sidecars, "whose sidecar is gone: s1, s2")
    item = store.open_read("p", "r", "d2", PLAN, [0, 1], 30.0, "s3", at("h:3"))
    assert item.reader == "d2" and item.reader_sidecars == {"s3": at("h:3")}
    assert taken == [("p", "r", "d1")]
    store.mark_done("p", "r", "d1", 0, [0, 1])  # the gone reader's late done
    assert consumed == []
    store.mark_done("p", "r", "d2", 0, [0])
    store.mark_done("p", "r", "d2", 1, [1])
    assert consumed == [0, 1]


def test_a_verdict_on_sidecars_that_changed_since_changes_nothing() -> None:
    """Between the refusal and its probe, the reader opened again from a new sidecar (its sidecar
    restarted, its engine retried): the old sidecar's death says nothing about the new one."""
    store = PublishedStore(lambda *_: None, lambda _i: None)
    store.publish("p", "r", [3, 4], 20, 30.0)
    store.open_read("p", "r", "d1", PLAN, [0, 1], 30.0, "s1", at("h:1"))
    with pytest.raises(ReadByAnother) as info:
        store.open_read("p", "r", "d2", PLAN, [0, 1], 30.0, "s3", at("h:3"))
    store.open_read("p", "r", "d1", PLAN, [0, 1], 30.0, "s1b", at("h:1"))  # the same reader, a new sidecar
    store.reader_gone("p", "r", "d1", info.value.sidecars, "whose sidecar is gone: s1")
    with pytest.raises(ReadByAnother) as again:
        store.open_read("p", "r", "d2", PLAN, [0, 1], 30.0, "s3", at("h:3"))
    assert again.value.sidecars == {"s1": at("h:1"), "s1b": at("h:1")}
    store.reader_gone("p", "r", "other", again.value.sidecars, "not its reader")
    with pytest.raises(ReadByAnother):
        store.open_read("p", "r", "d2", PLAN, [0, 1], 30.0, "s3", at("h:3"))


def test_no_takeover_of_a_gone_reader_once_a_consumed_event_fired() -> None:
    store = PublishedStore(lambda *_: None, lambda _i: None)
    store.publish("p", "r", [3, 4], 20, 30.0)
    store.open_read("p", "r", "d1", PLAN, [0, 1], 30.0, "s1", at("h:1"))
    store.mark_done("p", "r", "d1", 0, [0])  # prefill rank 0's blocks may be freed already
    with pytest.raises(ReadByAnother) as info:
        store.open_read("p", "r", "d2", PLAN, [0, 1], 30.0, "s3", at("h:3"))
    store.reader_gone("p", "r", "d1", info.value.sidecars, "whose sidecar is gone: s1")
    with pytest.raises(ReadByAnother):
        store.open_read("p", "r", "d2", PLAN, [0, 1], 30.0, "s3", at("h:3"))
