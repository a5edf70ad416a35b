"""A node sidecar run as control shards (`control_shards: 2`): one real front door process and its two
shard processes on loopback, with reference engines that know only the front door's socket.

A host engine goes, all its ranks, to a shard by its engine id (placement.py; or by a placement key its
client names); the engine ids here are picked so that one decode engine shares its prefill engine's
shard (host-direct) and one does not (host-nixl between the shards).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.layout_io import check_request, fill_request, logical_kv
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess, children, descendants
from kv_sidecar.shards.children import shard_socket
from kv_sidecar.shards.placement import Placement
from kv_sidecar_client import (
    Backoff,
    EngineSession,
    Event,
    PullResult,
    SidecarClient,
    params_from_json,
    params_to_json,
)
from kv_sidecar_client._proto.kvsidecar.v1 import engine_pb2, engine_pb2_grpc
from kv_sidecar_client.lane import LANE_SUFFIX
from kv_sidecar_client.shm import ShmKVCache

from .conftest import Spawn, consumed_events, spec_dict, wait_for

SHARDS = 2
_placement = Placement(SHARDS)


def engine_on(shard: int, prefix: str, taken: set[str]) -> str:
    """An engine id whose rank 0 the front door puts on `shard` (host ranks go by their engine id)."""
    for i in range(1000):
        name = f"{prefix}-{i}"
        if name not in taken and _placement.shard_of(name) == shard:
            taken.add(name)
            return name
    raise AssertionError("no engine id for that shard")


@pytest.fixture(scope="module")
def node() -> Iterator[SidecarProcess]:
    sc = SidecarProcess("node", extra=["--control-shards", str(SHARDS), "--leader-wait-ms", "3000"])
    yield sc
    code = sc.stop()
    left = [
        p
        for k in range(SHARDS)
        for p in (sc.socket, shard_socket(sc.socket, k), shard_socket(sc.socket, k) + LANE_SUFFIX)
        if os.path.exists(p)
    ]
    assert code == 0, "\n".join(sc.stderr_tail)
    assert not left, f"SIGTERM must remove the front door's and the shards' sockets: {left}"


def shard_of_ranks(node: SidecarProcess) -> dict[tuple[str, int], int]:
    with SidecarClient(node.socket, lane=False) as client:
        st = client.status()
    assert len(st.shards) == SHARDS and all(s.sidecar_id for s in st.shards), st
    return {(r.engine_id, r.rank): k for k, s in enumerate(st.shards) for r in s.ranks}


def prefill_and_pull(prefill: EngineProcess, decode: EngineProcess, request_id: str, seed: int) -> dict:
    pub = prefill.send(
        {"cmd": "prefill", "request_id": request_id, "block_ids": [1, 2, 3], "num_tokens": 40, "seed": seed}
    )
    assert pub["ok"], pub
    return decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [9, 4, 6], "seed": seed})


def pull_rank_by_rank(
    source: EngineProcess,
    reader: EngineProcess,
    request_id: str,
    src: list[int],
    dst: list[int],
    num_tokens: int,
    seed: int,
    path: str,
    ranks: tuple[int, ...] = (0, 1),
) -> None:
    """`source` publishes a request and `reader` pulls it one rank at a time, as a TP engine's workers
    each pull their own: every rank exact, by `path`."""
    pub = source.send(
        {"cmd": "prefill", "request_id": request_id, "block_ids": src, "num_tokens": num_tokens, "seed": seed}
    )
    assert pub["ok"], pub
    for rank in ranks:
        res = reader.send(
            {"cmd": "pull", "params": pub["params"], "block_ids": dst, "seed": seed, "ranks": [rank]}
        )
        assert res["ok"] and res["verified"] and res["path"] == path, (rank, res)


def consumed_on_each_rank(prefill: EngineProcess, request_id: str) -> None:
    """The TP 2 prefill engine hears "consumed" for the request once on each of its ranks."""
    events = [prefill.send({"cmd": "next_event", "timeout_s": 10}) for _ in range(2)]
    assert sorted((e["kind"], e["request_id"], e["rank"]) for e in events) == [
        ("consumed", request_id, 0),
        ("consumed", request_id, 1),
    ], events


def test_engines_pull_bit_exact_within_a_shard_and_across_shards(node: SidecarProcess, spawn: Spawn) -> None:
    spec = EngineSpec.from_dict(spec_dict())
    taken: set[str] = set()
    p, same, other = engine_on(0, "p", taken), engine_on(0, "d", taken), engine_on(1, "d", taken)
    prefill, d_same, d_other = (spawn(EngineProcess(node.socket, e, spec)) for e in (p, same, other))
    placed = shard_of_ranks(node)
    assert (placed[(p, 0)], placed[(same, 0)], placed[(other, 0)]) == (0, 0, 1), placed

    res = prefill_and_pull(prefill, d_same, "within", seed=5)
    assert res["ok"] and res["verified"] and res["path"] == "host-direct", res
    res = prefill_and_pull(prefill, d_other, "across", seed=6)
    assert res["ok"] and res["verified"] and res["path"] == "host-nixl", res
    assert consumed_events(prefill, 2) == 2


def test_host_engines_that_name_one_placement_key_share_a_shard(node: SidecarProcess, spawn: Spawn) -> None:
    """Engine ids that the front door would put on two shards, with one placement key (RouteRequest
    .placement, `SidecarClient(placement=...)`): both on the key's shard, and the pull a copy there."""
    spec = EngineSpec.from_dict(spec_dict())
    taken: set[str] = set()
    key = next(f"pair-{i}" for i in range(100) if _placement.shard_of(f"pair-{i}") == 1)
    p, d = engine_on(0, "keyed-p", taken), engine_on(0, "keyed-d", taken)
    prefill, decode = (spawn(EngineProcess(node.socket, e, spec, placement=key)) for e in (p, d))
    placed = shard_of_ranks(node)
    assert (placed[(p, 0)], placed[(d, 0)]) == (1, 1), placed
    res = prefill_and_pull(prefill, decode, "keyed", seed=8)
    assert res["ok"] and res["verified"] and res["path"] == "host-direct", res
    assert consumed_events(prefill, 1) == 1


