"""Engine descriptions: what an engine's KV cache looks like, as pure data.

An `EngineSpec` describes one engine (all of its TP ranks). Everything the
planner needs is here; nothing here touches memory, torch or the network.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from enum import Enum
from itertools import pairwise
from typing import Any


class PlanError(ValueError):
    """A pairing or request the planner refuses; `code` names the gRPC status."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message)
        self.code = code


class Layout(str, Enum):
    """Physical order of the dims of one rank's KV tensor (per layer).

    N: blocks, B: tokens in a block, H: KV heads on this rank, D: head_dim,
    2: K and V, L: MLA latent size. `packed` and `packed_nhd` are vLLM's
    `KVCacheLayout`s LBHNC and LBNHC: K then V in the last dim (docs/pairings.md).
    `vllm_cpu` is what vLLM's CPU attention backend really stores under LBHNC:
    its kernels view each head's page as the block's K plane, then its V plane,
    and keep the K plane transposed ([D, B]: `K_TRANSPOSED`).
    """

    FLASH_ATTN_NHD = "flash_attn_nhd"  # [2, N, B, H, D]
    FLASH_ATTN_HND = "flash_attn_hnd"  # [2, N, H, B, D]
    FLASHINFER_NHD = "flashinfer_nhd"  # [N, 2, B, H, D]
    FLASHINFER_HND = "flashinfer_hnd"  # [N, 2, H, B, D]
    PACKED = "packed"  # [N, H, B, 2*D]  (vLLM LBHNC)
    PACKED_NHD = "packed_nhd"  # [N, B, H, 2*D]  (vLLM LBNHC)
    VLLM_CPU = "vllm_cpu"  # [N, H, 2, B, D], the K plane as [D, B]  (vLLM's CPU backend, declared LBHNC)
    MLA = "mla"  # [N, B, L]


# Dim order of one layer's physical tensor, one letter per dim: N blocks (kernel
# blocks), K the K/V plane, B token in block, H local head, D head_dim (MLA:
# latent). The packed layouts store K and V side by side in their last dim, so
# their physical tensor has 4 dims and a trailing "KD" names the two halves of
# the last one (K outer). MLA has neither K/V nor heads. Shapes, descriptor
# geometry and both executors' views are all derived from this table.
LAYOUT_DIMS: dict[Layout, str] = {
    Layout.FLASH_ATTN_NHD: "KNBHD",
    Layout.FLASH_ATTN_HND: "KNHBD",
    Layout.FLASHINFER_NHD: "NKBHD",
    Layout.FLASHINFER_HND: "NKHBD",
    Layout.PACKED: "NHBKD",
    Layout.PACKED_NHD: "NBHKD",
    Layout.VLLM_CPU: "NHKBD",
    Layout.MLA: "NBD",
}


# Layouts whose K plane holds each [B, D] tile transposed, as [D, B] (V keeps [B, D]): the
# physical shape is still LAYOUT_DIMS's, only the K plane's B and D strides are swapped.
K_TRANSPOSED: frozenset[Layout] = frozenset({Layout.VLLM_CPU})


def kv_in_last_dim(layout: Layout) -> bool:
    """Whether the layout keeps K and V in its last dim (2 * head_dim wide, K first)."""
    return LAYOUT_DIMS[layout].endswith("KD")


# Bytes per element of the dtypes we move. Names follow torch without the prefix.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}


# Far above any real engine; they bound the work a spec from a peer can cause
# (planning is linear in ranks and heads, descriptor tables in blocks and layers).
LIMITS = {
    "tp_size": 1024,
    "num_layers": 4096,
    "num_kv_heads": 4096,
    "head_dim": 1 << 16,
    "block_size": 1 << 16,
    "num_blocks": 1 << 22,
}


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise PlanError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class StateSegment:
    """A run of a state array's TP-sharded dim that TP shards on its own: vLLM shards Mamba-2's conv
    channels as x, then B, then C, each split separately, so a rank holds its slice of each, back to
    back. `size` is the run's length in the model (over all ranks); `replicated`: every rank holds all
    of it (vLLM's one group of B and C when TP > 1, `extra_groups_for_head_shards`), else rank r holds
    [r * size / tp, (r + 1) * size / tp)."""

    size: int
    replicated: bool = False

    def local(self, tp_size: int) -> int:
        """Its length on one rank of an engine of `tp_size` ranks."""
        return self.size if self.replicated else self.size // tp_size

    def held(self, tp_size: int, rank: int) -> tuple[int, int]:
        """The model indices [start, stop) rank `rank` holds."""
        if self.replicated:
            return (0, self.size)
        n = self.size // tp_size
        return (rank * n, rank * n + n)

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "replicated": self.replicated}


