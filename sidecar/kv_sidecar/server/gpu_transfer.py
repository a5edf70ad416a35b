"""GPU paths of a pull: one kernel on a node, a staged NIXL ring across sidecars.

- gpu-direct: both engines are registered here. Each decode rank's reads run as
  one Triton launch per (request, source rank) on the decode GPU, reading the
  source over NVLink through mappings opened in that GPU's context.
- gpu-staged: the source engine is behind another sidecar. That sidecar
  gathers the tokens, already in this reader's layout, into its send ring
  (peer RPC Gather, one slot per chunk); this sidecar READs each ready slot
  over NIXL as one descriptor into its receive ring and scatters it into the
  engine's blocks. With S slots, the source gathers chunks i+1..i+S-1 while
  chunk i is on the wire and chunk i-1 is being scattered.

Engine memory is never registered with NIXL (DESIGN.md section 1): only the
rings, which the sidecars own.
"""

from __future__ import annotations

import contextlib
import logging
import queue
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING

import grpc
import numpy as np
import torch

from kv_sidecar.execute import gpu
from kv_sidecar.plan.blocks import dst_block_count, src_block_range
from kv_sidecar.plan.pair import PairPlan
from kv_sidecar.server.engines import RankEntry, spec_from_proto, spec_to_proto
from kv_sidecar.server.errors import Code, SidecarError
from kv_sidecar.server.peers import RemoteEngine, cached_plan, rpc_error
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2

if TYPE_CHECKING:
    from kv_sidecar.server.pull import Puller, PullJob
    from kv_sidecar.server.sidecar import Sidecar

log = logging.getLogger(__name__)

PATH_DIRECT = "gpu-direct"
PATH_STAGED = "gpu-staged"


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


