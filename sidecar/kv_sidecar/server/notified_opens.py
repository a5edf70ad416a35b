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
from typing import Any

from google.protobuf.message import DecodeError

from kv_sidecar.dataplane import staged_protocol as sp
from kv_sidecar.errors import Code, SidecarError, handler_error
from kv_sidecar.mailbox import Mailbox
from kv_sidecar.metrics import Metrics
from kv_sidecar.server.drain import Drain, draining_message
from kv_sidecar.server.peer_calls import PeerFuture, peer_error
from kv_sidecar.server.peers import BACKOFF_S, MISSES_TO_BACK_OFF, Holder, PeerLink, Peers
from kv_sidecar.server.push_runs import PushKeys, PushRuns
from kv_sidecar.server.reads import ProbeFirst, SourceReads
from kv_sidecar.transport.nixl_driver import NixlDriver
from kv_sidecar.transport.notifications import OPEN_TAG, SEP, signed_notif
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2

log = logging.getLogger(__name__)

# How long a reader waits for the answer before it makes the call too is the open_answer_wait_us
# setting (2 ms). A source polls for notifications every 0.1 ms while readers are recent
# (server/push_runs.py), and every nixl_quiet_poll_ms when idle for a while; the Publish before a pull
# wakes it (PushRuns' on_recent).
OPENED = b"o"  # the answer's kind, after sp.prefix(reply id)
OPEN_READ = "OpenRead"


# -- source ----------------------------------------------------------------------------
class OpenAnswers:
    """The source's end: OpenRead notifications, answered on the NIXL thread."""

    def __init__(
        self,
        reads: SourceReads,
        push_keys: PushKeys,
        push_runs: PushRuns,
        drain: Drain,
        nixl: NixlDriver,
        metrics: Metrics,
    ) -> None:
        self._reads = reads
        self._push_keys = push_keys
        self._push_runs = push_runs
        self._drain = drain
        self._nixl = nixl
        self._metrics = metrics

    def answer(self, agent: str, msg: bytes) -> None:
        """An OpenRead notification: open the request and answer. One without the key given to
        `agent`, or malformed, is dropped; its reader then makes the call."""
        signed = self._push_keys.verify(agent, OPEN_TAG, msg, peer_pb2.OpenReadRequest.FromString)
        if signed is None or signed[1].sidecar_id != agent or not sp.is_transfer_id(signed[1].reply_id):
            self._metrics.failures.labels("open_notification_refused").inc()
            log.debug("refused an OpenRead notification from %s", agent)
            return
        peer, req = signed
        self._push_runs.reader_seen()  # it will open again: poll for its notifications at the serving rate
        reply = peer_pb2.OpenReadReply()
        try:
            if self._drain.draining:
                raise SidecarError(Code.UNAVAILABLE, draining_message(OPEN_READ))
            reply.response.CopyFrom(self._reads.open_read(req, peer, probe=False))
        except ProbeFirst:
            log.debug("OpenRead notification from %s left to its call: its request's reader is probed", agent)
            return
        except Exception as e:
            err = handler_error(e)
            reply.code, reply.message = int(err.code), err.message
        self._nixl.notify(agent, reply_notif(req.reply_id, reply))


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
class NotifiedOpens:
    """The reader's end: opens sent as notifications where a link allows."""

    def __init__(
        self, enabled: bool, answer_wait_s: float, peers: Peers, nixl: NixlDriver, metrics: Metrics
    ) -> None:
        self._enabled = enabled  # the push_notifications setting
        self._answer_wait_s = answer_wait_s
        self._peers = peers
        self._nixl = nixl
        self._metrics = metrics

    def send(self, holder: Holder, msg: peer_pb2.OpenReadRequest) -> NotifiedOpen | None:
        """The open sent as a notification, where the link to `holder` allows; else None (make the call)."""
        if not self._enabled:
            return None
        link = self._peers.link(holder.address)
        key = link.push_key_for_open()
        if not key:
            return None
        return NotifiedOpen(self._nixl, self._metrics, self._answer_wait_s, holder, link, key, msg)


class NotifiedOpen:
    """One open sent as a notification, until its answer comes or the reader stops waiting for it."""

    def __init__(
        self,
        nixl: NixlDriver,
        metrics: Metrics,
        answer_wait_s: float,
        holder: Holder,
        link: PeerLink,
        key: bytes,
        msg: peer_pb2.OpenReadRequest,
    ) -> None:
        self._nixl = nixl
        self._metrics = metrics
        self._answer_wait_s = answer_wait_s
        self._holder = holder
        self._link = link
        self._what = f"to open request {msg.request_id!r}"
        self.reply_id = sp.new_transfer_id()
        # Answers: the notification's bytes, or the OpenRead call's future where one was made.
        self._answers: Mailbox[Any] = Mailbox()
        self._waiting = True
        req = peer_pb2.OpenReadRequest()
        req.CopyFrom(msg)
        req.reply_id = self.reply_id
        nixl.listen(sp.prefix(self.reply_id), lambda _agent, m: self._answers.put(m))
        # Poll at the busy rate while the answer is due (the READ may finish before it).
        nixl.add_poller(lambda _a: not self._waiting)
        # It leaves once the NIXL thread gets the GIL: when this thread next waits (bench/trace_pull.py).
        nixl.notify(holder.agent_name, signed_notif(OPEN_TAG, key, req.SerializeToString()))

    def result(
        self, call: Callable[[], PeerFuture[peer_pb2.OpenReadResponse]], deadline: float
    ) -> peer_pb2.OpenReadResponse:
        """The first answer: the notification's, or, where none came within open_answer_wait_us, that of
        the OpenRead call `call()` makes (the open is idempotent, so both may open it). Raises a
        refusal: PeerCallError for the call's."""
        future: PeerFuture[peer_pb2.OpenReadResponse] | None = None
        try:
            try:
                wait = min(self._answer_wait_s, deadline - time.monotonic())
                got = self._answers.get(timeout=max(0.0, wait))
            except queue.Empty:
                # Counted whichever answer comes first: the call's round trip is already paid.
                self._metrics.opens.labels("call_after_notification").inc()
                future = call()
                future.add_done_callback(self._answers.put)
                got = self._answers.get()  # the call ends by its deadline
                if got is not future:
                    future.cancel()
        finally:
            self.abandon()
        if not isinstance(got, bytes):  # the call's future
            self._missed()
            return got.result()
        self._link.open_answered_by_notification()
        reply = parse_reply(self.reply_id, got)
        if reply is None:
            raise SidecarError(Code.INTERNAL, f"peer sidecar {self._holder.address} sent a malformed answer")
        if future is None:
            self._metrics.opens.labels("notification").inc()
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
            self._nixl.unlisten(sp.prefix(self.reply_id))
