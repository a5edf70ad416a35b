"""device_workers: a sidecar's local copies in a worker process per device (dataplane/workers.py).

Real sidecar and engine processes, host memory (host-direct; gpu-direct runs the same worker code on
GPUs). A device's worker starts at the first local copy into it, which runs in the sidecar, as every
copy does until the worker answered. A pull through the worker is byte-exact; a worker SIGKILLed in
the middle of a copy fails that pull alone (UNAVAILABLE, naming the blocks not filled), is started
again with the ranks attached again, the next pull works, and the sidecar stays up.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

from kv_sidecar.commands.status import render
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess, cpu_ticks, side_by_side
from kv_sidecar_client import SidecarClient

from .conftest import Spawn, batch_with_one_unpublished, metric, spec_dict, wait_for

WORKERS = ["--device-workers", "true"]
SMALL = EngineSpec.from_dict(spec_dict())
# 2 MiB a block; a 512-block request is 1 GiB: its copy (memmoves) runs long enough to be killed midway.
BIG = EngineSpec.from_dict(
    spec_dict(num_layers=32, num_kv_heads=8, head_dim=128, num_blocks=520, dtype="float16")
)
LONG = 512
# 1 MiB a block, room for three engines' pulls of 8 blocks side by side.
MID = EngineSpec.from_dict(
    spec_dict(num_layers=16, num_kv_heads=8, head_dim=128, num_blocks=240, dtype="float16")
)


def workers_of(sidecar: SidecarProcess) -> list[int]:
    return sidecar.worker_pids()


def ready_workers(sidecar: SidecarProcess) -> list[int]:
    """The pids of the workers that `kv-sidecar status` shows started and answering."""
    return [pid for _, pid in sidecar.answering_workers()]


def start_the_worker(sidecar: SidecarProcess, prefill: EngineProcess, decode: EngineProcess) -> int:
    """A first copy (prefill block 0 into decode block 1; it runs in the sidecar) starts the host's
    worker: its pid once it answered."""
    pub = prefill.send(
        {"cmd": "prefill", "request_id": "first", "block_ids": [0], "num_tokens": 1, "seed": 1}
    )
    res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [1], "seed": 1})
    assert res["ok"] and res["verified"], res
    wait_for("the host worker, answering", lambda: len(ready_workers(sidecar)) == 1)
    return ready_workers(sidecar)[0]


def _pull(
    prefill: EngineProcess, decode: EngineProcess, request_id: str, blocks: list[int], seed: int
) -> dict:
    pub = prefill.send(
        {
            "cmd": "prefill",
            "request_id": request_id,
            "block_ids": blocks,
            "num_tokens": len(blocks) * SMALL.block_size,
            "seed": seed,
        }
    )
    assert pub["ok"], pub
    dst = [b + 20 for b in blocks]
    return decode.send({"cmd": "pull", "params": pub["params"], "block_ids": dst, "seed": seed})


def test_the_worker_starts_at_the_first_copy_which_runs_in_the_sidecar_meanwhile(spawn: Spawn) -> None:
    """Registered engines start no worker: a sidecar that sees devices it copies nothing into holds no
    process (nor, on a GPU, its memory) for them. The first copy runs in the sidecar and starts the
    worker, which `kv-sidecar status` shows starting until it answered; later copies run in it."""
    sc = spawn(SidecarProcess("workers-lazy", extra=WORKERS))
    prefill, decode = spawn.together(
        lambda: EngineProcess(sc.socket, "wl-p", BIG), lambda: EngineProcess(sc.socket, "wl-d", BIG)
    )
    time.sleep(0.5)
    assert workers_of(sc) == [], "no worker before a copy"
    with SidecarClient(sc.socket, lane=False) as client:
        assert list(client.status().workers) == []
    worker = start_the_worker(sc, prefill, decode)
    text = render(_status(sc))
    assert f"host: pid {worker}, runs local copies, restarts 0" in text and "starting" not in text, text
    # 64 blocks (128 MiB of memmoves): the worker's CPU shows the copy is its.
    before = cpu_ticks(worker)
    blocks = list(range(100, 164))
    pub = prefill.send(
        {
            "cmd": "prefill",
            "request_id": "big",
            "block_ids": blocks,
            "num_tokens": 64 * BIG.block_size,
            "seed": 2,
        }
    )
    res = decode.send(
        {"cmd": "pull", "params": pub["params"], "block_ids": [b + 200 for b in blocks], "seed": 2}
    )
    assert res["ok"] and res["verified"], res
    assert cpu_ticks(worker) >= before + 2, "the copy ran in the worker"
    assert workers_of(sc) == [worker]


def _status(sc: SidecarProcess) -> Any:
    with SidecarClient(sc.socket, lane=False) as client:
        return client.status()


def test_a_pull_through_the_worker_is_exact(spawn: Spawn) -> None:
    sc = spawn(SidecarProcess("workers", extra=WORKERS))
    prefill, decode = spawn.together(
        lambda: EngineProcess(sc.socket, "w-p", SMALL), lambda: EngineProcess(sc.socket, "w-d", SMALL)
    )
    start_the_worker(sc, prefill, decode)
    for i in range(3):
        res = _pull(prefill, decode, f"r{i}", [3 * i, 3 * i + 1, 3 * i + 2], seed=i)
        assert res["ok"] and res["path"] == "host-direct", res
        assert res["verified"], res["errors"]  # every byte, and nothing outside the blocks
    assert len(workers_of(sc)) == 1, "one worker for the host's copies"


def test_pulls_of_three_engines_at_once_through_one_worker_are_exact(spawn: Spawn) -> None:
    """Three decode engines pull side by side through the host's worker, 8 MiB each: a copy that comes
    in while another runs goes to the worker's pool, one alone runs on the thread that read it; each
    way every byte lands, and nothing outside the pulled blocks changes."""
    sc = spawn(SidecarProcess("workers-many", extra=WORKERS))
    prefill, *decodes = spawn.together(
        lambda: EngineProcess(sc.socket, "wm-p", MID),
        *[lambda i=i: EngineProcess(sc.socket, f"wm-d{i}", MID) for i in range(3)],
    )
    start_the_worker(sc, prefill, decodes[0])
    sources = {}
    for k in range(3):
        for i in range(4):
            blocks = list(range(8 + 32 * k + 8 * i, 16 + 32 * k + 8 * i))
            pub = prefill.send(
                {
                    "cmd": "prefill",
                    "request_id": f"m{k}-{i}",
                    "block_ids": blocks,
                    "num_tokens": len(blocks) * MID.block_size,
                    "seed": 10 * k + i,
                }
            )
            assert pub["ok"], pub
            sources[(k, i)] = pub["params"]

    def pulls_of(k: int) -> list[dict]:
        return [
            decodes[k].send(
                {
                    "cmd": "pull",
                    "params": sources[(k, i)],
                    "block_ids": list(range(200 + 8 * i, 208 + 8 * i)),
                    "seed": 10 * k + i,
                }
            )
            for i in range(4)
        ]

    for results in side_by_side(*[lambda k=k: pulls_of(k) for k in range(3)]):
        for res in results:
            assert res["ok"] and res["path"] == "host-direct", res
            assert res["verified"], res["errors"]
    assert len(workers_of(sc)) == 1


def test_a_worker_killed_mid_copy_fails_that_pull_alone_and_comes_back(spawn: Spawn) -> None:
    sc = spawn(SidecarProcess("workers-kill", extra=WORKERS))
    prefill, decode = spawn.together(
        lambda: EngineProcess(sc.socket, "k-p", BIG), lambda: EngineProcess(sc.socket, "k-d", BIG)
    )
    pub = prefill.send(
        {
            "cmd": "prefill",
            "request_id": "long",
            "block_ids": list(range(LONG)),
            "num_tokens": LONG * BIG.block_size,
            "seed": 7,
        }
    )
    assert pub["ok"], pub
    worker = start_the_worker(sc, prefill, decode)
    before = cpu_ticks(worker)
    dst = list(range(BIG.num_blocks - LONG, BIG.num_blocks))
    cmd = {"cmd": "pull", "params": pub["params"], "block_ids": dst, "seed": 7, "verify": False}
    decode.post(cmd)
    # The copy is running once the worker has spent 20 ms of CPU (1 GiB of memmoves takes far longer).
    deadline = time.monotonic() + 30
    while cpu_ticks(worker) < before + 2:
        assert time.monotonic() < deadline, "the worker never started the copy"
        time.sleep(0.002)
    os.kill(worker, signal.SIGKILL)
    res = json.loads(decode.readline(60))
    assert not res["ok"], "the copy ended before the kill; make it longer (LONG)"
    assert res["error_code"] == "UNAVAILABLE", res
    assert "data-plane worker of the host died" in res["error"] and "blocks not filled" in res["error"], res
    assert res["unfilled_blocks"] == dst
    # Started again, with both ranks attached again: the next pull (into other blocks) is exact.
    wait_for("a new worker, answering", lambda: ready_workers(sc) and ready_workers(sc) != [worker])
    assert metric(sc.metrics_port, "kvsidecar_worker_restarts_total", '{device="-1"}') == 1
    # `kv-sidecar status` names the worker that runs now and counts the restart.
    with SidecarClient(sc.socket, lane=False) as client:
        st = client.status()
    assert st.device_workers == "true"
    assert [(w.device, w.pid, w.restarts, w.local_copies, w.staged) for w in st.workers] == [
        (-1, workers_of(sc)[0], 1, True, False)
    ]
    text = render(st)
    assert "data-plane workers: 1 (device_workers true)" in text
    assert f"host: pid {workers_of(sc)[0]}, runs local copies, restarts 1" in text
    pub = prefill.send(
        {"cmd": "prefill", "request_id": "after", "block_ids": [0, 1], "num_tokens": 32, "seed": 8}
    )
    res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [2, 3], "seed": 8})
    assert res["ok"] and res["verified"], res
    assert sc.alive


def test_a_pull_batch_through_the_worker_is_exact_and_a_bad_member_fails_alone(spawn: Spawn) -> None:
    """A PullBatch's copies into one device go to its worker in one message (local_copies.copy_all
    there): every member exact, one naming a request never published refused alone, no byte outside
    the members' blocks written."""
    sc = spawn(SidecarProcess("workers-batch", extra=WORKERS))
    prefill, decode = spawn.together(
        lambda: EngineProcess(sc.socket, "wb-p", SMALL), lambda: EngineProcess(sc.socket, "wb-d", SMALL)
    )
    start_the_worker(sc, prefill, decode)
    pulls = []
    for i in range(4):
        blocks = [3 * i, 3 * i + 1, 3 * i + 2]
        pub = prefill.send(
            {"cmd": "prefill", "request_id": f"b{i}", "block_ids": blocks, "num_tokens": 40, "seed": i}
        )
        assert pub["ok"], pub
        pulls.append({"params": pub["params"], "block_ids": [b + 20 for b in blocks], "seed": i})
    batch_with_one_unpublished(decode, pulls, [40, 41, 42])
    assert len(workers_of(sc)) == 1


