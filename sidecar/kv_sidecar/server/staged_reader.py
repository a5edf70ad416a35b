"""The reader's end of the staged protocol, its control half: one Push per (decode rank, source rank)
read, sent as a NIXL notification or a gRPC call, its answer and its stop. The bytes, slots and
credits are the data plane's (dataplane/receive.py; docs/gpu.md says how the protocol flows)."""

from __future__ import annotations

import functools
import time
from concurrent.futures import wait
from typing import Any

from kv_sidecar.dataplane import staged_protocol as sp
from kv_sidecar.dataplane.jobs import CANCEL_WAIT_S, Receive
from kv_sidecar.dataplane.plane import DataPlane, Reception
from kv_sidecar.errors import Code, SidecarError, waited_for
from kv_sidecar.metrics import Metrics
from kv_sidecar.server.engines import RankEntry, spec_to_proto
from kv_sidecar.server.peer_calls import PeerCallError
from kv_sidecar.server.peers import PeerLink, Peers, RemoteEngine
from kv_sidecar.server.pull_direct import require_gpu
from kv_sidecar.server.pull_job import PullJob
from kv_sidecar.server.push_threads import PushThreads
from kv_sidecar.server.staged_common import read_heads
from kv_sidecar.transport.nixl_driver import NixlDriver
from kv_sidecar.transport.notifications import PUSH_TAG, signed_notif
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2

# A Push sent as a notification sends its gRPC call only if the transfer has not finished this long
# after: a small pull (~2 ms on two GPUs) then never runs a call on either sidecar, whose handler
# threads competed with the transfer's launches for the GIL (~0.5 ms each side, traced). A larger
# one gets the call's answer, errors and deadline as before; a refused notification (the source
# restarted: it no longer knows our key) costs this much once before the call starts the transfer.
CALL_AFTER_S = 0.005
# Under load a notified transfer waits at its source longer than CALL_AFTER_S (16 pulls in flight: tens
# of ms), and a call sent then only adds a gRPC call's work to both sidecars, which are already what
# the pulls wait for (10-55 % of a core across the two, docs/benchmarks.md, issue 32). So the call
# waits CALL_AFTER_FACTOR times what this link's notified transfers lately took, up to CALL_AFTER_MAX_S:
# how late a reader learns that its source died, or that a restarted source refused the notification.
CALL_AFTER_FACTOR = 3.0
CALL_AFTER_MAX_S = 0.1


def call_after_s(recent_s: float) -> float:
    """How long after its notification a Push's call goes, given the link's recent transfer time."""
    return min(CALL_AFTER_MAX_S, max(CALL_AFTER_S, CALL_AFTER_FACTOR * recent_s))


# How long a reader waits for its Push notification to leave before preparing its copies: the NIXL
# thread needs the GIL for that, usually within ~0.1 ms; a busier driver is not waited for.
NOTIFY_WAIT_S = 0.001


