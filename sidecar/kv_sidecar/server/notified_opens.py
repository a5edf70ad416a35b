"""OpenRead as a NIXL notification, both ways: a hand-off between two NIXL threads instead of a gRPC
round trip, which was most of a one-block host pull between sidecars (docs/benchmarks.md).

Reader: where the source's handshake gave this sidecar a push key (server/push_runs.py) and a pull
from that source has completed since (so our NIXL connection to it is set up), the open goes as a
notification signed with that key. The source's NIXL thread opens the request (server/reads.py) and
answers with an OpenReadReply notification to our agent, which it loaded from our handshake. An answer
that has not come within the open_answer_wait_us setting (the source polls slowly after a quiet spell,
restarted and has another key, or cannot reach us) is not waited for alone: the reader makes the
OpenRead call too, and takes whichever answer comes first (an open is idempotent for its reader). A
link whose calls keep winning sends its opens by call only for BACKOFF_S (PeerLink.open_missed).

Source: the key binds a notification to the peer it was given to over an authenticated call; NIXL
notifications carry no TLS and no token. A draining sidecar refuses such an open as it refuses the call.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError

from kv_sidecar.server import staged_protocol as sp
from kv_sidecar.server.drain import draining_message
from kv_sidecar.server.errors import Code, SidecarError, handler_error
from kv_sidecar.server.notifications import OPEN_TAG, SEP, TRANSFER_TAG, signed_notif
from kv_sidecar.server.peers import BACKOFF_S, MISSES_TO_BACK_OFF, Holder, PeerLink, peer_error
from kv_sidecar.server.reads import open_read
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2

if TYPE_CHECKING:
    from kv_sidecar.server.sidecar import Sidecar

log = logging.getLogger(__name__)

# How long a reader waits for the answer before it makes the call too is the open_answer_wait_us
# setting (2 ms). A source polls for notifications every 0.1 ms while readers are recent
# (server/push_runs.py), and every nixl_quiet_poll_ms when idle for a while; the Publish before a pull
# wakes it (PushRuns' on_recent).
OPENED = b"o"  # the answer's kind, after sp.prefix(reply id)
OPEN_READ = "OpenRead"


# -- source ----------------------------------------------------------------------------
def answer(sc: Sidecar, agent: str, msg: bytes) -> None:
    """An OpenRead notification (NIXL thread): open the request and answer. One without the key given
    to `agent`, or malformed, is dropped; its reader then makes the call."""
    signed = sc.push_keys.verify(agent, OPEN_TAG, msg, peer_pb2.OpenReadRequest.FromString)
    if signed is None or signed[1].sidecar_id != agent or not sp.is_transfer_id(signed[1].reply_id):
        sc.metrics.failures.labels("open_notification_refused").inc()
        log.debug("refused an OpenRead notification from %s", agent)
        return
    peer, req = signed
    sc.push_runs.reader_seen()  # it will open again: poll for its notifications at the serving rate
    reply = peer_pb2.OpenReadReply()
    try:
        if sc.drain.draining:
            raise SidecarError(Code.UNAVAILABLE, draining_message(OPEN_READ))
        reply.response.CopyFrom(open_read(sc, req, peer))
    except Exception as e:
        err = handler_error(e)
        reply.code, reply.message = int(err.code), err.message
    sc.nixl.notify(agent, reply_notif(req.reply_id, reply))


def reply_notif(reply_id: str, reply: peer_pb2.OpenReadReply) -> bytes:
    return sp.prefix(reply_id) + OPENED + SEP + reply.SerializeToString()


def parse_reply(reply_id: str, msg: bytes) -> peer_pb2.OpenReadReply | None:
    head = sp.prefix(reply_id) + OPENED + SEP
    if not msg.startswith(head):
        return None
    try:
        return peer_pb2.OpenReadReply.FromString(msg[len(head) :])
    except DecodeError:
        return None


# -- reader ----------------------------------------------------------------------------
class NotifiedOpen:
    """One open sent as a notification, until its answer comes or the reader stops waiting for it."""

    def __init__(
        self, sc: Sidecar, holder: Holder, link: PeerLink, key: bytes, msg: peer_pb2.OpenReadRequest
    ) -> None:
        self._sc = sc
        self._holder = holder
        self._link = link
        self._what = f"to open request {msg.request_id!r}"
        self.reply_id = sp.new_transfer_id()
        # Answers: the notification's bytes, or the OpenRead call's future where one was made.
        self._answers: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._waiting = True
        req = peer_pb2.OpenReadRequest()
        req.CopyFrom(msg)
        req.reply_id = self.reply_id
        sc.nixl.route(TRANSFER_TAG + SEP)
        sc.nixl.listen(sp.prefix(self.reply_id), lambda _agent, m: self._answers.put(m))
        # Poll at the busy rate while the answer is due (the READ may finish before it).
        sc.nixl.add_poller(lambda _a: not self._waiting)
        # It leaves once the NIXL thread gets the GIL: when this thread next waits (bench/trace_pull.py).
        sc.nixl.notify(holder.agent_name, signed_notif(OPEN_TAG, key, req.SerializeToString()))

    def result(self, call: Callable[[], grpc.Future], deadline: float) -> peer_pb2.OpenReadResponse:
        """The first answer: the notification's, or, where none came within open_answer_wait_us, that of
        the OpenRead call `call()` makes (the open is idempotent, so both may open it). Raises a refusal."""
        future: grpc.Future | None = None
        try:
            try:
                wait = min(self._sc.settings.open_answer_wait_us / 1e6, deadline - time.monotonic())
                got = self._answers.get(timeout=max(0.0, wait))
            except queue.Empty:
                # Counted whichever answer comes first: the call's round trip is already paid.
                self._sc.metrics.opens.labels("call_after_notification").inc()
                future = call()
                future.add_done_callback(self._answers.put)
                got = self._answers.get()  # the call ends by its deadline
                if got is not future:
                    future.cancel()
        finally:
            self.abandon()
        if isinstance(got, grpc.Future):
            self._missed()
            return got.result()  # raises its grpc.RpcError
        self._link.open_answered_by_notification()
        reply = parse_reply(self.reply_id, got)
        if reply is None:
            raise SidecarError(Code.INTERNAL, f"peer sidecar {self._holder.address} sent a malformed answer")
        if future is None:
            self._sc.metrics.opens.labels("notification").inc()
        if reply.code != Code.OK:
            code = Code(reply.code) if reply.code in set(Code) else Code.UNKNOWN
            raise peer_error(code, reply.message, self._holder.address, self._what)
        return reply.response

    def _missed(self) -> None:
        """The call answered first. Once is a slow poll (a source idle for a while polls every 50 ms);
        MISSES_TO_BACK_OFF times in a row, the notifications are not getting through."""
        if self._link.open_missed():
            log.warning(
                "%d OpenRead notifications to %s in a row were not answered before the call: "
                "opening by call only for %.0f s",
                MISSES_TO_BACK_OFF,
                self._holder.address,
                BACKOFF_S,
            )

    def abandon(self) -> None:
        if self._waiting:
            self._waiting = False
            self._sc.nixl.unlisten(sp.prefix(self.reply_id))


def send(sc: Sidecar, holder: Holder, msg: peer_pb2.OpenReadRequest) -> NotifiedOpen | None:
    """The open sent as a notification, where the link to `holder` allows; else None (make the call)."""
    if not sc.settings.push_notifications:
        return None
    link = sc.peers.link(holder.address)
    key = link.push_key_for_open()
    if not key:
        return None
    return NotifiedOpen(sc, holder, link, key, msg)
