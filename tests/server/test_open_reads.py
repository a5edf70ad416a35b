"""Several requests opened at once (a staged Push of several requests, PublishedStore.open_reads): each
as open_read would open it alone, one refusal failing only its own request."""

from __future__ import annotations

from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.plan.pair import plan_pair
from kv_sidecar.server.gone_readers import ReaderSidecar
from kv_sidecar.server.published import Published, PublishedStore, ReadOpen

from .test_served_reads import tp_spec

SPEC = tp_spec(2)
PLAN = plan_pair(SPEC, SPEC)
AT = ReaderSidecar("h:1", "peer")


def _store() -> PublishedStore:
    store = PublishedStore(on_consumed=lambda *_: None, on_expired=lambda _: None)
    for r in ("a", "b", "c", "d"):
        store.publish("p", r, [3, 4], 20, 30.0, generations={0: 7, 1: 8})
    return store


def _open(request: str, reader: str = "dec", ranks: tuple[int, ...] = (0, 1)) -> ReadOpen:
    return ReadOpen(request, reader, list(ranks), "s1", AT)


def test_each_request_opens_as_it_would_alone() -> None:
    together, alone = _store(), _store()
    out = together.open_reads("p", [_open("a"), _open("b", ranks=(1,))], PLAN, 60.0, {0: 7, 1: 8})
    for got, (request, ranks) in zip(out, [("a", [0, 1]), ("b", [1])], strict=True):
        assert not isinstance(got, SidecarError)
        item, owed = got
        want = alone.open_read("p", request, "dec", PLAN, ranks, 60.0, "s1", AT, {0: 7, 1: 8})
        assert isinstance(item, Published) and item.request_id == request
        assert (item.reader, item.pending, item.reader_sidecars) == (
            want.reader,
            want.pending,
            want.reader_sidecars,
        )
        assert owed == alone.readers_here(want, ranks) == ranks


def test_a_refused_request_fails_alone() -> None:
    """One never published, one read by another engine, one whose rank registered again: each gets its
    own error and is left as it was; the others open."""
    store = _store()
    store.open_read("p", "b", "other", PLAN, [0, 1], 30.0)
    store.abort("p", "c")
    c = store.publish("p", "c", [3, 4], 20, 30.0, generations={0: 7, 1: 6})  # rank 1's earlier process
    out = store.open_reads(
        "p", [_open("a"), _open("b"), _open("x"), _open("c"), _open("d")], PLAN, 60.0, {0: 7, 1: 8}
    )
    assert [type(o).__name__ for o in out] == [
        "tuple",
        "ReadByAnother",
        "SidecarError",
        "SidecarError",
        "tuple",
    ]
    refused = {i: o for i, o in enumerate(out) if isinstance(o, SidecarError)}
    assert (
        refused[1].code is Code.FAILED_PRECONDITION
        and "already being read by engine 'other'" in refused[1].message
    )
    assert refused[2].code is Code.NOT_FOUND and "never published" in refused[2].message
    assert refused[3].code is Code.NOT_FOUND and "not held by its rank 1 here" in refused[3].message
    assert store.get_live("p", "b").reader == "other" and c.reader is None and not c.pending
    assert store.get_live("p", "a").reader == store.get_live("p", "d").reader == "dec"
