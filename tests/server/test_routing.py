"""Which sidecar each control call and notification of a pull goes to (pure part of server/routing.py)."""

from __future__ import annotations

import pytest

from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.plan.chunks import chunk_geometry
from kv_sidecar.plan.pair import plan_pair
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.server.engines import spec_from_proto
from kv_sidecar.server.identity import Identity
from kv_sidecar.server.peers import Holder, RemoteEngine
from kv_sidecar.server.routing import (
    MAX_DONES,
    DoneReads,
    Opener,
    by_holder,
    depends_on,
    done_messages,
    holders_needed,
)
from kv_sidecar.transport import notifications as n
from kv_sidecar_client._proto.kvsidecar.v1 import common_pb2, engine_pb2

from ..e2e.conftest import spec_dict

LEADER = Holder("leader", "10.0.0.1:50061", "leader")
MEMBER = Holder("member", "10.0.0.2:50061", "member")


def _remote(prefill: dict, decode: dict, holders: dict[int, Holder]) -> RemoteEngine:
    pspec, dspec = EngineSpec.from_dict(spec_dict(**prefill)), EngineSpec.from_dict(spec_dict(**decode))
    return RemoteEngine(
        sidecar_id="leader",
        agent_name="leader",
        engine_id="p",
        spec=pspec,
        plan=plan_pair(pspec, dspec),
        geometry=chunk_geometry(pspec),
        regions={r: [0] for r in holders},
        memory_kind="DRAM",
        holders=holders,
    )


def test_tp4_over_two_sidecars_to_tp2() -> None:
    remote = _remote({"tp_size": 4}, {"tp_size": 2}, {0: LEADER, 1: LEADER, 2: MEMBER, 3: MEMBER})
    plans = remote.plan.decode_ranks
    assert holders_needed(remote, plans, "reader") == {LEADER: [0, 1], MEMBER: [2, 3]}
    # Each decode rank notifies only the sidecar holding what it read, naming only that sidecar's ranks.
    assert by_holder(remote, depends_on(plans[0]), "reader") == {LEADER: [0, 1]}
    assert by_holder(remote, depends_on(plans[1]), "reader") == {MEMBER: [2, 3]}
    assert remote.agent_of(3) == "member" and remote.agent_of(0) == "leader" and remote.complete()


def test_split_decode_opens_only_the_holders_its_ranks_need() -> None:
    remote = _remote({"tp_size": 2}, {"tp_size": 4}, {0: LEADER, 1: MEMBER})
    plans = remote.plan.decode_ranks
    assert holders_needed(remote, plans[:2], "reader") == {LEADER: [0]}
    assert holders_needed(remote, plans[2:], "reader") == {MEMBER: [1]}


def test_notify_only_ranks_are_routed_to_their_holder() -> None:
    mla = {"num_kv_heads": 1, "head_dim": 32, "layout": "mla"}
    remote = _remote(mla | {"tp_size": 4}, mla | {"tp_size": 1}, {0: LEADER, 1: LEADER, 2: MEMBER, 3: MEMBER})
    (plan,) = remote.plan.decode_ranks
    assert [r.prefill_rank for r in plan.reads] == [0]
    assert by_holder(remote, depends_on(plan), "reader") == {LEADER: [0, 1], MEMBER: [2, 3]}


def test_missing_and_own_ranks_are_refused() -> None:
    remote = _remote({"tp_size": 2}, {"tp_size": 2}, {0: LEADER})
    assert not remote.complete()
    with pytest.raises(SidecarError) as info:
        holders_needed(remote, remote.plan.decode_ranks, "reader")
    assert info.value.code is Code.FAILED_PRECONDITION and "no sidecar holds rank 1" in info.value.message
    with pytest.raises(SidecarError) as info:
        by_holder(remote, [0], "leader")  # the map puts rank 0 here, and it is not registered here now
    assert info.value.code is Code.FAILED_PRECONDITION and "handshake again" in info.value.message
    # Ranks the reader holds itself and copies (own_ranks.py) are left out, whoever the map names.
    assert by_holder(remote, [0], "leader", own={0}) == {}
    assert by_holder(remote, [0], "reader", own={0}) == {}


def _done_reads(remote: RemoteEngine, request: str) -> DoneReads:
    return DoneReads(remote, request, "d", list(enumerate(remote.plan.decode_ranks)))