@dataclass(frozen=True)
class StateArray:
    """One array of a Mamba layer's per-request state on one rank (vLLM's MambaSpec shapes and dtypes):
    contiguous, `offset` bytes into its block.

    `segments` (empty: not described) say how TP shards it: dim `tp_dim` of `shape` is this rank's
    part of each segment, in order; every other dim is the model's. The planner converts state between
    TP sizes only where both engines describe it (plan/state.py)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    tp_dim: int = 0
    segments: tuple[StateSegment, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(
            self,
            "segments",
            tuple(s if isinstance(s, StateSegment) else StateSegment(**s) for s in self.segments),
        )

    def sharding(self) -> str:
        """How TP shards it, for messages: e.g. "dim 1 = [512, 16 replicated, 16 replicated]"."""
        if not self.segments:
            return "sharding not described"
        runs = ", ".join(f"{s.size}{' replicated' if s.replicated else ''}" for s in self.segments)
        return f"dim {self.tp_dim} = [{runs}]"

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES.get(self.dtype, 0)
        for s in self.shape:
            n *= s
        return n

    def describe(self) -> str:
        return f"{self.name} {self.shape} {self.dtype} at byte {self.offset}"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "offset": self.offset,
        }
        if self.segments:  # an undescribed array reads (and hashes) as before sharding was described
            d["tp_dim"] = self.tp_dim
            d["segments"] = [s.to_dict() for s in self.segments]
        return d


@dataclass(frozen=True)
class KVGroupSpec:
    """One KV cache group of a hybrid model (EngineSpec.groups): its layers, one per layer position
    (the registered tensors), and its window (0: full attention). `state` set: a Mamba group, whose
    block holds one request's state (these arrays) instead of tokens."""

    layers: tuple[str, ...]
    sliding_window: int = 0
    state: tuple[StateArray, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(
            self, "state", tuple(a if isinstance(a, StateArray) else StateArray(**a) for a in self.state)
        )

    @property
    def kind(self) -> str:
        if self.state:
            return "Mamba state (" + ", ".join(a.describe() for a in self.state) + ")"
        return f"sliding window {self.sliding_window}" if self.sliding_window else "full attention"

    @property
    def is_state(self) -> bool:
        return bool(self.state)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"layers": list(self.layers), "sliding_window": self.sliding_window}
        if self.state:  # an attention group reads (and hashes) as before state groups existed
            d["state"] = [a.to_dict() for a in self.state]
        return d


