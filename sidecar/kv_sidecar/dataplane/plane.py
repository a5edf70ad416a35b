"""The data plane's one door: `DataPlane` for the node, a `DevicePlane` per device behind it.

Everything that touches a device's memory and moves bytes sits behind this door: the ranks'
mappings (dataplane/ranks.py), the staging rings (dataplane/rings.py), gather/scatter launches
(dataplane/chunk_copies.py, execute/), NIXL READ and WRITE posting (dataplane/nixl_reads.py,
dataplane/send.py), the staged protocol's credits and completions (dataplane/receive.py). The
control core hands it jobs of plain data (dataplane/jobs.py) and gets back bytes moved, or an
error; it never reaches past it. A `DevicePlane` is what a per-GPU worker process would serve.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch

from kv_sidecar.config import Settings
from kv_sidecar.dataplane import local_copies, state_copies
from kv_sidecar.dataplane.jobs import (
    HOST,
    BlockReads,
    ConvertedRead,
    Halt,
    IpcTensorRef,
    LocalCopy,
    PeerRead,
    RankKey,
    RankMemory,
    RankRead,
    Receive,
    Send,
    ShmTensor,
    StateCopy,
    StateRead,
    WorkerState,
)
from kv_sidecar.dataplane.nixl_reads import NixlReads, PostedRead
from kv_sidecar.dataplane.ranks import MappedRanks
from kv_sidecar.dataplane.receive import Reception
from kv_sidecar.dataplane.rings import Ring, new_ring, slot_bytes_for
from kv_sidecar.dataplane.send import Transmission
from kv_sidecar.dataplane.staged_workers import WorkerReception, WorkerTransmission, receive_in
from kv_sidecar.dataplane.workers import CopyWorker, CopyWorkers
from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.execute import gpu, gpu_launch_counts
from kv_sidecar.memory.cuda_ipc import mps_enabled
from kv_sidecar.metrics import Family, Metrics
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.transport.nixl_driver import NixlDriver
from kv_sidecar.transport.notifications import SEP, TRANSFER_TAG

# The door: what the control core may use of the data plane (with dataplane/jobs.py, the values it
# hands over, and dataplane/staged_protocol.py, the protocol's pure bookkeeping). tests/server/
# test_layering.py holds the core to it.
__all__ = [
    "DataPlane",
    "DevicePlane",
    "MappedRanks",
    "PostedRead",
    "Reception",
    "Transmission",
    "WorkerReception",
    "WorkerTransmission",
]

log = logging.getLogger(__name__)

# device_workers=auto runs GPU copies in workers where the sidecar sees at least this many GPUs: with two
# GPU pairs gpu-direct batches at 64 MiB moved 1.5-1.7x the GB/s through workers, at 2 MiB 1.1-1.2x,
# while one pair alone lost 6-24 % to the hand-off (4x H200, three leases, docs/benchmarks.md); on two
# GPUs no gain was measured.
AUTO_WORKER_GPUS = 4


def copies_in_workers(setting: str | bool, gpus: Callable[[], int]) -> tuple[bool, bool]:
    """Which local copies `device_workers` sends to worker processes: (those into GPU ranks, those into
    host ranks). auto: the GPU ones on a node of AUTO_WORKER_GPUS GPUs or more, never the host's (on
    the CPU machine a host-direct batch ran 0.58x through a worker). `gpus` counts the GPUs seen,
    asked only for auto: counting initialises CUDA, which a sidecar need not do at start."""
    if str(setting).lower() == "auto":
        return gpus() >= AUTO_WORKER_GPUS, False
    on = setting is True or str(setting).lower() == "true"
    return on, on


# Block ids uploaded at Publish, freed when the request's record goes (`forget_ids`), and kept for that
# many requests at most should the record outlive that (the oldest go first; a gather that finds none
# uploads its own).
_UPLOADS_KEPT = 4096


class DevicePlane:
    """One device's rings and the staged transfers that run through them (a CUDA ordinal, or HOST)."""

    def __init__(
        self, device: int, settings: Settings, nixl: NixlDriver, metrics: Metrics, ranks: MappedRanks
    ):
        self.device = device
        self._settings, self._nixl, self._metrics, self._ranks = settings, nixl, metrics, ranks
        self._lock = threading.Lock()
        self._rings: dict[str, Ring] = {}

    def ring(self, role: str) -> Ring:
        """The "send" or "recv" ring, allocated and registered with NIXL on first use."""
        with self._lock:
            ring = self._rings.get(role)
            if ring is None:
                s = self._settings
                ring = new_ring(
                    self.device,
                    role,
                    s.gpu_staging_bytes,
                    s.gpu_staging_slots,
                    self._nixl,
                    self._metrics,
                    s.gpu_staging_reserve,
                )
                self._rings[role] = ring
            return ring

    @property
    def ring_bytes(self) -> int:
        with self._lock:
            return sum(r.nbytes for r in self._rings.values())

    def receive(self, job: Receive, halt: Halt) -> Reception | None:
        ring = self.ring("recv")
        per_block = gpu.staging_bytes(job.spec, 1)
        if ring.slot_bytes < per_block:
            raise SidecarError(
                Code.RESOURCE_EXHAUSTED,
                f"a staging slot ({ring.slot_bytes} bytes) cannot hold one block of the reader's "
                f"layout ({per_block} bytes): raise gpu_staging_bytes or lower gpu_staging_slots",
            )
        if len(job.tokens.dst_blocks) == 0:
            return None  # a prefix hit covering the whole request: nothing to move
        return Reception(self._ranks, ring, self._nixl, self._metrics, job, halt)

    def blocks_per_chunk(self, reader_spec: EngineSpec, slot_lengths: Sequence[int]) -> int:
        """How many of the reader's blocks one chunk carries: as many as both sides' slots hold."""
        per_block = gpu.staging_bytes(reader_spec, 1)
        # From the settings, not the ring: with staged_workers the send ring is the worker's.
        ours = slot_bytes_for(self._settings.gpu_staging_bytes, self._settings.gpu_staging_slots)
        cap = min(ours, *slot_lengths)
        if cap < per_block:
            raise SidecarError(
                Code.RESOURCE_EXHAUSTED,
                f"a staging slot ({cap} bytes) cannot hold one block of the reader's layout ({per_block} "
                "bytes): raise gpu_staging_bytes or lower gpu_staging_slots",
            )
        return cap // per_block

    def send(self, job: Send, uploaded_ids: Any) -> Transmission:
        return Transmission(self._ranks, self.ring("send"), self._nixl, self._metrics, job, uploaded_ids)