def test_a_worker_killed_mid_batch_fails_every_member_it_held_and_comes_back(spawn: Spawn) -> None:
    """Both members of a batch go to the worker in one message: killed in the middle, it fails both
    (UNAVAILABLE, each naming its own blocks), is started again, and the next batch is exact."""
    sc = spawn(SidecarProcess("workers-batch-kill", extra=WORKERS))
    prefill, decode = spawn.together(
        lambda: EngineProcess(sc.socket, "bk-p", BIG), lambda: EngineProcess(sc.socket, "bk-d", BIG)
    )
    half = LONG // 2
    pulls = []
    for i in range(2):
        src = list(range(i * half, (i + 1) * half))
        pub = prefill.send(
            {
                "cmd": "prefill",
                "request_id": f"long{i}",
                "block_ids": src,
                "num_tokens": half * BIG.block_size,
                "seed": 7 + i,
            }
        )
        assert pub["ok"], pub
        dst = list(range(BIG.num_blocks - LONG + i * half, BIG.num_blocks - LONG + (i + 1) * half))
        pulls.append({"params": pub["params"], "block_ids": dst, "seed": 7 + i})
    worker = start_the_worker(sc, prefill, decode)
    before = cpu_ticks(worker)
    decode.post({"cmd": "pull_many", "pulls": pulls, "timeout_s": 60})
    deadline = time.monotonic() + 30
    while cpu_ticks(worker) < before + 2:  # copying (1 GiB of memmoves takes far longer than 20 ms)
        assert time.monotonic() < deadline, "the worker never started the copies"
        time.sleep(0.002)
    os.kill(worker, signal.SIGKILL)
    out = json.loads(decode.readline(120))
    for res, pull in zip(out["results"], pulls, strict=True):
        assert not res["ok"], "the copies ended before the kill; make them longer (LONG)"
        assert res["error_code"] == "UNAVAILABLE" and "data-plane worker of the host died" in res["error"], (
            res
        )
        assert res["unfilled_blocks"] == pull["block_ids"], res
    wait_for("a new worker, answering", lambda: ready_workers(sc) and ready_workers(sc) != [worker])
    again = []
    for i in range(2):
        pub = prefill.send(
            {
                "cmd": "prefill",
                "request_id": f"after{i}",
                "block_ids": [2 * i, 2 * i + 1],
                "num_tokens": 32,
                "seed": 9 + i,
            }
        )
        again.append({"params": pub["params"], "block_ids": [4 + 2 * i, 5 + 2 * i], "seed": 9 + i})
    out = decode.send({"cmd": "pull_many", "pulls": again})
    assert all(r["ok"] and r["verified"] for r in out["results"]), out
    assert sc.alive
