"""Registered engine ranks: their spec and where their memory lives (the data plane maps it)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kv_sidecar.dataplane.jobs import IpcTensorRef, RankKey, RankMemory, ShmTensor
from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.mailbox import Mailbox
from kv_sidecar.plan.chunks import ChunkGeometry, chunk_geometry
from kv_sidecar.plan.spec import EngineSpec, KVGroupSpec, PlanError, StateArray, StateSegment
from kv_sidecar_client._proto.kvsidecar.v1 import common_pb2, engine_pb2

log = logging.getLogger(__name__)


def spec_from_proto(msg: common_pb2.EngineSpec) -> EngineSpec:
    """The spec a message describes. Every staged Push names its reader's spec: each distinct one is
    built and validated once (~30 us a pull otherwise)."""
    return _spec_of(msg.SerializeToString(deterministic=True))


@functools.lru_cache(maxsize=256)
def _spec_of(data: bytes) -> EngineSpec:
    return _build_spec(common_pb2.EngineSpec.FromString(data))


def _build_spec(msg: common_pb2.EngineSpec) -> EngineSpec:
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
        groups=tuple(
            KVGroupSpec(
                tuple(g.layers),
                g.sliding_window,
                tuple(
                    StateArray(
                        a.name,
                        tuple(a.shape),
                        a.dtype,
                        a.offset,
                        a.tp_dim,
                        tuple(StateSegment(s.size, s.replicated) for s in a.segments),
                    )
                    for a in g.state
                ),
            )
            for g in msg.groups
        ),
    )


@functools.lru_cache(maxsize=256)
def spec_to_proto(spec: EngineSpec) -> common_pb2.EngineSpec:
    """The message of a spec, built once per spec (a Push carries one on every pull). Shared: callers
    put it into their message (which copies it) and never change it."""
    d = spec.to_dict()
    d["kernel_block_size"] = d["kernel_block_size"] or 0
    groups = d.pop("groups", [])
    return common_pb2.EngineSpec(**d, groups=[common_pb2.KVCacheGroup(**g) for g in groups])


_GENERATIONS = itertools.count(1)


def generations(entries: Iterable[RankEntry]) -> dict[int, int]:
    """Each rank -> which registration of it the entry is (RankEntry.generation): what a published
    request records, and what a read checks against it (Published.check_sources)."""
    return {e.rank: e.generation for e in entries}


@dataclass
class RankEntry:
    """A registered rank as the control plane knows it: its spec and where its memory lives. The
    mappings themselves are the data plane's (dataplane/ranks.py), found by `key`."""

    engine_id: str
    rank: int
    spec: EngineSpec
    geometry: ChunkGeometry
    memory: RankMemory
    events: Mailbox[engine_pb2.Event | None] = field(default_factory=Mailbox)
    sessions: int = 0
    # Which registration of (engine_id, rank) this is, unique in this process: a request published
    # under one is not in the memory of the next (a restarted process, a rank that moved here), whose
    # blocks of the same ids hold other bytes (Published.check_sources).
    generation: int = field(default_factory=lambda: next(_GENERATIONS))

    @functools.cached_property
    def key(self) -> RankKey:
        """Made once: a pull asks for it many times (a frozen dataclass costs ~1-2 us to make)."""
        return RankKey(self.engine_id, self.rank)

    @property
    def on_gpu(self) -> bool:
        return self.memory.on_gpu

    @property
    def regions(self) -> list[tuple[int, int, int]]:
        return list(self.memory.regions)

    @property
    def memory_kind(self) -> str:
        """NIXL's name for where the rank lives."""
        return self.memory.kind

    def emit(self, event: engine_pb2.Event | None) -> None:
        """An event for the rank's event streams; None ends them (the rank is unregistered)."""
        self.events.put(event)


class RankMemories(Protocol):
    """Where a registered rank's memory is mapped: the data plane (`DataPlane`)."""

    def attach_host(self, key: RankKey, spec: EngineSpec, tensors: list[ShmTensor]) -> RankMemory: ...

    def attach_gpu(self, key: RankKey, spec: EngineSpec, refs: list[IpcTensorRef]) -> RankMemory: ...

    def detach(self, key: RankKey) -> None: ...


def shm_tensors(handles: Sequence[common_pb2.TensorHandle]) -> list[ShmTensor]:
    """A host rank's tensors as its engine registers them (`TensorHandle.shm`), as the data plane maps them."""
    return [ShmTensor(h.shm.name, h.shm.offset, tuple(h.shape), tuple(h.strides), h.dtype) for h in handles]


class EngineRegistry:
    """Thread-safe map of (engine_id, rank) to RankEntry."""

    def __init__(self, memory: RankMemories) -> None:
        self._memory = memory  # the data plane's mappings: registering a rank maps it there
        self._lock = threading.Lock()
        self._ranks: dict[tuple[str, int], RankEntry] = {}
        # Ranks being mapped (register() outside the lock), with their specs: a concurrent duplicate or
        # a differing spec of the same engine fails fast, and readers of _ranks see only built entries.
        self._pending: dict[tuple[str, int], EngineSpec] = {}

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
        memory = self._memory.attach_host(RankKey(engine_id, rank), spec, shm_tensors(handles))
        return RankEntry(engine_id, rank, spec, chunk_geometry(spec), memory)

    def _build_gpu(
        self, engine_id: str, rank: int, spec: EngineSpec, handles: list[common_pb2.TensorHandle]
    ) -> RankEntry:
        refs = [IpcTensorRef(h.cuda_ipc.handle, h.cuda_ipc.offset, h.cuda_ipc.device_uuid) for h in handles]
        memory = self._memory.attach_gpu(RankKey(engine_id, rank), spec, refs)
        return RankEntry(engine_id, rank, spec, chunk_geometry(spec), memory)

    def unregister(self, engine_id: str, rank: int) -> RankEntry:
        with self._lock:
            entry = self._ranks.get((engine_id, rank))
            if entry is None:
                raise SidecarError(Code.NOT_FOUND, f"engine {engine_id!r} rank {rank} is not registered")
            del self._ranks[(engine_id, rank)]
        self._memory.detach(entry.key)
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
