"""GPU paths of a pull: one kernel on a node; the staged protocol across sidecars.

- gpu-direct: both engines are registered here. Each decode rank's reads run as
  one Triton launch per (request, source rank) on the decode GPU, reading the
  source over NVLink through mappings opened in that GPU's context.
- gpu-staged: the source engine is behind another sidecar. This sidecar (the
  reader) takes receive slots from its GPU's ring and asks the sidecar holding
  the source rank, in one `Push` call, to send the tokens into them. That
  sidecar gathers chunk after chunk, already in this reader's layout, into
  slots of its send ring on a CUDA stream; its NIXL driver thread WRITEs each
  chunk as soon as the chunk's CUDA event completes and a receive slot is
  free, as one descriptor with a notification naming the chunk. Here the
  notification launches the scatter on our stream, and the driver thread gives
  the slot back (a credit notification) as soon as the scatter's event
  completes. Gather, wire and scatter overlap across the slots with no host
  synchronisation between stages and no gRPC message per chunk
  (server/staged_protocol.py holds the bookkeeping; docs/gpu.md the protocol).
- host-ring: the same protocol between host-memory engines, through host rings
  and the host executor (`host_transfer: ring`; how CI runs it without GPUs).

Engine memory is never registered with NIXL (DESIGN.md section 1): only the
rings, which the sidecars own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import torch

from kv_sidecar.execute import gpu, host
from kv_sidecar.execute import gpu_geometry as geo
from kv_sidecar.plan.blocks import check_tokens
from kv_sidecar.plan.pair import PairPlan
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.server import staged_protocol as sp
from kv_sidecar.server.engines import RankEntry, spec_from_proto, spec_to_proto
from kv_sidecar.server.errors import Code, SidecarError
from kv_sidecar.server.gpu_staging import HOST, Ring
from kv_sidecar.server.peers import RemoteEngine, cached_plan, rpc_error
from kv_sidecar.server.published import Published
from kv_sidecar.server.reads import open_for_reader
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2

if TYPE_CHECKING:
    from kv_sidecar.server.pull import Puller, PullJob
    from kv_sidecar.server.sidecar import Sidecar

log = logging.getLogger(__name__)

PATH_DIRECT = "gpu-direct"
PATH_STAGED = "gpu-staged"
PATH_HOST_RING = "host-ring"

_CANCEL_WAIT_S = 5.0  # how long a stopped transfer waits for the other side to have nothing in flight
# Slots a peer may still write into (it never confirmed the end of its transfer) rejoin their pool
# this long after the Push call ended: a source whose call went away stops and cancels its WRITEs
# within _CANCEL_WAIT_S.
_QUARANTINE_S = 2 * _CANCEL_WAIT_S
_MAX_SLOTS = 4096
# Trailing metadata of every Push answer the source gives itself: nothing of it is in flight any more.
PUSH_ENDED = ("kvsidecar-push-ended", "1")
_PUSH_DONE = object()  # inbox marker: the Push call ended


def require_gpu(entries: list[RankEntry], side: str) -> list[RankEntry]:
    for e in entries:
        if e.gpu is None:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"{side} engine {e.engine_id!r} rank {e.rank} is in host memory while the other side is in "
                "GPU memory; host<->GPU pulls are not supported",
            )
    return entries


def read_heads(plan: PairPlan, decode_rank: int, prefill_rank: int) -> tuple[int, int] | None:
    for read in plan.decode_ranks[decode_rank].reads:
        if read.prefill_rank == prefill_rank:
            return read.heads
    raise SidecarError(
        Code.INVALID_ARGUMENT,
        f"decode rank {decode_rank} reads nothing from prefill rank {prefill_rank} under this plan",
    )


# -- same node -------------------------------------------------------------------
def pull_direct(job: PullJob, src_ranks: list[RankEntry]) -> int:
    """Every local decode rank's reads, one launch per source rank on the decode GPU."""
    require_gpu(src_ranks, "prefill")
    nbytes = 0
    for entry, rplan in zip(require_gpu(job.local, "decode"), job.rank_plans(), strict=True):
        assert entry.gpu is not None
        dev = entry.gpu.device
        for read in rplan.reads:
            job.remaining()
            src = src_ranks[read.prefill_rank].gpu
            assert src is not None
            with src.in_use(), entry.gpu.in_use():
                nbytes += gpu.copy_request(
                    src.view(dev),
                    entry.gpu.view(dev),
                    read.heads,
                    job.src_blocks,
                    job.dst_blocks,
                    job.num_tokens,
                    job.start_token,
                )
    return nbytes


