"""The reader's end of the staged protocol (server/staged_copies.py says how it flows): one Push per
(decode rank, source rank) read, chunks scattered as their notifications arrive, slots credited back."""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import wait
from typing import Any

from kv_sidecar.execute import gpu
from kv_sidecar.metrics import Metrics
from kv_sidecar.server import staged_protocol as sp
from kv_sidecar.server.engines import RankEntry, spec_to_proto
from kv_sidecar.server.errors import Code, SidecarError
from kv_sidecar.server.gpu_direct import require_gpu
from kv_sidecar.server.gpu_staging import HOST, GpuStaging, Ring
from kv_sidecar.server.notifications import PUSH_TAG, signed_notif
from kv_sidecar.server.peer_calls import PeerCallError
from kv_sidecar.server.peers import PeerLink, Peers, RemoteEngine
from kv_sidecar.server.pull_job import CANCEL_WAIT_S, PullJob
from kv_sidecar.server.staged_copies import (
    QUARANTINE_S,
    GpuCopies,
    HostCopies,
    read_heads,
)
from kv_sidecar.transport.nixl_driver import NixlDriver
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2

log = logging.getLogger(__name__)


_PUSH_DONE = object()  # inbox marker: the Push call ended
# A Push sent as a notification sends its gRPC call only if the transfer has not finished this long
# after: a small pull (~2 ms on two GPUs) then never runs a call on either sidecar, whose handler
# threads competed with the transfer's launches for the GIL (~0.5 ms each side, traced). A larger
# one gets the call's answer, errors and deadline as before; a refused notification (the source
# restarted: it no longer knows our key) costs this much once before the call starts the transfer.
CALL_AFTER_S = 0.005
# How long a reader waits for its Push notification to leave before preparing its copies: the NIXL
# thread needs the GIL for that, usually within ~0.1 ms; a busier driver is not waited for.
NOTIFY_WAIT_S = 0.001


class _PushCall:
    """A read's Push: its notification (when we hold the source's key) and its gRPC call, sent at once
    without a key, else only when due (CALL_AFTER_S) or to stop the transfer."""

    def __init__(
        self,
        staging: GpuStaging,
        metrics: Metrics,
        link: PeerLink,
        req: peer_pb2.PushRequest,
        job: PullJob,
        inbox: queue.Queue[Any],
    ) -> None:
        self.staging = staging
        self.metrics = metrics
        self.link = link
        self.req = req
        self.job = job
        self.inbox = inbox
        self.call: Any = None
        self.notified = req.notified
        self.due = time.monotonic() + CALL_AFTER_S if req.notified else 0.0

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

    def _send(self, req: peer_pb2.PushRequest, timeout_s: float, why: str) -> None:
        self.metrics.push_calls.labels(why).inc()
        self.call = self.staging.call(self.link.client.push, req, timeout_s)
        self.call.add_done_callback(functools.partial(_learn_key, self.link))
        self.call.add_done_callback(lambda _: self.inbox.put(_PUSH_DONE))


class _Credits:
    """Driver-thread poller of a reader: as each scatter's marker completes, give its slot back
    to the source (credit notification) or to our pool (the chunks to come fit the credits)."""

    def __init__(
        self,
        state: sp.RecvState,
        ready: Callable[[Any], bool],
        ring: Ring,
        ring_slots: list[int],
        agent: str,
        transfer_id: str,
        inbox: queue.Queue[Any],
    ) -> None:
        self.state = state
        self.ready = ready
        self.ring = ring
        self.ring_slots = ring_slots  # wire slot (position in the Push) -> our ring slot
        self.agent = agent
        self.tid = transfer_id
        self.inbox = inbox
        self.pending: deque[tuple[Any, int]] = deque()
        self.lock = threading.Lock()
        self.closed = False

    def add(self, marker: Any, slot: int) -> None:
        with self.lock:
            self.pending.append((marker, slot))

    def poll(self, a: Any) -> bool:
        with self.lock:
            if self.closed:
                return True
            try:
                if a is None:
                    raise SidecarError(Code.UNAVAILABLE, "the sidecar is shutting down")
                while self.pending and self.ready(self.pending[0][0]):
                    _, slot = self.pending.popleft()
                    if self.state.scattered(slot):
                        self._credit(a, slot)
                    else:
                        self.ring.pool.release([self.ring_slots[slot]])
            except Exception as e:  # tell the reader's thread; it stops the transfer
                self.closed = True
                self.inbox.put(e)
                return True
            return False

    def _credit(self, a: Any, slot: int) -> None:
        try:
            a.send_notif(self.agent, sp.credit_notif(self.tid, slot))
        except Exception as e:
            # Where UCX notices a dead peer at once, this send can fail before the Push call does: the
            # source is gone, which is not an internal error of ours.
            raise SidecarError(
                Code.UNAVAILABLE, f"the source sidecar (NIXL agent {self.agent}) is not reachable: {e}"
            ) from None

    def close(self) -> None:
        with self.lock:
            self.closed = True