class _PushCall:
    """A read's Push: its notification (when we hold the source's key) and its gRPC call, sent at once
    without a key, else only when due (CALL_AFTER_S) or to stop the transfer."""

    def __init__(
        self,
        threads: PushThreads,
        metrics: Metrics,
        link: PeerLink,
        req: peer_pb2.PushRequest,
        job: PullJob,
        reception: Reception,
    ) -> None:
        self.threads = threads
        self.metrics = metrics
        self.link = link
        self.req = req
        self.job = job
        self.reception = reception
        self.call: Any = None
        self.called_at = 0.0
        self.notified = req.notified
        self.sent_at = time.monotonic()
        self.due = self.sent_at + call_after_s(link.notified_push_s) if req.notified else 0.0

    @property
    def asked(self) -> bool:
        """The source may be moving the transfer: we sent its notification or its call."""
        return self.notified or self.call is not None

    def wait_s(self) -> float:
        """How long until the call is due (inf once it was sent)."""
        return float("inf") if self.call is not None else max(0.0, self.due - time.monotonic())

    def send_if_due(self) -> None:
        if self.call is None and time.monotonic() >= self.due:
            # Longer than the pull: the source stops at timeout_ms, and its answer says when nothing
            # is in flight any more, which a timed-out reader still needs.
            self._send(
                self.req, self.job.remaining() + CANCEL_WAIT_S + 1, "slow" if self.notified else "no_key"
            )

    def send_stopping(self) -> None:
        """We gave the transfer up before its call went out: ask the source to stop what the
        notification started (and start nothing), and to answer once nothing is in flight."""
        stop = peer_pb2.PushRequest()
        stop.CopyFrom(self.req)
        stop.stopping = True
        self._send(stop, CANCEL_WAIT_S + 1, "stop")

    def describe(self) -> str:
        """Where the Push stands, for an error that ends its read."""
        ago = time.monotonic() - self.sent_at
        how = "by notification" if self.notified else "by call"
        if self.call is None:
            return f"Push sent {how} {ago * 1000:.0f} ms ago, its call not sent"
        state = "not answered"
        if self.call.done():
            err = None if self.call.cancelled() else self.call.exception()
            state = "answered OK" if err is None else f"answered {type(err).__name__}: {err}"
        return f"Push sent {how} {ago * 1000:.0f} ms ago, its call {(self.called_at - self.sent_at) * 1000:.0f} ms after: {state}"

    def _send(self, req: peer_pb2.PushRequest, timeout_s: float, why: str) -> None:
        self.metrics.push_calls.labels(why).inc()
        self.called_at = time.monotonic()
        self.call = self.threads.call(self.link.client.push, req, timeout_s)
        self.call.add_done_callback(functools.partial(_learn_key, self.link))
        self.call.add_done_callback(lambda _: self.reception.poke())


class StagedReader:
    """The reads of pulls that run the staged protocol, into this sidecar's receive rings."""

    def __init__(
        self,
        sidecar_id: str,
        peers: Peers,
        plane: DataPlane,
        threads: PushThreads,
        nixl: NixlDriver,
        metrics: Metrics,
    ) -> None:
        self._sidecar_id = sidecar_id
        self._peers = peers
        self._plane = plane
        self._threads = threads
        self._nixl = nixl
        self._metrics = metrics

    def read(
        self,
        job: PullJob,
        remote: RemoteEngine,
        entry: RankEntry,
        src_rank: int,
        open_msg: peer_pb2.OpenReadRequest | None = None,
    ) -> int:
        """Move one (decode rank, source rank) read through the two sidecars' rings; returns bytes written.

        `open_msg`: the Push opens the request itself (no OpenRead before it); the job was planned from
        the params, and the source refuses before any WRITE if its record holds another token count.
        """
        # The sidecar holding the source rank: the peer itself, or a member of a multi-node engine.
        holder = remote.holders.get(src_rank)
        address = holder.address if holder is not None else job.params.sidecar_address
        link = self._peers.link(address)
        agent = remote.agent_of(src_rank)
        if not entry.on_gpu and remote.memory_kind == "VRAM":
            require_gpu([entry], "decode")
        heads = read_heads(job.plan, entry.rank, src_rank)
        tid = sp.new_transfer_id()
        rx = self._plane.receive(Receive(entry.key, job.plan.decode, heads, job.tokens, agent, tid), job)
        if rx is None:
            return 0  # a prefix hit covering the whole request: nothing to move
        push: _PushCall | None = None
        done = False
        try:
            slots = rx.slots
            # Once: another pull's answer may replace it meanwhile. None until the link is wired, nor
            # for a source that no longer expects us (it would see the notification only 50 ms on).
            key = link.push_key_for_push()
            req = peer_pb2.PushRequest(
                engine_id=job.params.engine_id,
                request_id=job.params.request_id,
                reader_engine_id=entry.engine_id,
                reader_spec=spec_to_proto(job.plan.decode),
                reader_rank=entry.rank,
                source_rank=src_rank,
                plan_hash=job.plan.hash(),
                start_token=job.start_token,
                transfer_id=tid,
                reader_agent=self._sidecar_id,
                reader_agent_metadata=slots.metadata,
                memory_kind=slots.memory_kind,
                device_id=slots.device_id,
                slots=[peer_pb2.PushSlot(address=a, length=slots.slot_bytes) for a in slots.addresses],
                timeout_ms=max(1, int(job.remaining() * 1000)),
                open=open_msg,
                open_num_tokens=job.num_tokens if open_msg is not None else 0,
                notified=bool(key),
            )
            push = _PushCall(self._threads, self._metrics, link, req, job, rx)
            if req.notified:
                # The request as a NIXL notification: the source's NIXL thread starts the transfer
                # from it (server/push_runs.py); the call follows only if it is slow.
                sent = self._nixl.notify(agent, signed_notif(PUSH_TAG, key, req.SerializeToString()))
                # Let the NIXL thread send it before the preparation below holds the GIL for
                # ~0.35 ms: the notification otherwise left ~0.2 ms later (traced on a GPU).
                wait((sent,), timeout=NOTIFY_WAIT_S)
            else:
                push.send_if_due()
            rx.prepare()  # while the source gathers its first chunk
            nbytes = _receive(job, rx, push, address)
            done = True
            link.staged_read_completed()
            if push.notified:
                link.notified_push_done(time.monotonic() - push.sent_at)
            return nbytes
        except SidecarError as e:
            if push is None:
                raise
            raise waited_for(e, f"staged read from {address}: {push.describe()}; {rx.describe()}") from None
        except sp.ProtocolError as e:
            self._metrics.failures.labels("staged_protocol").inc()
            raise SidecarError(
                Code.INTERNAL, f"peer sidecar {address} broke the staged protocol: {e}"
            ) from None
        finally:
            quiet = done or push is None or not push.asked or _stop_source(rx, push)
            call = push.call if push is not None else None
            # The Push call is a blocking call on a caller thread, which nothing can cancel: it ends at
            # its deadline at the latest, and a source whose call ended stops within its cancel wait.
            rx.close(quiet, None if call is None else lambda go: call.add_done_callback(lambda _: go()))


