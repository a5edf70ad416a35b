"""Which staged reads may share a transfer, and the blocks a group's transfer moves (server/staged_reader.py):
pure functions of the read's job and what the source's handshake said."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from kv_sidecar.plan.chunks import chunk_geometry
from kv_sidecar.plan.pair import plan_pair
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.server.peers import Holder, RemoteEngine
from kv_sidecar.server.pull_job import PullJob
from kv_sidecar.server.staged_reader import groupable, joined_tokens
from kv_sidecar_client._proto.kvsidecar.v1 import common_pb2

BASE = {
    "tp_size": 1,
    "num_layers": 2,
    "num_kv_heads": 4,
    "head_dim": 16,
    "dtype": "float16",
    "num_blocks": 64,
    "layout": "flash_attn_nhd",
}


def _spec(block_size: int) -> EngineSpec:
    return EngineSpec.from_dict(BASE | {"block_size": block_size})


def _job(
    bp: int, bd: int, src: list[int], dst: list[int], tokens: int, start: int = 0, first: int = 0
) -> PullJob:
    return PullJob(
        params=common_pb2.TransferParams(engine_id="p", request_id="r", first_token=first),
        local=[],
        plan=plan_pair(_spec(bp), _spec(bd)),
        src_blocks=np.array(src, dtype=np.int64),
        dst_blocks=np.array(dst, dtype=np.int64),
        num_tokens=tokens,
        start_token=start,
        deadline=math.inf,
        cancel=threading.Event(),
    )


def _source(bp: int, bd: int, members: bool = True, v2: bool = True, holder: str = "") -> RemoteEngine:
    remote = RemoteEngine(
        sidecar_id="s",
        agent_name="s",
        engine_id="p",
        spec=_spec(bp),
        plan=plan_pair(_spec(bp), _spec(bd)),
        geometry=chunk_geometry(_spec(bp)),
        regions={},
        memory_kind="VRAM",
        push_members=members,
        push_members_v2=v2,
    )
    remote.holders = {0: Holder(holder or "s", "addr", "agent")}
    return remote


def _read(bp: int, bd: int, tokens: int = 40, start: int = 0, first: int = 0) -> PullJob:
    n_src, n_dst = -(-tokens // bp), -(-tokens // bd) - start // bd
    return _job(bp, bd, list(range(n_src)), list(range(n_dst)), tokens, start, first)


@pytest.mark.parametrize(
    ("bp", "bd", "start", "v2", "expected"),
    [
        (16, 16, 0, False, True),  # what a source of the first version with groups takes
        (16, 16, 16, False, False),  # ... not past a prefix
        (16, 32, 0, False, False),  # ... nor into other block sizes
        (16, 16, 16, True, True),
        (16, 32, 0, True, True),  # decode blocks a multiple of the source's
        (16, 32, 32, True, True),
        (16, 48, 0, True, True),
        (32, 16, 0, True, False),  # a member would start inside a source block
        (16, 24, 0, True, False),  # 24 is not a multiple of 16
    ],
)
def test_which_reads_group(bp: int, bd: int, start: int, v2: bool, expected: bool) -> None:
    assert groupable(_read(bp, bd, 40, start), _source(bp, bd, v2=v2), 0) is expected


def test_reads_that_never_group() -> None:
    assert not groupable(_read(16, 16), _source(16, 16, members=False), 0)  # a source before groups
    assert not groupable(_read(16, 16), _source(16, 16, holder="member"), 0)  # another node's rank
    assert not groupable(_read(16, 16, 64, first=16), _source(16, 16), 0)  # held from a later token
    assert not groupable(_read(16, 16, 32, start=32), _source(16, 16), 0)  # nothing left to move


def test_a_group_concatenates_each_reads_own_blocks_from_its_start() -> None:
    """Prefill blocks of 16, decode blocks of 32: the first read (40 tokens) is padded to 64, so its
    source blocks run one past its last (0, 1, 2, then 2 again); the second reads past a one-block
    prefix (tokens 32 to 70), the last of the group, unpadded."""
    a = _job(16, 32, [10, 11, 12], [20, 21], 40)
    b = _job(16, 32, [30, 31, 32, 33, 34], [40, 41], 70, start=32)
    tokens = joined_tokens([a, b])
    assert tokens.src_blocks.tolist() == [10, 11, 12, 12, 32, 33, 34]
    assert tokens.dst_blocks.tolist() == [20, 21, 40, 41]
    assert (tokens.num_tokens, tokens.start_token) == (64 + 38, 0)
