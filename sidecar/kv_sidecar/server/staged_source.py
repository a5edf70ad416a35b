"""The source's end of the staged protocol (server/staged_copies.py says how it flows): the Push
handler checks the request (or opens it, when the Push carries the open), gathers chunks into its send
ring and WRITEs each into a receive slot the reader granted."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np

from kv_sidecar.execute import gpu
from kv_sidecar.metrics import Metrics
from kv_sidecar.plan.blocks import check_tokens
from kv_sidecar.plan.pair import PairPlan
from kv_sidecar.server import staged_protocol as sp
from kv_sidecar.server.engines import EngineRegistry, spec_from_proto
from kv_sidecar.server.errors import Code, SidecarError
from kv_sidecar.server.gpu_staging import HOST, GpuStaging, Ring
from kv_sidecar.server.notifications import PUSH_TAG
from kv_sidecar.server.peers import cached_plan
from kv_sidecar.server.published import Published, PublishedStore
from kv_sidecar.server.pull_job import CANCEL_WAIT_S
from kv_sidecar.server.push_runs import DuplicateTransfer, PushKeys, PushRun, PushRuns
from kv_sidecar.server.reads import SourceReads
from kv_sidecar.server.staged_copies import (
    MAX_SLOTS,
    PATH_HOST_RING,
    PATH_STAGED,
    QUARANTINE_S,
    GpuCopies,
    HostCopies,
    block_size_of,
    read_heads,
)
from kv_sidecar.transport.nixl_driver import NixlDriver, ucx_emulation_disabled
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2

log = logging.getLogger(__name__)

# A reader whose notified transfer has not finished CALL_AFTER_S (5 ms) after its notification sends
# the Push call, which then carries its liveness. A transfer its call has not joined this long after
# it started has lost its reader (it died before the call went out): stop it, rather than hold send
# slots until the request's timeout (30 s by default) waiting for credits that never come. A live
# reader's call arrives within milliseconds; the rest is margin for a loaded machine.
ALONE_S = 2.0


class PushCall(Protocol):
    """What the source asks of the Push call it serves (a gRPC call, or a notification's stand-in)."""

    def peer(self) -> str: ...

    def time_remaining(self) -> float | None: ...

    def add_callback(self, fn: Callable[[], None]) -> bool:
        """Run fn when the call ends (the reader went away, or we answered)."""
        ...

    def ended(self) -> None:
        """Our answer will say that nothing of the transfer is in flight (the reader may reuse its slots)."""
        ...


class _Pump:
    """Driver-thread poller of a source: WRITE each gathered chunk as soon as its gather is done and
    the reader has a slot free, with the notification that tells the reader which chunk it is."""

    def __init__(
        self,
        nixl: NixlDriver,
        metrics: Metrics,
        state: sp.SendState,
        copies: GpuCopies | HostCopies,
        ring: Ring,
        req: peer_pb2.PushRequest,
        deadline: float,
        block_bytes: int,
    ) -> None:
        self.nixl = nixl
        self.metrics = metrics
        self.state = state
        self.copies = copies
        self.ring = ring
        self.req = req
        self.deadline = deadline
        self.block_bytes = block_bytes
        self.block_size = block_size_of(copies)
        self.lock = threading.Lock()
        self.closed = False

    def poll(self, a: Any) -> bool:
        with self.lock:
            if self.closed:
                return True
            if a is None:
                self.state.fail(SidecarError(Code.UNAVAILABLE, "the sidecar is shutting down"))
                return True
            st, req, n = self.state, self.req, len(self.state.chunks)
            try:
                while (w := st.next_write(self.copies.ready)) is not None:
                    t0, t1 = st.chunks[w.index]
                    length = sp.blocks_in(self.block_size, t0, t1) * self.block_bytes
                    local = np.array(
                        [[self.ring.slot_address(w.send_slot), length, self.ring.nixl_device]], dtype=np.int64
                    )
                    remote = np.array(
                        [[req.slots[w.recv_slot].address, length, req.device_id]], dtype=np.int64
                    )
                    notif = sp.chunk_notif(req.transfer_id, w.index, n, w.recv_slot, t0, t1)
                    w.future = self.nixl.write_now(
                        a,
                        req.reader_agent,
                        local,
                        remote,
                        notif,
                        max(0.001, self.deadline - time.monotonic()),
                        self.ring.mem_type,
                    )
                    self.metrics.nixl_descriptors.observe(1)
                    w.future.add_done_callback(functools.partial(self._written, w.index))
            except Exception as e:
                st.fail(self._write_error(e))
            return False

    def _written(self, index: int, fut: Future[None]) -> None:
        err = fut.exception()
        if err is None:
            self.state.write_done(index)
        else:
            self.state.fail(self._write_error(err))

    def _write_error(self, e: BaseException) -> SidecarError:
        if isinstance(e, SidecarError):
            return e
        if self.ring.mem_type == "VRAM" and ucx_emulation_disabled():
            # With UCX_PROTO_EMULATION_ENABLE=n a VRAM WRITE UCX cannot do natively fails here
            # instead of crawling over TCP; we cannot tell that from other causes. With emulation
            # allowed such a WRITE crawls instead of failing, so a failure there is something else.
            self.metrics.ucx_emulation.inc()
            log.error(
                "GPU WRITE to %s failed: if UCX has no native path for VRAM here (cuda_ipc on a node, "
                "GPUDirect RDMA across nodes), it refused to emulate over TCP: see docs/operations.md "
                "section 5.1",
                self.req.reader_agent,
            )
        return SidecarError(
            Code.UNAVAILABLE, f"transfer from peer failed: NIXL WRITE into the reader's ring failed: {e}"
        )

    def close(self) -> None:
        with self.lock:
            self.closed = True


class _ReaderGone(SidecarError):
    """A notified transfer whose Push call never came (ALONE_S)."""


class _RunContext:
    """The PushCall of a transfer a notification started, until its call joins."""

    def __init__(self, run: PushRun, peer: str) -> None:
        self._run = run
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        """None once the call joined (the request's own timeout_ms bounds the transfer); until then,
        what is left of ALONE_S, and past it the transfer stops."""
        if self._run.called:
            return None
        left = self._run.started + ALONE_S - time.monotonic()
        if left <= 0:
            raise _ReaderGone(
                Code.CANCELLED,
                f"transfer {self._run.transfer_id}: its reader's Push call did not follow the notification "
                f"within {ALONE_S:g} s; the reader is taken for gone",
            )
        return left

    def add_callback(self, fn: Callable[[], None]) -> bool:
        self._run.add_callback(fn)  # runs if the call that joins goes away first
        return True

    def ended(self) -> None:
        pass  # the run keeps that itself (PushRun.finish), for the call that joins it


def _uploaded(item: Published, device: int) -> Any:
    """The record's block ids on `device` if their upload at Publish time is complete, else None."""
    fut = item.uploaded.get(device)
    if fut is None or not fut.done() or fut.exception() is not None:
        return None
    return fut.result()


def _quiesce(nixl: NixlDriver, state: sp.SendState) -> bool:
    """Cancel the WRITEs still in flight and wait for them to end; False if one would not."""
    quiet = True
    for w in state.in_flight():
        if w.future is None:
            continue  # never posted
        if not w.future.done():
            with contextlib.suppress(Exception):
                nixl.cancel(w.future)
        try:
            w.future.result(timeout=CANCEL_WAIT_S)
        except TimeoutError:
            quiet = False
        except Exception:
            pass  # it ended (failed or cancelled): nothing is in flight
    return quiet


class StagedSource:
    """The Pushes served here: started by a reader's call or its notification."""

    def __init__(
        self,
        engines: EngineRegistry,
        published: PublishedStore,
        reads: SourceReads,
        staging: GpuStaging,
        nixl: NixlDriver,
        metrics: Metrics,
        push_keys: PushKeys,
        push_runs: PushRuns,
        notifications: bool,
        pull_timeout_s: float,
    ) -> None:
        """notifications: the push_notifications setting (readers get keys to push by notification)."""
        self._engines = engines
        self._published = published
        self._reads = reads
        self._staging = staging
        self._nixl = nixl
        self._metrics = metrics
        self._push_keys = push_keys
        self._push_runs = push_runs
        self._notifications = notifications
        self._pull_timeout_s = pull_timeout_s

    def serve(self, req: peer_pb2.PushRequest, context: PushCall) -> peer_pb2.PushResponse:
        """Send one source rank's share of an opened request into the reader's receive slots, or, when
        its notification already started that (`req.notified`), wait for that transfer and answer for it
        (`req.stopping`: stop it first; start nothing).

        Every answer given while nothing of the transfer is in flight (success, a
        refusal, a stop after the WRITEs ended) says so (`PushCall.ended`), so that the
        reader may reuse its slots at once.
        """
        key = self._push_keys.grant(req.reader_agent, context.peer()) if self._notifications else b""
        if req.notified or req.stopping:
            try:
                run = self._push_runs.claim_by_call(req.transfer_id)
            except DuplicateTransfer:
                raise SidecarError(
                    Code.ALREADY_EXISTS, f"transfer {req.transfer_id} was pushed before"
                ) from None
            if req.stopping:
                if run is None:  # claimed: its notification, should it still come, starts nothing
                    context.ended()
                    raise SidecarError(
                        Code.CANCELLED, f"transfer {req.transfer_id}: the reader stopped it before it started"
                    )
                run.cancel()
            if run is not None:
                return self._join(run, context, key)
        else:
            self._push_runs.reader_seen()
        self._metrics.push_starts.labels("call").inc()
        quiet = [True]
        try:
            resp = self._push(req, context, quiet)
            resp.push_key = key
            return resp
        finally:
            if quiet[0]:
                context.ended()

    def from_notification(self, agent: str, msg: bytes) -> None:
        """A Push sent as a NIXL notification (driver thread): start its transfer on a source thread,
        unless its call came first. Refused notifications are dropped; the call then does the work."""
        signed = self._push_keys.verify(agent, PUSH_TAG, msg, peer_pb2.PushRequest.FromString)
        if signed is None or signed[1].reader_agent != agent or not sp.is_transfer_id(signed[1].transfer_id):
            # Wrong key (this sidecar restarted since the reader got it, or not a reader at all), or no
            # key at all: with push_notifications off none is ever given.
            self._metrics.failures.labels("push_notification_refused").inc()
            log.debug("refused a Push notification from %s", agent)
            return
        peer, req = signed
        run = self._push_runs.start_by_notif(req.transfer_id)
        if run is not None:
            self._metrics.push_starts.labels("notification").inc()
            self._staging.run_source(functools.partial(self._run_push, req, run, peer))

    def _run_push(self, req: peer_pb2.PushRequest, run: PushRun, peer: str) -> None:
        quiet = [True]
        try:
            run.finish(self._push(req, _RunContext(run, peer), quiet), None, quiet[0])
        except BaseException as e:
            if isinstance(e, _ReaderGone):
                self._metrics.failures.labels("push_call_missing").inc()
                log.warning("%s", e.message)
            elif not isinstance(e, SidecarError):
                log.exception("push %s started by notification failed", req.transfer_id)
            run.finish(None, e, quiet[0])
        finally:
            self._push_runs.ended(run)

    def _join(self, run: PushRun, context: PushCall, key: bytes) -> peer_pb2.PushResponse:
        """Answer for a transfer the Push's notification started: its result, once it has one."""
        context.add_callback(run.cancel)  # the reader went away: stop, as for a call that started it
        try:
            if not run.wait(context.time_remaining()):
                raise SidecarError(Code.DEADLINE_EXCEEDED, f"transfer {run.transfer_id} did not end in time")
            if run.quiet:
                context.ended()
            if run.error is not None:
                raise run.error
            resp = peer_pb2.PushResponse()
            resp.CopyFrom(run.response)
            resp.push_key = key
            return resp
        finally:
            self._push_runs.joined(run)

    def _push(self, req: peer_pb2.PushRequest, context: PushCall, quiet: list[bool]) -> peer_pb2.PushResponse:
        item = None if req.HasField("open") else self._published.get_live(req.engine_id, req.request_id)
        if item is not None and item.reader != req.reader_engine_id:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"request {req.request_id!r} is not open for engine {req.reader_engine_id!r}: OpenRead first",
            )
        src_entry = self._engines.get(req.engine_id, req.source_rank)
        if not req.HasField("reader_spec"):
            raise SidecarError(Code.INVALID_ARGUMENT, "reader_spec is required")
        reader_spec = spec_from_proto(req.reader_spec)
        plan = cached_plan(src_entry.spec, reader_spec)
        if plan.hash() != req.plan_hash:
            raise SidecarError(
                Code.FAILED_PRECONDITION, f"plan mismatch: ours {plan.hash()}, the reader's {req.plan_hash}"
            )
        if not 0 <= req.reader_rank < reader_spec.tp_size:
            raise SidecarError(Code.INVALID_ARGUMENT, f"reader rank {req.reader_rank} out of range")
        heads = read_heads(plan, req.reader_rank, req.source_rank)  # from our plan, not the reader's word
        if src_entry.memory_kind != req.memory_kind:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"engine {req.engine_id!r} rank {req.source_rank} is in {src_entry.memory_kind} memory, "
                f"the reader's ring in {req.memory_kind!r}",
            )
        if not sp.is_transfer_id(req.transfer_id):
            raise SidecarError(Code.INVALID_ARGUMENT, "transfer_id must be 16 lowercase hex characters")
        if not 1 <= len(req.slots) <= MAX_SLOTS or any(s.length == 0 for s in req.slots):
            raise SidecarError(Code.INVALID_ARGUMENT, f"between 1 and {MAX_SLOTS} non-empty slots are needed")
        ring = self._staging.ring(src_entry.gpu.device if src_entry.gpu is not None else HOST, "send")
        per_block = gpu.staging_bytes(reader_spec, 1)
        cap = min(ring.slot_bytes, *(s.length for s in req.slots))
        if cap < per_block:
            raise SidecarError(
                Code.RESOURCE_EXHAUSTED,
                f"a staging slot ({cap} bytes) cannot hold one block of the reader's layout ({per_block} "
                "bytes): raise gpu_staging_bytes or lower gpu_staging_slots",
            )
        if item is None:  # the open it carries, checked like an OpenRead once the rest of the Push is sound
            item = self._open_from_push(req, plan, context.peer(), src_entry.gpu is not None)
        check_tokens(item.num_tokens, req.start_token, reader_spec.block_size)
        item.check_read_from(req.start_token)
        chunks = sp.plan_chunks(req.start_token, item.num_tokens, reader_spec.block_size, cap // per_block)
        if not chunks:
            return peer_pb2.PushResponse()
        self._nixl.load_remote(req.reader_agent, req.reader_agent_metadata)
        left = req.timeout_ms / 1000 if req.timeout_ms else self._pull_timeout_s
        # A transfer a notification started asks its context at each wait instead (ALONE_S, until its
        # call joins); its deadline, which its WRITEs get too, is the request's own.
        alone = context if isinstance(context, _RunContext) else None
        call_left = None if alone is not None else context.time_remaining()
        deadline = time.monotonic() + (left if call_left is None else min(left, call_left))
        stopped = threading.Event()
        context.add_callback(stopped.set)  # the call ended: the reader went away (or we answered)

        def remaining() -> float:
            if stopped.is_set():
                raise SidecarError(
                    Code.CANCELLED, f"push of request {req.request_id!r}: the reader went away"
                )
            left = deadline - time.monotonic()
            alone_left = alone.time_remaining() if alone is not None else None  # raises once past ALONE_S
            if alone_left is not None:
                left = min(left, alone_left)
            if left <= 0:
                raise SidecarError(Code.DEADLINE_EXCEEDED, f"pushing request {req.request_id!r} timed out")
            return left

        send_slots = ring.pool.acquire(min(len(chunks), len(req.slots) + 1), remaining)
        state = sp.SendState(chunks, send_slots, list(range(len(req.slots))))
        copies: GpuCopies | HostCopies
        pump: _Pump | None = None

        def on_notif(agent: str, msg: bytes) -> None:  # NIXL driver thread
            parsed = sp.parse_notif(msg)
            try:
                if agent != req.reader_agent or parsed is None or parsed[1] == sp.CHUNK:
                    raise sp.ProtocolError(f"unexpected notification {msg[:64]!r} from {agent}")
                if parsed[1] == sp.STOP:
                    state.stop("the reader stopped the transfer")
                elif not 0 <= parsed[2][0] < len(req.slots):
                    raise sp.ProtocolError(f"credit for slot {parsed[2][0]} of {len(req.slots)}")
                else:
                    state.credit(parsed[2][0])
            except sp.ProtocolError as e:
                state.fail(SidecarError(Code.INVALID_ARGUMENT, f"the reader broke the staged protocol: {e}"))

        context.add_callback(lambda: state.stop("the reader cancelled the Push"))
        self._nixl.listen(sp.prefix(req.transfer_id), on_notif)
        src = src_entry.gpu
        try:
            with src.in_use() if src is not None else contextlib.nullcontext():
                if src is not None:
                    copies = GpuCopies(
                        gpu.StagedCopies(
                            src.view(src.device),
                            reader_spec,
                            req.reader_rank,
                            heads,
                            item.source_blocks,  # from our own record: the reader names only a start token
                            item.num_tokens,
                            req.start_token,
                            into_staging=True,
                            uploaded_ids=_uploaded(item, src.device),
                        )
                    )
                else:
                    ids = np.asarray(item.source_blocks, dtype=np.int64)
                    copies = HostCopies(
                        src_entry.host_view, reader_spec, req.reader_rank, heads, ids, ring, True
                    )
                pump = _Pump(self._nixl, self._metrics, state, copies, ring, req, deadline, per_block)
                quiet[0] = False
                self._nixl.add_poller(pump.poll)
                try:
                    nbytes = 0
                    while (g := state.next_gather(remaining)) is not None:
                        index, slot = g
                        t0, t1 = chunks[index]
                        marker, moved = copies.launch(t0, t1, ring.slot_address(slot))
                        nbytes += moved
                        state.gathered(index, slot, marker)
                    state.wait_finished(remaining)
                    quiet[0] = True
                    return peer_pb2.PushResponse(chunks=len(chunks), bytes=nbytes)
                except sp.Stopped as e:
                    raise SidecarError(
                        Code.CANCELLED, f"push of request {req.request_id!r} stopped: {e}"
                    ) from None
                finally:
                    if not quiet[0]:
                        state.fail(sp.Stopped("the push failed"))
                        pump.close()  # no WRITE starts after this
                        quiet[0] = _quiesce(self._nixl, state)
                        copies.synchronize()  # our gathers are done before the send slots are reused
        finally:
            if pump is not None:
                pump.close()
            self._nixl.unlisten(sp.prefix(req.transfer_id))
            if quiet[0]:
                ring.pool.release(send_slots)
            else:
                log.warning(
                    "transfer %s: WRITEs did not end; send slots rejoin the ring in %g s",
                    req.transfer_id,
                    QUARANTINE_S,
                )
                ring.pool.release_later(send_slots, QUARANTINE_S)

    def _open_from_push(
        self, req: peer_pb2.PushRequest, plan: PairPlan, peer: str, on_gpu: bool
    ) -> Published:
        """The open a Push carries: it must name this Push's request, reader and plan, and the token count
        the reader planned its slots for; then it opens the request exactly as OpenRead does."""
        o = req.open
        if (o.engine_id, o.request_id, o.reader_engine_id, o.plan_hash) != (
            req.engine_id,
            req.request_id,
            req.reader_engine_id,
            req.plan_hash,
        ) or req.reader_rank not in o.reader_ranks:
            raise SidecarError(
                Code.INVALID_ARGUMENT,
                "the open a Push carries must name the Push's engine, request, reader engine, plan and reader rank",
            )
        num_tokens = self._published.get_live(req.engine_id, req.request_id).num_tokens
        if num_tokens != req.open_num_tokens:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"request {req.request_id!r} holds {num_tokens} tokens here, the reader planned "
                f"{req.open_num_tokens}: its transfer params are out of date",
            )
        return self._reads.open_for_reader(o, plan, peer, PATH_STAGED if on_gpu else PATH_HOST_RING)
