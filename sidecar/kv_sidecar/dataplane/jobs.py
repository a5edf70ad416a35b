"""What crosses the data-plane boundary: plain data only.

The control core (server/) describes what to move with these values and hands them to the
`DataPlane` (dataplane/plane.py); it never sees a mapping, a ring, a stream or a NIXL handle. Every
field is a number, a string, bytes, a list or numpy array of them, or a plan value, so that a device's plane could
run in another process (one worker per GPU) and receive its jobs as messages. The one thing a job
is given that is not data is its `Halt`, the question "may I go on?", which such a worker would get
as the job's deadline plus a stop message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kv_sidecar.dataplane.staged_protocol import member_block_range, member_spans
from kv_sidecar.plan.pair import PairPlan
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.plan.state import StateMove

HOST = -1  # the device key of host memory (a CUDA ordinal otherwise)

# How long a stopped job waits for what it started to end: its NIXL READs, or, in the staged
# protocol, the other side to have nothing in flight.
CANCEL_WAIT_S = 5.0
# Receive slots a peer may still write into (it never confirmed the end of its transfer) rejoin their
# pool this long after the Push call ended: a source whose call went away stops and cancels its
# WRITEs within CANCEL_WAIT_S.
QUARANTINE_S = 2 * CANCEL_WAIT_S


# (source engine id, request id, reader engine id): one reader's read of a request, for which a peer
# READs host ranks here by address (dataplane/peer_reads.py).
PeerRead = tuple[str, str, str]


@dataclass(frozen=True)
class RankKey:
    """One registered engine rank."""

    engine_id: str
    rank: int


@dataclass(frozen=True)
class ShmTensor:
    """One host tensor as an engine sent it: a shared-memory segment and where the tensor sits in it."""

    name: str
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class IpcTensorRef:
    """One GPU tensor as an engine sent it (the CudaIpcTensor message)."""

    handle: bytes
    offset: int
    device_uuid: str


@dataclass(frozen=True)
class RankMemory:
    """What the control plane knows of a rank's memory once the plane has mapped it: where it lives,
    and its regions (address, length, NIXL device id) as peers see them at handshake."""

    kind: str  # NIXL's name: "DRAM" or "VRAM"
    device: int  # CUDA ordinal, or HOST
    regions: tuple[tuple[int, int, int], ...]

    @property
    def on_gpu(self) -> bool:
        return self.kind == "VRAM"


class Halt(Protocol):
    """May the job go on? `remaining()` answers the seconds left, and raises the error the job must
    end with once it must stop (stopped, or past its deadline)."""

    def remaining(self) -> float: ...


@dataclass(frozen=True)
class Tokens:
    """A request's token range and the blocks that hold it on both sides, validated against the plan
    (plan/blocks.check_pull): `src_blocks` every source block of the request, `dst_blocks` the
    destination blocks of [start_token, num_tokens)."""

    src_blocks: np.ndarray  # int64
    dst_blocks: np.ndarray  # int64
    num_tokens: int
    start_token: int

    def __reduce__(self) -> tuple[object, tuple[bytes, bytes, int, int]]:
        """Pickled with its ids as raw bytes: a worker's message (dataplane/workers.py) carries a batch's
        Tokens, and numpy's own pickling took about two thirds of dumping 16 one-block copies."""
        return (
            _tokens,
            (_raw(self.src_blocks), _raw(self.dst_blocks), self.num_tokens, self.start_token),
        )


def _raw(ids: np.ndarray) -> bytes:
    return np.ascontiguousarray(ids, dtype=np.int64).tobytes()


def _tokens(src: bytes, dst: bytes, num_tokens: int, start_token: int) -> Tokens:
    # bytearray: the arrays come back writable, as pickled arrays do
    return Tokens(
        np.frombuffer(bytearray(src), dtype=np.int64),
        np.frombuffer(bytearray(dst), dtype=np.int64),
        num_tokens,
        start_token,
    )


def joinable(tokens: Tokens, src_block_size: int, dst_block_size: int) -> bool:
    """Whether a request's copy may go as a member of a joined one (join_tokens): it moves at least a
    token from a destination block boundary, and a destination block holds whole source blocks."""
    return (
        dst_block_size % src_block_size == 0
        and tokens.start_token % dst_block_size == 0
        and tokens.num_tokens > tokens.start_token
    )


