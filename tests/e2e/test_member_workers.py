"""staged_workers on a member sidecar of a multi-node engine: the member reports its ranks' worker agents
to the leader (server/membership.py), so readers take a member's chunks from its worker as they do the
leader's (docs/gpu.md, "Node scaling"; docs/multinode.md). Real sidecar and engine processes on host
rings; a file of its own so that the suite's workers (`--dist loadfile`) run it beside
test_staged_workers.py, the longest file.
"""

from __future__ import annotations

import itertools
import os
import signal

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess

from .conftest import Spawn, logged, metric, spec_dict, wait_for
from .test_device_workers import workers_of
from .test_staged_workers import DESCRIPTORS, WORKER_DESCRIPTORS, WORKERS, _replaced

SPLIT = EngineSpec.from_dict(spec_dict(tp_size=2))
# The member's refresh, set far past PROMPT_S (what a worker's start and its report may take on a loaded
# CI machine): a report that waited for it would fail the test.
SLOW_REFRESH_MS = 600_000
PROMPT_S = 60


def _member_pull(
    leader: EngineProcess, member: EngineProcess, decode: EngineProcess, rid: str, seed: int
) -> dict:
    """Rank 1 fills on the member, rank 0 fills and publishes on the leader; the decode engine pulls
    both ranks (each from the sidecar that holds it), every byte checked."""
    fill = {"cmd": "prefill", "request_id": rid, "block_ids": [3, 4, 5], "num_tokens": 45, "seed": seed}
    assert member.send(fill | {"publish": False})["ok"]
    pub = leader.send(fill)
    assert pub["ok"], pub
    res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [9, 10, 11], "seed": seed})
    assert res["ok"] and res["verified"] and res["path"] == "host-ring", res
    return res


def test_a_member_sidecars_ranks_send_from_its_worker_once_reported_and_after_it_is_replaced(
    spawn: Spawn,
) -> None:
    """A prefill engine over a leader and a member sidecar, all with workers: the member reports its
    worker's agent to the leader as soon as the worker is ready, readers then take rank 1's chunks from
    that worker (its WRITEs, none of the member sidecar's own). SIGKILLed, the worker is replaced: every
    pull meanwhile is exact, and the new worker sends again. The member's own refresh is set far past
    the test's waits, so both reports must come when the worker changes, not at a refresh."""
    wait = ["--leader-wait-ms", "5000"]
    lead = spawn(SidecarProcess("swm-leader", extra=[*WORKERS, *wait]))
    memb = spawn(
        SidecarProcess("swm-member", extra=[*WORKERS, *wait, "--member-refresh-ms", str(SLOW_REFRESH_MS)])
    )
    ds = spawn(SidecarProcess("swm-decode", extra=WORKERS))
    leader = spawn(EngineProcess(lead.socket, "swm-p", SPLIT, ranks=[0]))
    member, decode = spawn.together(
        lambda: EngineProcess(memb.socket, "swm-p", SPLIT, ranks=[1], leader=lead.peer_address),
        lambda: EngineProcess(ds.socket, "swm-d", SPLIT),
    )

    def through_worker(rid: str, seed: int) -> bool:
        """One pull, exact; whether the member's worker sent rank 1 (and the member sidecar nothing)."""
        before = metric(memb.metrics_port, f"{WORKER_DESCRIPTORS}_count", '{device="-1"}')
        own = metric(memb.metrics_port, f"{DESCRIPTORS}_count")
        _member_pull(leader, member, decode, rid, seed)
        sent = metric(memb.metrics_port, f"{WORKER_DESCRIPTORS}_count", '{device="-1"}') > before
        assert not sent or metric(memb.metrics_port, f"{DESCRIPTORS}_count") == own
        return sent

    # Until its worker is ready and reported, the member sidecar sends.
    n = itertools.count()
    wait_for(
        "the member's worker sends rank 1", lambda: through_worker(f"a{next(n)}", next(n)), timeout_s=PROMPT_S
    )
    assert through_worker("steady", 7), "once reported, every pull of rank 1 goes through it"

    (old,) = workers_of(memb)
    os.kill(old, signal.SIGKILL)
    wait_for("the member's worker replaced", lambda: _replaced(memb, (old,)), timeout_s=60)
    assert logged(memb, "data-plane worker of device -1 died")
    wait_for(
        "the new worker sends rank 1", lambda: through_worker(f"b{next(n)}", next(n)), timeout_s=PROMPT_S
    )
    assert lead.alive and memb.alive and ds.alive