def test_a_tp_engine_goes_whole_to_one_shard(node: SidecarProcess, spawn: Spawn) -> None:
    """Every rank of an engine on its shard: a pull reads either its own shard's ranks or another's,
    never both (which no pull does, across nodes either)."""
    spec = EngineSpec.from_dict(spec_dict(tp_size=2))
    taken: set[str] = set()
    p, d = engine_on(1, "tp-p", taken), engine_on(0, "tp-d", taken)
    prefill, decode = spawn(EngineProcess(node.socket, p, spec)), spawn(EngineProcess(node.socket, d, spec))
    placed = shard_of_ranks(node)
    assert (placed[(p, 0)], placed[(p, 1)], placed[(d, 0)], placed[(d, 1)]) == (1, 1, 0, 0), placed
    pub = prefill.send(
        {"cmd": "prefill", "request_id": "tp", "block_ids": [2, 3], "num_tokens": 30, "seed": 8}
    )
    assert pub["ok"], pub
    with SidecarClient(node.socket, lane=False) as client:
        assert pub["params"]["sidecar_address"] == client.status().shards[1].peer_address
    res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [7, 8], "seed": 8})
    assert res["ok"] and res["verified"] and res["path"] == "host-nixl", res


def test_the_front_door_refuses_engine_calls_with_the_way_to_the_shards(node: SidecarProcess) -> None:
    with grpc.insecure_channel(f"unix:{node.socket}") as ch:
        stub = engine_pb2_grpc.EngineServiceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Publish(engine_pb2.PublishRequest(engine_id="x", request_id="r"), timeout=5)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "control shards" in e.value.details() and shard_socket(node.socket, 0) in e.value.details()


