"""errors.waited_for: a stalled operation's error says what it waited for, and nothing else changes."""

from __future__ import annotations

from kv_sidecar.errors import Code, SidecarError, waited_for


def test_a_timeout_or_a_stop_names_what_it_waited_for() -> None:
    for code in (Code.DEADLINE_EXCEEDED, Code.CANCELLED):
        e = SidecarError(code, "pull of request 'r' timed out", (("k", "v"),))
        out = waited_for(e, "waiting for a receive slot: 0 of 2 slots free")
        assert (out.code, out.metadata) == (code, (("k", "v"),))
        assert out.message == "pull of request 'r' timed out (waiting for a receive slot: 0 of 2 slots free)"
        assert str(out) == out.message


def test_other_errors_and_subclasses_pass_unchanged() -> None:
    refused = SidecarError(Code.INVALID_ARGUMENT, "block id 9 out of range")
    assert waited_for(refused, "anything") is refused

    class Gone(SidecarError):
        pass

    gone = Gone(Code.CANCELLED, "the reader is taken for gone")
    assert waited_for(gone, "anything") is gone  # callers tell subclasses apart
