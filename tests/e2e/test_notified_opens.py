"""OpenRead as a NIXL notification (server/notified_opens.py), between real sidecar processes.

Once a pull from a source has completed, a reader sends its opens to that source as NIXL
notifications signed with the push key of its handshake, and the source's NIXL thread answers them
the same way; a reader that gets no answer in time makes the call too. The bytes, the "consumed"
events and the errors are those of the call.
"""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Iterator

import grpc
import pytest

from kv_sidecar.dataplane import staged_protocol as sp
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess, together
from kv_sidecar.server import notified_opens
from kv_sidecar.server.push_runs import KEY_BYTES
from kv_sidecar.transport import notifications
from kv_sidecar.transport.nixl_driver import NixlDriver
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2

from .conftest import SLEEPY_WHEN_QUIET, Spawn, agent_handshake, metric, spec_dict

_ids = itertools.count()
OPENS = "kvsidecar_peer_opens_total"
REFUSED = "kvsidecar_failures_total"


# The reader waits this long for a notified open's answer before it calls too (2 ms by default): on a
# busy machine (CI) the call won that race now and then, and what a test saw depended on it.
PATIENT = ["--open-answer-wait-us", "500000"]


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[SidecarProcess, SidecarProcess]]:
    a, b = together(
        lambda: SidecarProcess("open-prefill"), lambda: SidecarProcess("open-decode", extra=PATIENT)
    )
    yield a, b
    assert (a.stop(), b.stop()) == (0, 0)


def _opens(sc: SidecarProcess, by: str) -> float:
    return metric(sc.metrics_port, OPENS, f'{{by="{by}"}}')


def _publish(prefill: EngineProcess, block_ids: list[int], tokens: int) -> tuple[str, dict[str, object]]:
    rid = f"n-{next(_ids)}"
    pub = prefill.send(
        {"cmd": "prefill", "request_id": rid, "block_ids": block_ids, "num_tokens": tokens, "seed": 3}
    )
    assert pub["ok"], pub
    return rid, pub["params"]


def _send_open(
    agent: NixlDriver,
    hs: peer_pb2.HandshakeResponse,
    engine_id: str,
    request_id: str,
    key: bytes | None = None,
    sidecar_id: str | None = None,
) -> str:
    """An OpenRead notification from `agent`, a reader whose handshake got `hs`, signed with `key` (the
    push key it was given unless said) and naming `sidecar_id` (the agent unless said); its reply id."""
    req = peer_pb2.OpenReadRequest(
        sidecar_id=sidecar_id or agent.name,
        engine_id=engine_id,
        request_id=request_id,
        reader_engine_id="forger-engine",
        reader_ranks=[0],
        plan_hash=hs.plan_hash,
        reply_id=sp.new_transfer_id(),
    )
    signed = notifications.signed_notif(
        notifications.OPEN_TAG, hs.push_key if key is None else key, req.SerializeToString()
    )
    agent.send_notif(hs.agent_name, signed)
    return req.reply_id


def test_opens_go_as_notifications_once_a_pull_completed(pair: tuple[SidecarProcess, SidecarProcess]) -> None:
    a, b = pair
    spec = EngineSpec.from_dict(spec_dict(tp_size=2))
    prefill, decode = together(
        lambda: EngineProcess(a.socket, "np", spec), lambda: EngineProcess(b.socket, "nd", spec)
    )
    try:
        by_notif = []
        for i in range(6):
            before = _opens(b, "notification")
            rid, params = _publish(prefill, [3 + i, 20 + i], 30)
            res = decode.send({"cmd": "pull", "params": params, "block_ids": [40 + i, 10 + i], "seed": 3})
            assert res["ok"] and res["verified"], res
            assert res["path"] == "host-nixl"
            for _ in range(2):  # each prefill rank hears once that its blocks were consumed
                ev = prefill.send({"cmd": "next_event", "timeout_s": 10})
                assert (ev["kind"], ev["request_id"]) == ("consumed", rid), ev
            by_notif.append(_opens(b, "notification") - before)
        # The first pull opened by call (no pull had completed yet), the later ones by notification.
        assert by_notif == [0, 1, 1, 1, 1, 1], by_notif
        assert metric(a.metrics_port, REFUSED, '{reason="open_notification_refused"}') == 0
        # Refusals come back by notification with the call's code and words, and change nothing.
        rid, params = _publish(prefill, [30, 31], 30)
        before = _opens(b, "notification")
        ok = decode.send({"cmd": "pull", "params": params, "block_ids": [50, 51], "seed": 3})
        assert ok["ok"] and ok["verified"], ok
        again = decode.send({"cmd": "pull", "params": params, "block_ids": [52, 53], "seed": 3})
        assert (again["ok"], again["error_code"]) == (False, "NOT_FOUND"), again
        assert f"refused to open request {rid!r}" in again["error"], again
        assert "was already consumed" in again["error"], again
        assert again["verified"], again  # no byte outside the requested blocks changed
        assert _opens(b, "notification") - before == 2  # the refusal came by notification too
    finally:
        prefill.stop()
        decode.stop()


