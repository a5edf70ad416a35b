"""Leases, completion and early release through real sidecars and engine processes (issue 5, items 2-3)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest

from kv_sidecar.plan.pair import plan_pair
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess, together
from kv_sidecar_client import SidecarClient, params_from_json

from .conftest import Spawn, spec_dict
from .events import no_event, wait_event

SPEC = EngineSpec.from_dict(spec_dict())
_ids = itertools.count()


@pytest.fixture(scope="module")
def engines(sidecar_pair: tuple[SidecarProcess, SidecarProcess]) -> Iterator[dict[str, EngineProcess]]:
    """A prefill engine on sidecar a; decode engines on b (NIXL path) and on a (direct path)."""
    a, b = sidecar_pair
    procs: dict[str, EngineProcess] = {}
    try:
        started = together(
            lambda: EngineProcess(a.socket, "lease-p", SPEC),
            lambda: EngineProcess(b.socket, "lease-d-remote", SPEC),
            lambda: EngineProcess(a.socket, "lease-d-local", SPEC),
        )
        procs.update(zip(("prefill", "nixl", "direct"), started, strict=True))
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def _publish(prefill: EngineProcess, lease_ms: int = 0, blocks: list[int] | None = None) -> dict:
    rid = f"lease-{next(_ids)}"
    blocks = blocks or [3, 4, 5]
    pub = prefill.send(
        {
            "cmd": "prefill",
            "request_id": rid,
            "block_ids": blocks,
            "num_tokens": 16 * len(blocks) - 5,
            "seed": 11,
            "lease_ms": lease_ms,
        }
    )
    assert pub["ok"], pub
    return pub["params"]


def _remaining_ms(params: dict) -> float:
    return int(params["lease_deadline_unix_ms"]) - time.time() * 1000


def test_default_and_per_request_lease(engines: dict[str, EngineProcess]) -> None:
    assert 28_000 < _remaining_ms(_publish(engines["prefill"])) <= 30_000
    assert 3_000 < _remaining_ms(_publish(engines["prefill"], lease_ms=5_000)) <= 5_000


@pytest.mark.parametrize("where", ["nixl", "direct"])
def test_keepalive_heartbeats_hold_the_lease_past_its_deadline(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess], engines: dict[str, EngineProcess], where: str
) -> None:
    decode = engines[where]
    params = _publish(engines["prefill"], lease_ms=2000)
    original = int(params["lease_deadline_unix_ms"])
    # The decode engine waits (e.g. in a queue) and heartbeats through its own sidecar.
    with SidecarClient(decode_socket(sidecar_pair, where)) as c:
        while time.time() * 1000 < original + 2_000:
            (deadline,) = c.keep_alive([params_from_json(params)])
            assert deadline > time.time() * 1000 + 1_000, f"a heartbeat must extend the lease: {deadline}"
            time.sleep(0.3)
    res = decode.send({"cmd": "pull", "params": params, "block_ids": [20, 21, 22], "seed": 11})
    assert res["ok"] and res["verified"], res
    wait_event(engines["prefill"], "consumed", params["request_id"])


def decode_socket(pair: tuple[SidecarProcess, SidecarProcess], where: str) -> str:
    return pair[1].socket if where == "nixl" else pair[0].socket


@pytest.mark.parametrize("where", ["nixl", "direct"])
def test_expired_lease_is_announced_and_never_read(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess], engines: dict[str, EngineProcess], where: str
) -> None:
    params = _publish(engines["prefill"], lease_ms=300)
    ev = wait_event(engines["prefill"], "lease_expired", params["request_id"], timeout_s=5)
    assert ev["block_ids"] == [3, 4, 5]
    with SidecarClient(decode_socket(sidecar_pair, where)) as c:
        assert c.keep_alive([params_from_json(params)]) == [0]  # too late to extend
    res = engines[where].send({"cmd": "pull", "params": params, "block_ids": [30, 31, 32], "seed": 11})
    assert res["error_code"] == "FAILED_PRECONDITION", res
    assert "lease" in res["error"] and "expired" in res["error"], res["error"]
    assert res["unfilled_blocks"] == [30, 31, 32]
    assert res["untouched"], "a pull after expiry must not read the (possibly reused) blocks"


@pytest.mark.parametrize("where", ["nixl", "direct"])
def test_decode_abort_releases_the_blocks_early(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess], engines: dict[str, EngineProcess], where: str
) -> None:
    params = _publish(engines["prefill"])  # 30 s lease: only the abort can end it this soon
    decode_id = engines[where].engine_id
    with SidecarClient(decode_socket(sidecar_pair, where)) as c:
        assert c.abort(decode_id, params["request_id"], params_from_json(params))
    ev = wait_event(engines["prefill"], "released", params["request_id"], timeout_s=5)
    assert ev["block_ids"] == [3, 4, 5]
    res = engines[where].send({"cmd": "pull", "params": params, "block_ids": [40, 41, 42], "seed": 11})
    assert res["error_code"] == "NOT_FOUND" and "released" in res["error"], res
    assert res["untouched"]


# Completion: decode ranks are pulled in groups; after each group, exactly the prefill
# ranks whose consumers (from the plan) are all done get "consumed", the others nothing.
MLA = {"num_kv_heads": 1, "head_dim": 32, "layout": "mla"}
COMPLETION: dict[str, tuple[dict, dict, list[list[int]]]] = {
    "tp1-to-tp2": ({"tp_size": 1}, {"tp_size": 2}, [[0], [1]]),
    "tp2-to-tp1": ({"tp_size": 2}, {"tp_size": 1}, [[0]]),
    "tp2-to-tp4": ({"tp_size": 2}, {"tp_size": 4}, [[0, 1], [3], [2]]),
    "mla-tp1-to-tp2": (MLA | {"tp_size": 1}, MLA | {"tp_size": 2}, [[1], [0]]),
    "mla-tp4-to-tp2": (MLA | {"tp_size": 4}, MLA | {"tp_size": 2}, [[0], [1]]),
}


@pytest.mark.parametrize("case", list(COMPLETION))
def test_each_prefill_rank_is_consumed_when_its_decode_ranks_are_done(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess], case: str, spawn: Spawn
) -> None:
    a, b = sidecar_pair
    p_over, d_over, groups = COMPLETION[case]
    pspec, dspec = EngineSpec.from_dict(spec_dict(**p_over)), EngineSpec.from_dict(spec_dict(**d_over))
    plan = plan_pair(pspec, dspec)
    n = next(_ids)
    prefill, decode = spawn.together(
        lambda: EngineProcess(a.socket, f"c-p-{case}-{n}", pspec),
        lambda: EngineProcess(b.socket, f"c-d-{case}-{n}", dspec),
    )
    pub = prefill.send(
        {"cmd": "prefill", "request_id": "r", "block_ids": [1, 2], "num_tokens": 20, "seed": n}
    )
    done: set[int] = set()
    told: set[int] = set()
    for group in groups:
        res = decode.send(
            {"cmd": "pull", "params": pub["params"], "block_ids": [7, 9], "seed": n, "ranks": group}
        )
        assert res["ok"] and res["verified"], res
        done |= set(group)
        due = {p for p in range(pspec.tp_size) if plan.consumers_of(p) <= done} - told
        got = {wait_event(prefill, "consumed", "r")["rank"] for _ in due}
        assert got == due, f"after decode ranks {sorted(done)}: consumed {got}, expected {due}"
        told |= got
        if len(told) < pspec.tp_size:
            no_event(prefill, "r", wait_s=0.5)  # nobody else is told early
    assert told == set(range(pspec.tp_size))