def test_routes(node: SidecarProcess) -> None:
    """A host rank goes by its engine id at once; an engine's own route waits for its rank 0's (a GPU
    engine's other ranks do too), and is refused when none comes."""
    with grpc.insecure_channel(f"unix:{node.socket}") as ch:
        stub = engine_pb2_grpc.EngineServiceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Route(engine_pb2.RouteRequest(engine_id="never-registered"), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value
        assert "rank 0 was not routed" in e.value.details()
        targets = [f"unix:{shard_socket(node.socket, k)}" for k in range(SHARDS)]
        shard = _placement.shard_of("x")
        answer = stub.Route(engine_pb2.RouteRequest(engine_id="x", rank=3), timeout=5)
        assert (answer.engine_target, answer.shard) == (targets[shard], shard)
        answer = stub.Route(engine_pb2.RouteRequest(engine_id="x"), timeout=5)
        assert answer.engine_target == targets[shard]


def test_health_and_metrics_cover_every_shard(node: SidecarProcess) -> None:
    host, port = node.peer_address.rsplit(":", 1)
    with grpc.insecure_channel(f"{host}:{port}") as ch:
        answer = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    text = _metrics(node)
    for k in range(SHARDS):
        assert f'kvsidecar_shard_up{{shard="{k}"}} 1.0' in text, text[:2000]
        # A shard's own series, labelled with it.
        assert f'kvsidecar_staging_bytes_capacity{{shard="{k}"}}' in text, text[:2000]


def test_kv_sidecar_status_shows_the_front_door_and_each_shard(node: SidecarProcess) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kv_sidecar", "status", "--engine-socket", node.socket],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert f"front door of {SHARDS} control shards" in out.stdout, out.stdout
    # This machine has no GPU: each shard serves host engines alone.
    assert all(f"shard {k} (no GPU):\n  sidecar " in out.stdout for k in range(SHARDS)), out.stdout


def _metrics(node: SidecarProcess) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=10) as answer:
        return str(answer.read().decode())


def _shard_pid(node: SidecarProcess, index: int) -> int:
    sock = shard_socket(node.socket, index)
    for child in children(node.proc.pid):
        with contextlib.suppress(OSError), open(f"/proc/{child}/cmdline", "rb") as c:
            if sock.encode() + b"\0" in c.read():
                return child
    raise AssertionError(f"no process of shard {index}")


@contextlib.contextmanager
def _session(socket: str, spec: EngineSpec) -> Iterator[tuple[ShmKVCache, EngineSession, threading.Event]]:
    """A host KV cache and an engine session on `socket`, with an event set once the session has
    registered its ranks again (their shard was started again)."""
    reconnected = threading.Event()

    def on_event(engine_id: str, rank: int, ev: Event) -> None:
        if ev.kind == "reconnected":
            reconnected.set()

    with (
        ShmKVCache(spec.rank_tensor_shapes(), torch.float16) as cache,
        EngineSession(socket, on_event, Backoff(initial_s=0.05, max_s=0.5)) as session,
    ):
        yield cache, session, reconnected


