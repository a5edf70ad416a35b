"""A sidecar restarts: engines reconnect with backoff and register again (issue 5, item 4)."""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time

import grpc
import pytest
import torch

from kv_sidecar import PROTOCOL_VERSION
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.layout_io import fill_request, logical_kv
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess, from_scratch
from kv_sidecar.server.engines import spec_to_proto
from kv_sidecar_client import Backoff, EngineSession, Event, KVSidecarError, SidecarClient, params_to_json
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2, peer_pb2_grpc
from kv_sidecar_client.client import TransferParams
from kv_sidecar_client.shm import ShmKVCache

from .conftest import Spawn, metric, spec_dict, wait_for

SPEC = EngineSpec.from_dict(spec_dict())


def test_backoff_grows_exponentially_with_jitter_up_to_its_cap() -> None:
    b = Backoff(initial_s=0.1, max_s=1.0, multiplier=2.0)
    delays = b.delays(random.Random(7))
    steps = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    got = [next(delays) for _ in steps]
    assert all(s / 2 <= d <= s for d, s in zip(got, steps, strict=True)), got
    assert len({round(d, 6) for d in got}) == len(got), "jitter: no two delays alike"
    # By default an engine finds its restarted sidecar within a second of its return.
    default = Backoff().delays(random.Random(7))
    assert max(next(default) for _ in range(30)) <= 1.0


def test_engine_registers_again_after_its_sidecar_restarts(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn
) -> None:
    events: list[tuple[str, int, Event]] = []
    reconnected = threading.Event()

    def on_event(engine_id: str, rank: int, ev: Event) -> None:
        events.append((engine_id, rank, ev))
        if ev.kind == "reconnected":
            reconnected.set()

    first = spawn(SidecarProcess("restarting"))
    decode = spawn(EngineProcess(sidecar_pair[1].socket, "restart-d", SPEC))
    with (
        ShmKVCache(SPEC.rank_tensor_shapes(), torch.float16) as cache,
        EngineSession(first.socket, on_event, Backoff(initial_s=0.05, max_s=0.5)) as session,
    ):
        session.register_rank("restart-p", 0, SPEC.to_dict(), cache.handles())
        session.client.publish("restart-p", "before", [1], 16)
        first.kill()  # SIGKILL: no goodbye, a stale socket file stays behind
        time.sleep(1.5)
        assert not reconnected.is_set()
        assert session.failed_attempts >= 2, "it must keep trying while the sidecar is down"
        second = spawn(SidecarProcess("restarting", workdir=first.workdir))  # the same socket path
        assert second.socket == first.socket
        assert reconnected.wait(20), f"no re-registration; last error {session.last_error}"
        assert session.wait_live(5)
        assert session.reconnects == 1
        # The new sidecar knows the rank and maps the same memory: a real pull reads it.
        logical = logical_kv(SPEC, 20, seed=4)
        fill_request(SPEC, 0, cache.tensors, [5, 6], logical)
        params = session.client.publish("restart-p", "after", [5, 6], 20)
        assert params.sidecar_id == second.sidecar_id
        res = decode.send({"cmd": "pull", "params": params_to_json(params), "block_ids": [10, 11], "seed": 4})
        assert res["ok"] and res["verified"], res
        # ... and events flow on the new session.
        deadline = time.monotonic() + 10
        while not any(ev.kind == "consumed" and ev.request_id == "after" for _, _, ev in events):
            assert time.monotonic() < deadline, events
            time.sleep(0.05)
    assert second.stop() == 0


