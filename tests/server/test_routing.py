"""Which sidecar each control call and notification of a pull goes to (pure part of server/routing.py)."""

from __future__ import annotations

import pytest

from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.plan.chunks import chunk_geometry
from kv_sidecar.plan.pair import plan_pair
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.server.peers import Holder, RemoteEngine
from kv_sidecar.server.routing import by_holder, depends_on, holders_needed

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
        by_holder(remote, [0], "leader")  # the reader itself holds rank 0
    assert info.value.code is Code.UNIMPLEMENTED
