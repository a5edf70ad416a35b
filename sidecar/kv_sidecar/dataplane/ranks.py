"""The engine ranks' memory as this node maps it: shared memory (host) or CUDA IPC (GPU), keyed by rank.

Only the data plane holds these mappings; the control core knows a rank by its `RankKey` and its
`RankMemory` description. Host ranks are registered with NIXL once (host-nixl READs land in them);
GPU ranks never are (DESIGN.md section 1: only the sidecar's own rings are).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kv_sidecar.dataplane.jobs import HOST, IpcTensorRef, PeerRead, RankKey, RankMemory, ShmTensor
from kv_sidecar.dataplane.peer_reads import PeerReads
from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.execute.host import RankView, rank_view
from kv_sidecar.memory.held import HeldMemory
from kv_sidecar.memory.shm import SegmentId, ShmMapper
from kv_sidecar.plan.chunks import ChunkGeometry, chunk_geometry, descriptor_table
from kv_sidecar.plan.pair import PairPlan, plan_pair
from kv_sidecar.plan.spec import EngineSpec, PlanError
from kv_sidecar.transport.nixl_driver import NixlDriver

if TYPE_CHECKING:
    from kv_sidecar.memory.gpu_rank import GpuRank

log = logging.getLogger(__name__)


@dataclass
class HostRank:
    """A rank in shared memory: its tensors (views of the mapped segments) and their NIXL registration.

    A copy that reads or writes its memory holds it (`in_use`): unregistered meanwhile (its engine
    died), the rank leaves the registry at once, but its memory stays mapped and registered until the
    last such copy ends. The copies address it by raw pointers, which keep no mapping alive, and a
    gather reading a segment unmapped under it took the whole sidecar down (SIGSEGV)."""

    key: RankKey
    spec: EngineSpec
    tensors: list[torch.Tensor]
    segments: list[SegmentId]  # the shared-memory objects mapped for it (ShmMapper.release)
    view: RankView
    geometry: ChunkGeometry
    nixl_key: int | None = None
    local_dlist: int | None = None  # every chunk of this rank, prepared once
    dlist_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _held: HeldMemory = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._held = HeldMemory(functools.partial(_gone, self.key))

    @property
    def region_bases(self) -> list[int]:
        return [t.data_ptr() for t in self.tensors]

    def in_use(self) -> contextlib.AbstractContextManager[None]:
        """Hold the memory for the duration of a copy, even if the rank is unregistered meanwhile."""
        return self._held.hold()

    def acquire(self) -> None:
        """Hold the memory until `let_go`: a peer may READ it by address (dataplane/peer_reads.py)."""
        self._held.acquire()

    def let_go(self) -> Callable[[], None] | None:
        return self._held.let_go()

    def close(self, release: Callable[[], None]) -> None:
        """No new copy may hold it; `release` runs now, or once the last copy holding it ends."""
        self._held.close(release)


class MappedRanks:
    """Every rank registered on this node, mapped; thread-safe."""

    def __init__(
        self,
        nixl: NixlDriver | None,
        on_gpu_device: Callable[[int], None] | None = None,
        copies_into: int | None = None,
        on_leaving: Callable[[int], None] | None = None,
    ) -> None:
        """copies_into: the one GPU this process copies into (a device worker's); None: any of them.
        on_leaving: told how many host ranks left but stay mapped (a copy or a peer's read holds them)."""
        self._nixl = nixl
        self._on_leaving = on_leaving
        self._leaving = 0
        self._on_gpu_device = on_gpu_device  # called with a GPU ordinal before its first rank is served
        self._copies_into = copies_into
        # Pairings' kernels compile here, one at a time, after the registration that met them answered.
        self._warming: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._host: dict[RankKey, HostRank] = {}
        self._gpu: dict[RankKey, GpuRank] = {}
        self._shm = ShmMapper()
        self.peer_reads = PeerReads()

    def attach_host(self, key: RankKey, spec: EngineSpec, tensors: list[ShmTensor]) -> RankMemory:
        mapped: list[torch.Tensor] = []
        segments: list[SegmentId] = []
        try:
            for t in tensors:
                tensor, segment = self._shm.map_tensor(
                    t.name, t.offset, list(t.shape), list(t.strides), t.dtype
                )
                mapped.append(tensor)
                segments.append(segment)
            view = rank_view(spec, key.rank, mapped)
            # After mapping (a bad handle is named first), before NIXL sees overlapping regions.
            _check_disjoint(spec, [(t.name, t.offset, t.shape) for t in tensors])
        except BaseException:
            for segment in segments:
                self._shm.release(segment)
            raise
        rank = HostRank(key, spec, mapped, segments, view, chunk_geometry(spec))
        if self._nixl is not None:
            rank.nixl_key = self._nixl.register(_regions(mapped))
        with self._lock:
            self._host[key] = rank
        return RankMemory("DRAM", HOST, _regions(mapped))

    def attach_gpu(self, key: RankKey, spec: EngineSpec, refs: list[IpcTensorRef]) -> RankMemory:
        """Import a rank's CUDA IPC handles into its GPU's context (a bad handle fails here, at
        registration, not at a later pull)."""
        # Imported here: a CPU-only sidecar never loads the CUDA driver bindings.
        try:
            from kv_sidecar.memory.gpu_rank import GpuRank
            from kv_sidecar_client.cuda_ipc import CudaIpcError
        except ImportError as e:  # pragma: no cover - depends on the install
            raise SidecarError(
                Code.FAILED_PRECONDITION, f"this sidecar cannot serve GPU memory: {e}"
            ) from None
        if not torch.cuda.is_available():
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                "rank registers CUDA IPC tensors but this sidecar sees no GPU "
                "(give the sidecar container the engine's GPUs)",
            )
        _check_disjoint(
            spec, [(r.handle, r.offset, spec.rank_tensor_shapes()[i]) for i, r in enumerate(refs)]
        )
        try:
            gpu = GpuRank(spec, key.rank, refs, home=self._copies_into)
        except CudaIpcError as e:
            raise SidecarError(
                Code.FAILED_PRECONDITION, f"cannot map rank {key.rank}'s GPU memory: {e}"
            ) from None
        if self._on_gpu_device is not None:
            try:
                self._on_gpu_device(gpu.device)
            except BaseException:
                gpu.close()
                raise
        _warm_up(key, gpu)
        with self._lock:
            self._gpu[key] = gpu
            others = [(k, r) for k, r in self._gpu.items() if k.engine_id != key.engine_id]
            if others and self._warming is None:
                self._warming = ThreadPoolExecutor(1, thread_name_prefix="kernel-warm")
            warming = self._warming
        if warming is not None and others:
            warming.submit(_warm_pairs, key, gpu, others, self._copies_into)
        # Peers never address a GPU rank's memory (they WRITE into our rings): no regions to tell.
        return RankMemory("VRAM", gpu.device, ())

    def detach(self, key: RankKey) -> None:
        with self._lock:
            host = self._host.pop(key, None)
            gpu = self._gpu.pop(key, None)
        if host is not None:
            self._count_leaving(+1)
            host.close(functools.partial(self._unmap, host))  # deferred while a copy or a pin holds it
            self.peer_reads.left(host)
        if gpu is not None:
            gpu.close()  # deferred while a copy still reads or writes the mappings

    def _unmap(self, host: HostRank) -> None:
        if self._nixl is not None:
            if host.local_dlist is not None:
                self._nixl.release_dlist(host.local_dlist)
            if host.nixl_key is not None:
                self._nixl.deregister(host.nixl_key)
        host.tensors.clear()
        for segment in host.segments:
            self._shm.release(segment)
        self._count_leaving(-1)

    def _count_leaving(self, change: int) -> None:
        with self._lock:
            self._leaving += change
            now = self._leaving
        if self._on_leaving is not None:
            self._on_leaving(now)

    def pin_for_peer(
        self, keys: Sequence[RankKey], read: PeerRead, reader_ranks: Sequence[int], until: float
    ) -> list[int]:
        """Keep these host ranks mapped while `read`'s reader ranks may READ them (peer_reads.py)."""
        return self.peer_reads.pin(read, reader_ranks, [self.host(k) for k in keys], until)

    def host(self, key: RankKey) -> HostRank:
        rank = self._host.get(key)
        if rank is None:
            if key in self._gpu:
                raise SidecarError(
                    Code.FAILED_PRECONDITION,
                    f"engine {key.engine_id!r} rank {key.rank} is in GPU memory; this path needs host memory",
                )
            raise _gone(key)
        return rank

    def gpu(self, key: RankKey) -> GpuRank:
        rank = self._gpu.get(key)
        if rank is None:
            raise _gone(key)
        return rank

    def is_gpu(self, key: RankKey) -> bool:
        return key in self._gpu

    def local_dlist(self, rank: HostRank) -> int:
        """The NIXL descriptor list of every chunk of `rank`, prepared once."""
        assert self._nixl is not None
        with rank.dlist_lock:
            if rank.local_dlist is None:
                rank.local_dlist = self._nixl.prep_dlist(
                    "", descriptor_table(rank.geometry, rank.region_bases)
                )
            return rank.local_dlist

    def close(self) -> None:
        with self._lock:
            keys = [*self._host, *self._gpu]
            warming, self._warming = self._warming, None
        if warming is not None:
            warming.shutdown(wait=False, cancel_futures=True)
        self.peer_reads.close()  # before the ranks leave, which then unmap at once
        for key in keys:
            with contextlib.suppress(Exception):
                self.detach(key)


def _warm_up(key: RankKey, rank: GpuRank) -> None:
    """Compile the rank's copy kernel at registration rather than at its first pull, which would wait
    0.5-2.1 s for the compiler (bench/kernel_compiles.py). A failure here is only logged: the first
    pull compiles again and reports what fails."""
    from kv_sidecar.execute.gpu import warm_up

    start = time.perf_counter()
    try:
        compiled = warm_up(rank.view(rank.home))  # the GPU this process copies on for it
    except Exception:
        log.warning(
            "could not compile the GPU copy kernel for engine %r rank %d at registration; its first pull "
            "will", key.engine_id, key.rank, exc_info=True,
        )  # fmt: skip
        return
    if compiled:
        log.info(
            "compiled the GPU copy kernel for engine %r rank %d (cuda:%d) in %.2f s",
            key.engine_id, key.rank, rank.home, time.perf_counter() - start,
        )  # fmt: skip


def _check_disjoint(spec: EngineSpec, tensors: list[tuple[str | bytes, int, tuple[int, ...]]]) -> None:
    """Refuse a rank whose tensors (where, offset, shape) share bytes: the sidecar would move one
    layer's data as another's (two layers that share a cache must be registered once: the engine's
    description is wrong)."""
    spans = sorted(
        (where, offset, offset + spec.element_size * math.prod(shape), i)
        for i, (where, offset, shape) in enumerate(tensors)
    )
    for (where, _, end, i), (other, start, _, j) in itertools.pairwise(spans):
        if where == other and start < end:
            raise SidecarError(
                Code.INVALID_ARGUMENT,
                f"tensors {min(i, j)} and {max(i, j)} overlap in their memory: each tensor the spec "
                "describes must have bytes of its own",
            )


def _regions(tensors: list[torch.Tensor]) -> tuple[tuple[int, int, int], ...]:
    return tuple((t.data_ptr(), t.numel() * t.element_size(), 0) for t in tensors)


def _gone(key: RankKey) -> SidecarError:
    return SidecarError(
        Code.FAILED_PRECONDITION,
        f"engine {key.engine_id!r} rank {key.rank} is not mapped here (it was unregistered during the pull)",
    )


def _warm_pairs(
    key: RankKey, rank: GpuRank, others: list[tuple[RankKey, GpuRank]], copies_into: int | None
) -> None:
    """Compile the kernels of gpu-direct copies between a new rank and the other engines' ranks on this
    node, either engine the prefill, where the pairing specialises another kernel than the ranks' own
    (another block size, layout or TP: `execute/gpu.warm_copy`), so that its first pull does not wait
    for the compiler. Pairings that cannot pull from each other are left to their pulls to refuse. A
    pull that meets a kernel still compiling here waits for it, as it would have compiled it."""
    from kv_sidecar.execute.gpu import warm_copy

    plans: dict[tuple[EngineSpec, EngineSpec], PairPlan | None] = {}
    for other_key, other in others:
        for (pk, prefill), (dk, decode) in (
            ((other_key, other), (key, rank)),
            ((key, rank), (other_key, other)),
        ):
            if copies_into is not None and decode.device != copies_into:
                continue  # another device's worker copies into it
            specs = (prefill.spec, decode.spec)
            if specs not in plans:
                try:
                    plans[specs] = plan_pair(*specs)
                except PlanError:  # engines that cannot pair: their pulls say why
                    plans[specs] = None
                except Exception:  # a bug in planning: the pull plans again and reports it
                    log.debug("could not plan %s -> %s", pk, dk, exc_info=True)
                    plans[specs] = None
            plan = plans[specs]
            if plan is None:
                continue
            for read in plan.decode_ranks[decode.rank].reads:
                if read.prefill_rank != prefill.rank:
                    continue
                start = time.perf_counter()
                try:
                    src, dst = prefill.view(prefill.home), decode.view(decode.home)
                    compiled = warm_copy(src, dst, read.heads, decode.device)
                except Exception:  # unregistered meanwhile, or a failure the first pull will report
                    log.debug("could not compile the kernel of %s -> %s", pk, dk, exc_info=True)
                    continue
                if compiled:
                    log.info(
                        "compiled the GPU copy kernel from engine %r rank %d into engine %r rank %d "
                        "(cuda:%d) in %.2f s",
                        pk.engine_id, pk.rank, dk.engine_id, dk.rank, decode.device, time.perf_counter() - start,
                    )  # fmt: skip