@pytest.mark.parametrize(
    ("restarts", "fast", "same_id"),
    [
        ("prefill", False, True),
        ("prefill", True, True),
        ("decode", True, True),
        ("prefill", True, False),
        ("decode", True, False),
    ],
    ids=[
        "prefill-restart",
        "prefill-fast-restart",
        "decode-fast-restart",
        "prefill-restart-new-id",
        "decode-restart-new-id",
    ],
)
@pytest.mark.parametrize("transfer", ["nixl", "ring"])
def test_pulls_go_on_after_a_sidecar_restarts_at_its_address(
    spawn: Spawn, transfer: str, restarts: str, fast: bool, same_id: bool
) -> None:
    """Same address after the restart. `same_id` (a `sidecar_id` set): the other sidecar's NIXL agent
    still holds the old one's, so the decode side's cached handshake and prepared descriptor lists are
    stale (prefill restarts), or the prefill side's loaded reader agent is (decode restarts). Otherwise
    the restarted sidecar has a new id, as by default: the decode side sees it in the next params and
    handshakes again (until 2026-11-29 its staged pulls from a restarted source failed, INTERNAL, for
    good: its chunks came from an agent the cached handshake did not name), and a request published
    before the restart is NOT_FOUND, saying so. `fast`: back within ~0.5 s from the fork server, whose
    children map memory at the same addresses as the one before; otherwise started from scratch, in the
    seconds a restarted pod takes. ring: the staged protocol, whose one-read pulls open the request in
    their Push (no OpenRead)."""
    mode = ["--host-transfer", "ring", "--gpu-staging-bytes", str(1 << 20)] if transfer == "ring" else []
    ids = {
        side: ["--sidecar-id", f"kvs-restarting-{side}-{transfer}"] if same_id else []
        for side in ("prefill", "decode")
    }
    sidecars = {
        side: spawn(SidecarProcess(f"restarting-{side}", extra=[*ids[side], *mode]))
        for side in ("prefill", "decode")
    }
    engines = {
        side: lambda side=side: EngineProcess(sidecars[side].socket, f"restart2-{side[0]}-{transfer}", SPEC)
        for side in ("prefill", "decode")
    }
    running = dict(
        zip(("decode", "prefill"), spawn.together(engines["decode"], engines["prefill"]), strict=True)
    )
    for attempt, when in enumerate(("before", "after")):
        pub = running["prefill"].send(
            {"cmd": "prefill", "request_id": when, "block_ids": [2, 3], "num_tokens": 30, "seed": attempt}
        )
        res = running["decode"].send(
            {"cmd": "pull", "params": pub["params"], "block_ids": [4, 5], "seed": attempt}
        )
        assert res["ok"] and res["verified"], (res, "\n".join(sidecars["decode"].stderr_lines(40)))
        assert res["path"] == ("host-ring" if mode else "host-nixl"), res
        if when == "before":
            before_params = pub["params"]
            old = sidecars[restarts]
            port = old.peer_address.rsplit(":", 1)[1]
            running[restarts].kill()
            old.kill()
            with contextlib.nullcontext() if fast else from_scratch():
                sidecars[restarts] = spawn(
                    SidecarProcess(
                        f"restarting-{restarts}",
                        workdir=old.workdir,
                        extra=[*ids[restarts], *mode, "--peer-port", port],
                    )
                )
            assert sidecars[restarts].peer_address == old.peer_address
            running[restarts] = spawn(engines[restarts]())
    if restarts == "prefill" and not same_id:  # a request of the sidecar before: gone, and said so
        res = running["decode"].send({"cmd": "pull", "params": before_params, "block_ids": [6, 7], "seed": 0})
        assert not res["ok"] and res["error_code"] == "NOT_FOUND", res
        assert "was published by sidecar" in res["error"] and "is sidecar" in res["error"], res
        # ... and so for an engine on the sidecar now at that address (a router's retry there).
        here = spawn(EngineProcess(sidecars["prefill"].socket, f"restart2-h-{transfer}", SPEC))
        res = here.send({"cmd": "pull", "params": before_params, "block_ids": [6, 7], "seed": 0})
        assert not res["ok"] and res["error_code"] == "NOT_FOUND", res
        assert "(this one) now" in res["error"], res