@dataclass(frozen=True)
class EngineSpec:
    """One engine's KV cache geometry, identical on every one of its ranks.

    `block_size` is the logical block size the scheduler hands out block ids
    in; `kernel_block_size` (if set) is the block size of the physical tensors,
    so that logical block b is kernel blocks b*r .. b*r+r-1 (r = ratio).
    `num_blocks` counts logical blocks. With `cross_layer`, one tensor holds
    every layer as `[N, num_layers, <layout without N>]` (blocks outermost, so a
    block of all layers is contiguous); otherwise there is one tensor per layer.
    """

    tp_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    num_blocks: int
    layout: Layout
    kernel_block_size: int | None = None
    cross_layer: bool = False
    # A hybrid model's KV cache groups; empty: one group of every layer. Each registered tensor is
    # then a layer position shared by that position's layer of every group.
    groups: tuple[KVGroupSpec, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.layout, str) and not isinstance(self.layout, Layout):
            object.__setattr__(self, "layout", parse_layout(self.layout))
        object.__setattr__(
            self, "groups", tuple(g if isinstance(g, KVGroupSpec) else KVGroupSpec(**g) for g in self.groups)
        )
        self.validate()

    # -- validation -------------------------------------------------------
    def validate(self) -> None:
        for name in ("tp_size", "num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks"):
            _positive(name, getattr(self, name))
            if getattr(self, name) > LIMITS[name]:
                raise PlanError(f"{name} {getattr(self, name)} is above the supported maximum {LIMITS[name]}")
        if self.dtype not in DTYPE_SIZES:
            raise PlanError(f"dtype {self.dtype!r} is not supported; use one of {sorted(DTYPE_SIZES)}")
        if self.kernel_block_size is not None:
            _positive("kernel_block_size", self.kernel_block_size)
            if self.block_size % self.kernel_block_size:
                raise PlanError(
                    f"block_size {self.block_size} is not a multiple of "
                    f"kernel_block_size {self.kernel_block_size}"
                )
        if self.layout is Layout.MLA and self.num_kv_heads != 1:
            raise PlanError(
                f"layout mla has one latent 'head'; num_kv_heads must be 1, got {self.num_kv_heads}"
            )
        self._validate_groups()
        kv, tp = self.num_kv_heads, self.tp_size
        if self.layout is not Layout.MLA and kv % tp and tp % kv:
            raise PlanError(
                f"num_kv_heads {kv} and tp_size {tp}: one must divide the other "
                f"(heads are split evenly or replicated evenly across ranks)"
            )

    def _validate_groups(self) -> None:
        if not self.groups:
            return
        if len(self.groups) > LIMITS["num_layers"]:
            raise PlanError(f"{len(self.groups)} KV cache groups is above the supported maximum")
        if self.cross_layer:
            raise PlanError("KV cache groups need one tensor per layer position, not a cross-layer tensor")
        seen: set[str] = set()
        widest = 0
        for i, g in enumerate(self.groups):
            if not g.layers or any(not n for n in g.layers):
                raise PlanError(f"KV cache group {i} names no layer, or an empty one")
            if not isinstance(g.sliding_window, int) or g.sliding_window < 0:
                raise PlanError(f"KV cache group {i}: sliding_window must be >= 0, got {g.sliding_window!r}")
            twice = seen & set(g.layers) or (len(set(g.layers)) < len(g.layers) and set(g.layers))
            if twice:
                raise PlanError(f"layer {sorted(twice)[0]} is in more than one place of the KV cache groups")
            seen |= set(g.layers)
            widest = max(widest, len(g.layers))
            if g.state:
                self._validate_state(i, g)
        if widest != self.num_layers:
            raise PlanError(
                f"the KV cache groups have {widest} layer positions but the engine registers num_layers "
                f"{self.num_layers} tensors (one per position)"
            )

    def _validate_state(self, i: int, g: KVGroupSpec) -> None:
        """A Mamba group's arrays lie inside one block of its layer position's region, apart."""
        where = f"KV cache group {i} (layer {g.layers[0]})"
        if g.sliding_window:
            raise PlanError(f"{where}: a Mamba state group has no sliding window")
        if not LAYOUT_DIMS[self.layout].startswith("N"):
            # The state lies in bytes [b * block, (b + 1) * block) of its region; a layout with the K/V
            # planes outermost keeps no block's bytes together there.
            raise PlanError(
                f"{where}: Mamba state needs a layout with blocks outermost (each block one page of its "
                f"layer position); {self.layout.value} keeps K and V planes outermost"
            )
        if len(g.state) > 16:
            raise PlanError(f"{where}: {len(g.state)} state arrays is above the supported maximum 16")
        block = rank_block_bytes(self) // self.num_layers  # one block of one region, on one rank
        spans = []
        for a in g.state:
            if not a.name:
                raise PlanError(f"{where}: a state array has no name")
            if a.dtype not in DTYPE_SIZES:
                raise PlanError(
                    f"{where}: state array {a.name} has dtype {a.dtype!r}; use one of {sorted(DTYPE_SIZES)}"
                )
            if not a.shape or len(a.shape) > 8 or any(not isinstance(s, int) or s <= 0 for s in a.shape):
                raise PlanError(f"{where}: state array {a.name} has shape {a.shape}")
            if not isinstance(a.offset, int) or a.offset < 0 or a.offset + a.nbytes > block:
                raise PlanError(
                    f"{where}: state array {a.describe()} ({a.nbytes} bytes) does not fit in a block of "
                    f"{block} bytes of its layer position"
                )
            if a.segments:
                self._validate_sharding(where, a)
            spans.append((a.offset, a.offset + a.nbytes, a.name))
        spans.sort()
        for (_, end, first), (start, _, second) in pairwise(spans):
            if start < end:
                raise PlanError(f"{where}: state arrays {first} and {second} overlap")

    def _validate_sharding(self, where: str, a: StateArray) -> None:
        """The segments describe this rank's `tp_dim` exactly, each split evenly over the TP ranks."""
        if len(a.segments) > 16:
            raise PlanError(
                f"{where}: state array {a.name} has {len(a.segments)} segments, above the maximum 16"
            )
        if isinstance(a.tp_dim, bool) or not isinstance(a.tp_dim, int) or not 0 <= a.tp_dim < len(a.shape):
            raise PlanError(f"{where}: state array {a.name} shape {a.shape} has no dim {a.tp_dim!r} to shard")
        for s in a.segments:
            if isinstance(s.size, bool) or not isinstance(s.size, int) or s.size <= 0:
                raise PlanError(f"{where}: state array {a.name} has a segment of size {s.size!r}")
            if not s.replicated and s.size % self.tp_size:
                raise PlanError(
                    f"{where}: state array {a.name}'s segment of {s.size} does not split evenly over "
                    f"tp_size {self.tp_size}"
                )
        local = sum(s.local(self.tp_size) for s in a.segments)
        if local != a.shape[a.tp_dim]:
            raise PlanError(
                f"{where}: state array {a.name} {a.sharding()} holds {local} per rank at tp_size "
                f"{self.tp_size}, its shape {a.shape} {a.shape[a.tp_dim]}"
            )

    # -- derived geometry -------------------------------------------------
    @property
    def element_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def is_mla(self) -> bool:
        return self.layout is Layout.MLA

    @property
    def physical_block_size(self) -> int:
        return self.kernel_block_size or self.block_size

    @property
    def kernel_blocks_per_block(self) -> int:
        return self.block_size // self.physical_block_size

    @property
    def heads_per_rank(self) -> int:
        """KV heads each rank holds (1 when heads are replicated, tp > heads)."""
        if self.is_mla:
            return 1
        return max(1, self.num_kv_heads // self.tp_size)

    def rank_heads(self, rank: int) -> tuple[int, int]:
        """Global KV head range [start, stop) held by `rank`."""
        if not 0 <= rank < self.tp_size:
            raise PlanError(f"rank {rank} out of range for tp_size {self.tp_size}")
        if self.is_mla:
            return (0, 1)
        if self.num_kv_heads >= self.tp_size:
            h = self.heads_per_rank
            return (rank * h, rank * h + h)
        # tp > heads: consecutive groups of tp/heads ranks share one head.
        head = rank // (self.tp_size // self.num_kv_heads)
        return (head, head + 1)

    def dim_sizes(self) -> dict[str, int]:
        """Size of each dim letter of `LAYOUT_DIMS` (plus L, layers) on one rank, N in kernel blocks."""
        return {
            "N": self.num_blocks * self.kernel_blocks_per_block,
            "L": self.num_layers,
            "K": kv_planes(self),
            "B": self.physical_block_size,
            "H": self.heads_per_rank,
            "D": self.head_dim,
        }

    def _physical_shape(self, dims: str) -> tuple[int, ...]:
        sizes = self.dim_sizes()
        shape = [sizes[letter] for letter in dims]
        if kv_in_last_dim(self.layout):
            shape[-2:] = [shape[-2] * shape[-1]]  # K and V are the two halves of one dim
        return tuple(shape)

    def layer_tensor_shape(self) -> tuple[int, ...]:
        """Shape of one layer's tensor on one rank, in physical (kernel) blocks."""
        return self._physical_shape(LAYOUT_DIMS[self.layout])

    def rank_tensor_shapes(self) -> list[tuple[int, ...]]:
        """Shapes of the tensors one rank registers, in order (per layer, or one)."""
        if self.cross_layer:
            return [self._physical_shape(tensor_dims(self))]
        return [self.layer_tensor_shape()] * self.num_layers

    def rank_bytes(self) -> int:
        return self._rank_bytes

    # Once per spec (a frozen dataclass's cache lives outside its fields): a source asks it for every
    # request it opens, and the shapes cost ~12 us to work out each time.
    @functools.cached_property
    def _rank_bytes(self) -> int:
        total = 0
        for shape in self.rank_tensor_shapes():
            n = 1
            for s in shape:
                n *= s
            total += n * self.element_size
        return total

    # -- (de)serialisation -----------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layout"] = self.layout.value
        if self.groups:
            d["groups"] = [g.to_dict() for g in self.groups]
        else:
            del d["groups"]  # a spec of one group reads (and hashes) as before groups existed
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(f"unknown engine spec keys {unknown}; known keys are {sorted(known)}")
        required = [f.name for f in fields(cls) if f.default is MISSING]
        missing = [k for k in required if k not in data]
        if missing:
            raise PlanError(f"engine spec is missing {missing}")
        return cls(**dict(data))

    def canonical_json(self) -> str:
        # An engine of one group hashes as before groups existed (plan hashes are exchanged with peers).
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]


