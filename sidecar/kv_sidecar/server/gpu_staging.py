"""Sidecar-owned staging rings for the staged protocol, registered with NIXL once.

DESIGN.md section 1: NIXL moves memory the sidecar owns ~400x faster than
memory it imported over CUDA IPC, so engine memory is never registered.
The source sidecar gathers a request's tokens, already in the reader's
layout, into slots of its send ring and WRITEs each chunk over NIXL (one
descriptor) into a slot of the reader's receive ring, which scatters from
there (server/staged_reader.py, server/staged_source.py, server/staged_protocol.py).

Each GPU has two rings, send and receive, each split into equal slots
(`gpu_staging_bytes` / 2 / `gpu_staging_slots` bytes). Every transfer on that
GPU takes the slots it needs from the ring's `SlotPool` and gives them back
one by one as its last chunks need fewer, so concurrent transfers share a
ring. Separate send and receive rings mean two sidecars pulling from each
other cannot deadlock: a transfer holds receive slots on one sidecar and send
slots on the other, never waits for the same pool twice, and slots only wait
on local scatters and on the wire.

With `host_transfer: ring`, host-memory pulls run the same protocol through
one pair of host rings of the same size (device `HOST`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from kv_sidecar.config import Settings
from kv_sidecar.execute import gpu
from kv_sidecar.metrics import Metrics
from kv_sidecar.server.push_runs import PushRuns
from kv_sidecar.server.staged_protocol import SlotPool
from kv_sidecar.transport.nixl_driver import NixlDriver

if TYPE_CHECKING:
    from kv_sidecar.server.engines import RankEntry
    from kv_sidecar.server.published import Published

T = TypeVar("T")
ALIGN = 4096  # slot starts aligned for the copy kernel's vector accesses and for RDMA
HOST = -1  # the device key of the host-memory rings


@dataclass
class Ring:
    device: int  # CUDA ordinal, or HOST
    buffer: torch.Tensor
    slots: int
    slot_bytes: int
    pool: SlotPool
    nixl_key: int
    metadata: bytes = field(default=b"", repr=False)  # NIXL partial metadata: what a peer needs to WRITE here

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def mem_type(self) -> str:
        return "DRAM" if self.device == HOST else "VRAM"

    @property
    def nixl_device(self) -> int:
        return 0 if self.device == HOST else self.device

    def slot_address(self, slot: int) -> int:
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} out of range [0, {self.slots})")
        return self.buffer.data_ptr() + slot * self.slot_bytes


_CALL_START_WAIT_S = 0.002


class GpuStaging:
    """Rings per (device, role), allocated on first use and kept until shutdown."""

    def __init__(self, settings: Settings, nixl: NixlDriver, metrics: Metrics, push_runs: PushRuns) -> None:
        """settings: the ring sizes (gpu_staging_bytes, gpu_staging_slots), engine_workers (how many
        threads call and serve Pushes) and push_notifications."""
        self._settings = settings
        self._nixl = nixl
        self._metrics = metrics
        self._push_runs = push_runs
        self._lock = threading.Lock()
        self._rings: dict[tuple[int, str], Ring] = {}
        self._callers: ThreadPoolExecutor | None = None
        self._sources: ThreadPoolExecutor | None = None
        self._uploader: ThreadPoolExecutor | None = None

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Run a blocking peer call (a reader's Push) on a thread kept for that, and return its future.

        Not `stub.Method.future()`: gRPC starts a new thread for every such call made on a channel
        with no other call of that kind in flight (its "channel spin" thread), which cost a
        one-block staged pull ~0.6-1.3 ms on 2 shared cores. Threads here are kept and reused.

        Returns once that thread runs the call (at most 2 ms): the caller goes on to prepare its
        copies, holding the GIL between CUDA calls, and the request would leave only after it.
        """
        started = threading.Event()

        def run() -> T:
            started.set()
            return fn(*args, **kwargs)

        with self._lock:
            if self._callers is None:
                self._callers = ThreadPoolExecutor(
                    max_workers=max(8, self._settings.engine_workers), thread_name_prefix="push"
                )
            future = self._callers.submit(run)
        started.wait(_CALL_START_WAIT_S)
        return future

    def expect_read(self, item: Published, entries: Iterable[RankEntry]) -> None:
        """`item` was just published here. If staged readers read from this sidecar lately, get ready
        for one: upload its ids (`upload_ids`) and poll for its Push notification at the serving rate.
        Otherwise do neither: a sidecar whose readers are all on its node (gpu-direct) would pay for
        them on every pull, the polling's GIL hand-offs most (~0.1 ms a pull, docs/benchmarks.md)."""
        runs = self._push_runs
        if not runs.readers_lately():
            return
        self.upload_ids(item, entries)
        if self._settings.push_notifications:
            runs.touch()

    def upload_ids(self, item: Published, entries: Iterable[RankEntry]) -> None:
        """Upload a published request's block ids to the GPU of each of its ranks here (`entries`) on a
        kept thread, so that a gather need not: the upload costs a source ~0.3 ms on a pull's critical
        path, and a reader asks only after the prefill engine's Publish has returned, which does not
        wait for it. A gather that finds it unfinished uploads its own."""
        devices = {
            e.gpu.device
            for e in entries
            if e.gpu is not None and (item.ranks is None or e.rank in item.ranks)
        }
        if not devices:
            return
        with self._lock:
            if self._uploader is None:
                self._uploader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ids-upload")
            for device in devices:
                item.uploaded[device] = self._uploader.submit(
                    gpu.upload_block_ids, item.source_blocks, device
                )

    def run_source(self, fn: Callable[[], None]) -> None:
        """Run a source's transfer (its whole Push) on a kept thread: the NIXL thread that received its
        notification must not block on it. With every thread busy (most of them waiting for send
        slots) it waits its turn in the pool's queue, as its call would wait for slots; dropping it
        would cost its reader CALL_AFTER_S, until its call started it. Only readers holding a push
        key queue here, each at most as many transfers as it has receive slots."""
        with self._lock:
            if self._sources is None:
                self._sources = ThreadPoolExecutor(
                    max_workers=self._source_threads(), thread_name_prefix="push-source"
                )
            self._sources.submit(fn)

    def _source_threads(self) -> int:
        return max(8, self._settings.engine_workers // 4)

    def ensure(self, device: int) -> None:
        """Allocate and register both rings of `device` (before any peer handshakes for its engines)."""
        self.ring(device, "send")
        self.ring(device, "recv")

    def ring(self, device: int, role: str) -> Ring:
        with self._lock:
            ring = self._rings.get((device, role))
            if ring is not None:
                return ring
            s = self._settings
            slots = max(1, s.gpu_staging_slots)
            slot_bytes = (s.gpu_staging_bytes // 2 // slots) // ALIGN * ALIGN
            if slot_bytes <= 0:
                raise ValueError(f"gpu_staging_bytes {s.gpu_staging_bytes} is too small for {slots} slots")
            where = torch.device("cpu") if device == HOST else torch.device("cuda", device)
            buf = torch.empty(slots * slot_bytes, dtype=torch.uint8, device=where)
            mem = "DRAM" if device == HOST else "VRAM"
            key = self._nixl.register([(buf.data_ptr(), buf.numel(), max(device, 0))], mem_type=mem)
            in_use = self._metrics.staging_in_use
            pool = SlotPool(slots, on_change=lambda n, b=slot_bytes: in_use.inc(n * b))
            ring = Ring(device, buf, slots, slot_bytes, pool, key)
            if role == "recv":
                ring.metadata = self._nixl.partial_metadata(key)
            self._rings[(device, role)] = ring
            self._metrics.gpu_memory.set(self.gpu_bytes_locked())
            self._metrics.staging_capacity.inc(ring.nbytes)
            return ring

    def gpu_bytes_locked(self) -> int:
        return sum(r.buffer.numel() for (dev, _), r in self._rings.items() if dev != HOST)

    def close(self) -> None:
        with self._lock:
            self._rings.clear()
            pools = [self._callers, self._sources, self._uploader]
            self._callers = self._sources = self._uploader = None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