def test_done_notifications_to_a_leader_that_takes_them_joined_go_as_one() -> None:
    """A PullBatch's members that ended together: the leader that said done_batches gets one notification
    for all of them; a member sidecar (never handshaken with) one per request and rank."""
    remote = _remote({"tp_size": 4}, {"tp_size": 2}, {0: LEADER, 1: LEADER, 2: MEMBER, 3: MEMBER})
    remote.done_batches = True
    messages, addresses = done_messages([_done_reads(remote, "r1"), _done_reads(remote, "r2")], "reader")
    assert addresses == {LEADER.address, MEMBER.address}
    to_leader = [m for a, m in messages if a == "leader"]
    to_member = [m for a, m in messages if a == "member"]
    assert len(to_leader) == 1 and to_leader[0].startswith(n.DONES_TAG + n.SEP)
    assert n.parse_done_batch(to_leader[0]) == [("p", "r1", "d", 0, [0, 1]), ("p", "r2", "d", 0, [0, 1])]
    assert [n.parse_done_notification(m) for m in to_member] == [
        ("p", "r1", "d", 1, [2, 3]),
        ("p", "r2", "d", 1, [2, 3]),
    ]


def test_done_notifications_go_one_by_one_to_a_peer_without_done_batches_and_alone() -> None:
    remote = _remote({"tp_size": 2}, {"tp_size": 2}, {0: LEADER, 1: LEADER})
    messages, _ = done_messages([_done_reads(remote, "r1"), _done_reads(remote, "r2")], "reader")
    assert [(a, n.parse_done_notification(m)) for a, m in messages] == [
        ("leader", ("p", "r1", "d", 0, [0])),
        ("leader", ("p", "r1", "d", 1, [1])),
        ("leader", ("p", "r2", "d", 0, [0])),
        ("leader", ("p", "r2", "d", 1, [1])),
    ]
    # One pull of one rank to a peer with done_batches: a plain done notification.
    single = _remote({"tp_size": 1}, {"tp_size": 1}, {0: LEADER})
    single.done_batches = True
    ((agent, msg),) = done_messages([_done_reads(single, "r1")], "reader")[0]
    assert agent == "leader" and n.parse_done_notification(msg) == ("p", "r1", "d", 0, [0])


def test_done_notifications_leave_out_the_ranks_the_reader_holds_itself() -> None:
    """A reader that holds some of a spread engine's ranks (it leads the engine, or follows its leader)
    marks those done in its own record (own_ranks.py): it notifies only the other holders."""
    remote = _remote({"tp_size": 4}, {"tp_size": 2}, {0: LEADER, 1: LEADER, 2: MEMBER, 3: MEMBER})
    reads = DoneReads(remote, "r1", "d", list(enumerate(remote.plan.decode_ranks)), own={0, 1})
    messages, addresses = done_messages([reads], "leader")
    assert addresses == {MEMBER.address}
    assert [(a, n.parse_done_notification(m)) for a, m in messages] == [
        ("member", ("p", "r1", "d", 1, [2, 3]))
    ]


def test_done_notifications_joined_are_split_at_max_dones() -> None:
    remote = _remote({"tp_size": 1}, {"tp_size": 1}, {0: LEADER})
    remote.done_batches = True
    pulls = [_done_reads(remote, f"r{i}") for i in range(MAX_DONES + 3)]
    messages, _ = done_messages(pulls, "reader")
    parts = [n.parse_done_batch(m) for _, m in messages]
    assert [len(p or []) for p in parts] == [MAX_DONES, 3]
    assert [r[1] for p in parts for r in p or [] if r is not None] == [f"r{i}" for i in range(MAX_DONES + 3)]


def test_a_pull_whose_holders_cannot_be_named_leaves_the_others_done_notifications_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    whole = _remote({"tp_size": 1}, {"tp_size": 1}, {0: LEADER})
    whole.done_batches = True
    missing = _remote({"tp_size": 2}, {"tp_size": 2}, {0: LEADER})  # rank 1's holder unknown
    messages, _ = done_messages(
        [_done_reads(whole, "r1"), _done_reads(missing, "bad"), _done_reads(whole, "r2")], "reader"
    )
    ((agent, msg),) = messages
    assert agent == "leader"
    assert [r[1] for r in n.parse_done_batch(msg) or [] if r is not None] == ["r1", "r2"]
    assert "no done notification for request 'bad'" in caplog.text


def test_an_open_a_push_carries_leaves_the_reader_spec_to_its_push() -> None:
    """A staged Push names the reader's spec once for every request it opens; an OpenRead (a call or a
    notification, which a member sidecar of a multi-node engine may get without a handshake) names it."""
    remote = _remote({}, {}, {0: LEADER})
    opener = Opener(Identity("reader", "10.0.0.9:50061"), None, None, None)  # type: ignore[arg-type]
    req = engine_pb2.PullRequest(
        engine_id="d", params=common_pb2.TransferParams(engine_id="p", request_id="r")
    )
    sent, carried = opener.request(remote, req, [0]), opener.request(remote, req, [0], pushed=True)
    assert spec_from_proto(sent.reader_spec) == remote.plan.decode and not carried.HasField("reader_spec")
    sent.ClearField("reader_spec")
    assert sent == carried and carried.plan_hash == remote.plan.hash() and list(carried.reader_ranks) == [0]
    assert (carried.request_id, carried.reader_engine_id, carried.reader_address) == (
        "r",
        "d",
        "10.0.0.9:50061",
    )