@pytest.mark.parametrize("lane", [False, True], ids=["grpc", "lane"])
def test_a_call_while_the_engines_sidecar_is_down_names_that_sidecar(spawn: Spawn, lane: bool) -> None:
    """The engine's own sidecar is gone (killed, restarting): its calls fail UNAVAILABLE naming the
    socket they could not reach, not only gRPC's "failed to connect to all addresses"; a pull names
    every block it was asked to fill."""
    sc = spawn(SidecarProcess("down"))
    sc.kill()
    with SidecarClient(sc.socket, timeout_s=2, lane=lane) as c:
        with pytest.raises(KVSidecarError) as info:
            c.publish("down-p", "r", [1], 16)
        assert info.value.code == "UNAVAILABLE"
        assert f"sidecar at unix:{sc.socket} is not reachable" in info.value.message
        params = TransferParams(
            engine_id="p", request_id="r", sidecar_address="127.0.0.1:1", num_tokens=16, block_ids=[1]
        )
        res = c.pull(params, "down-d", [3, 4], timeout_s=1)
        assert (
            res.error_code == "UNAVAILABLE" and f"sidecar at unix:{sc.socket} is not reachable" in res.error
        )
        assert res.unfilled_blocks == [3, 4]


@pytest.mark.parametrize(
    "decode_layout", ["flash_attn_nhd", "flash_attn_hnd"], ids=["read", "read-converted"]
)
def test_a_reader_does_not_read_where_a_restarted_engine_was(spawn: Spawn, decode_layout: str) -> None:
    """A prefill engine is killed and, once its sidecar has let it go, another engine registers there
    (its shared memory lands where the first one's was), then the first starts again. A decode sidecar
    that handshook before must not READ the old regions of its cached handshake: the OpenRead answer
    names the rank's new registration, the pull handshakes again, and its bytes are exact. Until
    2026-11-29 every later pull from that engine succeeded with the other engine's bytes (host-nixl
    and host-nixl-staged; one host's UCX reads by address; the chaos bench drew it too)."""
    a, c = spawn.together(lambda: SidecarProcess("rw-a"), lambda: SidecarProcess("rw-c"))
    prefill = spawn(EngineProcess(a.socket, "rw-p", SPEC))
    decode = spawn(EngineProcess(c.socket, "rw-d", EngineSpec.from_dict(spec_dict(layout=decode_layout))))
    blocks = [3, 4, 5]
    want = "host-nixl" if decode_layout == SPEC.layout.value else "host-nixl-staged"

    def pull(rid: str, seed: int) -> dict[str, object]:
        fill = {"cmd": "prefill", "request_id": rid, "block_ids": blocks, "num_tokens": 40, "seed": seed}
        pub = prefill.send(fill)
        assert pub["ok"], pub
        return decode.send({"cmd": "pull", "params": pub["params"], "block_ids": blocks, "seed": seed})

    res = pull("first", 1)  # c handshakes and caches the engine's regions
    assert res["ok"] and res["verified"] and res["path"] == want, res
    prefill.kill()
    with SidecarClient(a.socket) as client:  # its sidecar unregisters it once its event stream ends
        until = time.monotonic() + 10
        while any(r.engine_id == "rw-p" for r in client.status().ranks):
            assert time.monotonic() < until, "the killed engine stayed registered"
            time.sleep(0.05)
    other = spawn(EngineProcess(a.socket, "rw-q", SPEC))
    assert other.send(
        {
            "cmd": "prefill",
            "request_id": "q",
            "block_ids": blocks,
            "num_tokens": 40,
            "seed": 77,
            "publish": False,
        }
    )["ok"]
    prefill = spawn(EngineProcess(a.socket, "rw-p", SPEC))
    for rid, seed in (("after", 2), ("again", 3)):
        res = pull(rid, seed)
        assert res["ok"] and res["verified"] and res["path"] == want, res


