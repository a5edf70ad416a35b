"""Which staged reads may share a transfer, and the blocks a group's transfer moves (server/staged_reader.py):
pure functions of the read's job and what the source's handshake said."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.plan.chunks import chunk_geometry
from kv_sidecar.plan.pair import plan_pair
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.server.peer_calls import PeerCallError
from kv_sidecar.server.peers import Holder, RemoteEngine
from kv_sidecar.server.pull_job import PullJob
from kv_sidecar.server.staged_common import REFUSALS_BYTES, member_refusals, refused_member, refused_members
from kv_sidecar.server.staged_reader import RefusedMember, _push_error, groupable, joined_tokens
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


def test_a_group_refusal_names_every_refused_member_and_the_reader_fails_each_with_its_own_words() -> None:
    """The source lists every refused member in the refusal's trailer; the message names the first as
    before (a reader that knows no trailer fails that one and sends the others again). The reader's
    side makes of each the error a Push of that request alone gets, code and words."""
    refusals = [
        (2, SidecarError(Code.NOT_FOUND, "request 'b' was never published by engine 'p'")),
        (
            5,
            SidecarError(
                Code.FAILED_PRECONDITION, "request 'e' holds tokens [0, 16) here, the reader planned [0, 32)"
            ),
        ),
    ]
    err = member_refusals(refusals)
    assert err.code is Code.NOT_FOUND
    assert refused_member(err.message) == (2, "request 'b' was never published by engine 'p'")
    assert refused_members(err.metadata) == {i: (e.code, e.message) for i, e in refusals}
    call = PeerCallError(err.code, err.message, ended=True, trailers=err.metadata)
    got = _push_error(call, "10.0.0.1:1", "6 requests ('a', ...)", ["a", "b", "c", "d", "e", "f"])
    assert isinstance(got, RefusedMember) and sorted(got.refused) == [2, 5]
    assert got.refused[2].code is Code.NOT_FOUND and got.refused[5].code is Code.FAILED_PRECONDITION
    assert got.refused[5].message == f"{refusals[1][1].message} (peer sidecar 10.0.0.1:1)"
    # A source that names only the first (no trailer), or a trailer that is not ours: that one alone.
    for trailers in ((), (("kvsidecar-refused-members", "[[5, 'NOPE'"),)):
        one = _push_error(
            PeerCallError(err.code, err.message, True, trailers), "10.0.0.1:1", "6 requests", list("abcdef")
        )
        assert isinstance(one, RefusedMember) and sorted(one.refused) == [2]


def test_a_refusal_of_many_members_lists_whole_entries_up_to_its_trailer_budget() -> None:
    """gRPC refuses trailers past 8 KiB: entries are listed whole while they fit REFUSALS_BYTES; the ones
    left out are refused again in the next round (never cut, so each read keeps its words)."""
    refusals = [(i, SidecarError(Code.NOT_FOUND, f"request 'r{i}' {'x' * 200}")) for i in range(100)]
    err = member_refusals(refusals)
    listed = refused_members(err.metadata)
    assert 2 <= len(listed) < 100 and sorted(listed) == list(range(len(listed)))
    assert all(listed[i] == (Code.NOT_FOUND, refusals[i][1].message) for i in listed)
    assert sum(len(v) for _, v in err.metadata) <= REFUSALS_BYTES
    # One refused: no trailer, as before.
    assert member_refusals(refusals[:1]).metadata == ()
