"""Every NIXL notification's wire format: its tag (one type: bytes) and its fields.

A notification starts with one of the tags below and a separator; the NIXL thread routes it by that
head (`NotificationRoutes`, whose handlers the composition root sets once: server/sidecar.py).
TRANSFER_TAG messages go to the transfer listening for them (NixlDriver.listen). Field values may
contain anything printable, never the separator.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence

Handler = Callable[[str, bytes], None]  # (sending agent, message), on the NIXL thread

SEP = b"\x1f"
DONE_TAG = b"kvs1"  # decode rank -> source: it has read these prefill ranks of a request (server/pull.py)
TRANSFER_TAG = b"kvs2"  # a staged transfer's chunks, credits and stops, and open answers (staged_protocol)
PUSH_TAG = b"kvs3"  # a Push sent as a notification (server/push_runs.py)
OPEN_TAG = (
    b"kvs4"  # an OpenRead sent as a notification (server/notified_opens.py); answered under TRANSFER_TAG
)
# Several done notifications in one (a PullBatch's members that ended together), to a source whose
# handshake said it takes them (HandshakeResponse.done_batches): DONES_TAG, SEP, then the done
# notifications joined by RS (ids are printable: neither separator occurs in them).
DONES_TAG = b"kvs5"
RS = b"\x1e"
# Source -> reader: the transfer that this reader's Push notification started failed before its call
# joined it (PushRequest.failure_notice); the reader sends the call now for the error.
PUSH_FAILED_TAG = b"kvs6"
# Source -> reader: that failed transfer's answer itself, where nothing of it is in flight and the Push
# said it takes it (PushRequest.refusal_notice): signed with the reader's push key, the transfer id,
# the status's name, its words and trailers (JSON); the reader then sends no call.
PUSH_REFUSED_TAG = b"kvs7"


def done_notification(
    engine_id: str, request_id: str, reader: str, decode_rank: int, prefill_ranks: Sequence[int]
) -> bytes:
    ranks = ",".join(str(p) for p in prefill_ranks).encode()
    fields = (engine_id.encode(), request_id.encode(), reader.encode(), str(decode_rank).encode(), ranks)
    return SEP.join((DONE_TAG, *fields))


def parse_done_notification(msg: bytes) -> tuple[str, str, str, int, list[int]] | None:
    """(engine id, request id, reader engine, decode rank, prefill ranks), or None if malformed."""
    parts = [p.decode(errors="replace") for p in msg.split(SEP)]
    if len(parts) != 6 or parts[0] != DONE_TAG.decode():
        return None
    try:
        return parts[1], parts[2], parts[3], int(parts[4]), [int(p) for p in parts[5].split(",") if p]
    except ValueError:
        return None


def done_batch(notifications: Sequence[bytes]) -> bytes:
    """Done notifications (done_notification) as one."""
    return DONES_TAG + SEP + RS.join(notifications)


def parse_done_batch(msg: bytes) -> list[tuple[str, str, str, int, list[int]] | None] | None:
    """Each done notification of a batch, parsed (None where one is malformed); None if `msg` is not a
    batch."""
    if not msg.startswith(DONES_TAG + SEP):
        return None
    return [parse_done_notification(one) for one in msg[len(DONES_TAG) + 1 :].split(RS)]


def push_failed(transfer_id: str) -> bytes:
    return PUSH_FAILED_TAG + SEP + transfer_id.encode()


def parse_push_failed(msg: bytes) -> str | None:
    """The transfer id of a PUSH_FAILED_TAG notification, or None if `msg` is not one."""
    head = PUSH_FAILED_TAG + SEP
    return msg[len(head) :].decode(errors="replace") if msg.startswith(head) else None


def push_refused(
    key: bytes, transfer_id: str, code: str, message: str, trailers: Sequence[tuple[str, str]]
) -> bytes:
    body = json.dumps({"transfer": transfer_id, "code": code, "message": message, "trailers": list(trailers)})
    return signed_notif(PUSH_REFUSED_TAG, key, body.encode())


def parse_push_refused(
    msg: bytes, key_bytes: int
) -> tuple[bytes, str, str, str, tuple[tuple[str, str], ...]] | None:
    """(key, transfer id, status name, words, trailers) of a PUSH_REFUSED_TAG notification, or None if
    `msg` is not a well-formed one."""
    parsed = parse_signed_notif(PUSH_REFUSED_TAG, msg, key_bytes)
    if parsed is None:
        return None
    try:
        body = json.loads(parsed[1])
        trailers = tuple((str(k), str(v)) for k, v in body["trailers"])
        return parsed[0], str(body["transfer"]), str(body["code"]), str(body["message"]), trailers
    except (ValueError, KeyError, TypeError):
        return None


def signed_notif(tag: bytes, key: bytes, body: bytes) -> bytes:
    """Reader -> source: a serialized request (a Push, an OpenRead), signed with the reader agent's push key
    (and source -> reader: a refusal, PUSH_REFUSED_TAG)."""
    return tag + SEP + key.hex().encode() + SEP + body


def parse_signed_notif(tag: bytes, msg: bytes, key_bytes: int) -> tuple[bytes, bytes] | None:
    """(key, serialized request), or None if `msg` is not a well-formed notification of kind `tag`."""
    head = len(tag) + 1 + 2 * key_bytes + 1
    if len(msg) <= head or not msg.startswith(tag + SEP) or msg[head - 1 : head] != SEP:
        return None
    try:
        key = bytes.fromhex(msg[len(tag) + 1 : head - 1].decode("ascii"))
    except ValueError:
        return None
    return key, msg[head:]


class NotificationRoutes:
    """The handler of each notification that no transfer listens for: by tag, else `other` (done
    notifications). Set once, when every handler exists; until then such notifications wait."""

    def __init__(self) -> None:
        self._set = threading.Event()
        self._by_tag: Mapping[bytes, Handler] = {}
        self._other: Handler = lambda agent, msg: None

    def set(self, by_tag: Mapping[bytes, Handler], other: Handler) -> None:
        if self._set.is_set():
            raise RuntimeError("notification routes are set once")
        self._by_tag, self._other = dict(by_tag), other
        self._set.set()

    def dispatch(self, agent: str, msg: bytes) -> None:
        self._set.wait()
        handler = self._by_tag.get(msg[: msg.find(SEP)] if SEP in msg else msg, self._other)
        handler(agent, msg)
