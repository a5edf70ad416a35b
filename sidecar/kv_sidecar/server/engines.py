"""Registered engine ranks: their spec, their mapped tensors, their NIXL registration."""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kv_sidecar.execute.host import RankView, rank_view
from kv_sidecar.memory.shm import ShmMapper
from kv_sidecar.plan.chunks import ChunkGeometry, chunk_geometry
from kv_sidecar.plan.spec import EngineSpec, PlanError
from kv_sidecar.server.errors import Code, SidecarError
from kv_sidecar_client._proto.kvsidecar.v1 import common_pb2, engine_pb2

if TYPE_CHECKING:
    from kv_sidecar.memory.gpu_rank import GpuRank
    from kv_sidecar.transport.nixl_driver import NixlDriver

log = logging.getLogger(__name__)


def spec_from_proto(msg: common_pb2.EngineSpec) -> EngineSpec:
    return EngineSpec(
        tp_size=msg.tp_size,
        num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        dtype=msg.dtype,
        block_size=msg.block_size,
        num_blocks=msg.num_blocks,
        layout=msg.layout,  # type: ignore[arg-type]  # parsed and validated by EngineSpec
        kernel_block_size=msg.kernel_block_size or None,
        cross_layer=msg.cross_layer,
    )


def spec_to_proto(spec: EngineSpec) -> common_pb2.EngineSpec:
    d = spec.to_dict()
    d["kernel_block_size"] = d["kernel_block_size"] or 0
    return common_pb2.EngineSpec(**d)


@dataclass
class RankEntry:
    """A registered rank: host memory (shm `tensors`, `view`) or GPU memory (`gpu`), never both."""

    engine_id: str
    rank: int
    spec: EngineSpec
    tensors: list[torch.Tensor]
    shm_names: list[str]
    view: RankView | None
    geometry: ChunkGeometry
    gpu: GpuRank | None = None
    nixl_key: int | None = None
    local_dlist: int | None = None  # every chunk of this rank, prepared once
    events: queue.Queue[engine_pb2.Event | None] = field(default_factory=queue.Queue)
    sessions: int = 0

    @property
    def region_bases(self) -> list[int]:
        return [t.data_ptr() for t in self.tensors]

    @property
    def regions(self) -> list[tuple[int, int, int]]:
        return [(t.data_ptr(), t.numel() * t.element_size(), 0) for t in self.tensors]

    @property
    def memory_kind(self) -> str:
        """NIXL's name for where the rank lives."""
        return "VRAM" if self.gpu is not None else "DRAM"

    @property
    def host_view(self) -> RankView:
        if self.view is None:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"engine {self.engine_id!r} rank {self.rank} is in GPU memory; this path needs host memory",
            )
        return self.view

    def emit(self, event: engine_pb2.Event) -> None:
        self.events.put(event)


