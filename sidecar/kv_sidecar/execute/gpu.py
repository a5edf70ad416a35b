"""GPU executor: carry out one decode rank's read of a request with one Triton kernel launch.

Same contract as `kv_sidecar.execute.host.copy_request` (tokens
[start_token, num_tokens) of global heads `heads`, every layer and K/V plane,
any layout / block size / kernel block size / cross-layer on either side,
nothing outside the destination tokens written), but on raw device addresses:
both views are memory imported over CUDA IPC into the primary context of the
GPU that runs the copy (`kv_sidecar.memory.cuda_ipc`), or memory the sidecar
owns there. One launch per (request, source rank) replaces what would be
tens of thousands of per-block copies.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch

from kv_sidecar.execute import gpu_geometry as geo
from kv_sidecar.plan.blocks import BlockIds, check_copy, dst_block_count, local_heads
from kv_sidecar.plan.spec import EngineSpec, PlanError

# Bytes moved per program: large enough that each program keeps several 16-byte
# loads per thread in flight over NVLink, small enough for many programs per SM.
TILE_BYTES = 16384
NUM_WARPS = 4

_WORD_DTYPE = {4: torch.int32, 2: torch.int16, 1: torch.uint8}
# Launch templates kept per device: staged geometries (engine rank x reader layout) and, per
# geometry, (slot, blocks) pairs; direct (source view, destination view, heads) triples, also at
# most _MAX_TEMPLATES. Past a bound the templates are computed again (~0.1 ms each).
_MAX_GEOMETRIES = 64
_MAX_TEMPLATES = 1024
_MAX_RUNS = 4096  # kept views of id runs (`_DeviceState.run`)


class HasDataPtr(Protocol):
    def data_ptr(self) -> int: ...


@dataclass(frozen=True)
class GpuRankView:
    """One rank's registered KV tensors as addresses valid in `device`'s primary context.

    `tensor_ptrs` are the registered tensors' addresses (per layer, or one
    cross-layer tensor), `layer_ptrs` every layer's element 0. `keepalive`
    holds whatever owns the memory (IPC imports, torch tensors) for as long as
    the view lives.
    """

    spec: EngineSpec
    rank: int
    device: int
    tensor_ptrs: tuple[int, ...]
    layer_ptrs: tuple[int, ...]
    keepalive: tuple[Any, ...] = field(default=(), repr=False, compare=False)


def gpu_rank_view(
    spec: EngineSpec, rank: int, tensors: Sequence[HasDataPtr | int], device: int | torch.device
) -> GpuRankView:
    """A view over a rank's tensors (torch CUDA tensors, `ImportedTensor`s or raw addresses).

    Sizes cannot be checked from a raw address: callers importing over IPC
    check each tensor's byte size against `gpu_geometry.tensor_nbytes(spec)`.
    """
    if not 0 <= rank < spec.tp_size:
        raise PlanError(f"rank {rank} out of range for tp_size {spec.tp_size}")
    ordinal = device.index if isinstance(device, torch.device) else int(device)
    if ordinal is None:
        raise PlanError("a GPU view needs a device index")
    ptrs: list[int] = []
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor):
            _check_torch_tensor(spec, rank, i, t, ordinal)
        ptrs.append(t if isinstance(t, int) else t.data_ptr())
    layer_ptrs = geo.layer_addresses(spec, ptrs)
    keep = tuple(t for t in tensors if not isinstance(t, int))
    return GpuRankView(spec, rank, ordinal, tuple(ptrs), layer_ptrs, keep)


def _check_torch_tensor(spec: EngineSpec, rank: int, i: int, t: torch.Tensor, device: int) -> None:
    shape = spec.rank_tensor_shapes()[i] if i < len(spec.rank_tensor_shapes()) else None
    if tuple(t.shape) != shape:
        raise PlanError(f"rank {rank} tensor {i}: shape {tuple(t.shape)} does not match spec {shape}")
    if t.dtype != getattr(torch, spec.dtype):
        raise PlanError(f"rank {rank} tensor {i}: dtype {t.dtype} does not match spec {spec.dtype}")
    if not t.is_contiguous():
        raise PlanError(f"rank {rank} tensor {i}: must be contiguous (strides {t.stride()})")
    if t.device.type != "cpu" and t.device != torch.device("cuda", device):
        raise PlanError(f"rank {rank} tensor {i}: on {t.device}, the view is for cuda:{device}")


def staging_view(
    spec: EngineSpec, rank: int, buffer: HasDataPtr | int, num_blocks: int, device: int
) -> GpuRankView:
    """A contiguous mini-cache of `num_blocks` blocks shaped like (spec, rank): a staging buffer.

    Gather = copy_request(engine_view, staging, ..., dst_block_ids=range(n));
    scatter = copy_request(staging, engine_view, ..., src_block_ids=range(n)).
    The staged cross-sidecar path moves the one buffer (all layers, one
    descriptor) in between; the conversion happens in the gather or scatter.
    """
    mini = replace(spec, num_blocks=num_blocks)
    base = buffer if isinstance(buffer, int) else buffer.data_ptr()
    n = geo.tensor_nbytes(mini)
    ptrs = [base] if mini.cross_layer else [base + i * n for i in range(mini.num_layers)]
    keep = () if isinstance(buffer, int) else (buffer,)
    return GpuRankView(mini, rank, device, tuple(ptrs), geo.layer_addresses(mini, ptrs), keep)


@functools.lru_cache(maxsize=1024)
def staging_bytes(spec: EngineSpec, num_blocks: int) -> int:
    """Bytes a `staging_view` of `num_blocks` blocks needs (both ends of every staged pull ask)."""
    mini = replace(spec, num_blocks=num_blocks)
    return geo.tensor_nbytes(mini) * len(mini.rank_tensor_shapes())


class _DeviceState:
    """Per-device things reused across requests: anchors (one per word width), layer tables, the
    staged copies' launch templates and a shared 0..n-1 index table."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._anchors: dict[tuple[str, int], torch.Tensor] = {}
        self._tables: dict[tuple[str, int, tuple[int, ...]], torch.Tensor] = {}
        self._templates: dict[tuple[Any, ...], dict[tuple[int, int], _Template]] = {}
        self._direct: dict[tuple[Any, ...], _Template] = {}
        self._aranges: dict[str, torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []  # outgrown aranges (each at most half the next)
        self._runs: dict[tuple[str, int, int], torch.Tensor] = {}
        self._streams: dict[str, Any] = {}

    def anchor(self, device: torch.device, width: int) -> torch.Tensor:
        key = (str(device), width)
        with self._lock:
            if key not in self._anchors:
                self._anchors[key] = torch.zeros(64 // width, dtype=_WORD_DTYPE[width], device=device)
            return self._anchors[key]

    def layer_table(self, device: torch.device, width: int, layer_ptrs: tuple[int, ...]) -> torch.Tensor:
        """Word offsets of each layer from the anchor, on the device; cached (a view's layers never move)."""
        key = (str(device), width, layer_ptrs)
        with self._lock:
            table = self._tables.get(key)
        if table is None:
            base = self.anchor(device, width).data_ptr()
            table = torch.tensor([(p - base) // width for p in layer_ptrs], dtype=torch.int64).to(device)
            with self._lock:
                if len(self._tables) > 4096:  # views come and go with engines; stay bounded
                    self._tables.clear()
                self._tables[key] = table
        return table

    def templates(self, geometry: tuple[Any, ...]) -> dict[tuple[int, int], _Template]:
        """The launch templates of one transfer geometry, by (slot address, blocks): shared by every
        transfer of that geometry. The key holds everything a template is computed from."""
        with self._lock:
            found = self._templates.get(geometry)
            if found is None:
                if len(self._templates) >= _MAX_GEOMETRIES:  # they come and go with engines: stay bounded
                    self._templates.clear()
                found = self._templates[geometry] = {}
            return found

    def direct(self, key: tuple[Any, ...], compute: Callable[[], _Template]) -> _Template:
        """The launch template of one direct copy geometry (source view, destination view, heads)."""
        with self._lock:
            found = self._direct.get(key)
        if found is None:
            found = compute()
            with self._lock:
                if len(self._direct) >= _MAX_TEMPLATES:  # views come and go with engines: stay bounded
                    self._direct.clear()
                self._direct[key] = found
        return found

    def side_stream(self, device: torch.device) -> Any:
        """A kept stream per device for uploads ahead of time (never the legacy default stream, which
        would wait for every copy on the device)."""
        key = str(device)
        with self._lock:
            stream = self._streams.get(key)
            if stream is None:
                stream = self._streams[key] = torch.cuda.Stream(device)
            return stream

    def arange(self, device: torch.device, n: int) -> torch.Tensor:
        """int32 0..n-1 on the device, a view of one table grown by doubling and ready to read."""
        key = str(device)
        with self._lock:
            table = self._aranges.get(key)
            if table is None or table.numel() < n:
                if table is not None:
                    # Launches queued on any stream may still read it: never handed back to the allocator.
                    self._retired.append(table)
                table = torch.arange(max(1024, 1 << (n - 1).bit_length()), dtype=torch.int32, device=device)
                if device.type == "cuda":
                    # Readers on any stream may use it from now on: wait for it once, here.
                    torch.cuda.current_stream(device).synchronize()
                self._aranges[key] = table
        return table[:n]

    def run(self, device: torch.device, first: int, n: int) -> torch.Tensor:
        """int32 first..first+n-1 on the device: a view of the arange table, kept (a view costs
        microseconds to make, and the same runs, one-block pulls' above all, come back)."""
        key = (str(device), first, n)
        view = self._runs.get(key)
        if view is None:
            view = self.arange(device, first + n)[first:]
            with self._lock:
                if len(self._runs) >= _MAX_RUNS:
                    self._runs.clear()
                self._runs[key] = view
        return view


@dataclass
class _Template:
    """What a launch needs besides its ids, first block positions and token counts (a direct copy's,
    or a staged chunk's)."""

    la: LaunchArgs
    tables: tuple[torch.Tensor, torch.Tensor]
    anchor: torch.Tensor
    ready: Any  # a CUDA event after the layer tables' upload (None: interpreted)
    chunks_per_token: int  # a chunk's work items and bytes scale with its tokens
    bytes_per_token: int
    settled: bool = False  # `ready` has completed: no stream needs to wait for it any more
    # Streams its tables are recorded on: allocated on another stream, the memory of a table dropped
    # from the caches must not be reused while a launch queued here may still read it.
    streams: set[Any] = field(default_factory=set)

    def pending(self) -> Any:
        """The event a launch must wait for while the layer tables may still be on their way up, else None."""
        if self.settled:
            return None
        if self.ready.query():
            self.settled = True
            return None
        return self.ready


_state = _DeviceState()


@dataclass(frozen=True)
class LaunchArgs:
    """Everything one launch needs, decided on the host (exposed for tests and the bench)."""

    width: int
    align: int
    chunk: int
    rows: int
    n_chunks: int
    planes: int
    args: tuple[Any, ...]
    constexprs: dict[str, int]
    num_warps: int


def copy_request(
    src: GpuRankView,
    dst: GpuRankView,
    heads: tuple[int, int] | None,
    src_block_ids: BlockIds,
    dst_block_ids: BlockIds,
    num_tokens: int,
    start_token: int = 0,
    *,
    stream: torch.cuda.Stream | None = None,
    synchronize: bool = True,
    interpret: bool = False,
) -> int:
    """Copy tokens [start_token, num_tokens) of global heads `heads` from src into dst; return bytes written.

    Block id conventions are the host executor's: `dst_block_ids` covers tokens
    [start_token, num_tokens); `src_block_ids` covers all tokens or only the
    blocks from the start token's block on (the length says which). The ids go
    up and the launch goes on `stream` (default: the current stream of dst's
    device); with `synchronize` the call returns once the data is in place.
    `interpret` runs Triton's CPU interpreter over host addresses (tests without a GPU).
    """
    prepared = prepare_request(
        src,
        dst,
        heads,
        src_block_ids,
        dst_block_ids,
        num_tokens,
        start_token,
        stream=stream,
        interpret=interpret,
    )
    prepared.launch(stream)
    if synchronize and not interpret:
        (stream or torch.cuda.current_stream(prepared.device)).synchronize()
    return prepared.nbytes


@dataclass
class PreparedCopy:
    """A validated request with its index tables on their way to the device: `launch()` only enqueues."""

    launch_args: LaunchArgs
    device: torch.device
    anchor: torch.Tensor
    tables: tuple[torch.Tensor, ...]  # source and destination layer tables, source and destination ids
    nbytes: int
    interpret: bool = False
    stream: Any = None  # where the ids went up (None: the device's current stream)
    ready: Any = None  # an event after the layer tables' upload, while it may still be running

    def launch(self, stream: torch.cuda.Stream | None = None) -> None:
        from kv_sidecar.execute import gpu_kernels

        la = self.launch_args
        if la.n_chunks == 0:
            return
        grid = (triton_cdiv(la.n_chunks, la.rows), la.planes)
        if self.interpret:
            gpu_kernels.interpreted(gpu_kernels.kv_copy_kernel)[grid](
                self.anchor, *self.tables, *la.args, **la.constexprs
            )
            return
        with torch.cuda.device(self.device):
            current = torch.cuda.current_stream(self.device)
            upload = self.stream if self.stream is not None else current
            s = stream if stream is not None else upload
            if s != upload:
                s.wait_stream(upload)
            if self.ready is not None:
                s.wait_event(self.ready)
            gpu_kernels.launch(grid, s, (self.anchor, *self.tables), la.args, la.constexprs, la.num_warps)
            if s != upload or s != current:
                # The ids were allocated on the upload stream, the layer tables (typically) on the
                # current one: keep their memory from reuse until `s` is done with it.
                for t in self.tables:
                    t.record_stream(s)


def prepare_request(
    src: GpuRankView,
    dst: GpuRankView,
    heads: tuple[int, int] | None,
    src_block_ids: BlockIds,
    dst_block_ids: BlockIds,
    num_tokens: int,
    start_token: int = 0,
    *,
    stream: torch.cuda.Stream | None = None,
    interpret: bool = False,
) -> PreparedCopy:
    """Validate a request exactly as the host executor does and start its ids' upload on `stream`.

    Everything else a launch needs (tiling, strides, layer tables) is a template kept per (source
    view, destination view, heads): pull after pull between the same two ranks needs the same.
    """
    if src.device != dst.device:
        raise PlanError(
            f"both views must be mapped in one device's context (src {src.device}, dst {dst.device})"
        )
    # An out-of-range block id would make the kernel fault, and a fault poisons the whole context.
    shape = check_copy(
        src.spec, src.rank, dst.spec, dst.rank, heads, src_block_ids, dst_block_ids, num_tokens, start_token
    )
    nh, s_h0, d_h0 = shape.num_heads, shape.src_head0, shape.dst_head0
    dev = torch.device("cpu") if interpret else torch.device("cuda", dst.device)
    tpl = _direct_template(src, dst, nh, s_h0, d_h0, dev, interpret)
    n_chunks = (num_tokens - start_token) * tpl.chunks_per_token
    args = (n_chunks, start_token, shape.src_first, start_token // dst.spec.block_size, *tpl.la.args[4:])
    la = replace(tpl.la, n_chunks=n_chunks, args=args)
    grid = (triton_cdiv(n_chunks, la.rows), la.planes)
    if grid[0] > 2**31 - 1 or grid[1] > 65535:
        raise PlanError(f"request too large for one launch (grid {grid})")
    tables = (*tpl.tables, *_device_ids(src_block_ids, dst_block_ids, dev, stream))
    nbytes = (num_tokens - start_token) * tpl.bytes_per_token
    return PreparedCopy(la, dev, tpl.anchor, tables, nbytes, interpret, stream, tpl.pending())


def _run_start(ids: np.ndarray) -> int | None:
    """ids[0] where the ids are one ascending run (ids[i] == ids[0] + i), else None; 0 for no ids
    (nothing to upload either)."""
    n = ids.size
    if n == 0:
        return 0
    first = int(ids[0])
    if first < 0 or int(ids[-1]) - first != n - 1:
        return None
    if n > 2 and not bool((np.diff(ids) == 1).all()):
        return None
    return first


def _device_ids(
    src_block_ids: BlockIds, dst_block_ids: BlockIds, dev: torch.device, stream: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both id lists as int32 on `dev`. A side whose ids are one ascending run (one block, or blocks
    allocated in a row) is a view of the device's 0..n-1 table, already there, not an upload: pulls
    in flight together then no longer wait for each other's uploads (16 one-block gpu-direct Pull
    calls in flight 1.31x the pulls/s; a lone pull did not gain: docs/benchmarks.md, thirtieth
    session). The others go up in one copy on `stream` (`_upload_ids`)."""
    src = np.asarray(src_block_ids, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_block_ids, dtype=np.int64).reshape(-1)
    s0, d0 = _run_start(src), _run_start(dst)
    if s0 is None and d0 is None:
        return _upload_ids(src, dst, dev, stream)
    if s0 is not None and d0 is not None:
        return _state.run(dev, s0, src.size), _state.run(dev, d0, dst.size)
    up_src, up_dst = _upload_ids(src if s0 is None else (), dst if d0 is None else (), dev, stream)
    return (
        up_src if s0 is None else _state.run(dev, s0, src.size),
        up_dst if d0 is None else _state.run(dev, d0, dst.size),
    )


def _upload_ids(
    src_block_ids: BlockIds, dst_block_ids: BlockIds, dev: torch.device, stream: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both id lists as int32 on `dev`, in one copy uploaded on `stream`; the destination's start
    16-byte aligned so that the launch specialises the same way. A pageable copy: through torch's
    pinned-memory allocator the same upload took longer (bench/launch_cost.py). Non-blocking: a
    blocking `.to()` synchronises the stream after the copy, so each member of a batch waited for
    the kernels launched before it; from pageable memory the driver has taken the bytes when the
    call returns, and the launches that read the ids go on the same stream, after the copy."""
    n_src = len(src_block_ids)
    d0 = n_src + (-n_src % 4)
    host = np.zeros(d0 + len(dst_block_ids), dtype=np.int32)
    host[:n_src] = np.asarray(src_block_ids, dtype=np.int64).reshape(-1)
    host[d0:] = np.asarray(dst_block_ids, dtype=np.int64).reshape(-1)
    if dev.type != "cuda" or stream is None:
        ids = torch.from_numpy(host).to(dev, non_blocking=True)  # on dev's current stream
    else:
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            ids = torch.from_numpy(host).to(dev, non_blocking=True)
    return ids[:n_src], ids[d0:]


def upload_block_ids(block_ids: BlockIds, device: int) -> torch.Tensor:
    """A request's block ids as int32 on a GPU, ready for any stream: uploaded ahead of a transfer
    (a published request, before its reader asks), off the transfer's critical path. On a side stream
    of its own, waited for here: the caller is a background thread."""
    dev = torch.device("cuda", device)
    stream = _state.side_stream(dev)
    with torch.cuda.device(dev), torch.cuda.stream(stream):
        ids = torch.from_numpy(np.asarray(block_ids, dtype=np.int32).reshape(-1)).to(dev)
    stream.synchronize()
    return ids


def _direct_template(
    src: GpuRankView, dst: GpuRankView, nh: int, s_h0: int, d_h0: int, dev: torch.device, interpret: bool
) -> _Template:
    """The launch template between two views for these heads, kept per device (what a pull's copy and
    a registration's warm-up both ask for)."""
    key = (dev, src.spec, src.layer_ptrs, dst.spec, dst.layer_ptrs, nh, s_h0, d_h0)
    return _state.direct(key, lambda: _template(src, dst, nh, s_h0, d_h0, dev, interpret))


def _template(
    src: GpuRankView, dst: GpuRankView, nh: int, s_h0: int, d_h0: int, dev: torch.device, interpret: bool
) -> _Template:
    """The launch template between two views: a launch's tiling, strides and word width depend on the
    views and heads only, so it is planned for one token; each launch scales the work items and
    fills in its own positions."""
    la = plan_launch(src, dst, nh, s_h0, d_h0, 1, 0, 0, 0)
    tables = (
        _state.layer_table(dev, la.width, src.layer_ptrs),
        _state.layer_table(dev, la.width, dst.layer_ptrs),
    )
    ready = None
    if not interpret:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(dev))  # after a layer table's upload
    per_token = nh * geo.row_bytes(dst.spec) * la.planes
    return _Template(la, tables, _state.anchor(dev, la.width), ready, la.n_chunks, per_token, interpret)


def warm_up(view: GpuRankView) -> bool:
    """Compile the kernel of copies between two ranks shaped like `view` before the first pull needs
    it: a homogeneous pairing's gpu-direct copies, and the staged gather and scatter between the rank
    and a ring in its own layout, which specialise the same way (gpu_kernels._INTS: not on a pull's
    length or start). True if it compiled (False: it already was)."""
    heads = None if view.spec.is_mla else view.spec.rank_heads(view.rank)
    return warm_copy(view, view, heads, view.device)


def warm_copy(src: GpuRankView, dst: GpuRankView, heads: tuple[int, int] | None, device: int) -> bool:
    """Compile the kernel of copies of global heads `heads` (None: MLA) from rank `src` into rank `dst`
    on `device` (the destination's), before the first such pull needs it: a pairing of two ranks of
    different block sizes, layouts or TP compiles a kernel of its own (0.3 s on one H200 after the process's
    first compile, with Triton's cache empty: bench/worker_cost.py --decode-block-size 32).

    The views may be mapped on any device: the kernel specialises on their specs, the heads and the
    word width their addresses allow, not on the addresses themselves, and a rank's mapping in
    another device's context keeps its alignment (CUDA IPC maps whole allocations). True if it
    compiled (False: it already was)."""
    from kv_sidecar.execute import gpu_kernels

    s_h0, nh = local_heads(src.spec, src.rank, heads, "source")
    d_h0, _ = local_heads(dst.spec, dst.rank, heads, "destination")
    dev = torch.device("cuda", device)
    la = plan_launch(src, dst, nh, s_h0, d_h0, 1, 0, 0, 0)
    # Only the tables' dtype and alignment count here: the destination's stands for both.
    table = _state.layer_table(dev, la.width, dst.layer_ptrs)
    # Sized for every block id of both ranks now, so that no pull's ids that form a run
    # (`_device_ids`) grow it, and wait for it, on its way.
    ids = _state.arange(dev, max(src.spec.num_blocks, dst.spec.num_blocks))
    pointers = (_state.anchor(dev, la.width), table, table, ids, ids)
    return gpu_kernels.launch.warm(device, pointers, la.args, la.constexprs, la.num_warps)


def plan_launch(
    src: GpuRankView,
    dst: GpuRankView,
    nh: int,
    s_h0: int,
    d_h0: int,
    num_tokens: int,
    start_token: int,
    src_first: int,
    dst_first: int,
) -> LaunchArgs:
    """Word width, vector alignment, tiling and scalar arguments of one launch."""
    specs = (src.spec, dst.spec)
    addresses = (*src.layer_ptrs, *dst.layer_ptrs)
    width = geo.word_bytes(specs, addresses)
    align = geo.vector_words(specs, addresses, width)
    row_words = geo.row_bytes(src.spec) // width
    chunk = geo.chunk_words(row_words)
    nc = row_words // chunk
    rows = max(1, min(1024, TILE_BYTES // (chunk * width)))
    rows = 1 << (rows.bit_length() - 1)  # Triton tiles are powers of two
    ss, ds = geo.strides(src.spec), geo.strides(dst.spec)
    es = src.spec.element_size
    if es % width and any(s * es % width for s in (ss.kv, ss.block, ss.token, ss.head, ds.kv, ds.block)):
        raise PlanError("internal: strides are not whole words")

    def words(n: int) -> int:
        return n * es // width

    n_chunks = (num_tokens - start_token) * nh * nc
    planes = src.spec.num_layers * (2 if not src.spec.is_mla else 1)
    args = (
        n_chunks,
        start_token,
        src_first,
        dst_first,
        s_h0,
        d_h0,
        words(ss.kv),
        words(ss.block),
        words(ss.token),
        words(ss.head),
        words(ds.kv),
        words(ds.block),
        words(ds.token),
        words(ds.head),
    )
    constexprs = {
        "NKV": 1 if src.spec.is_mla else 2,
        "NH": nh,
        "NC": nc,
        "CHUNK": chunk,
        "ROWS": rows,
        "ALIGN": min(align, chunk),
        "S_BS": src.spec.block_size,
        "S_KBS": src.spec.physical_block_size,
        "D_BS": dst.spec.block_size,
        "D_KBS": dst.spec.physical_block_size,
    }
    return LaunchArgs(width, align, chunk, rows, n_chunks, planes, args, constexprs, NUM_WARPS)


class StagedCopies:
    """The copies of one staged transfer between an engine rank and staging slots, chunk by chunk.

    `into_staging`: gather (engine -> staging, the source sidecar); otherwise
    scatter (staging -> engine, the reader). A chunk is tokens [t0, t1) of whole
    staging blocks; its staging side is a `staging_view` of the chunk's blocks at
    a slot's address, so the bytes of a chunk are one contiguous descriptor.

    The whole request is validated once here exactly as `prepare_request`
    validates one copy (a bad id must never reach the kernel), and the engine
    side's block ids are uploaded once, on the transfer's own stream (unless they
    come uploaded: a source's published request, `uploaded_ids`); `launch`
    then only fills in a chunk's positions and enqueues the kernel: no per-chunk
    validation, upload or host synchronisation. What a launch needs besides
    (layer tables, tiling, strides) is a template shared by every transfer of the
    same geometry, per (slot, blocks): a transfer's host time is what paces a
    small pull, and the same slots and sizes come back pull after pull.
    """

    def __init__(
        self,
        engine: GpuRankView,
        staging_spec: EngineSpec,
        staging_rank: int,
        heads: tuple[int, int] | None,
        engine_block_ids: BlockIds,
        num_tokens: int,
        start_token: int = 0,
        *,
        into_staging: bool,
        interpret: bool = False,
        uploaded_ids: torch.Tensor | None = None,
    ) -> None:
        self.engine = engine
        self.staging_spec = staging_spec
        self.staging_rank = staging_rank
        self.into_staging = into_staging
        self.interpret = interpret
        self.num_tokens = num_tokens
        self.start_token = start_token
        bd = staging_spec.block_size
        total = dst_block_count(bd, num_tokens, start_token)
        whole = replace(staging_spec, num_blocks=max(1, total))  # the request as one staging mini-cache
        ids = np.asarray(engine_block_ids, dtype=np.int64).reshape(-1)
        stage_ids = np.arange(total, dtype=np.int64)
        if into_staging:
            shape = check_copy(
                engine.spec, engine.rank, whole, staging_rank, heads, ids, stage_ids, num_tokens, start_token
            )
            self._engine_first = shape.src_first  # block number of ids[0] (0, or the tail form's first)
        else:
            # Staging ids in the tail form (from the start token's block on), the engine's covering the request.
            shape = check_copy(
                whole, staging_rank, engine.spec, engine.rank, heads, stage_ids, ids, num_tokens, start_token
            )
            self._engine_first = start_token // engine.spec.block_size
        self._shape = shape
        self.device = torch.device("cpu") if interpret else torch.device("cuda", engine.device)
        # Everything a template is computed from (a re-registered rank at other addresses is another key).
        self._templates = _state.templates(
            (
                into_staging,
                self.device,
                engine.spec,
                engine.rank,
                engine.layer_ptrs,
                staging_spec,
                staging_rank,
                shape.num_heads,
                shape.src_head0,
                shape.dst_head0,
            )
        )
        self._stage_ids = _state.arange(self.device, max(1, total))
        # The transfer's own stream: the ids go up on it, so its launches need no event to wait for.
        self.stream: Any = None if interpret else torch.cuda.Stream(self.device)
        up = uploaded_ids
        if up is not None and up.device == self.device and up.dtype == torch.int32 and up.numel() == ids.size:
            # `engine_block_ids` uploaded earlier (upload_block_ids), complete: nothing to wait for.
            # Their memory is the upload stream's; this one reads it too.
            if self.stream is not None:
                up.record_stream(self.stream)
            self._ids = up
        else:
            self._ids, _ = _device_ids(ids, (), self.device, self.stream)
        self._other_streams: set[Any] = set()

    def chunk_bytes(self, t0: int, t1: int) -> int:
        """Bytes a chunk of tokens [t0, t1) occupies in a slot."""
        return staging_bytes(self.staging_spec, dst_block_count(self.staging_spec.block_size, t1, t0))

    def prepare(self, t0: int, t1: int, slot_address: int) -> None:
        """Ready a chunk's launch ahead of it (a reader waiting for its first chunk): its template, and
        its kernel compiled if no launch compiled it yet, so that the launches, which the reader makes on
        its NIXL thread, never wait for the compiler there (every chunk of a transfer runs one kernel:
        only the ints differ, on which it is not specialised)."""
        from kv_sidecar.execute import gpu_kernels

        tpl, args, _, ids = self._launch_args(t0, t1, slot_address)
        if not self.interpret:
            la = tpl.la
            gpu_kernels.launch.warm(
                self.engine.device, (tpl.anchor, *tpl.tables, *ids), args, la.constexprs, la.num_warps
            )

    def _launch_args(
        self, t0: int, t1: int, slot_address: int
    ) -> tuple[_Template, tuple[int, ...], tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
        """A chunk's template, ints, grid and id tables."""
        bd = self.staging_spec.block_size
        if not (t0 % bd == 0 and self.start_token <= t0 < t1 <= self.num_tokens):
            raise PlanError(
                f"chunk [{t0}, {t1}) is not block-aligned inside [{self.start_token}, {self.num_tokens})"
            )
        tpl = self._template_for(dst_block_count(bd, t1, t0), slot_address)
        la = tpl.la
        n_chunks = (t1 - t0) * tpl.chunks_per_token
        firsts = (self._engine_first, t0 // bd) if self.into_staging else (t0 // bd, self._engine_first)
        args = (n_chunks, t0, *firsts, *la.args[4:])
        grid = (triton_cdiv(n_chunks, la.rows), la.planes)
        ids = (self._ids, self._stage_ids) if self.into_staging else (self._stage_ids, self._ids)
        return tpl, args, grid, ids

    def launch(self, t0: int, t1: int, slot_address: int, stream: torch.cuda.Stream | None = None) -> int:
        """Enqueue the copy of tokens [t0, t1) between the engine and the slot at `slot_address`;
        returns the bytes it writes. On a GPU it goes on the transfer's stream unless `stream` is given."""
        from kv_sidecar.execute import gpu_kernels

        tpl, args, grid, ids = self._launch_args(t0, t1, slot_address)
        la = tpl.la
        nbytes = (t1 - t0) * tpl.bytes_per_token
        if self.interpret:
            gpu_kernels.interpreted(gpu_kernels.kv_copy_kernel)[grid](
                tpl.anchor, *tpl.tables, *ids, *args, **la.constexprs
            )
            return nbytes
        stream = self.stream if stream is None else stream
        with torch.cuda.device(self.device):
            if stream is not self.stream and stream not in self._other_streams:
                stream.wait_stream(self.stream)  # the ids went up on the transfer's stream
                self._other_streams.add(stream)
            pending = tpl.pending()
            if pending is not None:
                stream.wait_event(pending)  # its layer tables are still on their way up
            if stream not in tpl.streams:
                for t in tpl.tables:
                    t.record_stream(stream)
                tpl.streams.add(stream)
            gpu_kernels.launch(
                grid, stream, (tpl.anchor, *tpl.tables, *ids), args, la.constexprs, la.num_warps
            )
        return nbytes

    def _template_for(self, k: int, slot_address: int) -> _Template:
        key = (slot_address, k)
        tpl = self._templates.get(key)
        if tpl is None:
            if len(self._templates) >= _MAX_TEMPLATES:  # many small blocks per slot: stay bounded
                self._templates.clear()
            tpl = self._templates[key] = self._template(k, slot_address)
        return tpl

    def _template(self, k: int, slot_address: int) -> _Template:
        stage = staging_view(self.staging_spec, self.staging_rank, slot_address, k, self.engine.device)
        src, dst = (self.engine, stage) if self.into_staging else (stage, self.engine)
        sh = self._shape
        return _template(src, dst, sh.num_heads, sh.src_head0, sh.dst_head0, self.device, self.interpret)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