def join_tokens(
    members: Sequence[Tokens], src_block_size: int, dst_block_size: int
) -> tuple[Tokens, list[tuple[int, int]]]:
    """Several requests' copies between the same two ranks as one (each `joinable`): their tokens one
    after another from token 0, as a staged transfer carries a group's members (member_spans: every
    member but the last padded to whole destination blocks, its padding the rest of its own last
    block; member_block_range: which of its source blocks it takes). Returns the joined tokens and
    each member's span (first token in the join, tokens it moves there)."""
    spans = member_spans([t.num_tokens - t.start_token for t in members], dst_block_size)
    src, dst = [], []
    for t, (_, moved) in zip(members, spans, strict=True):
        # Slices, not a fancy index per member: a staged batch of 16 joins on its critical path.
        first, stop, repeats = member_block_range(len(t.src_blocks), t.start_token, moved, src_block_size)
        src.append(t.src_blocks[first:stop])
        if repeats:
            src.append(np.repeat(t.src_blocks[-1:], repeats))
        dst.append(t.dst_blocks[: -(-moved // dst_block_size)])
    joined = Tokens(np.concatenate(src), np.concatenate(dst), sum(moved for _, moved in spans), 0)
    return joined, spans


@dataclass(frozen=True)
class RankRead:
    """One read of a decode rank: from which source rank, which KV heads (None: all)."""

    dst: RankKey
    src: RankKey
    heads: tuple[int, int] | None


@dataclass(frozen=True)
class LocalCopy:
    """A pull whose source ranks are registered on this node (host-direct, gpu-direct).
    `whole_blocks`: the plan is the identity, so host copies move whole blocks."""

    reads: tuple[RankRead, ...]
    tokens: Tokens
    whole_blocks: bool


@dataclass(frozen=True)
class RemoteRank:
    """A source rank behind another sidecar, as its holder described it at handshake."""

    agent: str  # the holder's NIXL agent
    engine_id: str
    rank: int
    spec: EngineSpec
    region_bases: tuple[int, ...]


@dataclass(frozen=True)
class BlockReads:
    """host-nixl: NIXL READs of whole block chunks, each source rank straight into the same rank here
    (the plan is the identity)."""

    reads: tuple[tuple[RankKey, RemoteRank], ...]
    tokens: Tokens


@dataclass(frozen=True)
class ConvertedRead:
    """host-nixl-staged: READ the source blocks one decode rank needs into staging memory, then convert
    them (layout, TP, block size) into its blocks."""

    dst: RankKey
    src: RemoteRank
    plan: PairPlan
    heads: tuple[int, int] | None
    tokens: Tokens


@dataclass(frozen=True)
class StateBlock:
    """One request's Mamba state block into one decode rank: the plan's byte runs (plan/state.py) from
    the source ranks' block `src_block` into block `dst_block` here, in each of the group's first
    `positions` layer positions (regions)."""

    src_block: int
    dst_block: int
    positions: int
    moves: tuple[StateMove, ...]

    @property
    def nbytes(self) -> int:
        return self.positions * sum(m.nbytes for m in self.moves)


@dataclass(frozen=True)
class StateCopy:
    """host-direct for a Mamba group whose state is converted: `sources[q]` is prefill rank q here."""

    dst: RankKey
    sources: tuple[RankKey, ...]
    block: StateBlock


@dataclass(frozen=True)
class StateRead:
    """host-nixl-state: NIXL READs of a Mamba group's state runs straight into the destination block,
    one READ per source rank (`sources`: the ranks the runs read)."""

    dst: RankKey
    sources: tuple[RemoteRank, ...]
    block: StateBlock


@dataclass(frozen=True)
class Receive:
    """The reader's end of one staged transfer: take receive slots, scatter each chunk the source WRITEs
    into them as its notification arrives, and give the slot back (docs/gpu.md, the staged protocol)."""

    dst: RankKey
    spec: EngineSpec  # the reader's (decode) spec
    heads: tuple[int, int] | None
    tokens: Tokens
    source_agent: str  # the agent whose chunks arrive, and which our credits go to
    transfer_id: str
    # Its metadata, for a reception in a worker (staged_workers), whose own agent must load it to send
    # credits; empty: loaded already (the sidecar's agent loaded it at handshake).
    source_metadata: bytes = b""


@dataclass(frozen=True)
class ReceiveSlots:
    """What the source needs to WRITE into a reception's slots (it goes into the Push)."""

    addresses: tuple[int, ...]
    slot_bytes: int
    metadata: bytes  # NIXL partial metadata of the ring
    memory_kind: str
    device_id: int
    agent: str = ""  # the NIXL agent that owns the ring (a worker's, with staged_workers)


@dataclass(frozen=True)
class Send:
    """The source's end of one staged transfer: gather chunks of the request into send slots, already
    in the reader's layout, and WRITE each into a receive slot the reader granted."""

    src: RankKey
    reader_spec: EngineSpec
    reader_rank: int
    heads: tuple[int, int] | None
    # (engine, request): where ids prefetched at Publish are found; None for a Send of several requests
    # (their blocks concatenated in `block_ids`), which uploads its ids at once.
    request: tuple[str, str] | None
    # The source's blocks of the whole request, from its own record (not copied: a 1 GiB request of
    # 16 KiB blocks has 65536, and a copy and a comparison cost its pull ~1 ms).
    block_ids: Sequence[int]
    num_tokens: int
    start_token: int  # the reader's prefix: tokens [start_token, num_tokens) move
    chunks: tuple[tuple[int, int], ...]  # their token ranges, in order (DataPlane.blocks_per_chunk)
    transfer_id: str
    reader_agent: str
    reader_metadata: bytes
    reader_slots: tuple[tuple[int, int], ...]  # (address, length)
    reader_device: int
    deadline: float  # monotonic: the WRITEs' own deadline


@dataclass(frozen=True)
class Sent:
    chunks: int
    nbytes: int


@dataclass(frozen=True)
class WorkerState:
    """A data-plane worker process as `kv-sidecar status` shows it (dataplane/workers.py)."""

    device: int  # a CUDA ordinal, or HOST
    pid: int  # 0 while none runs
    restarts: int  # processes started again after one died
    local_copies: bool  # runs the local copies into this device (device_workers)
    staged: bool  # runs this device's staged transfers (staged_workers)
    ready: bool = True  # started, every rank mapped; until then its copies run in the sidecar
