"""A sidecar restarts: engines reconnect with backoff and register again (issue 5, item 4)."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.layout_io import fill_request, logical_kv
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess, from_scratch
from kv_sidecar_client import Backoff, EngineSession, Event, params_to_json
from kv_sidecar_client.shm import ShmKVCache

from .conftest import Spawn, spec_dict

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


@pytest.mark.parametrize("transfer", ["nixl", "ring"])
def test_pulls_handshake_again_after_the_prefill_sidecar_restarts(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn, transfer: str
) -> None:
    """Same address and sidecar id after the restart: the decode sidecar's cached handshake is stale.
    ring: the staged protocol, whose one-read pulls open the request in their Push (no OpenRead)."""
    mode = ["--host-transfer", "ring", "--gpu-staging-bytes", str(1 << 20)] if transfer == "ring" else []
    fixed = ["--sidecar-id", f"kvs-restarting-prefill-{transfer}", *mode]
    first = spawn(SidecarProcess("restarting-prefill", extra=fixed))
    port = first.peer_address.rsplit(":", 1)[1]
    reader = spawn(SidecarProcess("restart-reader", extra=mode)) if mode else sidecar_pair[1]
    decode, prefill = spawn.together(
        lambda: EngineProcess(reader.socket, f"restart2-d-{transfer}", SPEC),
        lambda: EngineProcess(first.socket, f"restart2-p-{transfer}", SPEC),
    )
    for attempt, sidecar in enumerate(("first", "second")):
        pub = prefill.send(
            {"cmd": "prefill", "request_id": sidecar, "block_ids": [2, 3], "num_tokens": 30, "seed": attempt}
        )
        res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [4, 5], "seed": attempt})
        assert res["ok"] and res["verified"], res
        assert res["path"] == ("host-ring" if mode else "host-nixl"), res
        if sidecar == "first":
            prefill.kill()
            first.kill()
            # Started from scratch, in the seconds a restarted pod takes: back within ~0.5 s from the
            # fork server, the reader's first pull fails about every other run with NIXL_ERR_NOT_FOUND,
            # twice (its retry too). A known race, not fixed yet (issue 32's note).
            with from_scratch():
                second = spawn(
                    SidecarProcess(
                        "restarting-prefill", workdir=first.workdir, extra=[*fixed, "--peer-port", port]
                    )
                )
            assert second.peer_address == first.peer_address
            prefill = spawn(EngineProcess(second.socket, f"restart2-p-{transfer}", SPEC))