# -- across sidecars: the reader -----------------------------------------------------
def read_staged(puller: Puller, job: PullJob, remote: RemoteEngine, entry: RankEntry, src_rank: int) -> int:
    """Move one (decode rank, source rank) read through the two sidecars' rings."""
    sc = puller.sidecar
    # The sidecar holding the source rank: the peer itself, or a member of a multi-node engine.
    holder = remote.holders.get(src_rank)
    link = sc.peers.link(holder.address if holder is not None else job.params.sidecar_address)
    agent = remote.agent_of(src_rank)
    rank = entry.gpu
    if rank is None:
        require_gpu([entry], "decode")
    assert rank is not None
    dev = rank.device
    ring = sc.gpu_staging.ring(dev, "recv")
    dst_spec = job.plan.decode
    heads = read_heads(job.plan, entry.rank, src_rank)
    bd = dst_spec.block_size
    requests: queue.Queue[peer_pb2.GatherRequest | None] = queue.Queue()
    requests.put(
        peer_pb2.GatherRequest(
            open=peer_pb2.GatherOpen(
                engine_id=job.params.engine_id,
                request_id=job.params.request_id,
                reader_engine_id=entry.engine_id,
                reader_spec=spec_to_proto(dst_spec),
                reader_rank=entry.rank,
                source_rank=src_rank,
                plan_hash=job.plan.hash(),
            )
        )
    )
    with sc.gpu_staging.hold(ring), rank.in_use():
        dst_view = rank.view(dev)
        reading: deque[tuple[int, Future[None]]] = deque()  # READs posted, oldest first
        stream: torch.cuda.Stream | None = None
        call = link.stub.Gather(
            iter(requests.get, None), timeout=job.remaining(), metadata=sc.peer_metadata()
        )
        try:
            replies = iter(call)
            opened = next(replies).opened
            slots = max(1, min(ring.slots, opened.slots))
            slot_bytes = min(ring.slot_bytes, opened.slot_bytes)
            per_block = gpu.staging_bytes(dst_spec, 1)
            if slot_bytes < per_block:
                raise SidecarError(
                    Code.RESOURCE_EXHAUSTED,
                    f"a GPU staging slot ({slot_bytes} bytes) cannot hold one block of the reader's "
                    f"layout ({per_block} bytes): raise gpu_staging_bytes or lower gpu_staging_slots",
                )
            step = (slot_bytes // per_block) * bd
            chunks = [
                (t, min(t + step, job.num_tokens)) for t in range(job.start_token, job.num_tokens, step)
            ]

            def ask(i: int) -> None:
                t0, t1 = chunks[i]
                requests.put(
                    peer_pb2.GatherRequest(
                        chunk=peer_pb2.GatherChunk(index=i, slot=i % slots, start_token=t0, end_token=t1)
                    )
                )

            for i in range(min(slots, len(chunks))):
                ask(i)
            stream = torch.cuda.Stream(dev)
            scattered: list[torch.cuda.Event | None] = [None] * slots
            nbytes = 0

            def finish_oldest() -> None:
                """Wait for the oldest READ, free its source slot, scatter it from our slot."""
                nonlocal nbytes
                i, fut = reading.popleft()
                try:
                    puller.wait(fut, job)
                except SidecarError as e:
                    if e.code is Code.UNAVAILABLE:
                        # With UCX_PROTO_EMULATION_ENABLE=n a VRAM READ UCX cannot do natively fails
                        # here instead of crawling over TCP; we cannot tell that from other causes.
                        sc.metrics.ucx_emulation.inc()
                        log.error(
                            "GPU READ from %s failed: if UCX has no native path for VRAM here "
                            "(cuda_ipc on a node, GPUDirect RDMA across nodes), it refused to emulate "
                            "over TCP: see docs/operations.md section 5.1",
                            agent,
                        )
                    raise
                if i + slots < len(chunks):
                    ask(i + slots)  # the source's slot is free again
                t0, t1 = chunks[i]
                k = dst_block_count(bd, t1, t0)
                first = (t0 - job.start_token) // bd
                staged = gpu.staging_view(dst_spec, entry.rank, ring.slot_address(i % slots), k, dev)
                prepared = gpu.prepare_request(
                    staged, dst_view, heads, range(k), job.dst_blocks[first : first + k], t1, t0
                )
                prepared.launch(stream)
                event = torch.cuda.Event()
                event.record(stream)
                scattered[i % slots] = event
                nbytes += prepared.nbytes

            for i, (t0, t1) in enumerate(chunks):
                # Chunk i was asked for once chunk i - slots was read: make sure that happened.
                while reading and reading[0][0] <= i - slots:
                    finish_oldest()
                ready = next(replies).ready
                k = dst_block_count(bd, t1, t0)
                length = gpu.staging_bytes(dst_spec, k)
                if ready.index != i or ready.length != length:
                    raise SidecarError(
                        Code.INTERNAL,
                        f"peer sent chunk {ready.index} of {ready.length} bytes, expected chunk {i} of {length}",
                    )
                done = scattered[i % slots]
                if done is not None:
                    done.synchronize()  # the chunk that last used our slot has been scattered out of it
                local = ring.slot_address(i % slots)
                # Several READs in flight at once: the wire overlaps the control round trips.
                fut = sc.nixl.read(
                    agent,
                    np.array([[local, length, dev]], dtype=np.int64),
                    np.array([[ready.address, length, ready.device_id]], dtype=np.int64),
                    b"",
                    job.remaining(),
                    mem_type="VRAM",
                )
                sc.metrics.nixl_descriptors.observe(1)
                reading.append((i, fut))
                while reading and reading[0][1].done():
                    finish_oldest()
            while reading:
                finish_oldest()
            stream.synchronize()
            requests.put(None)
            for _ in replies:  # let the source end the stream (and free its ring) on its own
                pass
            return nbytes
        except grpc.RpcError as e:
            raise rpc_error(e, link.address, f"to gather request {job.params.request_id!r}") from None
        except StopIteration:
            raise SidecarError(Code.UNAVAILABLE, f"peer {link.address} ended the gather early") from None
        finally:
            requests.put(None)
            call.cancel()
            # A failed pull may leave READs and scatters in flight; the ring must be quiet before
            # the next transfer gets it.
            for _, fut in reading:
                sc.nixl.cancel(fut)
                with contextlib.suppress(Exception):
                    fut.result(timeout=5)
            if stream is not None:
                stream.synchronize()


# -- across sidecars: the source ---------------------------------------------------------
def serve_gather(
    sc: Sidecar, requests: Iterator[peer_pb2.GatherRequest], context: grpc.ServicerContext
) -> Iterator[peer_pb2.GatherReply]:
    first = next(requests, None)
    if first is None or first.WhichOneof("kind") != "open":
        raise SidecarError(Code.INVALID_ARGUMENT, "a Gather stream starts with an open message")
    op = first.open
    item = sc.published.get_live(op.engine_id, op.request_id)
    if item.reader != op.reader_engine_id:
        raise SidecarError(
            Code.FAILED_PRECONDITION,
            f"request {op.request_id!r} is not open for engine {op.reader_engine_id!r}: OpenRead first",
        )
    src_entry = sc.engines.get(op.engine_id, op.source_rank)
    src = src_entry.gpu
    if src is None:
        raise SidecarError(
            Code.FAILED_PRECONDITION, f"engine {op.engine_id!r} rank {op.source_rank} is not in GPU memory"
        )
    if not op.HasField("reader_spec"):
        raise SidecarError(Code.INVALID_ARGUMENT, "reader_spec is required")
    reader_spec = spec_from_proto(op.reader_spec)
    plan = cached_plan(src_entry.spec, reader_spec)
    if plan.hash() != op.plan_hash:
        raise SidecarError(
            Code.FAILED_PRECONDITION, f"plan mismatch: ours {plan.hash()}, the reader's {op.plan_hash}"
        )
    if not 0 <= op.reader_rank < reader_spec.tp_size:
        raise SidecarError(Code.INVALID_ARGUMENT, f"reader rank {op.reader_rank} out of range")
    heads = read_heads(plan, op.reader_rank, op.source_rank)
    dev = src.device
    ring = sc.gpu_staging.ring(dev, "send")
    bd = reader_spec.block_size
    with sc.gpu_staging.hold(ring), src.in_use():
        src_view = src.view(dev)
        yield peer_pb2.GatherReply(opened=peer_pb2.GatherOpened(slots=ring.slots, slot_bytes=ring.slot_bytes))
        for req in requests:
            c = req.chunk
            if req.WhichOneof("kind") != "chunk":
                raise SidecarError(Code.INVALID_ARGUMENT, "only chunk messages may follow the open message")
            if not (c.start_token % bd == 0 and c.start_token < c.end_token <= item.num_tokens):
                raise SidecarError(
                    Code.INVALID_ARGUMENT,
                    f"chunk {c.index}: tokens [{c.start_token}, {c.end_token}) are not a block-aligned "
                    f"range of the request's {item.num_tokens} tokens",
                )
            k = dst_block_count(bd, c.end_token, c.start_token)
            length = gpu.staging_bytes(reader_spec, k)
            if length > ring.slot_bytes or not 0 <= c.slot < ring.slots:
                raise SidecarError(
                    Code.INVALID_ARGUMENT,
                    f"chunk {c.index} ({length} bytes into slot {c.slot}) does not fit the send ring "
                    f"({ring.slots} slots of {ring.slot_bytes} bytes)",
                )
            address = ring.slot_address(c.slot)
            staged = gpu.staging_view(reader_spec, op.reader_rank, address, k, dev)
            # Only the chunk's own source blocks (the executors' "tail" form): validating and
            # uploading the whole request's ids for every chunk cost ~1 ms a chunk.
            src_pos = src_block_range(src_entry.spec.block_size, c.end_token, c.start_token)
            src_ids = item.block_ids[src_pos.start : src_pos.stop]
            gpu.copy_request(src_view, staged, heads, src_ids, range(k), c.end_token, c.start_token)
            yield peer_pb2.GatherReply(
                ready=peer_pb2.GatherReady(index=c.index, address=address, length=length, device_id=dev)
            )
