"""Issue 10's failure cases as scenarios, shared by the dense model (test_pd_failures.py), the
Gemma-3 hybrid (test_hybrid_failures.py, test_hybrid.py) and the Mamba hybrid
(test_hybrid_ssm_failures.py): a sidecar killed mid-pull and restarted, abort of a waiting request,
a waiting request kept alive past its lease, a request nobody pulls freed at lease expiry, and (for a
model of several KV cache groups) a failed pull of one group.

Each scenario runs on a `FailurePair` (an EnginePair whose prefill engine `P` publishes through `sp`
and whose decode engine `D` pulls through `sd`) and checks what issue 10 asks of every model: the
decode output equals the one-engine reference, nothing hangs, the prefill engine's free blocks
return to their starting count (every KV cache group's), and the pair works again afterwards.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from kv_sidecar.refengine.procs import SidecarProcess
from kv_sidecar_client import SidecarClient, params_from_json

from .harness import EnginePair, VllmEngine, assert_same_output, metric, pulls_of, wait_until

Side = Literal["prefill", "decode"]


def pulling(sidecar: SidecarProcess) -> bool:
    with SidecarClient(sidecar.socket) as c:
        return len(c.status().inflight) > 0


def registered_ranks(sidecar: SidecarProcess) -> int:
    with SidecarClient(sidecar.socket) as c:
        return len(c.status().ranks)


def published(sidecar: SidecarProcess) -> int:
    with SidecarClient(sidecar.socket) as c:
        return c.status().published_requests


class FailurePair(EnginePair):
    """An EnginePair with one prefill engine `P` (on `sp`) and one decode engine `D` (on `sd`) whose
    sidecars the scenarios kill and restart; `groups`: the pull records of one request (its KV cache
    groups); `pull_timeout_s`: the connectors' pull timeout (what a pull may wait at worst)."""

    P: VllmEngine
    D: VllmEngine
    groups: int
    pull_timeout_s: float

    def restart(self, side: Side) -> None:
        """A new sidecar on the killed one's socket (new peer and metrics ports), as a restarted pod's."""
        old = self.sp if side == "prefill" else self.sd
        new = SidecarProcess(old.name, workdir=old.workdir)
        if side == "prefill":
            self.sp = new
        else:
            self.sd = new


@contextmanager
def killed_mid_pull(pair: FailurePair, side: Side) -> Iterator[None]:
    """Kill one sidecar while the decode engine's pulls are in flight, during the `with` body (which
    starts them). The prefill sidecar is stopped first so that the pulls surely wait for it; the
    decode sidecar's status shows them in flight before the kill."""
    os.kill(pair.sp.proc.pid, signal.SIGSTOP)
    victim = pair.sp if side == "prefill" else pair.sd

    def kill_when_pulling() -> None:
        try:
            wait_until(lambda: pulling(pair.sd), 60, "the decode sidecar to start the pulls")
        finally:  # killed whatever happens: a stopped sidecar left behind would hang the next test
            victim.kill()

    killer = threading.Thread(target=kill_when_pulling)
    killer.start()
    try:
        yield
    finally:
        killer.join()
        if pair.sp.alive:
            os.kill(pair.sp.proc.pid, signal.SIGCONT)


def works_again(pair: FailurePair, prompt: list[int]) -> None:
    """A request through both (new) sidecars decodes as one engine, every group pulled, and the prefill
    engine gets every block back without waiting for a lease."""
    wait_until(lambda: registered_ranks(pair.sp) == 1, 60, "the prefill engine to register again")
    wait_until(lambda: registered_ranks(pair.sd) == 1, 60, "the decode engine to register again")
    want = pair.reference([prompt])
    (params,) = pair.prefill(pair.P, [prompt])
    for p in params.get("kv_sidecar_groups", [{"params": params.get("kv_sidecar")}]):
        assert p["params"]["sidecar_address"] == pair.sp.peer_address, params
    got, ids = pair.decode(pair.D, [prompt], [params])
    assert_same_output(got, want, (len(prompt),))
    pulls = pulls_of(pair.D, ids)[ids[0]]
    assert len(pulls) == pair.groups and all(q["ok"] for q in pulls), pulls
    pair.settled(pair.P)


def sidecar_killed_mid_pull_then_restarted(
    pair: FailurePair, side: Side, prompt: list[int], again: list[int]
) -> list[dict[str, Any]]:
    """The decode engine pulls a request while `side`'s sidecar is killed: its pulls fail, it computes
    the request (all of it, or the blocks not filled) with the reference's output in bounded time; the
    prefill engine frees every block it held once its sidecar no longer holds the request (a restarted
    prefill sidecar knows none; a live one is told by the decode engine, through its restarted sidecar,
    to release them); the killed sidecar restarts and the pair works again (`again`). Returns the failed
    request's pull records."""
    start = pair.free[pair.P.name]
    want = pair.reference([prompt])
    (params,) = pair.prefill(pair.P, [prompt])
    held = pair.P.state()["free_blocks"]
    assert held < start
    expiries = metric(pair.sp.metrics_port, "kvsidecar_lease_expiries_total")

    t0 = time.monotonic()
    with killed_mid_pull(pair, side):
        got, ids = pair.decode(pair.D, [prompt], [params])
    took = time.monotonic() - t0
    still_held = pair.P.state()["free_blocks"]
    pair.restart(side)  # before any check: a failing one must not leave the module's pair without it
    assert_same_output(got, want, (len(prompt),))
    assert took < pair.pull_timeout_s + 30, f"the request took {took:.0f} s: a pull waited past its timeout"
    pulls = pulls_of(pair.D, ids)[ids[0]]
    assert len(pulls) == pair.groups and not all(q["ok"] for q in pulls), pulls

    if side == "prefill":
        # Every block was still held: the engine learns that its sidecar is gone only from the new one,
        # which knows none of its records; then it frees them all.
        assert still_held == held
        settled = pair.P.settle(60)
        assert settled["ok"] and settled["free_blocks"] == start, settled
    else:
        # The prefill sidecar lives on, holding the records the dead decode sidecar was reading. The
        # decode engine, which computed the request, releases them through its new sidecar: the blocks
        # come back long before their lease ends.
        pair.settled(pair.P)
        assert metric(pair.sp.metrics_port, "kvsidecar_lease_expiries_total") == expiries
    works_again(pair, again)
    return pulls