def test_a_killed_shard_is_started_again_and_its_engines_come_back(
    node: SidecarProcess, spawn: Spawn
) -> None:
    """SIGKILL one shard: the front door stays up and starts it again; an engine session on it registers
    again there (the route it learnt still holds: the shard's socket path) and serves pulls; the other
    shard's engine pulls from it as before."""
    spec = EngineSpec.from_dict(spec_dict())
    taken: set[str] = set()
    p, d = engine_on(1, "k-p", taken), engine_on(0, "k-d", taken)
    decode = spawn(EngineProcess(node.socket, d, spec))
    with _session(node.socket, spec) as (cache, session, reconnected):
        session.register_rank(p, 0, spec.to_dict(), cache.handles())
        assert session.client.engine_target(p, 0) == f"unix:{shard_socket(node.socket, 1)}"
        fill_request(spec, 0, cache.tensors, [1, 2], logical_kv(spec, 20, seed=11))
        params = session.client.publish(p, "before", [1, 2], 20)
        res = decode.send({"cmd": "pull", "params": params_to_json(params), "block_ids": [5, 6], "seed": 11})
        assert res["ok"] and res["verified"] and res["path"] == "host-nixl", res

        os.kill(_shard_pid(node, 1), signal.SIGKILL)
        assert reconnected.wait(60), f"no re-registration; last error {session.last_error}"
        assert node.alive
        fill_request(spec, 0, cache.tensors, [3, 4], logical_kv(spec, 20, seed=12))
        params = session.client.publish(p, "after", [3, 4], 20)
        res = decode.send({"cmd": "pull", "params": params_to_json(params), "block_ids": [7, 8], "seed": 12})
        assert res["ok"] and res["verified"] and res["path"] == "host-nixl", res
    text = _metrics(node)
    assert 'kvsidecar_shard_restarts{shard="1"} 1.0' in text and 'kvsidecar_shard_up{shard="1"} 1.0' in text


def test_a_pull_in_flight_on_a_killed_shard_fails_clearly_and_loses_nothing(spawn: Spawn) -> None:
    """The decode engine's shard is SIGKILLed while its pull waits for the prefill's shard (frozen by
    SIGSTOP): the pull fails UNAVAILABLE with every block named unfilled, the prefill's shard and the
    front door stay up, and the request is not lost: once the shard is back and the engine's session
    has registered again, the same params pull every byte."""
    door = spawn(SidecarProcess("door-kill", extra=["--control-shards", str(SHARDS)]))
    spec = EngineSpec.from_dict(spec_dict())
    taken: set[str] = set()
    p, d = engine_on(1, "x-p", taken), engine_on(0, "x-d", taken)
    prefill = spawn(EngineProcess(door.socket, p, spec))
    pub = prefill.send(
        {"cmd": "prefill", "request_id": "held", "block_ids": [1, 2, 3], "num_tokens": 40, "seed": 21}
    )
    assert pub["ok"], pub
    params = params_from_json(pub["params"])
    with _session(door.socket, spec) as (cache, session, reconnected):
        session.register_rank(d, 0, spec.to_dict(), cache.handles())
        box: list[PullResult] = []
        source = _shard_pid(door, 1)
        os.kill(source, signal.SIGSTOP)  # the prefill's shard answers nothing: the pull stays in flight
        try:
            pulling = threading.Thread(
                target=lambda: box.append(session.client.pull(params, d, [9, 4, 6], timeout_s=60)),
                daemon=True,
            )
            pulling.start()

            def in_flight() -> bool:
                with SidecarClient(door.socket, lane=False) as client:
                    return any(x.request_id == "held" for x in client.status().shards[0].inflight)

            wait_for("the pull to be in flight on shard 0", in_flight)
            os.kill(_shard_pid(door, 0), signal.SIGKILL)
            pulling.join(30)
        finally:
            os.kill(source, signal.SIGCONT)
        assert box, "the pull never returned"
        (res,) = box
        assert not res.ok and res.error_code == "UNAVAILABLE", res
        assert sorted(res.unfilled_blocks) == [4, 6, 9], res
        assert door.alive and _shard_pid(door, 1) == source, "the front door and the other shard stay up"

        assert reconnected.wait(60), f"no re-registration; last error {session.last_error}"
        again = session.client.pull(params, d, [9, 4, 6], timeout_s=30)
        assert again.ok, again
        assert check_request(spec, 0, cache.tensors, [9, 4, 6], logical_kv(spec, 40, seed=21)) == []


def test_shards_end_with_a_front_door_killed(spawn: Spawn) -> None:
    """SIGKILL the front door (no drain): the kernel ends its shards, which remove their sockets."""
    door = spawn(SidecarProcess("doomed", extra=["--control-shards", str(SHARDS)]))
    pids = [_shard_pid(door, k) for k in range(SHARDS)]
    door.kill()
    wait_for("the shards to end", lambda: not any(os.path.exists(f"/proc/{pid}") for pid in pids), 30)
    assert not any(os.path.exists(shard_socket(door.socket, k)) for k in range(SHARDS))


