"""The NIXL notifications' wire formats (transport/notifications.py)."""

from __future__ import annotations

import itertools

from kv_sidecar.transport import notifications as n


def test_tags_are_distinct_and_none_starts_another() -> None:
    tags = [
        n.DONE_TAG,
        n.TRANSFER_TAG,
        n.PUSH_TAG,
        n.OPEN_TAG,
        n.DONES_TAG,
        n.PUSH_FAILED_TAG,
        n.PUSH_REFUSED_TAG,
    ]
    for a, b in itertools.permutations(tags, 2):
        assert not (a + n.SEP).startswith(b + n.SEP), (a, b)


def test_a_done_notification_round_trips_ids_with_any_printable_character() -> None:
    msg = n.done_notification("eng:1/ä", "req,with,commas", "decode-engine", 3, [0, 2])
    assert msg.startswith(n.DONE_TAG + n.SEP)
    assert n.parse_done_notification(msg) == ("eng:1/ä", "req,with,commas", "decode-engine", 3, [0, 2])


def test_malformed_done_notifications_are_none() -> None:
    good = n.done_notification("e", "r", "d", 1, [0])
    for bad in (
        b"",
        good.replace(n.DONE_TAG, n.TRANSFER_TAG),  # another kind
        good + n.SEP + b"extra",  # a field too many
        good.replace(b"\x1f1\x1f", b"\x1fone\x1f"),  # rank not a number
        n.signed_notif(n.PUSH_TAG, b"k" * 16, b"body"),
    ):
        assert n.parse_done_notification(bad) is None, bad


def test_a_done_batch_round_trips_each_notification_and_names_a_malformed_one() -> None:
    a = n.done_notification("eng:1/ä", "req,with,commas", "decode", 3, [0, 2])
    b = n.done_notification("e", "r2", "decode", 0, [1])
    msg = n.done_batch([a, b])
    assert msg.startswith(n.DONES_TAG + n.SEP)
    assert n.parse_done_batch(msg) == [
        ("eng:1/ä", "req,with,commas", "decode", 3, [0, 2]),
        ("e", "r2", "decode", 0, [1]),
    ]
    assert n.parse_done_batch(n.done_batch([a])) == [n.parse_done_notification(a)]
    # One malformed notification is None in its place; the others still parse.
    assert n.parse_done_batch(n.done_batch([a, b"kvs1\x1fjunk", b])) == [
        n.parse_done_notification(a),
        None,
        n.parse_done_notification(b),
    ]
    for other in (a, b"", n.signed_notif(n.PUSH_TAG, b"k" * 16, b"body")):  # not a batch
        assert n.parse_done_batch(other) is None


def test_a_failure_notice_round_trips_its_transfer_id_and_nothing_else_parses_as_one() -> None:
    msg = n.push_failed("0123456789abcdef")
    assert msg.startswith(n.PUSH_FAILED_TAG + n.SEP)
    assert n.parse_push_failed(msg) == "0123456789abcdef"
    for other in (b"", n.PUSH_FAILED_TAG, n.signed_notif(n.PUSH_TAG, b"k" * 16, b"body"), b"kvs1\x1fx"):
        assert n.parse_push_failed(other) is None, other


def test_a_refusal_notice_round_trips_its_key_status_words_and_trailers() -> None:
    """Words with any character (a request id is the engine's), the trailers a group's refusal lists
    its members in; a failure notice, a Push, a truncated or unsigned one parse as none."""
    key = bytes(range(16))
    words = "members[2]: request 'r\x1f\u00e9' was never published by engine 'p'"
    trailers = (("kvsidecar-refused-members", '[[2,"NOT_FOUND","..."]]'),)
    msg = n.push_refused(key, "0123456789abcdef", "NOT_FOUND", words, trailers)
    assert n.parse_push_refused(msg, 16) == (key, "0123456789abcdef", "NOT_FOUND", words, trailers)
    for other in (
        b"",
        n.push_failed("0123456789abcdef"),
        n.signed_notif(n.PUSH_TAG, key, b"{}"),
        msg[:-5],
        n.signed_notif(n.PUSH_REFUSED_TAG, key, b'{"transfer": "x"}'),
    ):
        assert n.parse_push_refused(other, 16) is None, other