def abort_of_a_waiting_request_releases_every_group(
    pair: EnginePair, prefill: VllmEngine, decode: VllmEngine, prompt: list[int]
) -> None:
    """Aborted while queued at the decode engine (never stepped): the prefill engine gets every group's
    record released at once, and frees them long before the lease."""
    (params,) = pair.prefill(prefill, [prompt])
    assert prefill.state()["free_blocks"] < pair.free[prefill.name]
    (did,) = pair.ids("abort-", 1)
    expiries = metric(pair.sp.metrics_port, "kvsidecar_lease_expiries_total")
    decode.call({"cmd": "add", "id": did, "prompt": prompt, "max_tokens": 5, "kv_transfer_params": params})
    decode.call({"cmd": "abort", "ids": [did]})
    t0 = time.monotonic()
    pair.settled(prefill)  # within a third of the lease: released, not expired
    assert time.monotonic() - t0 < pair.lease_ms / 1000 / 3
    assert metric(pair.sp.metrics_port, "kvsidecar_lease_expiries_total") == expiries
    assert published(pair.sp) == 0  # every group's record, a Mamba state block's too
    assert not pulls_of(decode, [did])


def a_waiting_request_is_kept_alive_past_the_lease(
    pair: EnginePair, prefill: VllmEngine, decode: VllmEngine, prompt: list[int], groups: int
) -> None:
    """Queued at the decode engine and not stepped for longer than the lease: only KeepAlive of every
    group's record holds the prefill's blocks; then it pulls them all and decodes as one engine."""
    want = pair.reference([prompt])
    (params,) = pair.prefill(prefill, [prompt])
    (did,) = pair.ids("alive-", 1)
    expiries = metric(pair.sp.metrics_port, "kvsidecar_lease_expiries_total")
    decode.call(
        {
            "cmd": "add",
            "id": did,
            "prompt": prompt,
            "max_tokens": pair.max_tokens,
            "logprobs": 0,
            "kv_transfer_params": params,
        }
    )
    time.sleep(pair.lease_ms / 1000 + 2)
    out = decode.call({"cmd": "run", "ids": [did]})["outputs"][did]
    assert_same_output([out], want, (len(prompt),))
    pulls = pulls_of(decode, [did])[did]
    assert len(pulls) == groups and all(q["ok"] for q in pulls), pulls
    assert metric(pair.sp.metrics_port, "kvsidecar_lease_expiries_total") == expiries
    pair.settled(prefill)


def a_request_nobody_pulls_is_freed_at_lease_expiry(
    pair: EnginePair, prefill: VllmEngine, prompt: list[int], groups: int
) -> None:
    """Every group's record expires, and the prefill engine frees every group's blocks."""
    expiries = metric(pair.sp.metrics_port, "kvsidecar_lease_expiries_total")
    pair.prefill(prefill, [prompt])
    assert prefill.state()["free_blocks"] < pair.free[prefill.name]
    state = prefill.settle(pair.lease_ms / 1000 + 10)
    assert state["ok"] and state["free_blocks"] == pair.free[prefill.name], state
    assert metric(pair.sp.metrics_port, "kvsidecar_lease_expiries_total") == expiries + groups


def a_failed_pull_of_one_group_is_computed(
    pair: EnginePair, prefill: VllmEngine, decode: VllmEngine, decode_engine_id: str, p: list[int], group: int
) -> None:
    """Group `group`'s record cannot be pulled (the prefill's sidecar knows no such request): vLLM must
    compute the request from its first token, the other groups' pulls notwithstanding."""
    want = pair.reference([p])
    (params,) = pair.prefill(prefill, [p])
    groups = list(params["kv_sidecar_groups"])
    real = groups[group]["params"]
    groups[group] = groups[group] | {"params": real | {"request_id": "no-such-request"}}
    got, ids = pair.decode(decode, [p], [params | {"kv_sidecar_groups": groups}])
    assert_same_output(got, want, (len(p),))
    pulls = pulls_of(decode, ids)[ids[0]]
    assert sorted(q["ok"] for q in pulls) == [False] + [True] * (len(groups) - 1), pulls
    assert any("no-such-request" in q["error"] for q in pulls), pulls
    # The record never read: release it as its reader would; the prefill then frees the request.
    with SidecarClient(pair.sd.socket) as client:
        assert client.abort(decode_engine_id, real["request_id"], params_from_json(real))
    pair.settled(prefill)