def test_shards_with_device_workers_copy_exactly_and_leave_no_process_behind(spawn: Spawn) -> None:
    """`device_workers` with shards: each shard starts a worker of its own for its local copies, and a
    pull within a shard goes through it byte-exact, a pull across shards over NIXL beside it. SIGKILL
    of the front door (no drain) ends the shards, and with each shard its worker: nothing of the node
    sidecar outlives its main process, as a container's restart expects."""
    door = spawn(
        SidecarProcess("door-workers", extra=["--control-shards", str(SHARDS), "--device-workers", "true"])
    )
    spec = EngineSpec.from_dict(spec_dict())
    taken: set[str] = set()
    p, near, far = engine_on(0, "w-p", taken), engine_on(0, "w-d", taken), engine_on(1, "w-f", taken)
    prefill, decode, remote = spawn.together(
        lambda: EngineProcess(door.socket, p, spec),
        lambda: EngineProcess(door.socket, near, spec),
        lambda: EngineProcess(door.socket, far, spec),
    )
    res = prefill_and_pull(prefill, decode, "first", seed=1)  # runs in the shard, starts its worker
    assert res["ok"] and res["verified"] and res["path"] == "host-direct", res

    def shard0_worker() -> list[int]:
        with SidecarClient(door.socket, lane=False) as client:
            shard = client.status().shards[0]
        return [w.pid for w in shard.workers if w.pid and not w.starting and w.local_copies]

    wait_for("shard 0's host worker, answering", lambda: len(shard0_worker()) == 1)
    worker = shard0_worker()[0]
    assert worker in descendants(_shard_pid(door, 0))
    for i, engine in enumerate((decode, remote, decode)):
        res = prefill_and_pull(prefill, engine, f"r{i}", seed=10 + i)
        assert res["ok"] and res["verified"], res  # every byte, and nothing outside the blocks
        assert res["path"] == ("host-direct" if engine is decode else "host-nixl"), res

    below = descendants(door.proc.pid)
    assert worker in below and len(below) >= SHARDS + 1, below
    door.kill()
    wait_for(
        "every shard and worker to end",
        lambda: not any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in below),
        30,
    )