def _receive(job: PullJob, rx: Reception, push: _PushCall, address: str) -> int:
    """Scatter chunks as their notifications arrive, until the request is complete."""
    grace: float | None = None
    while True:
        left = job.remaining()
        if grace is not None and time.monotonic() > grace:
            raise sp.ProtocolError(f"the source answered but sent only part of the {rx.chunks} chunks")
        push.send_if_due()
        if rx.wait(min(0.05, left, push.wait_s()) or 1e-4):
            return rx.nbytes
        if grace is None and push.call is not None and push.call.done():
            _raise_push_error(push.call, address, job.params.request_id)
            # It answered OK: every WRITE is done, but their notifications may trail the answer.
            grace = time.monotonic() + CANCEL_WAIT_S


def _learn_key(link: PeerLink, call: Any) -> None:
    """Keep the key of the source's answer (a restarted source gives a new one; empty: it wants none)."""
    if not call.cancelled() and call.exception() is None:
        link.learn_push_key(call.result().push_key)


def _raise_push_error(call: Any, address: str, request_id: str) -> None:
    try:
        call.result(timeout=0)
    except PeerCallError as e:
        raise _push_error(e, address, request_id) from None


def _push_error(e: PeerCallError, address: str, request_id: str) -> SidecarError:
    if e.ended:
        # The source's own verdict (e.g. UNAVAILABLE: its NIXL WRITE failed).
        return SidecarError(e.code, f"{e.details} (peer sidecar {address})")
    return e.explain(address, f"to push request {request_id!r}")


def _stop_source(rx: Reception, push: _PushCall) -> bool:
    """Stop the source and wait until it has nothing in flight; False if it never confirmed."""
    if push.call is None or not push.call.done():
        rx.stop_source()
    else:
        rx.stop_credits()
    if push.call is None:  # only the notification went: the call confirms the stop (and starts nothing)
        try:
            push.send_stopping()
        except Exception:
            return False
    call = push.call
    try:
        call.result(timeout=CANCEL_WAIT_S)
    except TimeoutError:
        return False
    except PeerCallError as e:
        return e.ended
    except Exception:
        return False
    return True
