"""Engines whose ranks span several sidecars (multi-node TP), through four real sidecar processes.

Sidecars a, b, c, d stand for four nodes. A prefill engine spread over a
(leader) and b publishes on a; the transfer params carry only the engine id
and a's address; decode sidecars learn from a which sidecar holds each rank,
read every rank from its own sidecar, and each prefill rank hears "consumed"
on the sidecar it is registered on.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kv_sidecar.plan.pair import plan_pair
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess, together
from kv_sidecar.server.membership import REFRESH_S
from kv_sidecar_client import KVSidecarError, SidecarClient
from kv_sidecar_client.shm import ShmKVCache

from .conftest import Spawn, no_transfer_in_flight, spec_dict

Nodes = dict[str, SidecarProcess]
_ids = itertools.count()
TOKENS = 75  # not a multiple of the block size: the last block is partial


LEADER_WAIT_MS = 1500


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    names = ("a", "b", "c", "d")
    # NIXL start-up dominates; overlap it. A member waits LEADER_WAIT_MS for its leader's ranks.
    wait = ["--leader-wait-ms", str(LEADER_WAIT_MS)]
    procs = dict(
        zip(
            names,
            together(*(lambda n=n: SidecarProcess(f"node-{n}", extra=wait) for n in names)),
            strict=True,
        )
    )
    yield procs
    codes = {n: p.stop() for n, p in procs.items()}
    assert all(c == 0 for c in codes.values()), f"sidecars exited with {codes}:\n" + "\n".join(
        line for p in procs.values() for line in p.stderr_tail
    )
    assert not any(os.path.exists(p.socket) for p in procs.values())


def _engine(
    nodes: Nodes, placement: dict[str, list[int]], engine_id: str, spec: EngineSpec
) -> dict[str, EngineProcess]:
    """One engine process per sidecar, holding the given ranks; the first sidecar named is the leader."""
    leader = next(iter(placement))
    procs: dict[str, EngineProcess] = {}
    try:
        for node, ranks in placement.items():  # the leader's ranks register first
            procs[node] = EngineProcess(
                nodes[node].socket,
                engine_id,
                spec,
                ranks=ranks,
                leader="" if node == leader else nodes[leader].peer_address,
            )
    except BaseException:
        for p in procs.values():
            p.stop()
        raise
    return procs


def _events(proc: EngineProcess, count: int, timeout_s: float = 10) -> list[tuple[str, str, int]]:
    out = []
    for _ in range(count):
        ev = proc.send({"cmd": "next_event", "timeout_s": timeout_s})
        assert ev["ok"], ev
        out.append((ev["kind"], ev["request_id"], ev["rank"]))
    return out


def _no_event(proc: EngineProcess) -> None:
    ev = proc.send({"cmd": "next_event", "timeout_s": 0.3})
    assert not ev["ok"], f"unexpected event {ev}"


CASES = {
    # name: (prefill overrides, prefill placement, decode overrides, decode placement, path)
    "p4-over-a,b-to-d2-on-c": (
        {"tp_size": 4},
        {"a": [0, 1], "b": [2, 3]},
        {"tp_size": 2, "layout": "flash_attn_hnd"},
        {"c": [0, 1]},
        "host-nixl-staged",
    ),
    "p2-over-a,b-to-d4-over-c,d": (
        {"tp_size": 2},
        {"a": [0], "b": [1]},
        {"tp_size": 4, "block_size": 32},
        {"c": [0, 1], "d": [2, 3]},
        "host-nixl-staged",
    ),
    "p2-over-a,b-to-d2-over-c,d-identity": (
        {"tp_size": 2},
        {"a": [0], "b": [1]},
        {"tp_size": 2},
        {"c": [0], "d": [1]},
        "host-nixl",
    ),
    # Both engines spread over the same two sidecars, each decode rank beside the prefill ranks it
    # reads: each sidecar copies its own ranks (the leader, and the member from the request the leader
    # forwarded it), and each prefill rank hears "consumed" where it lives.
    "p2-over-a,b-to-d2-over-a,b": (
        {"tp_size": 2},
        {"a": [0], "b": [1]},
        {"tp_size": 2},
        {"a": [0], "b": [1]},
        "host-direct",
    ),
    "p4-over-a,b-to-d2-over-a,b-converted": (
        {"tp_size": 4},
        {"a": [0, 1], "b": [2, 3]},
        {"tp_size": 2, "layout": "flash_attn_hnd", "block_size": 32},
        {"a": [0], "b": [1]},
        "host-direct",
    ),
    # Every prefill rank is consumed by decode ranks on both decode sidecars (MLA round robin).
    "mla-p2-on-a-to-d4-over-c,d": (
        {"tp_size": 2, "num_kv_heads": 1, "head_dim": 32, "layout": "mla"},
        {"a": [0, 1]},
        {"tp_size": 4, "num_kv_heads": 1, "head_dim": 32, "layout": "mla"},
        {"c": [0, 1], "d": [2, 3]},
        "host-nixl-staged",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_split_engines_are_bit_exact(nodes: Nodes, case: str) -> None:
    p_over, p_place, d_over, d_place, path = CASES[case]
    pspec, dspec = EngineSpec.from_dict(spec_dict(**p_over)), EngineSpec.from_dict(spec_dict(**d_over))
    plan = plan_pair(pspec, dspec)
    n = next(_ids)
    prefill = _engine(nodes, p_place, f"p-{n}", pspec)
    try:
        decode = _engine(nodes, d_place, f"d-{n}", dspec)
    except BaseException:
        for p in prefill.values():
            p.stop()
        raise
    procs = [*prefill.values(), *decode.values()]
    try:
        for request in range(2):  # the second pull uses the cached handshake and map
            rid = f"r{request}"
            src = [
                pspec.num_blocks - 1 - 3 * j - request for j in range(math.ceil(TOKENS / pspec.block_size))
            ]
            dst = [5 * j + 1 + request for j in range(math.ceil(TOKENS / dspec.block_size))]
            seed = 100 * n + request
            fill = {"cmd": "prefill", "request_id": rid, "block_ids": src, "num_tokens": TOKENS, "seed": seed}
            leader, *members = prefill
            for node in members:  # ranks on member sidecars only fill; the leader publishes once
                assert prefill[node].send(fill | {"publish": False})["ok"]
            pub = prefill[leader].send(fill)
            assert pub["ok"], pub
            params = pub["params"]
            assert params["sidecar_address"] == nodes[leader].peer_address
            assert params["engine_id"] == f"p-{n}"

            done_decode: set[int] = set()
            told: set[int] = set()
            for node, proc in decode.items():  # each decode sidecar fills the ranks registered on it
                res = proc.send({"cmd": "pull", "params": params, "block_ids": dst, "seed": seed})
                assert res["ok"], res
                assert res["verified"], res["errors"]  # bit-exact, and nothing outside dst changed
                assert res["path"] == path
                done_decode |= set(d_place[node])
                # Exactly the prefill ranks whose every consumer is done hear "consumed", where they live.
                due = {p for p in range(pspec.tp_size) if plan.consumers_of(p) <= done_decode} - told
                for pnode, pproc in prefill.items():
                    mine = sorted(due & set(p_place[pnode]))
                    got = _events(pproc, len(mine))
                    assert sorted(got) == [("consumed", rid, r) for r in mine], (case, node, got)
                    if len(decode) > 1 and node != list(decode)[-1]:
                        _no_event(pproc)
                told |= due
            assert told == set(range(pspec.tp_size))
            no_transfer_in_flight(*nodes.values())
    finally:
        for p in procs:
            p.stop()


SPEC = EngineSpec.from_dict(spec_dict(tp_size=2))


def test_readers_that_hold_some_of_a_spread_engines_ranks_read_the_others_from_their_holders(
    nodes: Nodes,
) -> None:
    """A TP 2 prefill engine over a (leader, rank 0) and b (rank 1). Decode engines on a and b read
    ranks of both: each copies the rank its sidecar holds and reads the other from its holder, the
    leader through a handshake with itself. Bit-exact, nothing outside the blocks written, each
    prefill rank hears "consumed" once, where it lives. A failed such pull leaves the request to
    another reader (here one on c), which reads it whole."""
    n = next(_ids)
    one = EngineSpec.from_dict(spec_dict(tp_size=1))
    prefill = _engine(nodes, {"a": [0], "b": [1]}, f"mix-p-{n}", SPEC)
    procs = list(prefill.values())
    try:
        readers = {
            # name: (sidecar, spec, ranks, path): the plan TP 2 -> TP 1 converts (staged READ);
            # TP 2 -> TP 2 is the identity, read whole from the other holder
            "tp1-on-leader": ("a", one, None, "host-nixl-staged"),
            "tp1-on-member": ("b", one, None, "host-nixl-staged"),
            "tp2-on-leader": ("a", SPEC, None, "host-nixl"),
            "rank1-on-leader": ("a", SPEC, [1], "host-nixl"),
            "rank0-on-member": ("b", SPEC, [0], "host-nixl"),
            "plain-on-c": ("c", one, None, "host-nixl-staged"),
        }
        engines = {}
        for name, (node, spec, ranks, _) in readers.items():
            engines[name] = EngineProcess(nodes[node].socket, f"mix-{name}-{n}", spec, ranks=ranks)
            procs.append(engines[name])

        def publish(rid: str, seed: int) -> dict:
            fill = {"cmd": "prefill", "request_id": rid, "block_ids": [4, 5], "num_tokens": 20, "seed": seed}
            assert prefill["b"].send(fill | {"publish": False})["ok"]
            pub = prefill["a"].send(fill)
            assert pub["ok"], pub
            return pub["params"]

        for k, (name, (_, spec, ranks, path)) in enumerate(readers.items()):
            params = publish(f"mixed-{k}", seed=10 + k)
            res = engines[name].send({"cmd": "pull", "params": params, "block_ids": [2, 3], "seed": 10 + k})
            assert res["ok"] and res["verified"] and res["path"] == path, (name, res)
            # Each prefill rank that every decode rank which depends on it has read hears "consumed".
            plan = plan_pair(SPEC, spec)
            read = set(ranks if ranks is not None else range(spec.tp_size))
            for node, rank in (("a", 0), ("b", 1)):
                if plan.consumers_of(rank) <= read:
                    assert _events(prefill[node], 1) == [("consumed", f"mixed-{k}", rank)], name
                _no_event(prefill[node])

        # A failed pull that read from both (a destination block out of range, found once the opens have
        # answered): nothing written, and the request is left to a reader on another sidecar.
        params = publish("taken-over", seed=40)
        res = engines["tp1-on-member"].send(
            {"cmd": "pull", "params": params, "block_ids": [2, 10**6], "seed": 40}
        )
        assert not res["ok"] and sorted(res["unfilled_blocks"]) == [2, 10**6], res
        assert res["untouched"], res
        res = engines["plain-on-c"].send({"cmd": "pull", "params": params, "block_ids": [2, 3], "seed": 40})
        assert res["ok"] and res["verified"], res
        assert _events(prefill["a"], 1) == [("consumed", "taken-over", 0)]
        assert _events(prefill["b"], 1) == [("consumed", "taken-over", 1)]
        no_transfer_in_flight(*nodes.values())
    finally:
        for p in procs:
            p.stop()


@pytest.fixture
def shm_caches() -> Iterator[list[ShmKVCache]]:
    caches: list[ShmKVCache] = []
    yield caches
    for c in caches:
        c.close()


def _cache(caches: list[ShmKVCache], spec: EngineSpec = SPEC) -> list:
    cache = ShmKVCache(spec.rank_tensor_shapes(), torch.float16)
    caches.append(cache)
    return cache.handles()


def _expect(code: str, fragments: tuple[str, ...], fn) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(KVSidecarError) as info:
        fn()
    assert info.value.code == code, info.value
    for f in fragments:
        assert f in info.value.message, info.value.message


def test_bad_leader_and_split_publish(nodes: Nodes, shm_caches: list[ShmKVCache]) -> None:
    a, b = nodes["a"], nodes["b"]
    eid = f"bad-{next(_ids)}"
    spec = SPEC.to_dict()
    with SidecarClient(a.socket) as ca, SidecarClient(b.socket) as cb:
        # A leader nobody listens on: UNAVAILABLE naming it, and the rank is not left registered.
        _expect(
            "UNAVAILABLE",
            ("127.0.0.1:1", "not reachable", repr(eid)),
            lambda: cb.register_rank(eid, 1, spec, _cache(shm_caches), leader_address="127.0.0.1:1"),
        )
        # A live leader that does not know the engine: its ranks did not register there within
        # leader_wait_ms of this one.
        t0 = time.monotonic()
        _expect(
            "FAILED_PRECONDITION",
            (a.peer_address, f"does not lead engine {eid!r}", "waited 1.5 s for the leader's ranks"),
            lambda: cb.register_rank(eid, 1, spec, _cache(shm_caches), leader_address=a.peer_address),
        )
        assert time.monotonic() - t0 >= LEADER_WAIT_MS / 1000
        resp = ca.register_rank(eid, 0, spec, _cache(shm_caches))
        assert resp.leader_address == a.peer_address
        # The leader refuses a different spec, and a rank it already holds.
        other = SPEC.to_dict() | {"num_blocks": 32}
        _expect(
            "FAILED_PRECONDITION",
            ("differs from the leader's",),
            lambda: cb.register_rank(
                eid, 1, other, _cache(shm_caches, EngineSpec.from_dict(other)), leader_address=a.peer_address
            ),
        )
        _expect(
            "ALREADY_EXISTS",
            ("already registered on the leader",),
            lambda: cb.register_rank(eid, 0, spec, _cache(shm_caches), leader_address=a.peer_address),
        )
        # Until rank 1 registers somewhere, publishing would strand readers: refused.
        _expect(
            "FAILED_PRECONDITION",
            ("[1]", "registered on no sidecar"),
            lambda: ca.publish(eid, "early", [1], 16),
        )
        # Rank 1 registers fine now: the failed attempts left nothing behind on b.
        joined = cb.register_rank(eid, 1, spec, _cache(shm_caches), leader_address=a.peer_address)
        assert joined.leader_address == a.peer_address
        _expect(
            "FAILED_PRECONDITION",
            (f"led by the sidecar at {a.peer_address}", "publish there"),
            lambda: cb.publish(eid, "on-member", [1], 16),
        )
        params = ca.publish(eid, "ok", [1], 16)
        assert params.sidecar_address == a.peer_address
        assert ca.keep_alive([params])[0] > 0  # the leader extends it on b too
        assert ca.abort(eid, "ok")
        # A member rank that leaves is forgotten by the leader.
        cb.unregister_rank(eid, 1)
        _expect(
            "FAILED_PRECONDITION", ("registered on no sidecar",), lambda: ca.publish(eid, "late", [1], 16)
        )
        ca.unregister_rank(eid, 0)


def test_a_member_rank_registering_before_its_leader_waits_for_it(
    nodes: Nodes, shm_caches: list[ShmKVCache]
) -> None:
    """An engine's ranks start together (vLLM's TP workers do): a rank whose sidecar follows a leader may
    register before the leader's own ranks, and its registration waits for them (leader_wait_ms). Every
    rank names the leader alike, by a loopback address as sidecars of one node may (a sidecar per GPU):
    the leader's own rank is the leader's all the same, and answers with its advertised address."""
    a, b = nodes["a"], nodes["b"]
    eid = f"early-{next(_ids)}"
    spec = SPEC.to_dict()
    leader = f"localhost:{a.peer_address.rpartition(':')[2]}"
    with SidecarClient(a.socket) as ca, SidecarClient(b.socket) as cb, ThreadPoolExecutor(1) as pool:
        member = pool.submit(cb.register_rank, eid, 1, spec, _cache(shm_caches), leader_address=leader)
        time.sleep(LEADER_WAIT_MS / 1000 / 3)
        assert not member.done()  # waiting for the leader
        led = ca.register_rank(eid, 0, spec, _cache(shm_caches), leader_address=leader)
        assert led.leader_address == a.peer_address
        assert member.result(LEADER_WAIT_MS / 1000).leader_address == leader
        params = ca.publish(eid, "both-ranks", [1], 16)  # refused were rank 1 on no sidecar
        assert ca.abort(eid, params.request_id)
        cb.unregister_rank(eid, 1)
        ca.unregister_rank(eid, 0)


def test_split_engine_leases_and_aborts_reach_every_rank(nodes: Nodes) -> None:
    """The leader holds the request on its member: expiry is told on both sidecars, an abort releases both."""
    n = next(_ids)
    prefill = _engine(nodes, {"a": [0], "b": [1]}, f"lease-p-{n}", SPEC)
    decode = EngineProcess(nodes["c"].socket, f"lease-d-{n}", SPEC)
    try:
        fill = {"cmd": "prefill", "block_ids": [3], "num_tokens": 16, "seed": 1, "lease_ms": 500}
        for rid in ("aborted", "expiring"):
            assert prefill["b"].send(fill | {"request_id": rid, "publish": False})["ok"]
        assert prefill["a"].send(fill | {"request_id": "aborted"})["ok"]
        assert prefill["a"].send({"cmd": "abort", "request_id": "aborted"})["found"]
        pub = prefill["a"].send(fill | {"request_id": "expiring"})
        # Only "expiring" runs out, on both sidecars: the abort released the member's copy too.
        for node, rank in (("a", 0), ("b", 1)):
            assert _events(prefill[node], 1) == [("lease_expired", "expiring", rank)]
            _no_event(prefill[node])
        res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [7], "seed": 1})
        assert not res["ok"] and res["error_code"] == "FAILED_PRECONDITION", res
        assert "expired" in res["error"] and res["unfilled_blocks"] == [7], res
        assert res["verified"], res["errors"]  # the failed pull wrote nothing
    finally:
        for p in [*prefill.values(), decode]:
            p.stop()


def test_leader_that_lost_its_map_gets_it_back(nodes: Nodes) -> None:
    """The leader's engine process restarts: the leader forgets the map, the member's next refresh restores it."""
    n = next(_ids)
    eid = f"relead-{n}"
    prefill = _engine(nodes, {"a": [0], "b": [1]}, eid, SPEC)
    decode = EngineProcess(nodes["c"].socket, f"relead-d-{n}", SPEC)
    try:
        prefill["a"].stop()  # rank 0 unregisters: a holds no rank of the engine and drops its map
        lost = time.monotonic()
        prefill["a"] = EngineProcess(nodes["a"].socket, eid, SPEC, ranks=[0])
        fill = {"cmd": "prefill", "request_id": "r", "block_ids": [4, 9], "num_tokens": 20, "seed": 5}
        assert prefill["b"].send(fill | {"publish": False})["ok"]
        pub = prefill["a"].send(fill)
        if pub["ok"]:  # only where the engine's restart outlasted a member's refresh (a loaded machine)
            assert time.monotonic() - lost > REFRESH_S, pub
        else:
            assert "[1]" in pub["error"] and "registered on no sidecar" in pub["error"], pub
        deadline = time.monotonic() + 10 * REFRESH_S
        while not pub["ok"] and time.monotonic() < deadline:
            time.sleep(0.2)
            pub = prefill["a"].send(fill)
        assert pub["ok"], pub
        res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [2, 3], "seed": 5})
        assert res["ok"] and res["verified"], res
        for node, rank in (("a", 0), ("b", 1)):
            assert _events(prefill[node], 1) == [("consumed", "r", rank)]
        no_transfer_in_flight(*nodes.values())
    finally:
        for p in [*prefill.values(), decode]:
            p.stop()


def test_a_member_sidecar_restarted_under_a_new_id_is_handshaken_again(spawn: Spawn) -> None:
    """A prefill engine over a (leader) and b (member); a decode engine on c reads with host_transfer:
    ring (staged Pushes to each rank's holder). b comes back under a new id (a crashed container
    restarted at its pod's address); the params, which name only the leader, do not show it. The Push
    to b names the agent the reader's handshake expects the chunks from, and the new b, whose agent that
    is not, refuses it saying to handshake again; the pull does, and arrives exact. Until 2026-11-29
    the new b sent its chunks anyway and every such pull failed INTERNAL ("broke the staged protocol"):
    c's cached handshake named the old b's agent."""
    wait = ["--leader-wait-ms", str(LEADER_WAIT_MS)]
    a, b, c = spawn.together(
        lambda: SidecarProcess("mrs-a", extra=wait),
        lambda: SidecarProcess("mrs-b", extra=wait),
        lambda: SidecarProcess(
            "mrs-c", extra=["--host-transfer", "ring", "--gpu-staging-bytes", str(1 << 20)]
        ),
    )
    prefill = _engine({"a": a, "b": b}, {"a": [0], "b": [1]}, "mrs-p", SPEC)
    for proc in prefill.values():
        spawn(proc)  # stopped after the test, with the rest
    decode = spawn(EngineProcess(c.socket, "mrs-d", SPEC))
    blocks = [3, 4, 5, 6, 7]

    def publish_and_pull(rid: str, seed: int) -> dict[str, object]:
        fill = {"cmd": "prefill", "request_id": rid, "block_ids": blocks, "num_tokens": TOKENS, "seed": seed}
        assert prefill["b"].send(fill | {"publish": False})["ok"]
        pub = prefill["a"].send(fill)
        assert pub["ok"], pub
        return decode.send({"cmd": "pull", "params": pub["params"], "block_ids": blocks, "seed": seed})

    first = publish_and_pull("before", 1)
    assert first["ok"] and first["verified"] and first["path"] == "host-ring", first
    port = b.peer_address.rpartition(":")[2]
    prefill["b"].kill()
    b.proc.kill()
    b.proc.wait(10)
    b2 = spawn(SidecarProcess("mrs-b", workdir=b.workdir, extra=[*wait, "--peer-port", port]))
    assert b2.sidecar_id != b.sidecar_id and b2.peer_address == b.peer_address
    prefill["b"] = spawn(EngineProcess(b2.socket, "mrs-p", SPEC, ranks=[1], leader=a.peer_address))
    deadline = time.monotonic() + 20
    while True:  # until the leader's map has the new b (its report), as a router would retry
        res = publish_and_pull(f"after-{time.monotonic():.3f}", 2)
        if res["ok"] or time.monotonic() > deadline:
            break
        assert res["error_code"] != "INTERNAL", res
        time.sleep(0.3)
    assert res["ok"] and res["verified"] and res["path"] == "host-ring", res


@pytest.mark.parametrize("transfer", ["read", "ring"])
@pytest.mark.parametrize("to", ["member", "leader"])
def test_a_rank_moved_to_another_sidecar_is_read_there(spawn: Spawn, transfer: str, to: str) -> None:
    """A prefill engine over a (leader) and b; a decode engine on c pulls once, so that c caches the
    rank->sidecar map. Rank 1 then moves from b to d, or to the leader a (its pod rescheduled onto
    another node), while b runs on. The next request's params carry the map version it was published
    under, newer than c's; c handshakes again and reads rank 1 where it is now, exact. Until 2026-11-29
    c kept its cached map and every pull from the engine failed at b ("unknown engine ... no rank of it
    is registered here"), for good. A request published before the move, pulled after the newer map,
    fails NOT_FOUND: d never held it, and a holds it for rank 0 only. Until 2026-11-29 a sent it from
    the new rank 1 process's blocks of the same ids, and the pull succeeded with wrong bytes
    (`bench/chaos.py --gpu` found it on 2x H200). host_transfer read (OpenRead, NIXL READs from each
    holder) and ring (staged Pushes to each holder)."""
    wait = ["--leader-wait-ms", str(LEADER_WAIT_MS)]
    a, b, d, c = spawn.together(
        lambda: SidecarProcess("mv-a", extra=wait),
        lambda: SidecarProcess("mv-b", extra=wait),
        lambda: SidecarProcess("mv-d", extra=wait),
        lambda: SidecarProcess(
            "mv-c", extra=["--host-transfer", transfer, "--gpu-staging-bytes", str(1 << 20)]
        ),
    )
    prefill = _engine({"a": a, "b": b}, {"a": [0], "b": [1]}, "mv-p", SPEC)
    for proc in prefill.values():
        spawn(proc)  # stopped after the test, with the rest
    decode = spawn(EngineProcess(c.socket, "mv-d", SPEC))
    blocks = [3, 4, 5, 6, 7]
    want = "host-ring" if transfer == "ring" else "host-nixl"

    def publish(rid: str, seed: int) -> dict[str, object]:
        fill = {"cmd": "prefill", "request_id": rid, "block_ids": blocks, "num_tokens": TOKENS, "seed": seed}
        assert prefill["b"].send(fill | {"publish": False})["ok"]
        return prefill["a"].send(fill)

    pub = publish("before", 1)
    assert pub["ok"], pub
    first = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": blocks, "seed": 1})
    assert first["ok"] and first["verified"] and first["path"] == want, first
    version = int(pub["params"].get("map_version", 0))
    assert version > 0, pub["params"]  # a split engine's params carry its map's version
    old = publish("old", 2)  # not pulled before the move
    assert old["ok"], old

    prefill["b"].stop()  # rank 1 leaves b (b reports it holds none) ...
    moved = (  # ... for d, or for its leader a
        EngineProcess(d.socket, "mv-p", SPEC, ranks=[1], leader=a.peer_address)
        if to == "member"
        else EngineProcess(a.socket, "mv-p", SPEC, ranks=[1])
    )
    prefill["b"] = spawn(moved)
    pub = publish("after", 3)  # rank 1's new blocks of the same ids hold seed 3's bytes
    assert pub["ok"], pub  # d reported its rank before its registration answered
    assert int(pub["params"]["map_version"]) > version, pub["params"]
    res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": blocks, "seed": 3})
    assert res["ok"] and res["verified"] and res["path"] == want, res
    # "consumed" reaches rank 1 where it is now
    assert _events(prefill["b"], 1) == [("consumed", "after", 1)]
    res = decode.send({"cmd": "pull", "params": old["params"], "block_ids": blocks, "seed": 2})
    assert not res["ok"], res  # never "ok" with the new process's bytes
    assert res["error_code"] == "NOT_FOUND", res
    said = (
        "was never published"
        if to == "member"
        else "not held by its rank 1 here: rank 1 registered here after"
    )
    assert said in res["error"], res


@pytest.mark.parametrize("reader", ["direct", "read", "ring"])
def test_a_request_from_before_a_rank_registered_again_is_refused(spawn: Spawn, reader: str) -> None:
    """An engine of TP 2 on one sidecar, each rank its own process (as vLLM's workers are). Rank 1's
    process is replaced (it died, or restarted) while rank 0's runs on, so the engine never left and its
    requests stay published; but the new rank 1 holds other bytes in the same block ids. A request
    published before must fail NOT_FOUND for every reader: a decode engine on the same sidecar
    (host-direct), and one on another sidecar (NIXL READs, or the staged protocol)."""
    if reader == "direct":
        (a,) = spawn.together(lambda: SidecarProcess("rg-a"))
        c = a
    else:
        a, c = spawn.together(
            lambda: SidecarProcess("rg-a"),
            lambda: SidecarProcess(
                "rg-c", extra=["--host-transfer", reader, "--gpu-staging-bytes", str(1 << 20)]
            ),
        )
    ranks = {r: spawn(EngineProcess(a.socket, "rg-p", SPEC, ranks=[r])) for r in (0, 1)}
    decode = spawn(EngineProcess(c.socket, "rg-d", SPEC))
    blocks = [3, 4, 5, 6, 7]
    want = {"direct": "host-direct", "read": "host-nixl", "ring": "host-ring"}[reader]

    def publish(rid: str, seed: int) -> dict[str, object]:
        fill = {"cmd": "prefill", "request_id": rid, "block_ids": blocks, "num_tokens": TOKENS, "seed": seed}
        assert ranks[1].send(fill | {"publish": False})["ok"]
        return ranks[0].send(fill)

    first = publish("first", 1)
    res = decode.send({"cmd": "pull", "params": first["params"], "block_ids": blocks, "seed": 1})
    assert res["ok"] and res["verified"] and res["path"] == want, res
    old = publish("old", 2)
    assert old["ok"], old
    ranks[1].stop()
    ranks[1] = spawn(EngineProcess(a.socket, "rg-p", SPEC, ranks=[1]))
    assert ranks[1].send(
        {
            "cmd": "prefill",
            "request_id": "x",
            "block_ids": blocks,
            "num_tokens": TOKENS,
            "seed": 9,
            "publish": False,
        }
    )["ok"]  # the new process's blocks of the same ids hold other bytes
    res = decode.send({"cmd": "pull", "params": old["params"], "block_ids": blocks, "seed": 2})
    assert not res["ok"], res
    assert res["error_code"] == "NOT_FOUND", res
    assert "not held by its rank 1" in res["error"] and "registered here again" in res["error"], res
    new = publish("new", 3)
    res = decode.send({"cmd": "pull", "params": new["params"], "block_ids": blocks, "seed": 3})
    assert res["ok"] and res["verified"] and res["path"] == want, res
