"""A TP decode engine's workers pull their own ranks of one request at the same time.

vLLM with TP=N runs N worker processes; each asks the sidecar for its own rank
(`ranks=[r]`) of the same request, concurrently. Here the decode engine is TP2
split over two reference-engine processes (ranks 0 and 1, one each), as a
vLLM engine's workers would be. Pulls with disjoint ranks run side by side;
overlapping ranks are refused with ALREADY_EXISTS naming the ranks; Abort
stops all of them; unregistering a rank stops only the pull that fills it.

To hold pulls in flight honestly, the prefill sidecar is frozen with SIGSTOP
(their OpenRead waits on a live TCP connection) and thawed with SIGCONT.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kv_sidecar.plan.pair import plan_pair
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess, together
from kv_sidecar_client import SidecarClient, params_from_json

from .conftest import (
    Spawn,
    frozen,
    in_background,
    no_transfer_in_flight,
    pulls_in_flight,
    spec_dict,
    wait_for,
)
from .events import no_event, wait_event

_ids = itertools.count()
DECODE = EngineSpec.from_dict(spec_dict(tp_size=2))


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[SidecarProcess, SidecarProcess]]:
    """Sidecars of their own: the tests freeze the prefill one."""
    a, b = together(lambda: SidecarProcess("ranks-prefill"), lambda: SidecarProcess("ranks-decode"))
    yield a, b
    assert (a.stop(), b.stop()) == (0, 0)


def _engines(
    spawn: Spawn, prefill_socket: str, decode_socket: str, p_tp: int, tag: str
) -> tuple[EngineProcess, list[EngineProcess]]:
    n = next(_ids)
    pspec = EngineSpec.from_dict(spec_dict(tp_size=p_tp))
    # One decode engine, TP2, one process per rank (like a TP engine's workers, which start together).
    did = f"cr-d-{tag}-{n}"
    prefill, *workers = spawn.together(
        lambda: EngineProcess(prefill_socket, f"cr-p-{tag}-{n}", pspec),
        lambda: EngineProcess(decode_socket, did, DECODE, ranks=[0]),
        lambda: EngineProcess(decode_socket, did, DECODE, ranks=[1]),
    )
    return prefill, workers


def _publish(prefill: EngineProcess, seed: int) -> dict[str, Any]:
    rid = f"cr-{next(_ids)}"
    pub = prefill.send(
        {"cmd": "prefill", "request_id": rid, "block_ids": [9, 2, 30], "num_tokens": 40, "seed": seed}
    )
    assert pub["ok"], pub
    return pub["params"]


def _pull(worker: EngineProcess, params: dict[str, Any], rank: int, seed: int) -> dict[str, Any]:
    return worker.send(
        {
            "cmd": "pull",
            "params": params,
            "block_ids": [7, 50, 1],
            "seed": seed,
            "ranks": [rank],
            "timeout_s": 60,
        }
    )


def _go(
    start: threading.Barrier, worker: EngineProcess, params: dict[str, Any], rank: int, seed: int
) -> dict[str, Any]:
    start.wait()  # both workers ask at once
    return _pull(worker, params, rank, seed)


def _consumed_once_per_prefill_rank(prefill: EngineProcess, request_id: str) -> None:
    got = sorted(wait_event(prefill, "consumed", request_id)["rank"] for _ in range(prefill.spec.tp_size))
    assert got == list(range(prefill.spec.tp_size)), got
    no_event(prefill, request_id, wait_s=0.5)  # and nothing more: "consumed" exactly once per rank


@pytest.mark.parametrize("where", ["other", "same"])
@pytest.mark.parametrize("p_tp", [1, 2])
def test_concurrent_pulls_of_disjoint_ranks_are_bit_exact(
    pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn, p_tp: int, where: str
) -> None:
    a, b = pair
    prefill, workers = _engines(spawn, a.socket, (b if where == "other" else a).socket, p_tp, where)
    # TP2 -> TP2 over NIXL READs whole blocks into place; TP1 -> TP2 splits heads through staging.
    path = {"same": "host-direct", "other": "host-nixl" if p_tp == 2 else "host-nixl-staged"}[where]
    # Each worker receives its own half of the heads (2 of 4), 2 layers, K and V, 16 dims, fp16:
    # whole blocks (3 x 16 tokens) when the plan is the identity (TP2 -> TP2: blocks are copied
    # or READ in place), else the request's 40 tokens (a head split converts token by token).
    tokens = 48 if p_tp == 2 else 40
    for round_ in range(2):  # the first round includes the handshake
        seed = 100 + round_
        params = _publish(prefill, seed)
        start = threading.Barrier(2)
        results = [
            in_background(lambda r=r, p=params, s=seed, go=start: _go(go, workers[r], p, r, s))
            for r in (0, 1)
        ]
        for rank, res in enumerate(r() for r in results):
            assert res["ok"] and res["verified"], (rank, res)
            assert res["path"] == path, res
            assert res["bytes"] == tokens * 2 * 2 * 2 * 16 * 2, res
        _consumed_once_per_prefill_rank(prefill, params["request_id"])


def test_overlapping_ranks_are_refused_while_disjoint_ones_run(
    pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn
) -> None:
    a, b = pair
    prefill, workers = _engines(spawn, a.socket, b.socket, 1, "overlap")
    assert _pull(workers[0], _publish(prefill, 1), 0, 1)["ok"]  # handshake done before freezing
    params = _publish(prefill, 2)
    rid = params["request_id"]
    with frozen(a):
        first = in_background(lambda: _pull(workers[0], params, 0, 2))
        wait_for("the rank-0 pull to be in flight", lambda: pulls_in_flight(b.socket, rid) == 1)
        with SidecarClient(b.socket) as client:
            for ranks in ([0], [1, 0]):
                res = client.pull(params_from_json(params), workers[0].engine_id, [7, 50, 1], ranks=ranks)
                assert (res.ok, res.error_code) == (False, "ALREADY_EXISTS"), res
                assert f"request {rid!r}" in res.error and "rank(s) [0]" in res.error, res.error
        second = in_background(lambda: _pull(workers[1], params, 1, 2))
        wait_for("both pulls to be in flight", lambda: pulls_in_flight(b.socket, rid) == 2)
    for res in (first(), second()):
        assert res["ok"] and res["verified"], res
    _consumed_once_per_prefill_rank(prefill, rid)


def test_abort_stops_every_pull_of_the_request(
    pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn
) -> None:
    a, b = pair
    prefill, workers = _engines(spawn, a.socket, b.socket, 1, "abort")
    assert _pull(workers[0], _publish(prefill, 1), 0, 1)["ok"]
    params = _publish(prefill, 3)
    rid = params["request_id"]
    with frozen(a):
        results = [in_background(lambda r=r: _pull(workers[r], params, r, 3)) for r in (0, 1)]
        wait_for("both pulls to be in flight", lambda: pulls_in_flight(b.socket, rid) == 2)
        with SidecarClient(b.socket) as client:
            assert client.abort(workers[0].engine_id, rid)
    for res in (r() for r in results):
        assert (res["ok"], res["error_code"]) == (False, "CANCELLED"), res
        assert "aborted by the engine" in res["error"] and res["unfilled_blocks"] == [7, 50, 1], res
        assert res["verified"], res  # nothing outside the requested blocks was written
    # The reader is gone for good: the prefill engine may free the blocks now.
    wait_event(prefill, "released", rid, timeout_s=10)
    no_transfer_in_flight(a, b)  # the reads the frozen source opened late ended with the release


def test_unregistering_a_rank_stops_only_its_pull(
    pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn
) -> None:
    a, b = pair
    prefill, workers = _engines(spawn, a.socket, b.socket, 2, "unreg")
    assert _pull(workers[0], _publish(prefill, 1), 0, 1)["ok"]
    assert _pull(workers[1], _publish(prefill, 1), 1, 1)["ok"]
    params = _publish(prefill, 4)
    rid = params["request_id"]
    with frozen(a):
        results = [in_background(lambda r=r: _pull(workers[r], params, r, 4)) for r in (0, 1)]
        wait_for("both pulls to be in flight", lambda: pulls_in_flight(b.socket, rid) == 2)

        def unregister() -> dict[str, Any]:
            with SidecarClient(b.socket) as client:
                client.unregister_rank(workers[1].engine_id, 1)  # returns once rank 1's pull has stopped
            return {"ok": True}

        unregistered = in_background(unregister)
        time.sleep(0.3)
    assert unregistered()["ok"]
    kept, stopped = (r() for r in results)
    assert kept["ok"] and kept["verified"], kept
    assert (stopped["ok"], stopped["error_code"]) == (False, "CANCELLED"), stopped
    assert "rank 1 was unregistered" in stopped["error"], stopped
    # Decode rank 0 read prefill rank 0 (TP2 -> TP2), so rank 0 is consumed, unless rank 1's pull
    # ended first and released the request (its reader is gone) before rank 0's notification came.
    # A release reaches every prefill rank, in no fixed order, so rank 1's may come first.
    assert plan_pair(prefill.spec, DECODE).consumers_of(0) == {0}
    seen: list[tuple[str, int]] = []
    while not any(rank == 0 for _, rank in seen):
        ev = prefill.send({"cmd": "next_event", "timeout_s": 10})
        assert ev["ok"], (ev, seen)
        if ev["request_id"] == rid:  # skip the warm-up requests' events
            seen.append((ev["kind"], ev["rank"]))
    assert seen[-1] in {("consumed", 0), ("released", 0)}, seen
    assert set(seen[:-1]) <= {("released", 1)}, seen