# -- the staged protocol: copies on either kind of memory ---------------------------------
class _GpuCopies:
    """Chunk copies on one CUDA stream; each launch's marker is a CUDA event on it."""

    def __init__(self, staged: gpu.StagedCopies, device: int) -> None:
        self.staged = staged
        self.stream = torch.cuda.Stream(device)

    def launch(self, t0: int, t1: int, address: int) -> tuple[Any, int]:
        nbytes = self.staged.launch(t0, t1, address, self.stream)
        event = torch.cuda.Event()
        event.record(self.stream)
        return event, nbytes

    @staticmethod
    def ready(marker: Any) -> bool:
        return bool(marker.query())

    def synchronize(self) -> None:
        self.stream.synchronize()


class _HostCopies:
    """The same chunk copies with the host executor (synchronous: a marker is always ready)."""

    def __init__(
        self,
        engine: host.RankView,
        staging_spec: EngineSpec,
        staging_rank: int,
        heads: tuple[int, int] | None,
        engine_ids: np.ndarray,
        ring: Ring,
        into_staging: bool,
    ) -> None:
        self.engine = engine
        self.spec = staging_spec
        self.rank = staging_rank
        self.heads = heads
        self.ids = engine_ids
        self.ring = ring
        self.into = into_staging
        self.first = 0  # scatter: position of the start token's block in `ids`, set by the reader

    def _slot_view(self, address: int, k: int) -> host.RankView:
        """A slot as a k-block cache of the staging spec: the byte layout of `gpu.staging_view`."""
        mini = dataclasses.replace(self.spec, num_blocks=k)
        n = geo.tensor_nbytes(mini)
        off = address - self.ring.buffer.data_ptr()
        dtype = getattr(torch, mini.dtype)
        tensors = [
            self.ring.buffer[off + i * n : off + (i + 1) * n].view(dtype).view(shape)
            for i, shape in enumerate(mini.rank_tensor_shapes())
        ]
        return host.rank_view(mini, self.rank, tensors)

    def launch(self, t0: int, t1: int, address: int) -> tuple[Any, int]:
        bd = self.spec.block_size
        k = sp.blocks_in(bd, t0, t1)
        slot = self._slot_view(address, k)
        if self.into:
            return None, host.copy_request(self.engine, slot, self.heads, self.ids, range(k), t1, t0)
        first = t0 // bd - self.first
        dst = self.ids[first : first + k]
        return None, host.copy_request(slot, self.engine, self.heads, range(k), dst, t1, t0)

    @staticmethod
    def ready(marker: Any) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _route(sc: Sidecar) -> None:
    """Staged notifications go to the transfer listening for them, never to the done handler."""
    sc.nixl.route(sp.TAG + sp.SEP)


# -- across sidecars: the reader -----------------------------------------------------
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
                        a.send_notif(self.agent, sp.credit_notif(self.tid, slot))
                    else:
                        self.ring.pool.release([self.ring_slots[slot]])
            except Exception as e:  # tell the reader's thread; it stops the transfer
                self.closed = True
                self.inbox.put(e)
                return True
            return False

    def close(self) -> None:
        with self.lock:
            self.closed = True


