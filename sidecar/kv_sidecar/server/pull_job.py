"""A pull once validated (`PullJob`), how it is built, and how a failed one names its blocks.

Shared by every pull path (server/pull.py chooses among them); knows no gRPC and no `Sidecar`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kv_sidecar.dataplane.jobs import StateBlock, Tokens
from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.plan.blocks import check_pull, source_block_list
from kv_sidecar.plan.pair import DecodeRankPlan, PairPlan
from kv_sidecar.plan.state import check_state_pull
from kv_sidecar.server.engines import RankEntry
from kv_sidecar.server.inflight import Stop, stopped_error
from kv_sidecar_client._proto.kvsidecar.v1 import common_pb2, engine_pb2

# A failed pull names the blocks it left unfilled in its status message and in a trailer. Both travel
# as gRPC headers, which gRPC caps at 8 KiB by default (a longer one turns the answer into
# RESOURCE_EXHAUSTED): long lists are named by count, and the trailer says "all" of the request's.
_NAMED_BLOCKS = 32
_TRAILER_CHARS = 2048
UNFILLED_ALL = "all"


def unfilled_blocks(block_ids: Sequence[int]) -> tuple[str, str]:
    """(the failed pull's message fragment, its kvsidecar-unfilled-blocks trailer), both short.

    A pull fails whole, so every requested block is unfilled."""
    listed = ",".join(str(b) for b in block_ids)
    trailer = listed if len(listed) <= _TRAILER_CHARS else UNFILLED_ALL
    if len(block_ids) <= _NAMED_BLOCKS:
        return f"[{listed}]", trailer
    return f"all {len(block_ids)} requested (first {block_ids[0]}, last {block_ids[-1]})", trailer


@dataclass
class PullJob:
    """One validated pull, before any byte moves."""

    params: common_pb2.TransferParams
    local: list[RankEntry]
    plan: PairPlan
    # int64, validated against the plan; by position from token 0 (the full form), with placeholders
    # before a sliding-window request's published range, which no read from start_token on touches.
    src_blocks: np.ndarray
    dst_blocks: np.ndarray
    num_tokens: int
    start_token: int
    deadline: float
    cancel: Stop

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if self.cancel.is_set():
            raise stopped_error(self.cancel, self.params.request_id)
        if left <= 0:
            raise SidecarError(
                Code.DEADLINE_EXCEEDED, f"pull of request {self.params.request_id!r} timed out"
            )
        return left

    @property
    def tokens(self) -> Tokens:
        return Tokens(self.src_blocks, self.dst_blocks, self.num_tokens, self.start_token)

    def rank_plans(self) -> list[DecodeRankPlan]:
        return [self.plan.decode_ranks[e.rank] for e in self.local]


# Up to this many ids np.fromiter is the cheaper conversion; beyond, a protobuf repeated field converts
# in one go with np.array (8,000 ids: 8 us against 620-730 us), a list still with np.fromiter.
_FEW_IDS = 32


def ids_array(values: Sequence[int]) -> np.ndarray:
    """Block ids as an int64 array, whichever container they came in (a list, a protobuf repeated)."""
    if len(values) <= _FEW_IDS or isinstance(values, list):
        return np.fromiter(values, dtype=np.int64, count=len(values))
    return np.array(values, dtype=np.int64)


def build_job(
    req: engine_pb2.PullRequest,
    local: list[RankEntry],
    plan: PairPlan,
    src_blocks: Sequence[int],
    num_tokens: int,
    cancel: Stop,
    deadline: float,
    first_token: int = 0,
) -> PullJob:
    """`src_blocks`: the published blocks, of tokens [first_token, num_tokens)."""
    # Block ids arrive as protobuf repeated uint32 (never bools or negatives): as int64 arrays,
    # every later check (the executors validate again) takes the vectorised path. As Python
    # lists, validation was a quarter of a 1 GiB same-node GPU pull (py-spy, 2x H200).
    src = ids_array(src_blocks)
    dst = ids_array(req.block_ids)
    check_pull(plan, src, num_tokens, dst, req.start_token, first_token)
    if first_token:
        full = source_block_list(src_blocks, first_token, plan.prefill.block_size)
        src = np.asarray(full, dtype=np.int64)
    return PullJob(
        req.params,
        local,
        plan,
        src,
        dst,
        num_tokens,
        req.start_token,
        deadline,
        cancel,
    )


def state_group(req: engine_pb2.PullRequest, plan: PairPlan) -> int | None:
    """The Mamba group whose state this pull converts (plan/state.py); None where its blocks move as
    tokens, which includes every pull of an identity plan (a state block is then copied whole).
    A converting plan's pulls must name their group: a state record is one block, which moved as
    tokens would land as attention bytes."""
    if plan.is_identity() or all(moves is None for moves in plan.state):
        return None
    g = next(i for i, moves in enumerate(plan.state) if moves is not None)
    if not req.HasField("group"):
        raise SidecarError(
            Code.FAILED_PRECONDITION,
            f"engines {req.params.engine_id!r} and {req.engine_id!r} convert the Mamba state of KV cache group "
            f"{g} (layer {plan.decode.groups[g].layers[0]}): a pull between them must name its KV cache group "
            "(PullRequest.group; the connector of this version does)",
        )
    if req.group >= len(plan.state):
        raise SidecarError(
            Code.INVALID_ARGUMENT,
            f"group {req.group} is out of range: the engines have {len(plan.state)} groups",
        )
    return req.group if plan.state[req.group] is not None else None


def build_state_job(
    req: engine_pb2.PullRequest,
    local: list[RankEntry],
    plan: PairPlan,
    group: int,
    src_blocks: list[int],
    cancel: Stop,
    deadline: float,
) -> PullJob:
    """A pull of Mamba group `group`'s state block (its record's one block) into the request's one block."""
    check_state_pull(plan.prefill, plan.decode, group, src_blocks, list(req.block_ids), req.start_token)
    return PullJob(
        req.params,
        local,
        plan,
        ids_array(src_blocks),
        ids_array(req.block_ids),
        req.params.num_tokens,
        0,
        deadline,
        cancel,
    )


def state_blocks(job: PullJob, group: int) -> list[StateBlock]:
    """Each local rank's state block of the job: its runs (plan/state.py) in each of the group's layer
    positions."""
    moves = job.plan.state_moves(group)
    positions = len(job.plan.decode.groups[group].layers)
    return [
        StateBlock(int(job.src_blocks[0]), int(job.dst_blocks[0]), positions, moves[e.rank])
        for e in job.local
    ]


def require_gpu(entries: list[RankEntry], side: str) -> list[RankEntry]:
    for e in entries:
        if not e.on_gpu:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"{side} engine {e.engine_id!r} rank {e.rank} is in host memory while the other side is in "
                "GPU memory; host<->GPU pulls are not supported",
            )
    return entries
