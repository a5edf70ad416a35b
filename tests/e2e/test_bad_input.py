"""Bad input gets a precise status and message; a concurrent valid pull is not disturbed."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess, together
from kv_sidecar_client import KVSidecarError, SidecarClient
from kv_sidecar_client.shm import ShmKVCache

from .conftest import spec_dict

SPEC = EngineSpec.from_dict(spec_dict())
_ids = itertools.count()


@pytest.fixture(scope="module")
def valid_traffic(sidecar_pair: tuple[SidecarProcess, SidecarProcess]) -> Iterator[Callable[[], list[dict]]]:
    """Keeps pulling a real request a -> b in the background; yields a function returning the results."""
    a, b = sidecar_pair
    prefill, decode = together(
        lambda: EngineProcess(a.socket, "bg-prefill", SPEC),
        lambda: EngineProcess(b.socket, "bg-decode", SPEC),
    )
    results: list[dict] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            rid = f"bg-{next(_ids)}"
            pub = prefill.send(
                {"cmd": "prefill", "request_id": rid, "block_ids": [1, 2, 3, 4], "num_tokens": 60, "seed": 3}
            )
            results.append(
                decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [9, 8, 7, 6], "seed": 3})
            )

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    yield lambda: list(results)
    stop.set()
    t.join(60)
    prefill.stop()
    decode.stop()
    assert results and all(r["ok"] and r["verified"] for r in results), [
        r for r in results if not r.get("ok")
    ]


@pytest.fixture
def client(sidecar_pair: tuple[SidecarProcess, SidecarProcess]) -> Iterator[SidecarClient]:
    with SidecarClient(sidecar_pair[0].socket) as c:
        yield c


@pytest.fixture
def engine(client: SidecarClient) -> Iterator[str]:
    """A registered TP1 engine on sidecar a, held by this test process."""
    eid = f"eng-{next(_ids)}"
    cache = ShmKVCache(SPEC.rank_tensor_shapes(), torch.float16)
    client.register_rank(eid, 0, SPEC.to_dict(), cache.handles())
    yield eid
    try:
        client.unregister_rank(eid, 0)
    finally:
        cache.close()


def expect(code: str, fragment: str, fn: Callable[[], object]) -> None:
    with pytest.raises(KVSidecarError) as info:
        fn()
    assert info.value.code == code, info.value
    assert fragment in info.value.message, info.value.message


def test_unknown_engine_and_request(client: SidecarClient, engine: str, valid_traffic: Callable) -> None:
    expect("NOT_FOUND", "unknown engine 'nope'", lambda: client.publish("nope", "r", [0], 1))
    params = client.publish(engine, "known", [0], 1)
    params.request_id = "never-published"
    res = client.pull(params, engine, [5])
    assert (res.ok, res.error_code) == (False, "NOT_FOUND")
    assert "never published" in res.error and res.unfilled_blocks == [5]
    res = client.pull(client.publish(engine, "r-unknown-local", [0], 1), "no-such-decode-engine", [5])
    assert res.error_code == "NOT_FOUND" and "unknown engine 'no-such-decode-engine'" in res.error


def test_block_ids_out_of_range_or_duplicated(
    client: SidecarClient, engine: str, valid_traffic: Callable
) -> None:
    expect(
        "INVALID_ARGUMENT",
        "block id 64 at position 0 is out of range [0, 64)",
        lambda: client.publish(engine, "r", [64], 10),
    )
    expect(
        "INVALID_ARGUMENT",
        "block id 3 appears twice (positions 0 and 1)",
        lambda: client.publish(engine, "r", [3, 3], 20),
    )
    expect("INVALID_ARGUMENT", "need 2 blocks, got 1", lambda: client.publish(engine, "r", [3], 20))
    params = client.publish(engine, f"r-{next(_ids)}", [3, 4], 20)
    for dst, fragment in (([1, 99], "99"), ([1, 1], "1")):
        res = client.pull(params, engine, dst)
        assert res.error_code == "INVALID_ARGUMENT" and fragment in res.error, res


def test_block_lists_of_different_lengths(
    client: SidecarClient, engine: str, valid_traffic: Callable
) -> None:
    params = client.publish(engine, f"r-{next(_ids)}", [3, 4, 5], 40)
    res = client.pull(params, engine, [10, 11])
    assert res.error_code == "INVALID_ARGUMENT"
    assert "different lengths (3 vs 2)" in res.error or "different lengths (2 vs 3)" in res.error, res.error
    assert res.unfilled_blocks == [10, 11]


def test_failed_pull_of_thousands_of_blocks_keeps_its_status(
    client: SidecarClient, engine: str, valid_traffic: Callable
) -> None:
    # The unfilled blocks travel in gRPC headers, capped at 8 KiB: 3000 ids named one by one would
    # turn the answer into RESOURCE_EXHAUSTED and hide the real error.
    params = client.publish(engine, f"r-{next(_ids)}", [3, 4, 5], 40)
    dst = list(range(3000))
    res = client.pull(params, engine, dst)
    assert res.error_code == "INVALID_ARGUMENT", res.error
    assert "all 3000 requested (first 0, last 2999)" in res.error and len(res.error) < 1024, res.error
    assert res.unfilled_blocks == dst


def _register_at_once(socket: str, eid: str, regs: list[tuple[int, EngineSpec, ShmKVCache]]) -> list[str]:
    """Register every (rank, spec, cache) of engine `eid` from its own thread, all released at once;
    the outcome of each as "ok RANK BLOCK_SIZE" or "CODE RANK: message"."""
    barrier = threading.Barrier(len(regs))
    outcomes: list[str] = []

    def register(rank: int, spec: EngineSpec, cache: ShmKVCache) -> None:
        with SidecarClient(socket) as c:
            barrier.wait()
            try:
                c.register_rank(eid, rank, spec.to_dict(), cache.handles())
                outcomes.append(f"ok {rank} {spec.block_size}")
            except KVSidecarError as e:
                outcomes.append(f"{e.code} {rank}: {e.message}")

    threads = [threading.Thread(target=register, args=reg) for reg in regs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outcomes


def test_ranks_of_one_engine_register_concurrently(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess], valid_traffic: Callable
) -> None:
    # TP workers register their ranks at the same moment: a rank still being mapped must not break
    # another's registration (it once did, with INTERNAL), and a differing spec is still refused.
    socket = sidecar_pair[0].socket
    spec = EngineSpec.from_dict(spec_dict(tp_size=4))
    other = EngineSpec.from_dict(spec_dict(tp_size=4, block_size=32))
    for round_ in range(5):
        eid = f"tp4-{next(_ids)}"
        caches = [ShmKVCache(spec.rank_tensor_shapes(), torch.float16) for _ in range(4)]
        odd = ShmKVCache(other.rank_tensor_shapes(), torch.float16)
        try:
            # Ranks 0-3 with one spec, and rank 3 once more with another block size.
            outcomes = _register_at_once(
                socket, eid, [(r, spec, caches[r]) for r in range(4)] + [(3, other, odd)]
            )
            assert len(outcomes) == 5 and not [o for o in outcomes if o.startswith("INTERNAL")], (
                round_,
                outcomes,
            )
            # Whichever spec registered first is the engine's: every rank that registered has it, and
            # every other call was refused by name (a differing spec, or rank 3 taken).
            ok = [o.split() for o in outcomes if o.startswith("ok ")]
            assert ok and len({block for _, _, block in ok}) == 1, (round_, outcomes)
            refused = [o for o in outcomes if not o.startswith("ok ")]
            assert all(
                "declares a spec that differs from rank" in o or o.startswith("ALREADY_EXISTS 3")
                for o in refused
            ), (round_, outcomes)
            if ok[0][2] == str(spec.block_size):
                assert sorted(int(r) for _, r, _ in ok) == [0, 1, 2, 3], (round_, outcomes)
        finally:
            with SidecarClient(socket) as c:
                for r in range(4):
                    with contextlib.suppress(KVSidecarError):
                        c.unregister_rank(eid, r)
            for cache in [*caches, odd]:
                cache.close()


def test_second_registration_of_a_rank(client: SidecarClient, engine: str, valid_traffic: Callable) -> None:
    with ShmKVCache(SPEC.rank_tensor_shapes(), torch.float16) as cache:
        expect(
            "ALREADY_EXISTS",
            f"engine '{engine}' rank 0 is already registered",
            lambda: client.register_rank(engine, 0, SPEC.to_dict(), cache.handles()),
        )


def test_malformed_shared_memory_handles(client: SidecarClient, valid_traffic: Callable) -> None:
    with ShmKVCache(SPEC.rank_tensor_shapes(), torch.float16) as cache:
        good = cache.handles()

        def register(mutate: Callable) -> Callable[[], object]:
            handles = [type(h)() for h in good]
            for h, g in zip(handles, good, strict=True):
                h.CopyFrom(g)
            mutate(handles[0])
            return lambda: client.register_rank(f"bad-{next(_ids)}", 0, SPEC.to_dict(), handles)

        expect(
            "INVALID_ARGUMENT",
            "does not exist",
            register(lambda h: setattr(h.shm, "name", "kvsidecar-missing")),
        )
        expect(
            "INVALID_ARGUMENT", "is not valid", register(lambda h: setattr(h.shm, "name", "../etc/passwd"))
        )
        expect(
            "INVALID_ARGUMENT",
            "overruns shared memory object",
            register(lambda h: setattr(h.shm, "offset", cache.size)),
        )
        expect("INVALID_ARGUMENT", "not aligned", register(lambda h: setattr(h.shm, "offset", 1)))
        expect(
            "INVALID_ARGUMENT",
            "are not the contiguous strides",
            register(lambda h: h.strides.__setitem__(0, 1)),
        )
        expect("INVALID_ARGUMENT", "does not match the spec", register(lambda h: h.shape.__setitem__(1, 3)))
        expect(
            "INVALID_ARGUMENT",
            "dtype float32 but the spec says float16",
            register(lambda h: setattr(h, "dtype", "float32")),
        )
        expect(
            "INVALID_ARGUMENT",
            "spec needs 2 tensors",
            lambda: client.register_rank("x", 0, SPEC.to_dict(), good[:1]),
        )
        # Layer 1 over layer 0's bytes (a shared cache described as two layers): refused, not moved twice.
        expect(
            "INVALID_ARGUMENT",
            "tensors 0 and 1 overlap in their memory",
            _second_over_first(client, good),
        )
        expect(
            "INVALID_ARGUMENT",
            "unknown layout 'nhd'",
            lambda: client.register_rank("x", 0, SPEC.to_dict() | {"layout": "nhd"}, good),
        )


def _second_over_first(client: SidecarClient, good: list) -> Callable[[], object]:
    handles = [type(h)() for h in good]
    handles[0].CopyFrom(good[0])
    handles[1].CopyFrom(good[0])
    return lambda: client.register_rank(f"bad-{next(_ids)}", 0, SPEC.to_dict(), handles)


def test_gpu_tensors_on_a_sidecar_without_gpu(client: SidecarClient, valid_traffic: Callable) -> None:
    """CUDA IPC ranks of a GPU the sidecar cannot see are refused up front (CI's sidecar sees no GPU
    at all; on a GPU machine it does not see this made-up one), and kinds cannot be mixed."""
    with ShmKVCache(SPEC.rank_tensor_shapes(), torch.float16) as cache:
        good = cache.handles()
        gpu = [type(h)() for h in good]
        for h, g in zip(gpu, good, strict=True):
            h.CopyFrom(g)
            h.cuda_ipc.handle = bytes(64)
            h.cuda_ipc.device_uuid = "GPU-00000000-0000-0000-0000-000000000000"
        with pytest.raises(KVSidecarError) as info:
            client.register_rank(f"gpu-{next(_ids)}", 0, SPEC.to_dict(), gpu)
        assert info.value.code == "FAILED_PRECONDITION", info.value
        assert "sees no GPU" in info.value.message or (
            "GPU-00000000-0000-0000-0000-000000000000 is not visible to the sidecar" in info.value.message
        ), info.value.message
        expect(
            "INVALID_ARGUMENT",
            "one kind of memory",
            lambda: client.register_rank(f"mixed-{next(_ids)}", 0, SPEC.to_dict(), [good[0], gpu[1]]),
        )


def test_peer_sidecar_not_running(client: SidecarClient, engine: str, valid_traffic: Callable) -> None:
    params = client.publish(engine, f"r-{next(_ids)}", [1], 16)
    params.sidecar_id, params.sidecar_address = "elsewhere", "127.0.0.1:9"  # nothing listens on port 9
    res = client.pull(params, engine, [2], timeout_s=5)
    assert res.error_code == "UNAVAILABLE" and "127.0.0.1:9 is not reachable" in res.error, res


def test_incompatible_peer_names_the_field(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess], valid_traffic: Callable
) -> None:
    a, b = sidecar_pair
    other = EngineSpec.from_dict(spec_dict(head_dim=8))
    p_id, d_id = f"p-{next(_ids)}", f"d-{next(_ids)}"
    prefill, decode = together(
        lambda: EngineProcess(a.socket, p_id, SPEC), lambda: EngineProcess(b.socket, d_id, other)
    )
    try:
        pub = prefill.send(
            {"cmd": "prefill", "request_id": "x", "block_ids": [1], "num_tokens": 16, "seed": 1}
        )
        res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [2], "seed": 1})
        assert res["error_code"] == "FAILED_PRECONDITION", res
        assert "head_dim" in res["error"] and "16" in res["error"] and "8" in res["error"], res["error"]
        assert res["verified"], res["errors"]  # the failed pull wrote nothing anywhere
    finally:
        prefill.stop()
        decode.stop()


def test_valid_traffic_kept_flowing(valid_traffic: Callable) -> None:
    deadline = time.monotonic() + 120  # run alone (-k), the background pulls may not have finished one yet
    while not valid_traffic() and time.monotonic() < deadline:
        time.sleep(0.2)
    done = valid_traffic()
    assert done and all(r["ok"] and r["verified"] for r in done)