def read_staged(
    puller: Puller,
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
    sc = puller.sidecar
    # The sidecar holding the source rank: the peer itself, or a member of a multi-node engine.
    holder = remote.holders.get(src_rank)
    address = holder.address if holder is not None else job.params.sidecar_address
    link = sc.peers.link(address)
    agent = remote.agent_of(src_rank)
    on_gpu = entry.gpu is not None
    if not on_gpu and remote.memory_kind == "VRAM":
        require_gpu([entry], "decode")
    dst_spec = job.plan.decode
    ring = sc.gpu_staging.ring(entry.gpu.device if entry.gpu is not None else HOST, "recv")
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
    _route(sc)
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
    call: Any = None
    copies: _GpuCopies | _HostCopies | None = None
    credits: _Credits | None = None
    done = confirmed = False
    sc.nixl.listen(sp.prefix(tid), lambda a, m: inbox.put((a, m)))
    try:
        with entry.gpu.in_use() if entry.gpu is not None else contextlib.nullcontext():
            try:
                call = sc.gpu_staging.call(
                    link.stub.Push,
                    peer_pb2.PushRequest(
                        engine_id=job.params.engine_id,
                        request_id=job.params.request_id,
                        reader_engine_id=entry.engine_id,
                        reader_spec=spec_to_proto(dst_spec),
                        reader_rank=entry.rank,
                        source_rank=src_rank,
                        plan_hash=job.plan.hash(),
                        start_token=job.start_token,
                        transfer_id=tid,
                        reader_agent=sc.sidecar_id,
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
                    ),
                    # Longer than the pull: the source stops at timeout_ms, and its answer says
                    # when nothing is in flight any more, which a timed-out reader still needs.
                    timeout=job.remaining() + _CANCEL_WAIT_S + 1,
                    metadata=sc.peer_metadata(),
                )
                call.add_done_callback(lambda _: inbox.put(_PUSH_DONE))
                # Validate and upload while the source gathers its first chunk.
                if entry.gpu is not None:
                    dev = entry.gpu.device
                    copies = _GpuCopies(
                        gpu.StagedCopies(
                            entry.gpu.view(dev),
                            dst_spec,
                            entry.rank,
                            heads,
                            job.dst_blocks,
                            job.num_tokens,
                            job.start_token,
                            into_staging=False,
                        ),
                        dev,
                    )
                else:
                    copies = _HostCopies(
                        entry.host_view, dst_spec, entry.rank, heads, job.dst_blocks, ring, into_staging=False
                    )
                    copies.first = job.start_token // dst_spec.block_size
                credits = _Credits(state, copies.ready, ring, slots, agent, tid, inbox)
                sc.nixl.add_poller(credits.poll)
                nbytes = _receive(job, state, copies, credits, ring, slots, inbox, call, agent, address)
                copies.synchronize()  # every byte is in the engine's blocks before we answer
                done = True
                return nbytes
            except sp.ProtocolError as e:
                sc.metrics.failures.labels("staged_protocol").inc()
                raise SidecarError(
                    Code.INTERNAL, f"peer sidecar {address} broke the staged protocol: {e}"
                ) from None
            finally:
                if credits is not None:
                    credits.close()
                confirmed = done or _stop_source(sc, call, agent, tid)
                if copies is not None and not done:
                    copies.synchronize()  # no scatter of ours may still write after a failed pull returns
    finally:
        sc.nixl.unlisten(sp.prefix(tid))
        held = [slots[s] for s in state.release_all()]
        if done or confirmed or call is None:
            ring.pool.release(held)
        else:
            sc.metrics.failures.labels("staging_quarantined").inc()
            log.warning(
                "peer %s did not confirm that transfer %s ended: %d receive slots rejoin the ring %g s "
                "after its Push call ended",
                address,
                tid,
                len(held),
                _QUARANTINE_S,
            )
            # The Push call is a blocking call on a caller thread, which nothing can cancel: it ends at
            # its deadline at the latest, and a source whose call ended stops within its cancel wait.
            ring.pool.release_later(held, _QUARANTINE_S, lambda go: call.add_done_callback(lambda _: go()))


def _receive(
    job: PullJob,
    state: sp.RecvState,
    copies: _GpuCopies | _HostCopies,
    credits: _Credits,
    ring: Ring,
    slots: list[int],
    inbox: queue.Queue[Any],
    call: Any,
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
        try:
            item = inbox.get(timeout=min(0.05, left))
        except queue.Empty:
            continue
        if item is _PUSH_DONE:
            _raise_push_error(call, address, job.params.request_id)
            # It answered OK: every WRITE is done, but their notifications may trail the answer.
            grace = time.monotonic() + _CANCEL_WAIT_S
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


def _raise_push_error(call: Any, address: str, request_id: str) -> None:
    try:
        call.result(timeout=0)
    except grpc.RpcError as e:
        raise _push_error(e, address, request_id) from None


def _push_error(e: grpc.RpcError, address: str, request_id: str) -> SidecarError:
    trailing = e.trailing_metadata() if isinstance(e, grpc.Call) else None
    if isinstance(e, grpc.Call) and PUSH_ENDED in tuple(trailing or ()):
        # The source's own verdict (e.g. UNAVAILABLE: its NIXL WRITE failed).
        return SidecarError(e.code(), f"{e.details()} (peer sidecar {address})")
    return rpc_error(e, address, f"to push request {request_id!r}")


def _stop_source(sc: Sidecar, call: Any, agent: str, transfer_id: str) -> bool:
    """Stop the source and wait until it has nothing in flight; False if it never confirmed."""
    if call is None:
        return True  # it was never asked
    if not call.done():
        with contextlib.suppress(Exception):
            sc.nixl.send_notif(agent, sp.stop_notif(transfer_id))
    try:
        call.result(timeout=_CANCEL_WAIT_S)
    except FutureTimeout:
        return False
    except grpc.RpcError as e:
        return isinstance(e, grpc.Call) and PUSH_ENDED in tuple(e.trailing_metadata() or ())
    except Exception:
        return False
    return True


# -- across sidecars: the source ---------------------------------------------------------
class _Pump:
    """Driver-thread poller of a source: WRITE each gathered chunk as soon as its gather is done and
    the reader has a slot free, with the notification that tells the reader which chunk it is."""

    def __init__(
        self,
        sc: Sidecar,
        state: sp.SendState,
        copies: _GpuCopies | _HostCopies,
        ring: Ring,
        req: peer_pb2.PushRequest,
        deadline: float,
        block_bytes: int,
    ) -> None:
        self.sc = sc
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
                    w.future = self.sc.nixl.write_now(
                        a,
                        req.reader_agent,
                        local,
                        remote,
                        notif,
                        max(0.001, self.deadline - time.monotonic()),
                        self.ring.mem_type,
                    )
                    self.sc.metrics.nixl_descriptors.observe(1)
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
        if self.ring.mem_type == "VRAM":
            # With UCX_PROTO_EMULATION_ENABLE=n a VRAM WRITE UCX cannot do natively fails here
            # instead of crawling over TCP; we cannot tell that from other causes.
            self.sc.metrics.ucx_emulation.inc()
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


def block_size_of(copies: _GpuCopies | _HostCopies) -> int:
    spec = copies.staged.staging_spec if isinstance(copies, _GpuCopies) else copies.spec
    return spec.block_size


def serve_push(
    sc: Sidecar, req: peer_pb2.PushRequest, context: grpc.ServicerContext
) -> peer_pb2.PushResponse:
    """Send one source rank's share of an opened request into the reader's receive slots.

    Every answer given while nothing of the transfer is in flight (success, a
    refusal, a stop after the WRITEs ended) carries PUSH_ENDED, so that the
    reader may reuse its slots at once.
    """
    quiet = [True]
    try:
        return _push(sc, req, context, quiet)
    finally:
        if quiet[0]:
            context.set_trailing_metadata((PUSH_ENDED,))


def _push(
    sc: Sidecar, req: peer_pb2.PushRequest, context: grpc.ServicerContext, quiet: list[bool]
) -> peer_pb2.PushResponse:
    _route(sc)
    item = None if req.HasField("open") else sc.published.get_live(req.engine_id, req.request_id)
    if item is not None and item.reader != req.reader_engine_id:
        raise SidecarError(
            Code.FAILED_PRECONDITION,
            f"request {req.request_id!r} is not open for engine {req.reader_engine_id!r}: OpenRead first",
        )
    src_entry = sc.engines.get(req.engine_id, req.source_rank)
    if not req.HasField("reader_spec"):
        raise SidecarError(Code.INVALID_ARGUMENT, "reader_spec is required")
    reader_spec = spec_from_proto(req.reader_spec)
    plan = cached_plan(src_entry.spec, reader_spec)
    if plan.hash() != req.plan_hash:
        raise SidecarError(
            Code.FAILED_PRECONDITION, f"plan mismatch: ours {plan.hash()}, the reader's {req.plan_hash}"
        )
    if item is None:  # the open it carries, checked like an OpenRead, once the plan is known to match
        item = _open_from_push(sc, req, plan, context.peer(), src_entry.gpu is not None)
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
    if not 1 <= len(req.slots) <= _MAX_SLOTS or any(s.length == 0 for s in req.slots):
        raise SidecarError(Code.INVALID_ARGUMENT, f"between 1 and {_MAX_SLOTS} non-empty slots are needed")
    check_tokens(item.num_tokens, req.start_token, reader_spec.block_size)
    ring = sc.gpu_staging.ring(src_entry.gpu.device if src_entry.gpu is not None else HOST, "send")
    per_block = gpu.staging_bytes(reader_spec, 1)
    cap = min(ring.slot_bytes, *(s.length for s in req.slots))
    if cap < per_block:
        raise SidecarError(
            Code.RESOURCE_EXHAUSTED,
            f"a staging slot ({cap} bytes) cannot hold one block of the reader's layout ({per_block} "
            "bytes): raise gpu_staging_bytes or lower gpu_staging_slots",
        )
    chunks = sp.plan_chunks(req.start_token, item.num_tokens, reader_spec.block_size, cap // per_block)
    if not chunks:
        return peer_pb2.PushResponse()
    sc.nixl.load_remote(req.reader_agent, req.reader_agent_metadata)
    left = req.timeout_ms / 1000 if req.timeout_ms else sc.settings.pull_timeout_ms / 1000
    deadline = time.monotonic() + min(left, context.time_remaining() or left)
    stopped = threading.Event()
    context.add_callback(stopped.set)  # the call ended: the reader went away (or we answered)

    def remaining() -> float:
        if stopped.is_set():
            raise SidecarError(Code.CANCELLED, f"push of request {req.request_id!r}: the reader went away")
        left = deadline - time.monotonic()
        if left <= 0:
            raise SidecarError(Code.DEADLINE_EXCEEDED, f"pushing request {req.request_id!r} timed out")
        return left

    send_slots = ring.pool.acquire(min(len(chunks), len(req.slots) + 1), remaining)
    state = sp.SendState(chunks, send_slots, list(range(len(req.slots))))
    copies: _GpuCopies | _HostCopies
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
    sc.nixl.listen(sp.prefix(req.transfer_id), on_notif)
    src = src_entry.gpu
    try:
        with src.in_use() if src is not None else contextlib.nullcontext():
            if src is not None:
                copies = _GpuCopies(
                    gpu.StagedCopies(
                        src.view(src.device),
                        reader_spec,
                        req.reader_rank,
                        heads,
                        item.block_ids,  # from our own record: the reader names only a start token
                        item.num_tokens,
                        req.start_token,
                        into_staging=True,
                    ),
                    src.device,
                )
            else:
                ids = np.asarray(item.block_ids, dtype=np.int64)
                copies = _HostCopies(
                    src_entry.host_view, reader_spec, req.reader_rank, heads, ids, ring, True
                )
            pump = _Pump(sc, state, copies, ring, req, deadline, per_block)
            quiet[0] = False
            sc.nixl.add_poller(pump.poll)
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
                    quiet[0] = _quiesce(sc, state)
                    copies.synchronize()  # our gathers are done before the send slots are reused
    finally:
        if pump is not None:
            pump.close()
        sc.nixl.unlisten(sp.prefix(req.transfer_id))
        if quiet[0]:
            ring.pool.release(send_slots)
        else:
            log.warning(
                "transfer %s: WRITEs did not end; send slots rejoin the ring in %g s",
                req.transfer_id,
                _QUARANTINE_S,
            )
            ring.pool.release_later(send_slots, _QUARANTINE_S)


def _open_from_push(
    sc: Sidecar, req: peer_pb2.PushRequest, plan: PairPlan, peer: str, on_gpu: bool
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
    num_tokens = sc.published.get_live(req.engine_id, req.request_id).num_tokens
    if num_tokens != req.open_num_tokens:
        raise SidecarError(
            Code.FAILED_PRECONDITION,
            f"request {req.request_id!r} holds {num_tokens} tokens here, the reader planned "
            f"{req.open_num_tokens}: its transfer params are out of date",
        )
    return open_for_reader(sc, o, plan, peer, PATH_STAGED if on_gpu else PATH_HOST_RING)


def _quiesce(sc: Sidecar, state: sp.SendState) -> bool:
    """Cancel the WRITEs still in flight and wait for them to end; False if one would not."""
    quiet = True
    for w in state.in_flight():
        if w.future is None:
            continue  # never posted
        if not w.future.done():
            with contextlib.suppress(Exception):
                sc.nixl.cancel(w.future)
        try:
            w.future.result(timeout=_CANCEL_WAIT_S)
        except FutureTimeout:
            quiet = False
        except Exception:
            pass  # it ended (failed or cancelled): nothing is in flight
    return quiet