class StagedReader:
    """The reads of pulls that run the staged protocol, through this sidecar's receive rings."""

    def __init__(
        self, sidecar_id: str, peers: Peers, staging: GpuStaging, nixl: NixlDriver, metrics: Metrics
    ) -> None:
        self._sidecar_id = sidecar_id
        self._peers = peers
        self._staging = staging
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
        on_gpu = entry.gpu is not None
        if not on_gpu and remote.memory_kind == "VRAM":
            require_gpu([entry], "decode")
        dst_spec = job.plan.decode
        ring = self._staging.ring(entry.gpu.device if entry.gpu is not None else HOST, "recv")
        heads = read_heads(job.plan, entry.rank, src_rank)
        per_block = gpu.staging_bytes(dst_spec, 1)
        if ring.slot_bytes < per_block:
            raise SidecarError(
                Code.RESOURCE_EXHAUSTED,
                f"a staging slot ({ring.slot_bytes} bytes) cannot hold one block of the reader's "
                f"layout ({per_block} bytes): raise gpu_staging_bytes or lower gpu_staging_slots",
            )
        n_blocks = len(job.dst_blocks)
        if n_blocks == 0:
            return 0  # a prefix hit covering the whole request: nothing to move
        blocks_per_slot = ring.slot_bytes // per_block
        slots = ring.pool.acquire(-(-n_blocks // blocks_per_slot), job.remaining)
        tid = sp.new_transfer_id()
        inbox: queue.Queue[Any] = queue.Queue()
        state = sp.RecvState(
            job.start_token,
            job.num_tokens,
            dst_spec.block_size,
            dict.fromkeys(range(len(slots)), ring.slot_bytes),
            lambda k: k * per_block,  # staging bytes are linear in blocks (tested)
        )
        push: _PushCall | None = None
        copies: GpuCopies | HostCopies | None = None
        credits: _Credits | None = None
        done = confirmed = False
        self._nixl.listen(sp.prefix(tid), lambda a, m: inbox.put((a, m)))
        try:
            with entry.gpu.in_use() if entry.gpu is not None else contextlib.nullcontext():
                try:
                    # Once: another pull's answer may replace it meanwhile. None until the link is wired, nor
                    # for a source that no longer expects us (it would see the notification only 50 ms on).
                    key = link.push_key_for_push()
                    req = peer_pb2.PushRequest(
                        engine_id=job.params.engine_id,
                        request_id=job.params.request_id,
                        reader_engine_id=entry.engine_id,
                        reader_spec=spec_to_proto(dst_spec),
                        reader_rank=entry.rank,
                        source_rank=src_rank,
                        plan_hash=job.plan.hash(),
                        start_token=job.start_token,
                        transfer_id=tid,
                        reader_agent=self._sidecar_id,
                        reader_agent_metadata=ring.metadata,
                        memory_kind=ring.mem_type,
                        device_id=ring.nixl_device,
                        slots=[
                            peer_pb2.PushSlot(address=ring.slot_address(s), length=ring.slot_bytes)
                            for s in slots
                        ],
                        timeout_ms=max(1, int(job.remaining() * 1000)),
                        open=open_msg,
                        open_num_tokens=job.num_tokens if open_msg is not None else 0,
                        notified=bool(key),
                    )
                    push = _PushCall(self._staging, self._metrics, link, req, job, inbox)
                    if req.notified:
                        # The request as a NIXL notification: the source's NIXL thread starts the transfer
                        # from it (server/push_runs.py); the call follows only if it is slow.
                        sent = self._nixl.notify(agent, signed_notif(PUSH_TAG, key, req.SerializeToString()))
                        # Let the NIXL thread send it before the preparation below holds the GIL for
                        # ~0.35 ms: the notification otherwise left ~0.2 ms later (traced on a GPU).
                        wait((sent,), timeout=NOTIFY_WAIT_S)
                    else:
                        push.send_if_due()
                    # Validate and upload while the source gathers its first chunk.
                    if entry.gpu is not None:
                        dev = entry.gpu.device
                        copies = GpuCopies(
                            gpu.StagedCopies(
                                entry.gpu.view(dev),
                                dst_spec,
                                entry.rank,
                                heads,
                                job.dst_blocks,
                                job.num_tokens,
                                job.start_token,
                                into_staging=False,
                            )
                        )
                        # The first chunk's launch template, before its notification: it lands in the
                        # first slot offered, as large as a slot holds (a source with smaller slots
                        # sends smaller chunks, whose template is then computed on arrival).
                        t1 = min(job.num_tokens, job.start_token + blocks_per_slot * dst_spec.block_size)
                        copies.staged.prepare(job.start_token, t1, ring.slot_address(slots[0]))
                    else:
                        copies = HostCopies(
                            entry.host_view,
                            dst_spec,
                            entry.rank,
                            heads,
                            job.dst_blocks,
                            ring,
                            into_staging=False,
                        )
                        copies.first = job.start_token // dst_spec.block_size
                    credits = _Credits(state, copies.ready, ring, slots, agent, tid, inbox)
                    self._nixl.add_poller(credits.poll)
                    nbytes = _receive(job, state, copies, credits, ring, slots, inbox, push, agent, address)
                    copies.synchronize()  # every byte is in the engine's blocks before we answer
                    done = True
                    link.staged_read_completed()
                    return nbytes
                except sp.ProtocolError as e:
                    self._metrics.failures.labels("staged_protocol").inc()
                    raise SidecarError(
                        Code.INTERNAL, f"peer sidecar {address} broke the staged protocol: {e}"
                    ) from None
                finally:
                    if credits is not None:
                        credits.close()
                    confirmed = done or _stop_source(self._nixl, push, agent, tid)
                    if copies is not None and not done:
                        copies.synchronize()  # no scatter of ours may still write after a failed pull returns
        finally:
            self._nixl.unlisten(sp.prefix(tid))
            held = [slots[s] for s in state.release_all()]
            if done or confirmed or push is None or not push.asked:
                ring.pool.release(held)
            else:
                self._metrics.failures.labels("staging_quarantined").inc()
                log.warning(
                    "peer %s did not confirm that transfer %s ended: %d receive slots rejoin the ring %g s "
                    "after its Push call ended",
                    address,
                    tid,
                    len(held),
                    QUARANTINE_S,
                )
                # The Push call is a blocking call on a caller thread, which nothing can cancel: it ends at
                # its deadline at the latest, and a source whose call ended stops within its cancel wait.
                call = push.call
                if call is None:  # nothing will say when the source stopped: its timeout bounds it
                    ring.pool.release_later(held, QUARANTINE_S)
                else:
                    ring.pool.release_later(
                        held, QUARANTINE_S, lambda go: call.add_done_callback(lambda _: go())
                    )


def _receive(
    job: PullJob,
    state: sp.RecvState,
    copies: GpuCopies | HostCopies,
    credits: _Credits,
    ring: Ring,
    slots: list[int],
    inbox: queue.Queue[Any],
    push: _PushCall,
    agent: str,
    address: str,
) -> int:
    """Scatter chunks as their notifications arrive, until the request is complete."""
    nbytes = 0
    grace: float | None = None
    while not state.complete:
        left = job.remaining()
        if grace is not None and time.monotonic() > grace:
            raise sp.ProtocolError(f"the source answered but sent only part of the {state.count} chunks")
        push.send_if_due()
        try:
            item = inbox.get(timeout=min(0.05, left, push.wait_s()) or 1e-4)
        except queue.Empty:
            continue
        if item is _PUSH_DONE:
            _raise_push_error(push.call, address, job.params.request_id)
            # It answered OK: every WRITE is done, but their notifications may trail the answer.
            grace = time.monotonic() + CANCEL_WAIT_S
            continue
        if isinstance(item, BaseException):
            raise item
        sender, msg = item
        parsed = sp.parse_notif(msg)
        if sender != agent or parsed is None or parsed[1] != sp.CHUNK:
            raise sp.ProtocolError(f"unexpected notification {msg[:64]!r} from {sender}")
        index, count, slot, t0, t1 = parsed[2]
        state.arrive(index, count, slot, t0, t1)
        marker, moved = copies.launch(t0, t1, ring.slot_address(slots[slot]))
        nbytes += moved
        credits.add(marker, slot)
    return nbytes


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


def _stop_source(nixl: NixlDriver, push: _PushCall | None, agent: str, transfer_id: str) -> bool:
    """Stop the source and wait until it has nothing in flight; False if it never confirmed."""
    if push is None or not push.asked:
        return True  # it was never asked
    if push.call is None or not push.call.done():
        with contextlib.suppress(Exception):
            nixl.send_notif(agent, sp.stop_notif(transfer_id))
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