def _alive(pid: int) -> bool:
    """Running, not a zombie that waits for a parent to reap it (init reaps orphans at its pace)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_front_door_whose_gpu_groups_name_gpus_it_does_not_see_refuses_to_start(tmp_path: Path) -> None:
    """`control_shard_gpus` names GPUs by ordinal: one this node does not see (here none) is a mistake the
    operator hears of at start-up, with no shard started and no socket left, not an engine without a
    shard later."""
    sock = tmp_path / "door.sock"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kv_sidecar",
            "serve",
            "--engine-socket",
            str(sock),
            "--peer-port",
            "0",
            "--metrics-port",
            "-1",
            "--control-shards",
            "2",
            "--control-shard-gpus",
            "0;1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out
    assert "control_shard_gpus names GPU 0, but this node sees 0 GPU(s)" in out.stderr, out.stderr
    assert not list(tmp_path.iterdir()), "no socket, no shard"


def test_spread_ranks_pull_and_serve_each_from_a_shard_of_their_own(spawn: Spawn) -> None:
    """`control_shard_ranks: spread`: a TP 2 engine's rank 1 goes to another shard than its rank 0, and
    registers there led by rank 0's shard, as a rank on another node names its leader. A TP 2 prefill
    engine spread so serves a decode engine on another sidecar, each rank from the shard that holds it,
    and each rank hears "consumed" there; a TP 2 decode engine spread so pulls each rank on its own
    shard. Both engines spread on this node, each decode rank beside the prefill rank it reads: each
    shard copies its own rank (host-direct); misaligned, each reads its prefill rank from the other
    shard over NIXL. Every byte compared."""
    door = spawn(
        SidecarProcess(
            "door-spread",
            extra=[
                "--control-shards",
                str(SHARDS),
                "--control-shard-ranks",
                "spread",
                "--leader-wait-ms",
                "5000",
            ],
        )
    )
    other = spawn(SidecarProcess("other-node"))
    spec = EngineSpec.from_dict(spec_dict(tp_size=2))
    prefill, decode = spawn.together(
        lambda: EngineProcess(door.socket, "spread-p", spec),
        lambda: EngineProcess(other.socket, "plain-d", spec),
    )
    placed = shard_of_ranks(door)
    assert {placed[("spread-p", 0)], placed[("spread-p", 1)]} == set(range(SHARDS)), placed
    res = prefill_and_pull(prefill, decode, "spread-out", seed=31)
    assert res["ok"] and res["verified"] and res["path"] == "host-nixl", res
    events = [prefill.send({"cmd": "next_event", "timeout_s": 10}) for _ in range(2)]
    assert sorted((e["kind"], e["rank"]) for e in events) == [("consumed", 0), ("consumed", 1)], events

    taken = {"spread-p"}
    aligned = engine_on(placed[("spread-p", 0)], "spread-d", taken)
    misaligned = engine_on(placed[("spread-p", 1)], "spread-x", taken)
    source, reader, crossed = spawn.together(
        lambda: EngineProcess(other.socket, "plain-p", spec),
        lambda: EngineProcess(door.socket, aligned, spec),
        lambda: EngineProcess(door.socket, misaligned, spec),
    )
    placed = shard_of_ranks(door)
    assert all(placed[(aligned, r)] == placed[("spread-p", r)] for r in (0, 1)), placed
    assert all(placed[(misaligned, r)] != placed[("spread-p", r)] for r in (0, 1)), placed
    # Each worker of a TP engine pulls its own rank, on that rank's shard.
    pull_rank_by_rank(source, reader, "spread-in", [1, 2, 3], [9, 4, 6], 40, 32, "host-nixl")

    # Both engines on this node sidecar, both spread, each decode rank on its prefill rank's shard.
    pull_rank_by_rank(prefill, reader, "spread-both", [4, 5, 6], [10, 11, 12], 40, 33, "host-direct")
    consumed_on_each_rank(prefill, "spread-both")

    # One PullBatch with a member for each rank: the client sends each rank's members to its shard.
    pubs = [
        prefill.send(
            {
                "cmd": "prefill",
                "request_id": f"spread-batch-{r}",
                "block_ids": [20 + 2 * r, 21 + 2 * r],
                "num_tokens": 30,
                "seed": 40 + r,
            }
        )
        for r in (0, 1)
    ]
    assert all(p["ok"] for p in pubs), pubs
    got = reader.send(
        {
            "cmd": "pull_many",
            "pulls": [
                {
                    "params": pubs[r]["params"],
                    "block_ids": [30 + 2 * r, 31 + 2 * r],
                    "seed": 40 + r,
                    "ranks": [r],
                }
                for r in (0, 1)
            ],
        }
    )
    assert got["ok"] and got["untouched_outside"], got
    assert [(m["verified"], m["path"]) for m in got["results"]] == [(True, "host-direct")] * 2, got
    events = [prefill.send({"cmd": "next_event", "timeout_s": 10}) for _ in range(2)]
    assert sorted((e["request_id"], e["rank"]) for e in events) == [
        ("spread-batch-0", 0),
        ("spread-batch-1", 1),
    ]

    # Misaligned: decode rank 1 sits on the shard that leads the prefill engine and reads its rank 1 on
    # the other shard (through a handshake with itself), decode rank 0 on that other shard reads prefill
    # rank 0 from the leader: each over NIXL between the shards.
    pull_rank_by_rank(prefill, crossed, "spread-crossed", [7, 8], [13, 14], 30, 34, "host-nixl", ranks=(1, 0))
    consumed_on_each_rank(prefill, "spread-crossed")
