"""staged_workers: each device's staged transfers in its worker process, on a NIXL agent of its own
(dataplane/staged_workers.py; docs/gpu.md, "Node scaling").

Real sidecar and engine processes on host rings (host-ring runs the GPU staged protocol's code on host
memory; tests/gpu runs it on GPUs): pulls through workers on both sides, and with a peer that runs
none, are byte-exact and leave every byte outside the pulled blocks alone; a worker SIGKILLed in the
middle of a transfer fails that pull alone (UNAVAILABLE, naming the blocks not filled), is started
again, the next pull works, and the sidecar stays up.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess
from kv_sidecar_client import SidecarClient, params_from_json

from .conftest import Spawn, logged, metric, prefilled, spec_dict, wait_for
from .test_device_workers import workers_of

RING = ["--host-transfer", "ring", "--gpu-staging-bytes", str(8 << 20)]
WORKERS = [*RING, "--staged-workers", "true"]
SMALL = EngineSpec.from_dict(spec_dict())
# 2 MiB a block: a 256-block request (512 MiB) takes long enough through the rings to be killed midway.
BIG = EngineSpec.from_dict(
    spec_dict(num_layers=32, num_kv_heads=8, head_dim=128, num_blocks=520, dtype="float16")
)
LONG = 256
READS = "kvsidecar_staged_transfer_reads"  # staged transfers the reader ran, and the reads they carried
STAGING = "kvsidecar_worker_staging_bytes"  # each worker's rings, by device (-1: the host's)
DESCRIPTORS = "kvsidecar_nixl_descriptors_per_transfer"  # the sidecar's own NIXL transfers (WRITEs)
WORKER_DESCRIPTORS = "kvsidecar_worker_nixl_descriptors_per_transfer"  # its workers', by device


def _pull(prefill: EngineProcess, decode: EngineProcess, rid: str, blocks: list[int], seed: int) -> dict:
    pub = prefill.send(
        {
            "cmd": "prefill",
            "request_id": rid,
            "block_ids": blocks,
            "num_tokens": len(blocks) * SMALL.block_size - 3,
            "seed": seed,
        }
    )
    assert pub["ok"], pub
    dst = [b + 40 for b in blocks]
    return decode.send({"cmd": "pull", "params": pub["params"], "block_ids": dst, "seed": seed})


@pytest.mark.parametrize(
    ("prefill_workers", "decode_workers"),
    [(True, True), (False, True), (True, False)],
    ids=["both", "decode-only", "prefill-only"],
)
def test_staged_pulls_through_workers_are_exact(
    spawn: Spawn, prefill_workers: bool, decode_workers: bool
) -> None:
    """Both sides in workers, or one (the other runs the transfer in its sidecar, as a sidecar without
    workers does): each pull exact, side by side too (grouped transfers), through the workers."""
    ps = spawn(SidecarProcess("sw-prefill", extra=WORKERS if prefill_workers else RING))
    ds = spawn(SidecarProcess("sw-decode", extra=WORKERS if decode_workers else RING))
    prefill, decode = spawn.together(
        lambda: EngineProcess(ps.socket, "sw-p", SMALL), lambda: EngineProcess(ds.socket, "sw-d", SMALL)
    )
    res = _pull(prefill, decode, "one", [1, 2, 3], seed=1)
    assert res["ok"] and res["path"] == "host-ring", res
    assert res["verified"], res["errors"]  # every byte, and nothing outside the blocks
    for sc, on in ((ps, prefill_workers), (ds, decode_workers)):
        assert len(workers_of(sc)) == (1 if on else 0), "one worker: the host's"
        with SidecarClient(sc.socket, lane=False) as client:
            shown = [(w.device, w.pid, w.local_copies, w.staged) for w in client.status().workers]
        assert shown == ([(-1, workers_of(sc)[0], False, True)] if on else []), shown  # kv-sidecar status
    # Side by side: reads of one rank pair that wait go as one transfer (staged_group_reads).
    pulls = [
        {
            "params": prefilled(prefill, f"r{i}", [5 + 3 * i, 6 + 3 * i], 29, seed=i + 2),
            "block_ids": [45 + 2 * i, 46 + 2 * i],
            "seed": i + 2,
        }
        for i in range(8)
    ]
    before = metric(ds.metrics_port, f"{READS}_count")
    out = decode.send({"cmd": "pull_many", "pulls": pulls, "timeout_s": 60})
    assert out["ok"] and out["untouched_outside"], out
    for r in out["results"]:
        assert r["verified"] and r["path"] == "host-ring", r["errors"]
    assert metric(ds.metrics_port, f"{READS}_count") - before < 8, "some reads went together"
    # A worker's rings are its own: each sidecar's scrape shows them, asked from the worker, idle now.
    for sc, on in ((ps, prefill_workers), (ds, decode_workers)):
        owned = metric(sc.metrics_port, f"{STAGING}_capacity", '{device="-1"}')
        assert (0 < owned <= 8 << 20) if on else owned == 0, (sc.name, owned)  # rings of 4 MiB
        assert metric(sc.metrics_port, f"{STAGING}_in_use", '{device="-1"}') == 0
        # So are its NIXL agent's registrations (its rings) ...
        held = metric(sc.metrics_port, "kvsidecar_worker_nixl_held", '{device="-1",kind="registrations"}')
        assert held >= 1 if on else held == 0, (sc.name, held)
    # ... and the source's WRITEs: a worker's, where the source runs one, else the sidecar's own.
    writes = metric(ps.metrics_port, f"{WORKER_DESCRIPTORS}_count", '{device="-1"}')
    own = metric(ps.metrics_port, f"{DESCRIPTORS}_count")
    assert (writes >= 2 and own == 0) if prefill_workers else (writes == 0 and own >= 2), (writes, own)


def test_a_request_the_source_refuses_fails_alone_through_workers(spawn: Spawn) -> None:
    """A PullBatch through workers on both sides, two of whose requests the source no longer holds:
    those two fail alone (NOT_FOUND, their blocks named and untouched, the words a pull of each alone
    gets); the others arrive exact, nothing outside the blocks changes, and the workers' receptions
    all end (their rings idle). A refused transfer's reception in the worker is asked how far it got
    and closed: commands that wake its loop at once (StagedServer._scattering)."""
    ps = spawn(SidecarProcess("swr-prefill", extra=WORKERS))
    ds = spawn(SidecarProcess("swr-decode", extra=WORKERS))
    prefill, decode = spawn.together(
        lambda: EngineProcess(ps.socket, "swr-p", SMALL), lambda: EngineProcess(ds.socket, "swr-d", SMALL)
    )
    pulls = [
        {
            "params": prefilled(prefill, f"r{i}", [2 * i, 2 * i + 1], 29, seed=20 + i),
            "block_ids": [40 + 2 * i, 41 + 2 * i],
            "seed": 20 + i,
        }
        for i in range(8)
    ]
    refused = (2, 5)
    for i in refused:
        assert prefill.send({"cmd": "abort", "request_id": f"r{i}"})["found"]
    out = decode.send({"cmd": "pull_many", "pulls": pulls, "timeout_s": 60})
    assert out["untouched_outside"], out
    for i, r in enumerate(out["results"]):
        if i in refused:
            assert not r["ok"] and r["error_code"] == "NOT_FOUND", (i, r)
            assert r["unfilled_blocks"] == pulls[i]["block_ids"], r
        else:
            assert r["ok"] and r["verified"] and r["path"] == "host-ring", (i, r)
    with SidecarClient(ds.socket) as client:
        for i in refused:
            alone = client.pull(params_from_json(pulls[i]["params"]), decode.engine_id, pulls[i]["block_ids"])
            r = out["results"][i]
            assert (alone.error_code, alone.error) == (r["error_code"], r["error"]), (i, alone)
    for sc in (ps, ds):
        wait_for(
            f"{sc.name}: its worker's rings idle",
            lambda sc=sc: metric(sc.metrics_port, f"{STAGING}_in_use", '{device="-1"}') == 0,
            timeout_s=20,
        )
    assert ps.alive and ds.alive


def _pushes(source: SidecarProcess) -> float:
    """Staged transfers the source sidecar has started (by the reader's notification or call)."""
    return sum(
        metric(source.metrics_port, "kvsidecar_push_starts_total", f'{{by="{by}"}}')
        for by in ("notification", "call")
    )


def _kill_when_pushed(
    victim: SidecarProcess,
    source: SidecarProcess,
    pushes: float,
    decode: EngineProcess,
    reader: SidecarProcess,
) -> tuple[int, float]:
    """SIGKILL the victim's worker once the source has started more than `pushes` transfers, a little
    after (mid-transfer: a 512 MiB transfer takes seconds here); its pid, and the transfers started
    then (the next Push is the retry's)."""
    # A retry's Push follows a worker's restart (spawned: seconds on a loaded 2-core machine).
    deadline = time.monotonic() + 60
    while (started := _pushes(source)) <= pushes:
        if time.monotonic() > deadline:
            # The pull ended without the Push: its answer and both sidecars' logs say why.
            try:
                answer = decode.readline(5)
            except Exception as e:  # none yet: the engine says what it waits for
                answer = f"none ({e})"
            raise AssertionError(
                "\n".join(
                    [
                        "timed out waiting for the transfer's Push; the pull's answer:",
                        answer,
                        *reader.stderr_lines(40),
                        "--- source:",
                        *source.stderr_lines(40),
                    ]
                )
            )
        time.sleep(0.05)
    time.sleep(0.3)
    (worker,) = workers_of(victim)
    os.kill(worker, signal.SIGKILL)
    return worker, started


def _replaced(sc: SidecarProcess, killed: tuple[int, ...]) -> bool:
    """A worker runs that is none of the killed ones (one look at /proc: it changes meanwhile)."""
    pids = workers_of(sc)
    return bool(pids) and not set(pids) & set(killed)


@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_a_worker_killed_mid_transfer_is_restarted_and_its_pull_fails_or_retries_cleanly(
    spawn: Spawn, victim: str
) -> None:
    """Killed once, the pull handshakes again (the worker's new agent) and retries within its deadline:
    it arrives whole. Killed in the retry too, it fails UNAVAILABLE naming every block it did not fill.
    Either way the worker is started again, the next pulls are exact, and both sidecars stay up."""
    big_rings = [*WORKERS, "--gpu-staging-bytes", str(32 << 20)]  # slots of 4 MiB: two blocks each
    ps = spawn(SidecarProcess(f"swk-prefill-{victim}", extra=big_rings))
    ds = spawn(SidecarProcess(f"swk-decode-{victim}", extra=big_rings))
    victim_sc = ds if victim == "decode" else ps
    prefill, decode = spawn.together(
        lambda: EngineProcess(ps.socket, f"swk-p-{victim}", BIG),
        lambda: EngineProcess(ds.socket, f"swk-d-{victim}", BIG),
    )
    warm = prefilled(prefill, "warm", [0], 16, seed=1)
    res = decode.send({"cmd": "pull", "params": warm, "block_ids": [1], "seed": 1})
    assert res["ok"] and res["verified"], res.get("error")
    dst = list(range(BIG.num_blocks - LONG, BIG.num_blocks))
    for kills in (1, 2):
        params = prefilled(prefill, f"long-{kills}", list(range(LONG)), LONG * BIG.block_size, seed=6 + kills)
        # Counted before the pull goes: read after, its Push may already be in it (CI, loaded), and the
        # wait would be for a Push that never comes.
        pushes = _pushes(ps)
        decode.post(
            {"cmd": "pull", "params": params, "block_ids": dst, "seed": 6 + kills, "verify": kills == 1}
        )
        killed = []
        for _ in range(kills):
            pid, pushes = _kill_when_pushed(victim_sc, ps, pushes, decode, ds)
            killed.append(pid)
            wait_for("a new worker", lambda k=tuple(killed): _replaced(victim_sc, k))
        res = json.loads(decode.readline(60))
        if kills == 1:  # retried on a new handshake, with the restarted worker's agent
            assert res["ok"] and res["verified"], (
                victim,
                res.get("error"),
                "\n".join(ds.stderr_lines(30)),
                "\n".join(ps.stderr_lines(30)),
            )
        else:
            assert not res["ok"], (
                f"the transfer ended before the second kill ({victim}); make it longer (LONG)"
            )
            assert res["error_code"] == "UNAVAILABLE", (
                victim,
                res.get("error"),
                "\n".join(ds.stderr_lines(30)),
                "\n".join(ps.stderr_lines(30)),
            )
            assert res["unfilled_blocks"] == dst, res
            if victim == "decode":  # whichever side noticed first: our worker's death, or the source's WRITE
                assert any(
                    why in res["error"]
                    for why in (
                        "data-plane worker of the host died",
                        "NIXL WRITE into the reader's ring failed",
                    )
                ), res
        assert logged(ds, "handshake again and retry once"), "the first failure is logged"
    assert metric(victim_sc.metrics_port, "kvsidecar_worker_restarts_total", '{device="-1"}') == 3
    for i in range(2):  # the next pulls (into other blocks) are exact
        params = prefilled(prefill, f"after-{i}", [2, 3], 32, seed=8 + i)
        res = decode.send({"cmd": "pull", "params": params, "block_ids": [4, 5], "seed": 8 + i})
        assert res["ok"] and res["verified"], (victim, i, res.get("error"))
    assert ps.alive and ds.alive