def test_a_publish_after_a_quiet_spell_wakes_the_source_for_the_open(spawn: Spawn) -> None:
    """A source whose NIXL thread has had nothing to do for a second polls only every
    nixl_quiet_poll_ms (50 by default). The Publish before a pull wakes it: before that, an open
    notification after a quiet spell waited for the next poll, the reader made the call after 2 ms,
    and the pull paid ~0.8 ms more (`bench/ring_latency.py --host-nixl --idle 1.5`, docs/benchmarks.md).

    The test's own NIXL agent is the reader, so that no reader's 2 ms race with the call (lost now and
    then on a busy machine) decides the outcome, and the source polls every 10 s when quiet: woken, it
    answers in milliseconds; not woken, ~10 s later."""
    source = spawn(SidecarProcess("quiet-source", extra=SLEEPY_WHEN_QUIET))
    spec = EngineSpec.from_dict(spec_dict())
    prefill = spawn(EngineProcess(source.socket, "quiet-np", spec))
    answers: queue.Queue[bytes] = queue.Queue()
    reader = NixlDriver("quiet-reader", on_notif=lambda agent, msg: answers.put(msg))
    reader.start()
    try:
        hs = agent_handshake(source, reader, "quiet-np", spec)
        reader.add_remote(hs.agent_metadata, hs.agent_name)
        waited = []
        for i in range(3):  # not woken, the first quiet spell fails: one more is for good measure
            if i:  # the first open comes while the handshake's fast polling lasts
                time.sleep(1.5)
            rid, _ = _publish(prefill, [2 + i], 10)
            sent = time.monotonic()
            reply_id = _send_open(reader, hs, "quiet-np", rid)
            try:
                msg = answers.get(timeout=5)
            except queue.Empty:
                pytest.fail(
                    f"open {i} after a quiet spell was not answered within 5 s: the Publish did not wake the source"
                )
            waited.append(time.monotonic() - sent)
            reply = notified_opens.parse_reply(reply_id, msg)
            assert reply is not None and reply.code == 0, reply
            assert list(reply.response.block_ids) == [2 + i]
            # Ends the read it opened (no reader will READ): the source stops polling for it.
            assert prefill.send({"cmd": "abort", "request_id": rid})["found"]
        print("answered after", [f"{w * 1e3:.1f} ms" for w in waited])
    finally:
        reader.stop()


def test_the_source_answers_signed_opens_and_drops_the_rest(
    pair: tuple[SidecarProcess, SidecarProcess],
) -> None:
    """The source side alone, driven by a NIXL agent of the test's own: an open signed with the key its
    handshake gave opens the request and is answered with its blocks; a refusal is answered with the
    call's status; one with another key, or naming another reader, is dropped unanswered."""
    a, _ = pair
    spec = EngineSpec.from_dict(spec_dict())
    prefill = EngineProcess(a.socket, "forged-np", spec)
    answers: queue.Queue[bytes] = queue.Queue()
    forger = NixlDriver("open-forger", on_notif=lambda agent, msg: answers.put(msg))
    forger.start()
    try:
        rid, _ = _publish(prefill, [4, 5], 20)
        hs = agent_handshake(a, forger, "forged-np", spec)
        assert len(hs.push_key) == KEY_BYTES
        forger.add_remote(hs.agent_metadata, hs.agent_name)

        def open_by_notif(key: bytes, request_id: str, sidecar_id: str = "open-forger") -> str:
            return _send_open(forger, hs, "forged-np", request_id, key, sidecar_id)

        def answer(reply_id: str) -> peer_pb2.OpenReadReply:
            reply = notified_opens.parse_reply(reply_id, answers.get(timeout=10))
            assert reply is not None
            return reply

        refused = metric(a.metrics_port, REFUSED, '{reason="open_notification_refused"}')
        reply = answer(open_by_notif(hs.push_key, rid))
        assert reply.code == 0, reply
        assert (list(reply.response.block_ids), reply.response.num_tokens) == ([4, 5], 20)
        assert reply.response.lease_deadline_unix_ms > time.time() * 1000
        reply = answer(open_by_notif(hs.push_key, "never-published"))
        assert reply.code == grpc.StatusCode.NOT_FOUND.value[0], reply
        assert "was never published" in reply.message
        for key, who in ((bytes(KEY_BYTES), "open-forger"), (hs.push_key, "someone-else")):
            open_by_notif(key, rid, sidecar_id=who)
        deadline = time.monotonic() + 10
        while metric(a.metrics_port, REFUSED, '{reason="open_notification_refused"}') < refused + 2:
            assert time.monotonic() < deadline, "the forged opens were not refused"
            time.sleep(0.05)
        time.sleep(0.2)
        assert answers.empty(), "a forged open was answered"
    finally:
        forger.stop()
        prefill.stop()


def test_reply_notifications_round_trip_and_reject_other_ids() -> None:
    reply = peer_pb2.OpenReadReply(code=5, message="gone \x1f with a separator")
    msg = notified_opens.reply_notif("0123456789abcdef", reply)
    assert msg.startswith(sp.prefix("0123456789abcdef"))
    assert notified_opens.parse_reply("0123456789abcdef", msg) == reply
    assert notified_opens.parse_reply("fedcba9876543210", msg) is None
    assert notified_opens.parse_reply("0123456789abcdef", msg[: len(sp.prefix("0123456789abcdef"))]) is None
    signed = notifications.signed_notif(notifications.OPEN_TAG, bytes(KEY_BYTES), b"body")
    assert notifications.parse_signed_notif(notifications.OPEN_TAG, signed, KEY_BYTES) == (
        bytes(KEY_BYTES),
        b"body",
    )
    assert notifications.parse_signed_notif(notifications.PUSH_TAG, signed, KEY_BYTES) is None