def _mapped(pid: int, name: str) -> list[str]:
    """The lines of /proc/<pid>/maps that map /dev/shm/<name>: "(deleted)" ends those of an object
    removed since."""
    with open(f"/proc/{pid}/maps") as f:
        return sorted({line.split(None, 5)[-1].strip() for line in f if f"/dev/shm/{name}" in line})


def test_an_engine_that_leaves_mid_read_stays_mapped_until_its_reader_is_done(spawn: Spawn) -> None:
    """A reader READs the source engine's memory at its handshake's addresses once the OpenRead answer
    came, without another word to the source. An engine that dies meanwhile stays mapped (and
    registered with NIXL) on its sidecar until the reader said it is done, so that no other pages can
    come to lie at those addresses; and its successor, whose objects have the names it had (vLLM's
    pool names them by pid, which a fresh container repeats), maps its own objects, not the dead
    one's still mapped there (mapped by name, as until 2026-11-30, it would get the dead one's pages,
    and every pull of it would move stale bytes)."""
    a, c = spawn.together(lambda: SidecarProcess("pin-a"), lambda: SidecarProcess("pin-c"))
    name = f"kvs-pin-{os.getpid()}"
    prefill = spawn(EngineProcess(a.socket, "pin-p", SPEC, shm_names=name))
    decode = spawn(EngineProcess(c.socket, "pin-d", SPEC))
    blocks = [3, 4, 5]
    pub = prefill.send(
        {"cmd": "prefill", "request_id": "opened", "block_ids": blocks, "num_tokens": 40, "seed": 1}
    )
    assert pub["ok"], pub
    read = {"engine_id": "pin-p", "request_id": "opened", "reader_engine_id": "test-reader"}
    with grpc.insecure_channel(a.peer_address) as ch:
        peer = peer_pb2_grpc.PeerServiceStub(ch)  # this test is the reader, as a decode sidecar would be
        hs = peer.Handshake(
            peer_pb2.HandshakeRequest(
                protocol_version=PROTOCOL_VERSION,
                sidecar_id="test-reader",
                engine_id="pin-p",
                reader_engine_id="test-reader",
                reader_spec=spec_to_proto(SPEC),
            ),
            timeout=30,
        )
        peer.OpenRead(peer_pb2.OpenReadRequest(**read, reader_ranks=[0], plan_hash=hs.plan_hash), timeout=30)
        prefill.kill()  # before the reader READs
        with SidecarClient(a.socket) as client:
            wait_for(
                "the engine to leave", lambda: not any(r.engine_id == "pin-p" for r in client.status().ranks)
            )
        assert _mapped(a.proc.pid, f"{name}-0") == [f"/dev/shm/{name}-0"]  # kept for the reader
        assert metric(a.metrics_port, "kvsidecar_host_ranks_leaving") == 1
        prefill = spawn(EngineProcess(a.socket, "pin-p", SPEC, shm_names=name))  # removes the old object
        assert _mapped(a.proc.pid, f"{name}-0") == [f"/dev/shm/{name}-0", f"/dev/shm/{name}-0 (deleted)"]
        for rid, seed in (("after", 2), ("again", 3)):
            fill = {"cmd": "prefill", "request_id": rid, "block_ids": blocks, "num_tokens": 40, "seed": seed}
            pub = prefill.send(fill)
            assert pub["ok"], pub
            res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": blocks, "seed": seed})
            assert res["ok"] and res["verified"] and res["path"] == "host-nixl", res
        peer.CloseRead(peer_pb2.CloseReadRequest(**read, reader_ranks=[0]), timeout=30)
    wait_for(
        "the dead engine's memory to go", lambda: _mapped(a.proc.pid, f"{name}-0") == [f"/dev/shm/{name}-0"]
    )
    wait_for("the gauge to say so", lambda: metric(a.metrics_port, "kvsidecar_host_ranks_leaving") == 0)
