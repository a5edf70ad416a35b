"""GPU pulls through real sidecars: the same-node kernel path and the cross-sidecar staged ring.

Engine processes keep their KV caches on GPUs and register them with CUDA IPC
handles; sidecar processes import them. Same node: one sidecar holds both
engines and runs one kernel per (request, source rank) on the decode GPU.
Staged: two sidecars; the prefill sidecar gathers chunks into its send ring in
the decode layout and WRITEs each over NIXL (UCX cuda_ipc between the two
processes) into a slot of the decode sidecar's receive ring, with a NIXL
notification; the decode sidecar scatters it and gives the slot back by
notification (docs/gpu.md). The rings are sized small so that a request takes
several chunks, every slot is reused, and concurrent pulls share the slots.
The decode engine checks every requested token bit for bit against the
seeded reference and that no byte outside the requested blocks changed.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

from kv_sidecar.plan.spec import EngineSpec  # noqa: E402
from kv_sidecar.refengine import scrape  # noqa: E402
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess, gpu_memory_by_process  # noqa: E402
from kv_sidecar_client import params_from_json, params_to_json  # noqa: E402

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)
# Prefill on one GPU, decode on another; a one-GPU machine runs both on it (every path but NVLink P2P).
GPU_A, GPU_B = ("cuda:0", "cuda:1") if torch.cuda.device_count() >= 2 else ("cuda:0", "cuda:0")
GPUS = sorted({int(g.split(":")[1]) for g in (GPU_A, GPU_B)})  # the ordinals of the two, once each

# Small rings: 3 slots of 64 KiB per role, 2 of them for any one peer (gpu_staging_reserve), so a
# request moves in several chunks and reuses slots.
SMALL_RINGS = ["--gpu-staging-bytes", str(384 << 10), "--gpu-staging-slots", "3"]
BASE: dict[str, Any] = {
    "tp_size": 1,
    "num_layers": 2,
    "num_kv_heads": 4,
    "head_dim": 64,
    "dtype": "bfloat16",
    "block_size": 16,
    "num_blocks": 40,
    "layout": "flash_attn_nhd",
}
MLA: dict[str, Any] = {"num_kv_heads": 1, "head_dim": 576, "layout": "mla"}
# name: (prefill overrides, decode overrides)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "homogeneous": ({}, {}),
    "tp1_to_tp2": ({}, {"tp_size": 2}),
    "tp2_to_tp1": ({"tp_size": 2}, {}),
    "nhd_to_hnd": ({}, {"layout": "flash_attn_hnd"}),
    "block16_to_32": ({}, {"block_size": 32}),
    # vLLM's default GPU layout (LBNHC) and its cross-layer form (BLNHC).
    "packed_nhd_to_hnd_tp2": ({"layout": "packed_nhd"}, {"layout": "flash_attn_hnd", "tp_size": 2}),
    "packed_nhd_to_packed_block32": ({"layout": "packed_nhd"}, {"layout": "packed", "block_size": 32}),
    "packed_nhd_cross_layer_to_packed_nhd": (
        {"layout": "packed_nhd", "cross_layer": True},
        {"layout": "packed_nhd"},
    ),
    # One layer: a 32-token MLA block (37 KiB) fits the small test rings' 64 KiB slots.
    "mla_block16_to_32": (
        MLA | {"num_layers": 1},
        MLA | {"num_layers": 1, "block_size": 32, "num_blocks": 20},
    ),
}
SAME_NODE_ONLY = {"mla_block16_to_64": (MLA, MLA | {"block_size": 64, "num_blocks": 12})}
NUM_TOKENS = 150  # not a multiple of any block size: the last block is partial


def pull_failure(res: dict[str, Any], *context: object) -> str:
    """A failed pull's answer for an assertion's message, as a str: pytest cuts a non-str message's repr
    short, and a dict's cut left out the path and the errors (one failure under the whole suite's load,
    thirty-fourth session, showed neither)."""
    head = " ".join(str(c) for c in context)
    return (
        f"{head}{': ' if head else ''}ok {res.get('ok')}, path {res.get('path')}, verified "
        f"{res.get('verified')}, error {res.get('error')!r}, errors {res.get('errors')}; {res}"
    )


_count = iter(range(10**6))


@pytest.fixture(scope="module")
def node() -> Iterator[SidecarProcess]:
    # Copies in this process on any machine, whatever the default: these tests count the launches this
    # process makes; worker_node runs the same in workers.
    s = SidecarProcess("gpu-node", extra=[*SMALL_RINGS, "--device-workers", "false"])
    yield s
    assert s.stop() == 0, "\n".join(s.stderr_tail)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[SidecarProcess, SidecarProcess]]:
    a, b = SidecarProcess("gpu-prefill", extra=SMALL_RINGS), SidecarProcess("gpu-decode", extra=SMALL_RINGS)
    yield a, b
    assert (a.stop(), b.stop()) == (0, 0), "\n".join([*a.stderr_tail, *b.stderr_tail])


def run_case(psock: str, dsock: str, name: str, want_path: str) -> None:
    with engines_after_a_pull(psock, dsock, name, want_path):
        pass


@contextlib.contextmanager
def engines_after_a_pull(psock: str, dsock: str, name: str, want_path: str) -> Iterator[None]:
    """A case's prefill and decode engines, one request pulled between them and checked; stopped on
    exit, so that the caller can look at the sidecar while both are registered."""
    pover, dover = (CASES | SAME_NODE_ONLY)[name]
    pspec, dspec = EngineSpec.from_dict(BASE | pover), EngineSpec.from_dict(BASE | dover)
    n = next(_count)
    # Prefill ranks spread over both GPUs; decode rank 0 on the other GPU than prefill rank 0.
    prefill = EngineProcess(psock, f"p-{name}-{n}", pspec, devices=[GPU_A, GPU_B])
    decode = EngineProcess(dsock, f"d-{name}-{n}", dspec, devices=[GPU_B, GPU_A])
    try:
        src = list(range(pspec.num_blocks - 1, -1, -3))[: -(-NUM_TOKENS // pspec.block_size)]
        dst = list(range(1, dspec.num_blocks, 2))[: -(-NUM_TOKENS // dspec.block_size)]
        pub = prefill.send(
            {"cmd": "prefill", "request_id": "r", "block_ids": src, "num_tokens": NUM_TOKENS, "seed": n}
        )
        assert pub["ok"], pub
        res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": dst, "seed": n})
        assert res["ok"], res
        assert res["path"] == want_path, res
        assert res["verified"], res["errors"]
        consumed = {
            prefill.send({"cmd": "next_event", "timeout_s": 30})["rank"] for _ in range(pspec.tp_size)
        }
        assert consumed == set(range(pspec.tp_size))
        yield
    finally:
        prefill.stop()
        decode.stop()


@pytest.mark.parametrize("name", list(CASES | SAME_NODE_ONLY))
def test_same_node_kernel_path(node: SidecarProcess, name: str) -> None:
    run_case(node.socket, node.socket, name, "gpu-direct")


def answering_workers(sc: SidecarProcess) -> list[int]:
    """The devices of the sidecar's workers that have started and answered (`kv-sidecar status`)."""
    return [device for device, _ in sc.answering_workers()]