class EngineRegistry:
    """Thread-safe map of (engine_id, rank) to RankEntry."""

    def __init__(self, nixl: NixlDriver | None, on_gpu_device: Callable[[int], None] | None = None) -> None:
        self._nixl = nixl
        self._on_gpu_device = on_gpu_device  # called with a GPU ordinal before its first rank is served
        self._lock = threading.Lock()
        self._ranks: dict[tuple[str, int], RankEntry] = {}
        # Ranks being mapped (register() outside the lock), with their specs: a concurrent duplicate or
        # a differing spec of the same engine fails fast, and readers of _ranks see only built entries.
        self._pending: dict[tuple[str, int], EngineSpec] = {}
        self._shm = ShmMapper()

    def register(
        self, engine_id: str, rank: int, spec: EngineSpec, handles: list[common_pb2.TensorHandle]
    ) -> RankEntry:
        if rank >= spec.tp_size:
            raise SidecarError(
                Code.INVALID_ARGUMENT, f"rank {rank} is out of range for tp_size {spec.tp_size}"
            )
        key = (engine_id, rank)
        with self._lock:
            if key in self._ranks or key in self._pending:
                raise SidecarError(
                    Code.ALREADY_EXISTS, f"engine {engine_id!r} rank {rank} is already registered"
                )
            specs = [((eid, r), e.spec) for (eid, r), e in self._ranks.items()] + list(self._pending.items())
            for (eid, other_rank), other_spec in specs:
                if eid == engine_id and other_spec != spec:
                    raise SidecarError(
                        Code.FAILED_PRECONDITION,
                        f"engine {engine_id!r} rank {rank} declares a spec that differs from rank {other_rank}'s",
                    )
            self._pending[key] = spec
        try:
            entry = self._build(engine_id, rank, spec, handles)
        except BaseException:
            with self._lock:
                del self._pending[key]
            raise
        with self._lock:
            del self._pending[key]
            self._ranks[key] = entry
        return entry

    def _build(
        self, engine_id: str, rank: int, spec: EngineSpec, handles: list[common_pb2.TensorHandle]
    ) -> RankEntry:
        expected = spec.rank_tensor_shapes()
        if len(handles) != len(expected):
            raise SidecarError(
                Code.INVALID_ARGUMENT,
                f"spec needs {len(expected)} tensors ({'one cross-layer' if spec.cross_layer else 'one per layer'}), "
                f"got {len(handles)}",
            )
        kinds = {h.WhichOneof("memory") for h in handles}
        if len(kinds) != 1 or None in kinds:
            raise SidecarError(
                Code.INVALID_ARGUMENT,
                f"every tensor of a rank must be in one kind of memory (shm or cuda_ipc), got {sorted(map(str, kinds))}",
            )
        for i, (h, shape) in enumerate(zip(handles, expected, strict=True)):
            if tuple(h.shape) != shape:
                raise SidecarError(
                    Code.INVALID_ARGUMENT,
                    f"tensor {i}: shape {list(h.shape)} does not match the spec's {list(shape)}",
                )
            if h.dtype != spec.dtype:
                raise SidecarError(
                    Code.INVALID_ARGUMENT, f"tensor {i}: dtype {h.dtype} but the spec says {spec.dtype}"
                )
        if kinds == {"cuda_ipc"}:
            entry = self._build_gpu(engine_id, rank, spec, handles)
        else:
            entry = self._build_host(engine_id, rank, spec, handles)
        log.info(
            "registered engine %s rank %d (%s, %s, %d bytes)",
            engine_id,
            rank,
            spec.layout.value,
            entry.memory_kind,
            spec.rank_bytes(),
        )
        return entry

    def _build_host(
        self, engine_id: str, rank: int, spec: EngineSpec, handles: list[common_pb2.TensorHandle]
    ) -> RankEntry:
        tensors: list[torch.Tensor] = []
        names: list[str] = []
        try:
            for h in handles:
                tensors.append(self._shm.map_tensor(h.shm.name, h.shm.offset, h.shape, h.strides, h.dtype))
                names.append(h.shm.name)
            view = rank_view(spec, rank, tensors)
            _check_disjoint(spec, handles)
        except BaseException:
            for n in names:
                self._shm.release(n)
            raise
        entry = RankEntry(engine_id, rank, spec, tensors, names, view, chunk_geometry(spec))
        if self._nixl is not None:
            entry.nixl_key = self._nixl.register(entry.regions)
        return entry

    def _build_gpu(
        self, engine_id: str, rank: int, spec: EngineSpec, handles: list[common_pb2.TensorHandle]
    ) -> RankEntry:
        # Imported lazily: a CPU-only sidecar never loads the CUDA driver bindings.
        try:
            from kv_sidecar.memory.gpu_rank import GpuRank, IpcTensorRef
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
        _check_disjoint(spec, handles)
        refs = [IpcTensorRef(h.cuda_ipc.handle, h.cuda_ipc.offset, h.cuda_ipc.device_uuid) for h in handles]
        try:
            gpu = GpuRank(spec, rank, refs)
        except CudaIpcError as e:
            raise SidecarError(
                Code.FAILED_PRECONDITION, f"cannot map rank {rank}'s GPU memory: {e}"
            ) from None
        if self._on_gpu_device is not None:
            try:
                self._on_gpu_device(gpu.device)
            except BaseException:
                gpu.close()
                raise
        return RankEntry(engine_id, rank, spec, [], [], None, chunk_geometry(spec), gpu=gpu)

    def unregister(self, engine_id: str, rank: int) -> RankEntry:
        with self._lock:
            entry = self._ranks.get((engine_id, rank))
            if entry is None:
                raise SidecarError(Code.NOT_FOUND, f"engine {engine_id!r} rank {rank} is not registered")
            del self._ranks[(engine_id, rank)]
        if self._nixl is not None:
            if entry.local_dlist is not None:
                self._nixl.release_dlist(entry.local_dlist)
            if entry.nixl_key is not None:
                self._nixl.deregister(entry.nixl_key)
        entry.tensors.clear()
        if entry.gpu is not None:
            entry.gpu.close()  # deferred while a copy still reads or writes the mappings
        for n in entry.shm_names:
            self._shm.release(n)
        entry.emit(None)  # ends any open event stream
        log.info("unregistered engine %s rank %d", engine_id, rank)
        return entry

    def get(self, engine_id: str, rank: int) -> RankEntry:
        entry = self._ranks.get((engine_id, rank))
        if entry is None:
            with self._lock:
                known = any(eid == engine_id for eid, _ in [*self._ranks, *self._pending])
            if known:
                raise SidecarError(Code.NOT_FOUND, f"engine {engine_id!r} has no rank {rank} registered here")
            raise SidecarError(
                Code.NOT_FOUND, f"unknown engine {engine_id!r}: no rank of it is registered here"
            )
        return entry

    def engine_ranks(self, engine_id: str) -> list[RankEntry]:
        with self._lock:
            ranks = sorted(
                (e for (eid, _), e in self._ranks.items() if eid == engine_id),
                key=lambda e: e.rank,
            )
        if not ranks:
            raise SidecarError(
                Code.NOT_FOUND, f"unknown engine {engine_id!r}: no rank of it is registered here"
            )
        return ranks

    def ranks_of(self, engine_id: str) -> list[int]:
        """The ranks of this engine registered here, in order; empty if none."""
        with self._lock:
            return sorted(r for eid, r in self._ranks if eid == engine_id)

    def spec(self, engine_id: str) -> EngineSpec:
        return self.engine_ranks(engine_id)[0].spec

    def all(self) -> list[RankEntry]:
        with self._lock:
            return list(self._ranks.values())

    def close(self) -> None:
        for e in self.all():
            with contextlib.suppress(SidecarError, PlanError):
                self.unregister(e.engine_id, e.rank)


def _check_disjoint(spec: EngineSpec, handles: list[common_pb2.TensorHandle]) -> None:
    """Refuse a rank whose tensors share bytes: the sidecar would move one layer's data as another's
    (two layers that share a cache must be registered once: the engine's description is wrong)."""
    spans = []
    for i, h in enumerate(handles):
        memory = h.WhichOneof("memory")
        where = h.shm.name if memory == "shm" else h.cuda_ipc.handle
        offset = h.shm.offset if memory == "shm" else h.cuda_ipc.offset
        size = spec.element_size * math.prod(h.shape)
        spans.append((where, offset, offset + size, i))
    spans.sort()
    for (where, _, end, i), (other, start, _, j) in itertools.pairwise(spans):
        if where == other and start < end:
            raise SidecarError(
                Code.INVALID_ARGUMENT,
                f"tensors {min(i, j)} and {max(i, j)} overlap in their memory: each tensor the spec "
                "describes must have bytes of its own",
            )
