"""What an Events stream sends (adapters/engine_service.stream_messages): "consumed" events waiting
together go as one `consumed_many` to a stream opened `batched`, in order, with every other event
where it came; to a stream without it (a client from before) each goes alone, as before."""

from __future__ import annotations

import pytest

from kv_sidecar.mailbox import Mailbox
from kv_sidecar.server.adapters import engine_service
from kv_sidecar.server.adapters.engine_service import stream_messages
from kv_sidecar_client._proto.kvsidecar.v1 import engine_pb2

Event = engine_pb2.Event | None


def _consumed(request_id: str) -> engine_pb2.Event:
    return engine_pb2.Event(consumed=engine_pb2.RequestConsumed(request_id=request_id, block_ids=[7]))


def _expired(request_id: str) -> engine_pb2.Event:
    return engine_pb2.Event(lease_expired=engine_pb2.LeaseExpired(request_id=request_id))


def _drain(queued: list[Event], batched: bool) -> list[Event]:
    """Every message a stream sends for `queued`, put before it looked."""
    box: Mailbox[Event] = Mailbox()
    for ev in queued:
        box.put(ev)
    sent: list[Event] = []
    while not box.empty():
        sent += stream_messages(box.get(timeout=0), box, batched)
    return sent


def _read(sent: list[Event]) -> list[tuple[str, str]]:
    """As the client reads them (EventStream): one (kind, request id) per event."""
    out: list[tuple[str, str]] = []
    for m in sent:
        assert m is not None
        kind = m.WhichOneof("kind")
        if kind == "consumed_many":
            out += [("consumed", c.request_id) for c in m.consumed_many.requests]
        else:
            out.append((kind, getattr(m, kind).request_id))
    return out


def test_consumed_events_waiting_together_go_as_one_message_in_order() -> None:
    queued = [_consumed(f"r{i}") for i in range(5)] + [_expired("x"), _consumed("r5"), _consumed("r6")]
    sent = _drain(queued, batched=True)
    assert [m.WhichOneof("kind") for m in sent if m is not None] == [
        "consumed_many",
        "lease_expired",
        "consumed_many",
    ]
    assert _read(sent) == _read(queued)


def test_a_stream_opened_without_batched_gets_each_event_alone() -> None:
    queued = [_consumed(f"r{i}") for i in range(4)] + [_expired("x")]
    assert _drain(queued, batched=False) == queued


def test_a_lone_consumed_goes_as_itself_and_the_end_still_ends() -> None:
    sent = _drain([_consumed("r0"), None], batched=True)
    assert sent == [_consumed("r0"), None]  # None: the rank was unregistered, the stream returns


def test_a_run_stops_at_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_service, "MAX_CONSUMED_PER_MESSAGE", 3)
    queued = [_consumed(f"r{i}") for i in range(7)]
    sent = _drain(queued, batched=True)
    assert [len(m.consumed_many.requests) for m in sent if m is not None and m.HasField("consumed_many")] == [
        3,
        3,
    ]
    assert _read(sent) == _read(queued)


def test_a_run_stops_before_its_bytes_pass_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """An event names its request's blocks: a run of large ones must stay under what a client takes in
    one message (4 MiB by default)."""
    big = [
        engine_pb2.Event(consumed=engine_pb2.RequestConsumed(request_id=f"r{i}", block_ids=range(1000)))
        for i in range(5)
    ]
    one = big[0].consumed.ByteSize()
    monkeypatch.setattr(engine_service, "MAX_CONSUMED_BYTES", 2 * one + 10)
    sent = _drain(big, batched=True)
    assert all(m is not None and m.ByteSize() <= 2 * one + 20 for m in sent)
    assert len(sent) < len(big)  # still joined where they fit
    assert _read(sent) == _read(big)