@pytest.fixture(scope="module")
def worker_node() -> Iterator[SidecarProcess]:
    s = SidecarProcess("gpu-workers", extra=[*SMALL_RINGS, "--device-workers", "true"])
    # A GPU's worker starts at the first copy into it (which runs in the sidecar): copy into both GPUs'
    # ranks once, and wait for their workers to answer.
    run_case(s.socket, s.socket, "tp1_to_tp2", "gpu-direct")
    deadline = time.monotonic() + 120
    while answering_workers(s) != GPUS:
        assert time.monotonic() < deadline, f"workers answering: {answering_workers(s)}, want {GPUS}"
        time.sleep(0.1)
    yield s
    assert s.stop() == 0, "\n".join(s.stderr_tail)


def _own_launches(sc: SidecarProcess) -> float:
    return sum(_metric(sc, "kvsidecar_gpu_launches_total", f'{{by="{by}"}}') for by in ("direct", "triton"))


def _worker_launches(sc: SidecarProcess, device: int) -> float:
    return sum(
        _metric(sc, "kvsidecar_worker_gpu_launches_total", f'{{by="{by}",device="{device}"}}')
        for by in ("direct", "triton")
    )


@pytest.mark.parametrize("name", ["homogeneous", "tp1_to_tp2", "nhd_to_hnd", "block16_to_32"])
def test_same_node_kernel_path_in_device_workers(worker_node: SidecarProcess, name: str) -> None:
    """device_workers: the decode GPU's worker process maps both engines' IPC handles itself and runs
    the copy; exact as the sidecar's own (tests/e2e/test_device_workers.py kills one, host memory).
    The sidecar launches nothing itself once the workers answer."""
    before = _own_launches(worker_node)
    in_workers = {d: _worker_launches(worker_node, d) for d in GPUS}
    run_case(worker_node.socket, worker_node.socket, name, "gpu-direct")
    assert _own_launches(worker_node) == before, "the copies ran in the workers"
    # A decode engine of two ranks has one on each GPU: each GPU's copies ran in that GPU's worker.
    decode_gpus = (
        GPUS if (CASES | SAME_NODE_ONLY)[name][1].get("tp_size", 1) > 1 else [int(GPU_B.split(":")[1])]
    )
    grew = [d for d in GPUS if _worker_launches(worker_node, d) > in_workers[d]]
    assert grew == decode_gpus, (grew, decode_gpus)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: a worker's own and another")
def test_a_device_worker_holds_gpu_memory_on_its_own_gpu_only(worker_node: SidecarProcess) -> None:
    """A device worker copies into its GPU only, so it imports every engine rank into that GPU's context
    (memory/gpu_rank.GpuRank's `home`), not into each rank's own GPU's: a CUDA context on every GPU
    with a rank would cost each worker GPU memory on all of them (nvidia-smi's processes). Looked at while
    engines with ranks on both GPUs are registered: a worker maps the ranks there are."""
    with engines_after_a_pull(worker_node.socket, worker_node.socket, "tp1_to_tp2", "gpu-direct"):
        workers = worker_node.answering_workers()
        on = {pid: set(held) for pid, held in gpu_memory_by_process().items()}
    assert len(workers) == 2, workers
    for device, pid in workers:
        assert on.get(pid) == {str(device)}, (device, pid, on.get(pid))


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="device_workers=auto needs 4 GPUs to act")
def test_device_workers_auto_runs_gpu_copies_in_workers_on_four_gpus_and_host_copies_here() -> None:
    """With device_workers=auto a sidecar that sees 4 GPUs or more runs its gpu-direct copies in the
    decode GPU's worker process, exact, once that worker answers (the first copy, which starts it,
    runs in the sidecar), while host-direct copies stay in the sidecar: no host worker is started, nor
    one for the prefill GPU, which no copy goes into."""
    sc = SidecarProcess("gpu-auto-workers", extra=[*SMALL_RINGS, "--device-workers", "auto"])
    engines: list[EngineProcess] = []
    try:
        n = next(_count)
        spec = EngineSpec.from_dict(BASE)
        host_spec = EngineSpec.from_dict(BASE | {"dtype": "float16"})
        prefill = EngineProcess(sc.socket, f"auto-p-{n}", spec, devices=[GPU_A])
        decode = EngineProcess(sc.socket, f"auto-d-{n}", spec, devices=[GPU_B])
        host_p = EngineProcess(sc.socket, f"auto-hp-{n}", host_spec)
        host_d = EngineProcess(sc.socket, f"auto-hd-{n}", host_spec)
        engines = [prefill, decode, host_p, host_d]
        device = GPU_B.split(":")[1]
        launches = functools.partial(_worker_launches, sc, int(device))

        def pull(p: EngineProcess, d: EngineProcess, path: str, request_id: str, dst: list[int]) -> None:
            src = list(range(0, 10))
            pub = p.send(
                {
                    "cmd": "prefill",
                    "request_id": request_id,
                    "block_ids": src,
                    "num_tokens": NUM_TOKENS,
                    "seed": n,
                }
            )
            assert pub["ok"], pub
            res = d.send({"cmd": "pull", "params": pub["params"], "block_ids": dst, "seed": n})
            assert res["ok"] and res["verified"] and res["path"] == path, pull_failure(res)

        pull(prefill, decode, "gpu-direct", "first", list(range(10, 20)))  # in the sidecar; starts the worker
        deadline = time.monotonic() + 120
        while answering_workers(sc) != [int(device)]:
            assert time.monotonic() < deadline, answering_workers(sc)
            time.sleep(0.1)
        before, own = launches(), _own_launches(sc)
        for p, d, path in ((prefill, decode, "gpu-direct"), (host_p, host_d, "host-direct")):
            pull(p, d, path, "r", list(range(20, 30)))
        assert launches() - before >= 1, "the gpu-direct copy ran in the decode GPU's worker"
        assert _own_launches(sc) == own, "no copy launched in the sidecar's own process"
        # One worker: the decode GPU's. None for the prefill GPU, none for the host's copies.
        assert len(sc.worker_pids()) == 1, sc.worker_pids()
    finally:
        for e in engines:
            e.stop()
        assert sc.stop() == 0, "\n".join(sc.stderr_tail)


@pytest.mark.parametrize("name", list(CASES))
def test_cross_sidecar_staged_ring(pair: tuple[SidecarProcess, SidecarProcess], name: str) -> None:
    a, b = pair
    run_case(a.socket, b.socket, name, "gpu-staged")


def test_a_staged_transfer_of_several_chunks_polls_at_the_lone_period_at_both_ends(
    pair: tuple[SidecarProcess, SidecarProcess],
) -> None:
    """nixl_lone_poll_us is in effect on the GPU path (docs/gpu.md): the homogeneous case, 10 blocks
    through 64 KiB slots (5 chunks), alone on the pair, moves kvsidecar_nixl_lone_polls_total at the
    source and at the reader (tests/e2e/test_staged_ring.py checks that a one-chunk pull does not)."""
    a, b = pair
    _rings_idle(a, b)
    before = [_metric(sc, "kvsidecar_nixl_lone_polls_total") for sc in pair]
    run_case(a.socket, b.socket, "homogeneous", "gpu-staged")
    after = [_metric(sc, "kvsidecar_nixl_lone_polls_total") for sc in pair]
    assert after[0] > before[0] and after[1] > before[1], (before, after)