class DataPlane:
    """The node's data plane: the ranks' memory, and each device's plane, created on first use."""

    def __init__(self, settings: Settings, nixl: NixlDriver, metrics: Metrics) -> None:
        self._settings, self._nixl, self._metrics = settings, nixl, metrics
        # A transfer's notifications (staged_protocol.prefix) go to the transfer listening for them.
        nixl.route(TRANSFER_TAG + SEP)
        self.ranks = MappedRanks(
            nixl, on_gpu_device=self._ready_device, on_leaving=metrics.host_ranks_leaving.set
        )
        self._reads = NixlReads(
            self.ranks, nixl, metrics, settings.staging_bytes, merge=settings.host_read_merge
        )
        self._lock = threading.Lock()
        self._devices: dict[int, DevicePlane] = {}
        self._seen_gpus: set[int] = set()  # GPUs a rank was mapped on (their MPS state reported once)
        self._uploads: OrderedDict[tuple[str, str], tuple[Sequence[int], dict[int, Future[Any]]]] = (
            OrderedDict()
        )
        self._uploader: ThreadPoolExecutor | None = None
        # Local copies, staged transfers or both in a process per device (dataplane/workers.py), or here.
        self.staged_workers = settings.staged_workers
        staged = (nixl.name, settings) if settings.staged_workers else None
        self._gpu_in_workers, self._host_in_workers = copies_in_workers(
            settings.device_workers, torch.cuda.device_count
        )
        in_workers = self._gpu_in_workers or self._host_in_workers
        if in_workers:  # counted here only where copies go to workers, once
            log.info(
                "device_workers=%s (%d GPUs): %s copies run in worker processes",
                settings.device_workers,
                torch.cuda.device_count(),
                "GPU and host" if self._host_in_workers else "GPU",
            )
        # Called with the device when its worker died and was replaced, and when a worker became ready: a
        # member sidecar of a multi-node engine then tells its leader at once which agent (none, while
        # one starts) runs the device's staged transfers, rather than at its next refresh.
        self.on_worker_change: Callable[[int], None] = lambda device: None
        self.workers = (
            CopyWorkers(metrics, staged, lambda device: self.on_worker_change(device))
            if in_workers or staged
            else None
        )
        # Host ranks go to the host's worker too, with staged_workers whatever host_transfer says here:
        # a source serves host-ring transfers when its reader's setting asks for them.

    def worker_states(self) -> list[WorkerState]:
        """Each worker process, what it runs, and how often it was started again."""
        if self.workers is None:
            return []
        return [
            WorkerState(device, pid, restarts, self._in_worker(device), self.staged_workers, ready)
            for device, pid, restarts, ready in self.workers.processes()
        ]

    def worker_metrics(self) -> dict[int, list[Family]]:
        """What each worker process counts (its rings, WRITEs, failures, launches, NIXL objects), device
        -> families: what a scrape shows of them."""
        return {} if self.workers is None else self.workers.metrics()

    @staticmethod
    def gpu_launches() -> dict[str, int]:
        """The GPU copy kernel's launches in this process, by how they were made."""
        return gpu_launch_counts()

    def device(self, device: int) -> DevicePlane:
        with self._lock:
            plane = self._devices.get(device)
            if plane is None:
                plane = self._devices[device] = DevicePlane(
                    device, self._settings, self._nixl, self._metrics, self.ranks
                )
            return plane

    def _ready_device(self, device: int) -> None:
        """Allocate and register both rings of a GPU before any peer handshakes for its engines (the
        worker's, with staged_workers: its agent's first answer, asked at handshake)."""
        with self._lock:
            first = device not in self._seen_gpus
            self._seen_gpus.add(device)
        if first:
            self._report_mps(device)
        if self.staged_workers:
            return
        plane = self.device(device)
        plane.ring("send")
        plane.ring("recv")
        self._metrics.gpu_memory.set(self.gpu_ring_bytes())

    def _report_mps(self, device: int) -> None:
        """Say once per GPU whether the sidecar's copies on it run beside the engines' kernels (CUDA MPS) or
        take turns with them (docs/operations.md, "Pulls into a GPU its engine keeps busy")."""
        try:
            mps = mps_enabled(device)
        except Exception:  # the rank mapped, so the driver is there; a failure here only loses the report
            log.debug("could not ask the driver whether GPU %d runs under MPS", device, exc_info=True)
            return
        if mps is None:
            return  # a driver older than the attribute
        self._metrics.gpu_mps.labels(str(device)).set(int(mps))
        log.info(
            "GPU %d: the sidecar's copies %s",
            device,
            "run under CUDA MPS, beside the engines' kernels"
            if mps
            else "take turns with other processes' kernels on it (no CUDA MPS): a busy engine slows them",
        )

    def gpu_ring_bytes(self) -> int:
        with self._lock:
            planes = [p for d, p in self._devices.items() if d != HOST]
        return sum(p.ring_bytes for p in planes)

    # -- memory ---------------------------------------------------------------------
    def attach_host(self, key: RankKey, spec: EngineSpec, tensors: list[ShmTensor]) -> RankMemory:
        memory = self.ranks.attach_host(key, spec, tensors)
        if self.workers is not None and (self._host_in_workers or self.staged_workers):
            self.workers.attach_host(key, spec, tensors)
        return memory

    def attach_gpu(self, key: RankKey, spec: EngineSpec, refs: list[IpcTensorRef]) -> RankMemory:
        memory = self.ranks.attach_gpu(key, spec, refs)
        if self.workers is not None:
            self.workers.attach_gpu(key, spec, memory.device, refs)
        return memory

    def detach(self, key: RankKey) -> None:
        if self.workers is not None:
            self.workers.detach(key)
        self.ranks.detach(key)

    def pin_for_peer(
        self, keys: Sequence[RankKey], read: PeerRead, reader_ranks: Sequence[int], until: float
    ) -> list[int]:
        """A peer may READ these host ranks by address for `read` until its reader ranks are done or
        `until` (time.monotonic()): they stay mapped that long, even if their engine leaves
        (dataplane/peer_reads.py). Returns the reader ranks the pin added."""
        return self.ranks.pin_for_peer(keys, read, reader_ranks, until)

    def peer_read_done(self, read: PeerRead, reader_ranks: Sequence[int] = ()) -> None:
        self.ranks.peer_reads.done(read, reader_ranks)

    def _device_of(self, key: RankKey) -> int:
        return self.ranks.gpu(key).device if self.ranks.is_gpu(key) else HOST

    # -- jobs -----------------------------------------------------------------------
    def _in_worker(self, device: int) -> bool:
        """Whether local copies into `device` run in its worker process (device_workers)."""
        return self._host_in_workers if device == HOST else self._gpu_in_workers

    def _worker_for(self, device: int) -> CopyWorker | None:
        """The worker that runs local copies into `device` now: None where device_workers keeps them
        here, and while the device's worker starts (the first copy starts it) or comes back."""
        if self.workers is None or not self._in_worker(device):
            return None
        return self.workers.ready(device)

    @property
    def _copies_in_workers(self) -> bool:
        """Whether device_workers sends any local copies to workers (staged_workers alone sends none)."""
        return self.workers is not None and (self._gpu_in_workers or self._host_in_workers)

    def _by_device(self, job: LocalCopy) -> dict[int, LocalCopy]:
        """The job's reads split by the device they write into: each device's part goes to that
        device's worker (a decode engine's ranks may sit on several GPUs)."""
        reads: dict[int, list[RankRead]] = {}
        for read in job.reads:
            reads.setdefault(self._device_of(read.dst), []).append(read)
        if len(reads) == 1:
            return {device: job for device in reads}
        return {device: replace(job, reads=tuple(rs)) for device, rs in reads.items()}

    def copy_local(self, job: LocalCopy, halt: Halt) -> int:
        """host-direct or gpu-direct, as the ranks are (the caller checked they are all one kind); in
        each decode device's worker process where device_workers sends it there and it is ready."""
        if job.reads and self._copies_in_workers:  # else nothing to split: every copy runs here
            parts = self._by_device(job)
            if len(parts) > 1:
                moved = 0
                for part in self.copy_local_all([(p, halt) for p in parts.values()]):
                    if isinstance(part, BaseException):
                        raise part
                    moved += part
                return moved
            worker = self._worker_for(next(iter(parts)))
            if worker is not None:
                return worker.copy(job, halt)
        if job.reads and self.ranks.is_gpu(job.reads[0].dst):
            return local_copies.copy_gpu(self.ranks, job, halt)
        return local_copies.copy_host(self.ranks, job, halt)

    def copy_local_all(self, jobs: Sequence[tuple[LocalCopy, Halt]]) -> list[int | BaseException]:
        """Several copies (a PullBatch's), each's bytes or what failed it: on GPUs launched together
        with one wait per decode GPU, host ones one after another (local_copies.copy_all); those that
        device_workers sends to workers, each device's share in one message to its worker, which does
        the same."""
        if not self._copies_in_workers:
            return local_copies.copy_all(self.ranks, jobs)
        out: list[int | BaseException] = [0] * len(jobs)
        ready: dict[int, CopyWorker | None] = {}  # each device's worker, asked once per batch
        parts: list[tuple[int, LocalCopy, Halt]] = []  # (the job's index, its share of one device, halt)
        by_worker: dict[CopyWorker, list[int]] = {}  # indices into parts
        here: list[int] = []
        for i, (job, halt) in enumerate(jobs):
            try:  # a rank gone since the pull began fails that copy alone
                shares = self._by_device(job) if job.reads else {}
            except Exception as e:
                out[i] = e
                continue
            for device, share in shares.items():
                if device not in ready:
                    ready[device] = self._worker_for(device)
                worker = ready[device]
                (here if worker is None else by_worker.setdefault(worker, [])).append(len(parts))
                parts.append((i, share, halt))

        def settle(k: int, moved: int | BaseException) -> None:
            i = parts[k][0]
            done = out[i]
            if isinstance(moved, BaseException):
                if not isinstance(done, BaseException):  # the first failure of a job's shares
                    out[i] = moved
            elif not isinstance(done, BaseException):
                out[i] = done + moved

        # Sent to every worker first, then waited for: devices copy side by side, and with this
        # process's own share.
        posted = [
            (idx, w.post_copies([(parts[k][1], parts[k][2]) for k in idx])) for w, idx in by_worker.items()
        ]
        if here:
            mine = local_copies.copy_all(self.ranks, [(parts[k][1], parts[k][2]) for k in here])
            for k, moved in zip(here, mine, strict=True):
                settle(k, moved)
        for idx, copies in posted:
            for k, moved in zip(idx, copies.wait(), strict=True):
                settle(k, moved)
        return out

    def copy_state(self, job: StateCopy, halt: Halt) -> int:
        """host-direct of a converted Mamba state block (host ranks only: the caller checked)."""
        return state_copies.copy_state_local(self.ranks, job, halt)

    def read_state(self, job: StateRead, halt: Halt) -> int:
        """host-nixl-state: a converted Mamba state block READ from another sidecar's host ranks."""
        return self._reads.read_state(job, halt)

    def post_reads(self, job: BlockReads, halt: Halt) -> list[PostedRead]:
        return self._reads.post(job, halt)

    def finish_reads(self, reads: list[PostedRead], halt: Halt) -> int:
        return self._reads.finish(reads, halt)

    def abandon_reads(self, reads: list[PostedRead]) -> None:
        self._reads.abandon(reads)

    def read_converted(self, job: ConvertedRead, halt: Halt) -> int:
        return self._reads.read_converted(job, halt)

    def receive(
        self, job: Receive, halt: Halt, in_worker: bool = False
    ) -> Reception | WorkerReception | None:
        """The receiving end of a staged transfer into `job.dst`, its slots taken; None if the job moves
        nothing. Raises RESOURCE_EXHAUSTED if a slot cannot hold one block. `in_worker` (with
        staged_workers): in the device's worker, whose agent the source then WRITEs to."""
        device = self._device_of(job.dst)
        if in_worker and self.workers is not None and self.staged_workers:
            return receive_in(self.workers.get(device), job, halt)
        return self.device(device).receive(job, halt)

    def worker_agent(self, key: RankKey) -> tuple[str, bytes] | None:
        """The NIXL agent (name, metadata) that runs staged transfers of rank `key` (staged_workers), or
        None: this sidecar's own. Starts the worker, and its rings, if they are not yet."""
        if self.workers is None or not self.staged_workers:
            return None
        device = self._device_of(key)
        return self.workers.get(device).agent()

    def ready_worker_agent(self, key: RankKey) -> tuple[str, bytes] | None:
        """`worker_agent` if the rank's worker runs and is ready; else None (none yet, or restarting):
        starts nothing and waits at most a second (a member sidecar's report to its leader)."""
        if self.workers is None or not self.staged_workers:
            return None
        return self.workers.ready_agent(self._device_of(key))

    def worker_agent_name(self, key: RankKey) -> str | None:
        """The name `worker_agent` would give, without asking the worker (or starting it)."""
        if self.workers is None or not self.staged_workers:
            return None
        return self.workers.staged_agent_name(self._device_of(key))

    def blocks_per_chunk(self, src: RankKey, reader_spec: EngineSpec, slot_lengths: Sequence[int]) -> int:
        """How many of the reader's blocks one chunk of a transfer out of `src` carries; RESOURCE_EXHAUSTED
        if a slot (ours or the reader's) cannot hold one."""
        return self.device(self._device_of(src)).blocks_per_chunk(reader_spec, slot_lengths)

    def send(self, job: Send, in_worker: bool = False) -> Transmission | WorkerTransmission:
        """The sending end of a staged transfer out of `job.src`; `run` moves it. `in_worker`: in the
        source device's worker (the reader expects the chunks from its agent); FAILED_PRECONDITION
        without staged_workers (this sidecar restarted without them since the reader's handshake)."""
        device = self._device_of(job.src)
        if in_worker:
            if self.workers is None or not self.staged_workers:
                raise SidecarError(
                    Code.FAILED_PRECONDITION,
                    "the reader expects this transfer from a staged worker, and this sidecar runs none for "
                    "the rank (staged_workers is off): its handshake is out of date, it handshakes again",
                )
            return WorkerTransmission(self.workers.get(device), job)
        return self.device(device).send(job, self._uploaded(job, device))

    # -- block ids, uploaded ahead of a gather ----------------------------------------
    def prefetch_ids(
        self, request: tuple[str, str], block_ids: Sequence[int], ranks: Sequence[RankKey]
    ) -> None:
        """Upload a published request's block ids to the GPU of each of its ranks here on a kept
        thread, so that a gather need not: the upload costs a source ~0.3 ms on a pull's critical
        path, and a reader asks only after the prefill engine's Publish has returned, which does not
        wait for it. A gather that finds it unfinished uploads its own."""
        devices = {self.ranks.gpu(k).device for k in ranks if self.ranks.is_gpu(k)}
        if not devices or self.staged_workers:  # a worker's gather uploads its own
            return
        with self._lock:
            if self._uploader is None:
                self._uploader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ids-upload")
            futures = {d: self._uploader.submit(gpu.upload_block_ids, block_ids, d) for d in devices}
            # Kept as given (not copied): a Send of this request names the same record's ids.
            self._uploads[request] = (block_ids, futures)
            self._uploads.move_to_end(request)
            while len(self._uploads) > _UPLOADS_KEPT:
                self._uploads.popitem(last=False)

    def forget_ids(self, engine_id: str, request_id: str) -> None:
        """The request's record is gone: free its uploaded ids."""
        with self._lock:
            self._uploads.pop((engine_id, request_id), None)

    def _uploaded(self, job: Send, device: int) -> Any:
        """The job's block ids on `device` where the request's upload is complete, else None (its
        StagedCopies uploads them). A Send of several requests names no request and uploads its joined
        ids at once: joining the requests' uploads on the transfer's stream instead (a view and a
        record_stream each, then a cat) was no faster (docs/benchmarks.md, twenty-eighth session)."""
        if job.request is None:
            return None
        return self._uploaded_ids(job.request, job.block_ids, device)

    def _uploaded_ids(self, request: tuple[str, str], block_ids: Sequence[int], device: int) -> Any:
        """A request's block ids on `device` if their upload is complete, else None."""
        with self._lock:
            entry = self._uploads.get(request)
        # The same record's ids (the same list, in this process: no O(blocks) comparison on the path),
        # else equal ones; otherwise never uploaded, or a request of that id published again since.
        if entry is None or (entry[0] is not block_ids and list(entry[0]) != list(block_ids)):
            return None
        fut = entry[1].get(device)
        if fut is None or not fut.done() or fut.exception() is not None:
            return None
        return fut.result()

    def close(self) -> None:
        with self._lock:
            uploader, self._uploader = self._uploader, None
            self._devices.clear()
            self._uploads.clear()
        if uploader is not None:
            uploader.shutdown(wait=False, cancel_futures=True)
        if self.workers is not None:
            self.workers.close()
        self.ranks.close()