def parse_layout(name: str) -> Layout:
    try:
        return Layout(name)
    except ValueError:
        raise PlanError(
            f"unknown layout {name!r}; use one of {[layout.value for layout in Layout]}"
        ) from None


# Fields that two engines must share for any plan to exist between them.
MUST_MATCH = ("num_layers", "head_dim", "dtype")


def tensor_dims(spec: EngineSpec) -> str:
    """Dim letters of one registered tensor, outermost first (a packed last dim split into K, D).

    Cross-layer tensors put blocks outermost, then layers: `[N, L, <layer dims without N>]`,
    so one block of every layer is one contiguous run.
    """
    dims = LAYOUT_DIMS[spec.layout]
    return "NL" + dims.replace("N", "") if spec.cross_layer else dims


def kv_planes(spec: EngineSpec) -> int:
    """How many planes a token has per layer and head: 2 (K and V), 1 for MLA."""
    return 1 if spec.is_mla else 2


def token_bytes_per_head(spec: EngineSpec) -> int:
    """Bytes one token of one head occupies across all layers and K/V planes."""
    return spec.num_layers * kv_planes(spec) * spec.head_dim * spec.element_size


def rank_block_bytes(spec: EngineSpec) -> int:
    """Bytes one logical block occupies on one rank (all layers, K and V, its heads)."""
    return spec.block_size * spec.heads_per_rank * token_bytes_per_head(spec)