@pytest.fixture(scope="module")
def worker_pair() -> Iterator[tuple[SidecarProcess, SidecarProcess]]:
    extra = [*SMALL_RINGS, "--staged-workers", "true"]
    a, b = SidecarProcess("gpu-sw-prefill", extra=extra), SidecarProcess("gpu-sw-decode", extra=extra)
    yield a, b
    assert (a.stop(), b.stop()) == (0, 0), "\n".join([*a.stderr_tail, *b.stderr_tail])


@pytest.mark.parametrize("name", ["homogeneous", "tp1_to_tp2", "tp2_to_tp1", "nhd_to_hnd", "block16_to_32"])
def test_cross_sidecar_staged_ring_in_staged_workers(
    worker_pair: tuple[SidecarProcess, SidecarProcess], name: str
) -> None:
    """staged_workers: each GPU's worker process, with its own NIXL agent and rings, gathers, WRITEs and
    scatters (prefill ranks on both GPUs: two workers a side); exact as the sidecar's own
    (tests/e2e/test_staged_workers.py kills one mid-transfer, host rings)."""
    a, b = worker_pair
    run_case(a.socket, b.socket, name, "gpu-staged")


def test_concurrent_staged_pulls_in_staged_workers(
    worker_pair: tuple[SidecarProcess, SidecarProcess],
) -> None:
    a, b = worker_pair
    errors: list[BaseException] = []

    def one(name: str) -> None:
        try:
            run_case(a.socket, b.socket, name, "gpu-staged")
        except BaseException as e:
            errors.append(e)

    threads = [
        threading.Thread(target=one, args=(n,)) for n in ["homogeneous", "nhd_to_hnd", "tp1_to_tp2"] * 2
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors


def test_a_member_sidecars_rank_sends_from_its_gpu_worker_once_reported() -> None:
    """A prefill engine over a leader sidecar (rank 0) and a member sidecar (rank 1, on GPU_B), the decode
    engine on a third, all with staged_workers: once the member reported its GPU worker to the leader
    (when the worker is ready), rank 1's chunks come from that worker (its WRITEs grow, the member sidecar's own
    do not), bit-exact; until then the member sidecar sends them. tests/e2e/test_member_workers.py runs
    the same on host rings and kills the worker."""
    extra = [*SMALL_RINGS, "--staged-workers", "true", "--leader-wait-ms", "10000"]
    sidecars = [SidecarProcess(f"gpu-swm-{role}", extra=extra) for role in ("leader", "member", "decode")]
    lead, memb, dec = sidecars
    pspec = EngineSpec.from_dict(BASE | {"tp_size": 2})
    dspec = EngineSpec.from_dict(BASE | {"tp_size": 2, "layout": "flash_attn_hnd"})
    engines: list[EngineProcess] = []
    worker_writes = "kvsidecar_worker_nixl_descriptors_per_transfer_count"
    own_writes = "kvsidecar_nixl_descriptors_per_transfer_count"
    on_b = {"device": GPU_B.split(":")[1]}
    try:
        on_gpus = [GPU_A, GPU_B]  # rank r on on_gpus[r]
        engines.append(leader := EngineProcess(lead.socket, "gpu-swm-p", pspec, ranks=[0], devices=on_gpus))
        engines.append(
            member := EngineProcess(
                memb.socket, "gpu-swm-p", pspec, ranks=[1], devices=on_gpus, leader=lead.peer_address
            )
        )
        engines.append(decode := EngineProcess(dec.socket, "gpu-swm-d", dspec, devices=[GPU_B, GPU_A]))
        src = list(range(pspec.num_blocks - 1, -1, -3))[: -(-NUM_TOKENS // pspec.block_size)]
        dst = list(range(1, dspec.num_blocks, 2))[: -(-NUM_TOKENS // dspec.block_size)]
        deadline = time.monotonic() + 120
        for n in range(10**6):
            before = scrape.value(memb.metrics_port, worker_writes, **on_b)
            own = scrape.value(memb.metrics_port, own_writes)
            fill = {
                "cmd": "prefill",
                "request_id": f"r{n}",
                "block_ids": src,
                "num_tokens": NUM_TOKENS,
                "seed": n,
            }
            assert member.send(fill | {"publish": False})["ok"]
            pub = leader.send(fill)
            assert pub["ok"], pub
            res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": dst, "seed": n})
            assert res["ok"] and res["path"] == "gpu-staged", pull_failure(res)
            assert res["verified"], res["errors"]
            if scrape.value(memb.metrics_port, worker_writes, **on_b) > before:
                assert scrape.value(memb.metrics_port, own_writes) == own, "rank 1 from the worker alone"
                break
            assert time.monotonic() < deadline, "the member's worker never sent rank 1"
            time.sleep(0.2)
    finally:
        for e in engines:
            e.stop()
        codes = [s.stop() for s in sidecars]
        assert codes == [0, 0, 0], "\n".join(line for s in sidecars for line in s.stderr_tail)


@pytest.mark.parametrize(
    ("pover", "dover"),
    [({"tp_size": 2}, {"tp_size": 2}), ({"tp_size": 4}, {"tp_size": 2, "layout": "flash_attn_hnd"})],
    ids=["identity", "converted"],
)
def test_engines_spread_over_the_same_two_sidecars_copy_gpu_direct_on_each(
    pover: dict[str, Any], dover: dict[str, Any]
) -> None:
    """A prefill and a decode engine both spread over a leader sidecar (the first half of each's ranks,
    on GPU_A) and a member (the rest, on GPU_B), as control shards' `spread` places a node's engines:
    each decode rank reads only prefill ranks beside it, so each sidecar copies them gpu-direct (the
    member from the request its leader forwarded), bit-exact, and every prefill rank hears "consumed"
    where it lives."""
    sidecars = [SidecarProcess(f"gpu-spread-{role}", extra=["--leader-wait-ms", "10000"]) for role in "ab"]
    lead, memb = sidecars
    pspec, dspec = EngineSpec.from_dict(BASE | pover), EngineSpec.from_dict(BASE | dover)
    engines: dict[tuple[str, str], EngineProcess] = {}
    try:
        for role, spec in (("p", pspec), ("d", dspec)):
            half = spec.tp_size // 2
            devices = [GPU_A] * half + [GPU_B] * half  # rank r on devices[r]
            engines[role, "a"] = EngineProcess(
                lead.socket, f"gpu-spread-{role}", spec, ranks=list(range(half)), devices=devices
            )
            engines[role, "b"] = EngineProcess(
                memb.socket,
                f"gpu-spread-{role}",
                spec,
                ranks=list(range(half, spec.tp_size)),
                devices=devices,
                leader=lead.peer_address,
            )
        src = list(range(pspec.num_blocks - 1, -1, -3))[: -(-NUM_TOKENS // pspec.block_size)]
        dst = list(range(1, dspec.num_blocks, 2))[: -(-NUM_TOKENS // dspec.block_size)]
        fill = {"cmd": "prefill", "request_id": "both", "block_ids": src, "num_tokens": NUM_TOKENS, "seed": 5}
        assert engines["p", "b"].send(fill | {"publish": False})["ok"]
        pub = engines["p", "a"].send(fill)
        assert pub["ok"], pub
        for side in "ab":
            res = engines["d", side].send(
                {"cmd": "pull", "params": pub["params"], "block_ids": dst, "seed": 5}
            )
            assert res["ok"] and res["path"] == "gpu-direct", pull_failure(res, side)
            assert res["verified"], res["errors"]
        half = pspec.tp_size // 2
        for side, ranks in (("a", range(half)), ("b", range(half, pspec.tp_size))):
            got = [engines["p", side].send({"cmd": "next_event", "timeout_s": 30}) for _ in ranks]
            assert sorted((e["kind"], e["rank"]) for e in got) == [("consumed", r) for r in ranks], got
    finally:
        for e in engines.values():
            e.stop()
        codes = [s.stop() for s in sidecars]
        assert codes == [0, 0], "\n".join(line for s in sidecars for line in s.stderr_tail)


def test_readers_that_hold_some_of_a_spread_engines_ranks_copy_them_and_stage_the_others() -> None:
    """A TP 2 prefill engine over a leader sidecar (rank 0, GPU_A) and a member (rank 1, GPU_B). Decode
    engines on either that read both ranks copy the one beside them (gpu-direct) and take the other from
    its holder (gpu-staged; the leader through a handshake with itself); one on the leader that reads
    only rank 1 stages it all. Bit-exact, and each prefill rank hears "consumed" where it lives."""
    sidecars = [SidecarProcess(f"gpu-mixed-{role}", extra=["--leader-wait-ms", "10000"]) for role in "ab"]
    lead, memb = sidecars
    pspec = EngineSpec.from_dict(BASE | {"tp_size": 2})
    one = EngineSpec.from_dict(BASE | {"layout": "flash_attn_hnd"})
    engines: list[EngineProcess] = []
    try:
        on_gpus = [GPU_A, GPU_B]
        engines.append(leader := EngineProcess(lead.socket, "gpu-mixed-p", pspec, ranks=[0], devices=on_gpus))
        engines.append(
            member := EngineProcess(
                memb.socket, "gpu-mixed-p", pspec, ranks=[1], devices=on_gpus, leader=lead.peer_address
            )
        )
        readers = [
            ("tp1-on-leader", EngineProcess(lead.socket, "gpu-mixed-d1", one, devices=[GPU_A]), (0, 1)),
            ("tp1-on-member", EngineProcess(memb.socket, "gpu-mixed-d2", one, devices=[GPU_B]), (0, 1)),
            (
                "rank1-on-leader",
                EngineProcess(lead.socket, "gpu-mixed-d3", pspec, ranks=[1], devices=on_gpus),
                (1,),
            ),
        ]
        engines += [e for _, e, _ in readers]
        src = list(range(pspec.num_blocks - 1, -1, -3))[: -(-NUM_TOKENS // pspec.block_size)]
        dst = list(range(1, one.num_blocks, 2))[: -(-NUM_TOKENS // one.block_size)]
        for k, (name, reader, consumed) in enumerate(readers):
            fill = {
                "cmd": "prefill",
                "request_id": f"m{k}",
                "block_ids": src,
                "num_tokens": NUM_TOKENS,
                "seed": k,
            }
            assert member.send(fill | {"publish": False})["ok"]
            pub = leader.send(fill)
            assert pub["ok"], pub
            res = reader.send({"cmd": "pull", "params": pub["params"], "block_ids": dst, "seed": k})
            assert res["ok"] and res["path"] == "gpu-staged", pull_failure(res, name)
            assert res["verified"], res["errors"]
            for rank, proc in ((0, leader), (1, member)):
                if rank in consumed:
                    ev = proc.send({"cmd": "next_event", "timeout_s": 30})
                    assert (ev["kind"], ev["request_id"], ev["rank"]) == ("consumed", f"m{k}", rank), (
                        name,
                        ev,
                    )
    finally:
        for e in engines:
            e.stop()
        codes = [s.stop() for s in sidecars]
        assert codes == [0, 0], "\n".join(line for s in sidecars for line in s.stderr_tail)


@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_a_staged_worker_killed_mid_transfer_is_restarted_and_its_pull_retried(victim: str) -> None:
    """staged_workers on GPUs: the worker of the GPU a transfer runs on (the decode or the prefill side)
    SIGKILLed in the middle of it. The pull handshakes again and retries on the restarted worker's new
    agent: it arrives bit-exact, nothing else written; the next pull too; both sidecars stay up.
    Two-block chunks through two 64 KiB slots: a 16,000-block request takes 8,000 chunks."""
    import json
    import os
    import signal

    extra = [*SMALL_RINGS, "--staged-workers", "true"]
    a = SidecarProcess(f"gpu-swk-p-{victim}", extra=extra)
    b = SidecarProcess(f"gpu-swk-d-{victim}", extra=extra)
    spec = EngineSpec.from_dict(BASE | {"num_blocks": 16384})
    prefill = EngineProcess(a.socket, f"swk-p-{victim}", spec, devices=[GPU_A])
    decode = EngineProcess(b.socket, f"swk-d-{victim}", spec, devices=[GPU_B])
    try:
        pub = prefill.send(
            {"cmd": "prefill", "request_id": "warm", "block_ids": [0], "num_tokens": 16, "seed": 1}
        )
        res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [1], "seed": 1})
        assert res["ok"] and res["verified"], pull_failure(res)
        sidecar = b if victim == "decode" else a
        (worker,) = sidecar.worker_pids()
        _long_staged_pull(a, prefill, decode, 16000)
        os.kill(worker, signal.SIGKILL)
        res = json.loads(decode.readline(120))
        # Each failure message carries both sidecars' last log lines: this test failed once with no
        # log to say why (run K, twelfth session).
        logs = "\n".join(["-- prefill sidecar", *a.stderr_tail, "-- decode sidecar", *b.stderr_tail])
        assert res["ok"] and res["verified"], (res.get("error"), res.get("errors"), logs)
        assert sidecar.worker_pids() and sidecar.worker_pids() != [worker], ("a new worker", logs)
        assert any("handshake again and retry once" in line for line in b.stderr_tail), (
            "killed mid-transfer",
            logs,
        )
        pub = prefill.send(
            {"cmd": "prefill", "request_id": "after", "block_ids": [3, 4], "num_tokens": 30, "seed": 3}
        )
        res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [5, 6], "seed": 3})
        assert res["ok"] and res["verified"], (res, "\n".join([*a.stderr_tail, *b.stderr_tail]))
        assert a.alive and b.alive
    finally:
        prefill.stop()
        decode.stop()
        a.stop()
        b.stop()


def test_bad_block_id_fails_cleanly_and_the_sidecar_keeps_serving(
    pair: tuple[SidecarProcess, SidecarProcess],
) -> None:
    """An out-of-range id must be refused before any kernel runs (a fault would poison the context)."""
    a, b = pair
    spec = EngineSpec.from_dict(BASE)
    prefill = EngineProcess(a.socket, "p-bad", spec, devices=[GPU_A])
    decode = EngineProcess(b.socket, "d-bad", spec, devices=[GPU_B])
    try:
        pub = prefill.send(
            {"cmd": "prefill", "request_id": "r", "block_ids": [1, 2], "num_tokens": 32, "seed": 5}
        )
        bad = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [3, 400], "seed": 5})
        assert bad["error_code"] == "INVALID_ARGUMENT" and "400" in bad["error"], bad
        assert bad["verified"], bad["errors"]  # nothing written anywhere
    finally:
        prefill.stop()
        decode.stop()
    run_case(a.socket, b.socket, "homogeneous", "gpu-staged")


def test_ring_too_small_for_one_block_is_a_clear_error(pair: tuple[SidecarProcess, SidecarProcess]) -> None:
    """A 147 KiB MLA block (2 layers x 64 tokens x 576) cannot fit a 64 KiB slot: refused, nothing written."""
    a, b = pair
    pspec, dspec = (EngineSpec.from_dict(BASE | o) for o in SAME_NODE_ONLY["mla_block16_to_64"])
    prefill = EngineProcess(a.socket, "p-mla-big", pspec, devices=[GPU_A])
    decode = EngineProcess(b.socket, "d-mla-big", dspec, devices=[GPU_B])
    try:
        pub = prefill.send(
            {"cmd": "prefill", "request_id": "r", "block_ids": [3, 4, 5, 6], "num_tokens": 64, "seed": 9}
        )
        res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [2], "seed": 9})
        assert res["error_code"] == "RESOURCE_EXHAUSTED", res
        assert "gpu_staging_bytes" in res["error"] and res["unfilled_blocks"] == [2], res
        assert res["verified"], res["errors"]
    finally:
        prefill.stop()
        decode.stop()


def test_the_sidecar_counts_its_kernel_launches(node: SidecarProcess) -> None:
    """Every GPU copy the sidecar launches shows in kvsidecar_gpu_launches_total, by how it was made;
    on a Triton it launches directly, repeated copies of one shape go direct."""
    from kv_sidecar.execute import gpu_kernels

    before = {
        by: _metric(node, "kvsidecar_gpu_launches_total", f'{{by="{by}"}}') for by in ("direct", "triton")
    }
    for _ in range(3):
        run_case(node.socket, node.socket, "homogeneous", "gpu-direct")
    after = {
        by: _metric(node, "kvsidecar_gpu_launches_total", f'{{by="{by}"}}') for by in ("direct", "triton")
    }
    assert sum(after.values()) >= sum(before.values()) + 3, (before, after)
    if triton.__version__.startswith(gpu_kernels.DIRECT_TRITON):
        assert after["direct"] >= before["direct"] + 2, (before, after)  # the 2nd and 3rd copy at least


def test_a_prefill_engine_publishes_only_what_its_gpu_has_written(
    pair: tuple[SidecarProcess, SidecarProcess],
) -> None:
    """The reference engine's own soundness, which every GPU test leans on: the sidecar reads an
    engine's KV from another process, on its own streams, and sees only writes that have completed. Here
    the prefill's writes are kernels queued behind one that spins 300 ms on the prefill GPU, as on a
    GPU that other processes keep busy; the engine publishes once they are done (RefEngine._settle),
    so both paths read the request's bytes, not the poison the blocks held before. (Without that wait
    the gpu-direct pull, the first, was answered ok with every token poison, on 2x H200. A blocking
    copy_ into a block's strided view returns before its last kernel has run: the likely cause of
    one pull found wrong under the whole suite's load.)"""
    a, b = pair
    spec = EngineSpec.from_dict(BASE)
    n = next(_count)
    remote = EngineProcess(a.socket, f"late-pr-{n}", spec, devices=[GPU_A])
    local = EngineProcess(b.socket, f"late-pl-{n}", spec, devices=[GPU_A])
    decode = EngineProcess(b.socket, f"late-d-{n}", spec, devices=[GPU_B])
    try:
        blocks = -(-NUM_TOKENS // spec.block_size)
        for i, (prefill, path) in enumerate(((local, "gpu-direct"), (remote, "gpu-staged"))):
            # Its kernels loaded first: loading one (CUDA's lazy loading) waits for the device, which
            # would wait for the fill's writes whether the engine does or not.
            warm = {"cmd": "prefill", "block_ids": [blocks], "num_tokens": 1, "seed": 0, "publish": False}
            assert prefill.send(warm | {"delay_ms": 1})["ok"]
            seed = 100 * n + i
            t0 = time.monotonic()
            pub = prefill.send(
                {
                    "cmd": "prefill",
                    "request_id": f"late{i}",
                    "block_ids": list(range(blocks)),
                    "num_tokens": NUM_TOKENS,
                    "seed": seed,
                    "delay_ms": 300,
                }
            )
            assert pub["ok"], pub
            waited = time.monotonic() - t0
            res = decode.send(
                {"cmd": "pull", "params": pub["params"], "block_ids": list(range(blocks)), "seed": seed}
            )
            assert res["ok"] and res["verified"] and res["path"] == path, pull_failure(res, path, "expected")
            assert waited >= 0.25, f"the prefill answered {waited:.3f} s after its call, before its writes"
    finally:
        for e in (remote, local, decode):
            e.stop()


def test_registration_compiles_the_copy_kernel_so_that_no_pull_waits_for_the_compiler() -> None:
    """RegisterRank compiles the copy kernel of a homogeneous pairing (execute/gpu.warm_up): the first
    gpu-direct pull and the first staged pull (the source's gather, the reader's scatter) launch the
    compiled kernel, as do pulls of other lengths and prefix starts, on which the kernel is not
    specialised. None goes through Triton, where a compile would happen."""
    from kv_sidecar.execute import gpu_kernels

    if not triton.__version__.startswith(gpu_kernels.DIRECT_TRITON):
        pytest.skip(f"Triton {triton.__version__}: every launch goes through Triton")
    extra = [*SMALL_RINGS, "--device-workers", "false"]
    a, b = SidecarProcess("warm-prefill", extra=extra), SidecarProcess("warm-decode", extra=extra)
    engines: list[EngineProcess] = []
    try:
        n = next(_count)
        spec = EngineSpec.from_dict(BASE)
        remote = EngineProcess(a.socket, f"warm-pr-{n}", spec, devices=[GPU_A])
        local = EngineProcess(b.socket, f"warm-pl-{n}", spec, devices=[GPU_A])
        decode = EngineProcess(b.socket, f"warm-d-{n}", spec, devices=[GPU_B])
        engines = [remote, local, decode]
        bs = spec.block_size
        for prefill, path in ((local, "gpu-direct"), (remote, "gpu-staged")):
            for i, (tokens, start) in enumerate(((NUM_TOKENS, 0), (33, 0), (NUM_TOKENS, 2 * bs), (1, 0))):
                src = list(range(0, -(-tokens // bs)))
                dst = list(range(20, 20 + -(-tokens // bs) - start // bs))
                seed = 100 * n + i
                pub = prefill.send(
                    {
                        "cmd": "prefill",
                        "request_id": f"r{i}",
                        "block_ids": src,
                        "num_tokens": tokens,
                        "seed": seed,
                    }
                )
                assert pub["ok"], pub
                res = decode.send(
                    {
                        "cmd": "pull",
                        "params": pub["params"],
                        "block_ids": dst,
                        "seed": seed,
                        "start_token": start,
                    }
                )
                assert res["ok"] and res["verified"] and res["path"] == path, pull_failure(
                    res, path, "expected,", tokens, "tokens from", start
                )
        for sc, what in ((b, "gpu-direct copies and scatters"), (a, "gathers")):
            launches = {
                by: _metric(sc, "kvsidecar_gpu_launches_total", f'{{by="{by}"}}')
                for by in ("direct", "triton")
            }
            assert launches["triton"] == 0 and launches["direct"] >= 4, (what, launches)
    finally:
        for e in engines:
            e.stop()
        assert (a.stop(), b.stop()) == (0, 0), "\n".join([*a.stderr_tail, *b.stderr_tail])


HETEROGENEOUS = ["tp1_to_tp2", "tp2_to_tp1", "nhd_to_hnd", "block16_to_32", "packed_nhd_to_packed_block32"]


def test_registration_compiles_the_kernels_of_heterogeneous_pairings_on_the_node() -> None:
    """Two engines of different TP, layout or block size on one sidecar: registering the second
    compiles the kernels of their gpu-direct copies, either way (dataplane/ranks._warm_pairs), so that
    the first pull between them launches a compiled kernel instead of waiting for Triton to compile it."""
    from kv_sidecar.execute import gpu_kernels

    if not triton.__version__.startswith(gpu_kernels.DIRECT_TRITON):
        pytest.skip(f"Triton {triton.__version__}: every launch goes through Triton")
    node = SidecarProcess("warm-pairs", extra=[*SMALL_RINGS, "--device-workers", "false"])
    try:
        for name in HETEROGENEOUS:
            run_case(node.socket, node.socket, name, "gpu-direct")
        launches = {
            by: _metric(node, "kvsidecar_gpu_launches_total", f'{{by="{by}"}}') for by in ("direct", "triton")
        }
        assert launches["triton"] == 0 and launches["direct"] >= len(HETEROGENEOUS), launches
    finally:
        assert node.stop() == 0, "\n".join(node.stderr_tail)


def test_the_sidecar_says_whether_its_copies_on_a_gpu_run_under_mps() -> None:
    """`kvsidecar_gpu_mps{device}`, set when a GPU's first rank registers: 1 where the sidecar's contexts
    on it are CUDA MPS clients (its copies run beside the engines' kernels), 0 where they take turns
    with them; and a log line once per GPU. The driver of this process, which reaches the same MPS
    daemon if any, says which."""
    from kv_sidecar.memory.cuda_ipc import mps_enabled

    sc = SidecarProcess("gpu-mps", extra=[*SMALL_RINGS, "--device-workers", "false"])
    try:
        run_case(sc.socket, sc.socket, "homogeneous", "gpu-direct")
        for device in GPUS:
            want = mps_enabled(device)
            if want is None:
                pytest.skip("this driver does not say whether a GPU runs under MPS")
            got = scrape.value(sc.metrics_port, "kvsidecar_gpu_mps", device=str(device))
            assert got == int(want), (device, got, want)
        assert scrape.present(sc.metrics_port, "kvsidecar_gpu_mps"), "set, not absent (0 reads as absent)"
        said = [
            line for line in sc.stderr_lines(400) if "the sidecar's copies" in line and "CUDA MPS" in line
        ]
        assert len(said) == len(GPUS), said
    finally:
        assert sc.stop() == 0, "\n".join(sc.stderr_tail)


def _metric(sc: SidecarProcess, name: str, labels: str = "") -> float:
    """A sample of the sidecar's /metrics, its labels as exposed (`{kind="x"}`): 0 when absent."""
    return scrape.value(sc.metrics_port, name, **scrape.labels(labels))


def _long_staged_pull(
    source: SidecarProcess,
    prefill: EngineProcess,
    decode: EngineProcess,
    blocks: int,
    timeout_s: float | None = None,
) -> tuple[dict[str, Any], list[int]]:
    """A request of `blocks` blocks published (seed 2) and its pull sent into the last blocks of the decode
    engine's 16,384, returning once its transfer has run 50 ms (its answer: `decode.readline`); the
    request's params and the pull's blocks."""
    pushes = _pushes(source)
    pub = prefill.send(
        {
            "cmd": "prefill",
            "request_id": "long",
            "block_ids": list(range(blocks)),
            "num_tokens": blocks * 16,
            "seed": 2,
        }
    )
    assert pub["ok"], pub
    dst = list(range(16384 - blocks, 16384))
    cmd = {"cmd": "pull", "params": pub["params"], "block_ids": dst, "seed": 2}
    decode.post(cmd | ({"timeout_s": timeout_s} if timeout_s else {}))
    deadline = time.monotonic() + 30
    while _pushes(source) <= pushes:
        assert time.monotonic() < deadline, "the transfer never started"
        time.sleep(0.002)
    time.sleep(0.05)
    return pub["params"], dst


def _pushes(source: SidecarProcess) -> float:
    """Staged transfers the source sidecar has started (by the reader's notification or its call)."""
    return sum(
        _metric(source, "kvsidecar_push_starts_total", f'{{by="{by}"}}') for by in ("notification", "call")
    )


def _rings_idle(*sidecars: SidecarProcess, timeout_s: float = 10) -> None:
    """Every ring slot back in its pool and no NIXL transfer open."""
    deadline = time.monotonic() + timeout_s
    for sc in sidecars:
        while True:
            busy = (
                _metric(sc, "kvsidecar_staging_bytes_in_use"),
                _metric(sc, "kvsidecar_nixl_held", '{kind="transfers_open"}'),
            )
            if busy == (0, 0):
                break
            assert time.monotonic() < deadline, f"staging in use / transfers open: {busy}"
            time.sleep(0.05)


def test_concurrent_staged_pulls_share_the_rings(pair: tuple[SidecarProcess, SidecarProcess]) -> None:
    """Four engine pairs pull at once through two 64 KiB slots of each ring, a peer's share of three
    (every request takes several chunks): the pulls interleave on the slots, and every one is
    bit-exact."""
    a, b = pair
    _rings_idle(a, b)
    errors: list[str] = []

    def worker(w: int) -> None:
        try:
            for name in ("homogeneous", "nhd_to_hnd", "tp2_to_tp1"):
                run_case(a.socket, b.socket, name, "gpu-staged")
        except Exception as e:  # reported below: one thread's failure must not hide the others'
            errors.append(f"worker {w}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    _rings_idle(a, b)


def test_staged_pull_timing_out_mid_transfer_stops_both_ends(
    pair: tuple[SidecarProcess, SidecarProcess],
) -> None:
    """A pull whose deadline passes with chunks in flight (600 chunks in 30 ms): it fails cleanly, writes nothing outside its
    blocks, the source confirms its WRITEs ended (no ring slot is quarantined), the next pull works."""
    a, b = pair
    # 64 KiB blocks: one per chunk through the 64 KiB slots.
    spec = EngineSpec.from_dict(BASE | {"num_layers": 4, "num_blocks": 1000})
    blocks = 600
    prefill = EngineProcess(a.socket, "p-long", spec, devices=[GPU_A], start_timeout_s=120)
    decode = EngineProcess(b.socket, "d-long", spec, devices=[GPU_B], start_timeout_s=120)
    try:
        quarantined = _metric(b, "kvsidecar_failures_total", '{reason="staging_quarantined"}')
        assert prefill.send({"cmd": "randomize", "seed": 3}, timeout_s=120)["ok"]
        # A first pull between the two engines makes the handshake (which alone may outlast 30 ms on a
        # loaded machine), so that the deadline below passes with chunks in flight.
        warm = prefill.send(
            {"cmd": "prefill", "request_id": "warm", "block_ids": [0], "num_tokens": 16, "seed": 0}
        )
        res = decode.send({"cmd": "pull", "params": warm["params"], "block_ids": [0], "seed": 0})
        assert res["ok"] and res["verified"], pull_failure(res)
        pub = prefill.send(
            {
                "cmd": "prefill",
                "request_id": "long",
                "block_ids": list(range(blocks)),
                "num_tokens": blocks * 16,
                "seed": 0,
                "fill": False,
            }
        )
        dst = list(range(999, 999 - blocks, -1))
        res = decode.send(
            {"cmd": "pull", "params": pub["params"], "block_ids": dst, "seed": 0, "timeout_s": 0.03},
            timeout_s=120,
        )
        if res["ok"]:
            pytest.skip(f"the pull finished within its timeout ({res['wall_s']:.3f} s): nothing to stop")
        assert res["error_code"] in ("DEADLINE_EXCEEDED", "CANCELLED"), res
        assert res["unfilled_blocks"] == dst
        assert res["verified"], res["errors"]  # no byte outside the requested blocks changed
        _rings_idle(a, b, timeout_s=5)
        assert _metric(b, "kvsidecar_failures_total", '{reason="staging_quarantined"}') == quarantined
    finally:
        prefill.stop()
        decode.stop()
    run_case(a.socket, b.socket, "homogeneous", "gpu-staged")


def test_a_pull_batch_of_staged_and_direct_members_arrives_bit_exact(
    pair: tuple[SidecarProcess, SidecarProcess],
) -> None:
    """One PullBatch into a GPU engine: members through the staged ring (another sidecar) and the kernel
    path (this sidecar, their copies launched together), of other layouts and block sizes, side by
    side; a bad member of either kind fails alone."""
    a, b = pair
    n = next(_count)
    dspec = EngineSpec.from_dict(BASE | {"num_blocks": 64})  # room for every member's own blocks
    sources = {
        "staged": (a, BASE, "gpu-staged"),
        "staged-hnd": (a, BASE | {"layout": "flash_attn_hnd"}, "gpu-staged"),
        "direct": (b, BASE, "gpu-direct"),
        "direct-block32": (b, BASE | {"block_size": 32, "num_blocks": 20}, "gpu-direct"),
    }
    engines = {
        k: EngineProcess(sc.socket, f"pb-{k}-{n}", EngineSpec.from_dict(over), devices=[GPU_A])
        for k, (sc, over, _) in sources.items()
    }
    decode = EngineProcess(b.socket, f"pb-d-{n}", dspec, devices=[GPU_B])
    try:
        pulls = []
        for i, (k, eng) in enumerate(engines.items()):
            bs = sources[k][1]["block_size"]
            pub = eng.send(
                {
                    "cmd": "prefill",
                    "request_id": f"m{i}",
                    "block_ids": list(range(2, 2 + -(-NUM_TOKENS // bs))),
                    "num_tokens": NUM_TOKENS,
                    "seed": n + i,
                }
            )
            assert pub["ok"], pub
            first = 1 + i * 10  # each member's own decode blocks
            pulls.append(
                {"params": pub["params"], "block_ids": list(range(first, first + 10)), "seed": n + i}
            )
        pub = engines["staged"].send(
            {
                "cmd": "prefill",
                "request_id": "bad",
                "block_ids": list(range(20, 30)),
                "num_tokens": NUM_TOKENS,
                "seed": n,
            }
        )
        assert pub["ok"], pub
        # A block id out of range: refused alone. A direct member of a request never published: refused
        # alone, while the other direct members' copies launch together (one wait).
        bad = {"params": pub["params"], "block_ids": [*range(41, 50), dspec.num_blocks], "seed": n}
        unpublished = params_from_json(pulls[2]["params"])
        unpublished.request_id = "never-published"
        gone = {"params": params_to_json(unpublished), "block_ids": list(range(51, 61)), "seed": n}
        out = decode.send({"cmd": "pull_many", "pulls": [*pulls, bad, gone]})
        *good, refused, unknown = out["results"]
        assert out["untouched_outside"], out["outside_errors"]
        for res, (_, _, path) in zip(good, sources.values(), strict=True):
            assert res["ok"] and res["verified"] and res["path"] == path, pull_failure(res)
        assert refused["error_code"] == "INVALID_ARGUMENT", refused
        assert unknown["error_code"] == "NOT_FOUND", unknown
    finally:
        for e in (*engines.values(), decode):
            e.stop()


@pytest.mark.parametrize(("where", "decode_block"), [("node", 16), ("node", 32), ("worker_node", 32)])
def test_direct_members_of_one_engine_go_as_one_launch_bit_exact(
    request: pytest.FixtureRequest, where: str, decode_block: int
) -> None:
    """gpu-direct PullBatch members from one prefill engine into one decode engine: their copies go as
    one kernel launch (local_copies.copy_gpu_all), and each member lands exact: a partial last block in
    the middle of the join, one past a prefix, prefill blocks of 16 into decode blocks of 16 or 32. No
    byte outside the members' blocks changes; a member naming a block out of range fails alone. With
    device_workers the batch goes to the decode GPU's worker in one message and joins there."""
    node: SidecarProcess = request.getfixturevalue(where)
    n = next(_count)
    pspec = EngineSpec.from_dict(BASE | {"num_blocks": 64})
    dspec = EngineSpec.from_dict(BASE | {"block_size": decode_block, "num_blocks": 64})
    prefill = EngineProcess(node.socket, f"join-p-{n}", pspec, devices=[GPU_A])
    decode = EngineProcess(node.socket, f"join-d-{n}", dspec, devices=[GPU_B])
    try:
        pulls, src_at, dst_at = [], 0, 0
        for i, (tokens, start) in enumerate([(150, 0), (40, 0), (100, decode_block), (17, 0)]):
            src = list(range(src_at, src_at + -(-tokens // 16)))
            src_at += len(src)
            pub = prefill.send(
                {
                    "cmd": "prefill",
                    "request_id": f"j{i}",
                    "block_ids": src,
                    "num_tokens": tokens,
                    "seed": n + i,
                }
            )
            assert pub["ok"], pub
            dst = list(range(dst_at, dst_at + -(-tokens // decode_block) - start // decode_block))
            dst_at += len(dst) + 1  # a block between members: the padding must not reach it
            pulls.append({"params": pub["params"], "block_ids": dst, "seed": n + i, "start_token": start})
        pub = prefill.send(
            {"cmd": "prefill", "request_id": "jbad", "block_ids": [60, 61, 62], "num_tokens": 40, "seed": n}
        )
        last = dspec.num_blocks  # one past the end
        bad = {
            "params": pub["params"],
            "block_ids": list(range(last - 40 // decode_block, last + 1)),
            "seed": n,
        }
        if where == "worker_node":  # counted in the worker, exposed by the sidecar with its device
            launches = functools.partial(_worker_launches, node, int(GPU_B.split(":")[1]))
        else:
            launches = functools.partial(_own_launches, node)
        before = launches()
        out = decode.send({"cmd": "pull_many", "pulls": [*pulls, bad]})
        *good, refused = out["results"]
        for res in good:
            assert res["ok"] and res["verified"] and res["path"] == "gpu-direct", pull_failure(res)
        assert refused["error_code"] == "INVALID_ARGUMENT" and str(dspec.num_blocks) in refused["error"], (
            refused
        )
        assert out["untouched_outside"], out["outside_errors"]
        assert launches() - before == 1, "the four members' copies as one launch"
    finally:
        prefill.stop()
        decode.stop()


@pytest.mark.parametrize("decode_block", [16, 32])
def test_staged_reads_that_wait_go_as_one_transfer_bit_exact(
    pair: tuple[SidecarProcess, SidecarProcess], decode_block: int
) -> None:
    """Sixteen gpu-staged pulls of one prefill engine in one PullBatch, through two 64 KiB slots of each
    ring: reads that wait while two transfers run go as one transfer of several requests (PushRequest.members,
    server/staged_reader.py), whose chunks cross from one request into the next; every other one pulls
    past a one-block prefix (PushMember.start_token), and the decode engine keeps blocks of 16 tokens
    like the prefill engine or of 32 (a member's padding then reaches past its last source block).
    Every request lands bit-exact in its own scattered blocks, nothing else changes, and fewer
    transfers than reads ran."""
    a, b = pair
    n = next(_count)
    spec = EngineSpec.from_dict(BASE | {"num_blocks": 64})
    dspec = EngineSpec.from_dict(BASE | {"num_blocks": 64, "block_size": decode_block})
    prefill = EngineProcess(a.socket, f"sg-p-{n}", spec, devices=[GPU_A])
    decode = EngineProcess(b.socket, f"sg-d-{n}", dspec, devices=[GPU_B])
    try:
        pulls = []
        for i in range(16):
            tokens = 40 - (i % 3)  # three blocks of 16 (two of 32), the last partial: a group pads it
            src = [63 - i, 2 * i, 32 + i]
            pub = prefill.send(
                {
                    "cmd": "prefill",
                    "request_id": f"g{i}",
                    "block_ids": src,
                    "num_tokens": tokens,
                    "seed": n + i,
                }
            )
            assert pub["ok"], pub
            start = decode_block * (i % 2)  # a one-block prefix the decode engine holds
            dst = [3 * i + 2, 3 * i + 1, 3 * i][: -(-tokens // decode_block)]
            pulls.append(
                {
                    "params": pub["params"],
                    "block_ids": dst[start // decode_block :],  # only the blocks after the prefix
                    "seed": n + i,
                    "start_token": start,
                }
            )
        count0 = _metric(b, "kvsidecar_staged_transfer_reads_count")
        reads0 = _metric(b, "kvsidecar_staged_transfer_reads_sum")
        out = decode.send({"cmd": "pull_many", "pulls": pulls, "timeout_s": 120})
        assert out["untouched_outside"], out["outside_errors"]
        for res in out["results"]:
            assert res["ok"] and res["verified"] and res["path"] == "gpu-staged", pull_failure(res)
        transfers = _metric(b, "kvsidecar_staged_transfer_reads_count") - count0
        reads = _metric(b, "kvsidecar_staged_transfer_reads_sum") - reads0
        assert reads == 16 and transfers < 16, (transfers, reads)
        _rings_idle(a, b)
    finally:
        prefill.stop()
        decode.stop()


@pytest.mark.parametrize("victim", ["prefill-engine", "decode-engine", "decode-sidecar"])
def test_a_peer_that_dies_mid_staged_transfer_loses_nothing_else(victim: str) -> None:
    """A long staged pull between GPUs, and SIGKILL mid-transfer to:
    - the prefill engine: its sidecar keeps the imported memory until its gathers end; the pull completes
      or fails naming its unfilled blocks; both sidecars stay up, and the next pull from another prefill
      engine on that sidecar arrives bit-exact;
    - the decode engine, whose memory the decode sidecar scatters into: the prefill engine hears
      "released" at once, both sidecars stay up (no fault in their CUDA contexts), and another decode
      engine on the same sidecar pulls the next request bit-exact;
    - the decode sidecar: the prefill sidecar stays up, and another decode sidecar's engine pulls the
      same request whole and bit-exact (it takes the request over from the dead reader)."""
    import json

    a = SidecarProcess(f"gpu-die-p-{victim}", extra=SMALL_RINGS)
    b = SidecarProcess(f"gpu-die-d-{victim}", extra=SMALL_RINGS)
    c = SidecarProcess(f"gpu-die-d2-{victim}", extra=SMALL_RINGS)
    spec = EngineSpec.from_dict(BASE | {"num_blocks": 16384})
    prefill = EngineProcess(a.socket, f"die-p-{victim}", spec, devices=[GPU_A])
    other = EngineProcess(a.socket, f"die-p2-{victim}", spec, devices=[GPU_A])
    decode = EngineProcess(b.socket, f"die-d-{victim}", spec, devices=[GPU_B])
    decode2 = EngineProcess(c.socket, f"die-d2-{victim}", spec, devices=[GPU_B])
    try:
        pub = prefill.send(
            {"cmd": "prefill", "request_id": "warm", "block_ids": [0], "num_tokens": 16, "seed": 1}
        )
        assert decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [1], "seed": 1})["verified"]
        # 3,000 two-block chunks through a peer's 2 slots of SMALL_RINGS
        params, dst = _long_staged_pull(a, prefill, decode, 6000, timeout_s=60)
        logs = lambda: "\n".join(["-- prefill sidecar", *a.stderr_tail, "-- decode sidecar", *b.stderr_tail])  # noqa: E731
        if victim == "prefill-engine":
            prefill.kill()
            res = json.loads(decode.readline(120))
            assert res["verified"], (res.get("errors"), logs())
            if not res["ok"]:
                assert res["unfilled_blocks"] == dst, (res.get("error"), logs())
            assert a.alive and b.alive, logs()
            pub2 = other.send(
                {"cmd": "prefill", "request_id": "after", "block_ids": [3, 4], "num_tokens": 30, "seed": 3}
            )
            res = decode.send({"cmd": "pull", "params": pub2["params"], "block_ids": [5, 6], "seed": 3})
            assert res["ok"] and res["verified"], (res.get("error"), logs())
        elif victim == "decode-engine":
            decode.kill()
            deadline = time.monotonic() + 30
            while True:  # the prefill engine's events: "released" for the request, at once
                ev = prefill.send({"cmd": "next_event", "timeout_s": max(0.1, deadline - time.monotonic())})
                assert ev["ok"], ("no event for the request", logs())
                if ev.get("request_id") == "long":
                    break
            assert ev["kind"] == "released", (ev, logs())
            assert a.alive and b.alive, logs()
            later = EngineProcess(b.socket, f"die-d3-{victim}", spec, devices=[GPU_B])
            try:
                pub2 = prefill.send(
                    {
                        "cmd": "prefill",
                        "request_id": "after",
                        "block_ids": [3, 4],
                        "num_tokens": 30,
                        "seed": 3,
                    }
                )
                res = later.send({"cmd": "pull", "params": pub2["params"], "block_ids": [5, 6], "seed": 3})
                assert res["ok"] and res["verified"], (res.get("error"), logs())
            finally:
                later.stop()
        else:
            b.proc.kill()
            b.proc.wait(10)
            t0 = time.monotonic()
            while True:  # as a router retries: refused only until the source has seen its transfer fail
                res = decode2.send(
                    {"cmd": "pull", "params": params, "block_ids": dst, "seed": 2, "timeout_s": 60},
                    timeout_s=120,
                )
                if res["ok"] or "already being read" not in res["error"] or time.monotonic() - t0 > 10:
                    break
                time.sleep(0.1)
            assert res["ok"] and res["verified"], (res.get("error"), logs())
            assert a.alive and c.alive, logs()
    finally:
        for p in (prefill, other, decode, decode2):
            p.stop()
        for s in (a, b, c):
            if s.alive:
                s.stop()
