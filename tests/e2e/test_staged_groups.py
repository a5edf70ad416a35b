"""Staged transfers that carry several requests (server/staged_reader.py, server/group_commit.py,
PushRequest.members), through real sidecars on host rings (`host_transfer: ring`, the staged protocol's
own code on host memory) and engine processes: reads of other requests between the same two ranks that
wait while a transfer runs go as one transfer next; every byte lands where a transfer of its own would
put it, each request is "consumed" once, and a request its source refuses fails alone."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess, together
from kv_sidecar_client import BatchPull, SidecarClient, params_from_json

from .conftest import (
    Spawn,
    consumed_events,
    frozen,
    logged,
    metric,
    no_transfer_in_flight,
    prefilled,
    pulls_in_flight,
    spec_dict,
    wait_for,
)

SPEC = EngineSpec.from_dict(spec_dict(num_blocks=160))
BLOCK32 = EngineSpec.from_dict(spec_dict(num_blocks=80, block_size=32))
SLOT = 32 << 10  # four blocks of SPEC (2 layers x K/V x 16 tokens x 4 heads x 16 x fp16 = 8 KiB)
RING = ["--host-transfer", "ring", "--gpu-staging-bytes", str(4 * SLOT), "--gpu-staging-slots", "4"]
ENV = {"OMP_NUM_THREADS": "1"}
TOKENS = 40  # 3 blocks, the last partial: a group pads it (staged_protocol.member_spans)
READS = "kvsidecar_staged_transfer_reads"
DONES = "kvsidecar_done_notifications_received_total"


@pytest.fixture(scope="module")
def ring_pair() -> Iterator[tuple[SidecarProcess, SidecarProcess]]:
    """Two sidecars on host rings, grouping reads as by default (staged_group_reads 64; with 1 each read is
    its own transfer, as every other ring test runs it), and a PullBatch's staged members run as one unit
    (staged_batch_reads, on by default)."""
    a, b = together(
        lambda: SidecarProcess("groups-p", extra=RING, env=ENV),
        lambda: SidecarProcess("groups-d", extra=RING, env=ENV),
    )
    yield a, b
    assert (a.stop(), b.stop()) == (0, 0)


def _pull_all_exact(
    decode: EngineProcess, b: SidecarProcess, pulls: list[dict[str, Any]]
) -> tuple[float, float]:
    """The pulls in one batch, each bit-exact on host rings with nothing else written; the staged
    transfers the decode sidecar ran for them, and the reads those carried."""
    before = (metric(b.metrics_port, f"{READS}_count"), metric(b.metrics_port, f"{READS}_sum"))
    out = decode.send({"cmd": "pull_many", "pulls": pulls, "timeout_s": 60})
    assert out["ok"] and out["untouched_outside"], out
    for res in out["results"]:
        assert res["verified"] and res["path"] == "host-ring", {
            k: res[k] for k in ("bytes", "path", "errors")
        }
    return (
        metric(b.metrics_port, f"{READS}_count") - before[0],
        metric(b.metrics_port, f"{READS}_sum") - before[1],
    )


def _engines_after_one_pull(
    a: SidecarProcess, b: SidecarProcess, spawn: Spawn, name: str
) -> tuple[EngineProcess, EngineProcess]:
    """A prefill engine on `a`, a decode engine on `b`, and one pull between them first: the handshake
    is made, so that the reads a test starts next reach the staged reader together."""
    prefill, decode = spawn.together(
        lambda: EngineProcess(a.socket, f"{name}-p", SPEC, env=ENV),
        lambda: EngineProcess(b.socket, f"{name}-d", SPEC, env=ENV),
    )
    warm = prefilled(prefill, f"{name}-warm", [30, 31, 32], TOKENS, seed=399)
    assert decode.send({"cmd": "pull", "params": warm, "block_ids": [90, 91, 92], "seed": 399})["verified"]
    return prefill, decode


class _HungSource(NamedTuple):
    far: SidecarProcess
    prefill: EngineProcess
    decode: EngineProcess
    hung: EngineProcess
    fine: list[BatchPull]
    sources: list[list[int]]


FULL = 3 * SPEC.block_size  # whole blocks: their digests compare


def _whole_block_pulls(
    source: EngineProcess, ids: list[str], seed: int, first_dst: int
) -> tuple[list[list[int]], list[BatchPull]]:
    """Requests `ids` of three whole blocks each published on `source` (blocks 3i..3i+2) and their pulls
    into three blocks each from `first_dst` on: each request's source blocks and its pull."""
    sources = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(len(ids))]
    pulls = [
        BatchPull(
            params_from_json(prefilled(source, request_id, src, FULL, seed=seed + i)),
            [first_dst + 3 * i + k for k in range(3)],
        )
        for i, (request_id, src) in enumerate(zip(ids, sources, strict=True))
    ]
    return sources, pulls


def _a_hung_source_and_a_running_one(
    a: SidecarProcess, b: SidecarProcess, spawn: Spawn, name: str, seed: int
) -> _HungSource:
    """A decode engine on `b` with cached handshakes to a prefill engine on `a` and to one on a sidecar
    of its own (`far`, to freeze), and three whole-block members from `a`'s engine, into blocks 43-51."""
    far = spawn(SidecarProcess(f"groups-far-{name}", extra=RING, env=ENV))
    prefill, decode = _engines_after_one_pull(a, b, spawn, name)
    hung = spawn(EngineProcess(far.socket, f"{name}-far", SPEC, env=ENV))
    warm = prefilled(hung, f"{name}-far-warm", [30, 31, 32], TOKENS, seed=seed)
    assert decode.send({"cmd": "pull", "params": warm, "block_ids": [93, 94, 95], "seed": seed})["verified"]
    sources, fine = _whole_block_pulls(prefill, [f"{name}-fine{i}" for i in range(3)], seed + 20, 43)
    return _HungSource(far, prefill, decode, hung, fine, sources)


@contextlib.contextmanager
def _killed_at_the_end(sidecar: SidecarProcess) -> Iterator[None]:
    """The sidecar killed (SIGKILL) by the end of the block, however it ends: a stopped one would hold
    up the test's teardown."""
    try:
        yield
    finally:
        sidecar.proc.kill()
        sidecar.proc.wait(5)


def _fine_members_exact(h: _HungSource) -> None:
    for src, pull in zip(h.sources, h.fine, strict=True):
        want = h.prefill.send({"cmd": "digest", "block_ids": src})["digests"]
        assert h.decode.send({"cmd": "digest", "block_ids": pull.block_ids})["digests"] == want


def test_reads_that_wait_go_as_one_transfer_and_land_as_their_own_would(
    ring_pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn
) -> None:
    a, b = ring_pair
    prefill, decode = spawn.together(
        lambda: EngineProcess(a.socket, "sg-p", SPEC, env=ENV),
        lambda: EngineProcess(b.socket, "sg-d", SPEC, env=ENV),
    )
    n = 24
    pulls = []
    for i in range(n):
        src = [159 - i, 3 * i, 80 + i]  # scattered, so a wrong concatenation shows
        params = prefilled(prefill, f"g{i}", src, TOKENS - (i % 3), seed=100 + i)
        pulls.append(
            {"params": params, "block_ids": [3 * i, 3 * i + 2 if i % 2 else 80 + i, 150 - i], "seed": 100 + i}
        )
    transfers, reads = _pull_all_exact(decode, b, pulls)
    assert reads == n, (transfers, reads)
    # The batch's members reach the reader together: after the first two, they wait and group.
    assert transfers < n / 2, (transfers, reads)
    assert consumed_events(prefill, n) == n
    no_transfer_in_flight(a, b)


def test_a_batch_of_reads_goes_as_one_transfer(
    ring_pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn
) -> None:
    """A PullBatch's staged members run as one unit (staged_batch_reads): each up to its read, then the
    reads together (StagedReader.read_all), so they go as one transfer, where a thread per member would
    send the first two alone (three transfers for six reads at least)."""
    a, b = ring_pair
    prefill, decode = _engines_after_one_pull(a, b, spawn, "sbt")
    n = 6
    pulls = []
    for i in range(n):
        params = prefilled(prefill, f"bt{i}", [120 + 3 * i, 3 * i, 60 + i], TOKENS - i % 3, seed=500 + i)
        pulls.append({"params": params, "block_ids": [3 * i, 100 + 2 * i, 101 + 2 * i], "seed": 500 + i})
    dones = {form: metric(a.metrics_port, DONES, f'{{form="{form}"}}') for form in ("one", "joined")}
    transfers, reads = _pull_all_exact(decode, b, pulls)
    assert (transfers, reads) == (1, n)
    assert consumed_events(prefill, n + 1) == n + 1
    # The members ended together: their done notifications reached the source as one.
    assert {form: metric(a.metrics_port, DONES, f'{{form="{form}"}}') - v for form, v in dones.items()} == {
        "one": 0,
        "joined": 1,
    }
    no_transfer_in_flight(a, b)


def test_a_batch_whose_transfer_ends_as_a_member_is_aborted_sends_the_others_again_as_one(
    ring_pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn
) -> None:
    """A PullBatch's six reads from one source go as one transfer, and the source hangs (SIGSTOP) with it
    in flight. Aborting one member's request ends that transfer (its halt is every member's): the aborted
    member answers CANCELLED while the source still hangs, and the five others go again as one transfer
    (StagedReader._lead's AGAIN), not one transfer each, which runs once the source does (and has
    confirmed the end of the first, whose receive slots it takes); they arrive bit-exact."""
    a, b = ring_pair
    h = _a_hung_source_and_a_running_one(a, b, spawn, "sab", 396)
    sources, pulls = _whole_block_pulls(h.hung, [f"ab{i}" for i in range(6)], 640, 100)
    count, total = f"{READS}_count", f"{READS}_sum"
    before = (metric(b.metrics_port, count), metric(b.metrics_port, total))
    with frozen(h.far), SidecarClient(b.socket) as client:
        members = client.pull_batch_async(h.decode.engine_id, pulls, timeout_s=60)
        wait_for("the batch's transfer to start", lambda: metric(b.metrics_port, count) > before[0], 10)
        time.sleep(0.3)  # its Push out, waiting for the hung source
        assert metric(b.metrics_port, total) - before[1] == 6  # one transfer of all six
        t0 = time.monotonic()
        assert client.abort(h.decode.engine_id, "ab0")
        wait_for("the aborted member to answer", members[0].done, 5)
        took = time.monotonic() - t0
        time.sleep(0.3)
        # They wait for the source: their new transfer's receive slots are the old one's, which come back
        # once the source confirms that nothing of it is in flight.
        assert not any(m.done() for m in members[1:])
    res = members[0].result()
    assert res.error_code == "CANCELLED" and "aborted by the engine" in res.error, res
    assert took < 3.5, took
    for m in members[1:]:
        assert m.result().ok, m.result()
    # Two transfers: the six, then the five as one (one by one, it would be six transfers).
    assert (metric(b.metrics_port, count) - before[0], metric(b.metrics_port, total) - before[1]) == (2, 11)
    for src, pull in zip(sources[1:], pulls[1:], strict=True):
        want = h.hung.send({"cmd": "digest", "block_ids": src})["digests"]
        assert h.decode.send({"cmd": "digest", "block_ids": pull.block_ids})["digests"] == want
    no_transfer_in_flight(a, b)


def test_separate_pulls_whose_group_ends_as_one_is_aborted_go_again_together(
    ring_pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn
) -> None:
    """Separate Pull calls (StagedReader.read), the source hung (SIGSTOP): two run as transfers of their
    own and four wait, since two transfers of a pair run at once. Aborting the first of the two lets the
    four start as one group, which waits for receive slots (the two hold them until the source confirms
    that nothing is in flight). Aborting one of the four ends that group, and the three others re-enter
    the pair's queue (AGAIN): the first goes at once beside the one still running, the other two wait and
    go as one: two transfers where one each made three. All arrive bit-exact once the source runs."""
    a, b = ring_pair
    h = _a_hung_source_and_a_running_one(a, b, spawn, "sag", 395)
    ids = [f"ag{i}" for i in range(6)]
    sources, pulls = _whole_block_pulls(h.hung, ids, 660, 100)
    count, total = f"{READS}_count", f"{READS}_sum"
    before = (metric(b.metrics_port, count), metric(b.metrics_port, total))
    started = lambda n: lambda: metric(b.metrics_port, count) >= before[0] + n  # noqa: E731
    with frozen(h.far), SidecarClient(b.socket) as client:
        running = [
            client.pull_async(p.params, h.decode.engine_id, p.block_ids, timeout_s=60) for p in pulls[:2]
        ]
        wait_for("two transfers to start", started(2), 10)
        waiting = [
            client.pull_async(p.params, h.decode.engine_id, p.block_ids, timeout_s=60) for p in pulls[2:]
        ]
        wait_for("four more to wait", lambda: all(pulls_in_flight(b.socket, r) for r in ids[2:]), 10)
        time.sleep(0.3)
        assert client.abort(h.decode.engine_id, ids[0])
        # Its transfer ended at once and handed the pair's turn to the four; its answer waits for its
        # CloseRead to the hung source to give up.
        wait_for("the first aborted pull to answer", running[0].done, 5)
        time.sleep(0.3)
        assert metric(b.metrics_port, count) == before[0] + 2  # the four wait for receive slots
        assert client.abort(h.decode.engine_id, ids[2])
        wait_for("the aborted one of the four to answer", waiting[0].done, 5)
        time.sleep(0.3)
        assert not any(r.done() for r in [running[1], *waiting[1:]])  # they wait for the source
    results = [r.result() for r in [*running, *waiting]]
    for stopped in (results[0], results[2]):
        assert stopped.error_code == "CANCELLED" and "aborted by the engine" in stopped.error, stopped
    for i in (1, 3, 4, 5):
        assert results[i].ok, results[i]
    # The two, then the three again in two transfers (one each would make three; the four never started).
    assert (metric(b.metrics_port, count) - before[0], metric(b.metrics_port, total) - before[1]) == (4, 5)
    for i in (1, 3, 4, 5):
        want = h.hung.send({"cmd": "digest", "block_ids": sources[i]})["digests"]
        assert h.decode.send({"cmd": "digest", "block_ids": pulls[i].block_ids})["digests"] == want
    no_transfer_in_flight(a, b)


def test_a_batch_member_that_must_ask_a_hung_source_first_holds_up_no_other(
    ring_pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn
) -> None:
    """A member from a source whose handshake is cached joins the batch's unit on the call's thread, but
    its params do not plan (two decode blocks for three blocks' tokens), so it asks the source with an
    OpenRead first, and the source hangs (SIGSTOP). It steps apart (pull_steps.Apart) before it waits:
    the members from the running source, after it in the batch, answer at once; it fails by itself at
    its deadline."""
    a, b = ring_pair
    h = _a_hung_source_and_a_running_one(a, b, spawn, "sa", 397)
    bad = BatchPull(params_from_json(prefilled(h.hung, "sa-bad", [0, 1, 2], FULL, seed=430)), [40, 41])
    with frozen(h.far), SidecarClient(b.socket) as client:
        members = client.pull_batch_async(h.decode.engine_id, [bad, *h.fine], timeout_s=6)
        wait_for(
            "the members from the running source to answer", lambda: all(m.done() for m in members[1:]), 4
        )
        assert all(m.result().ok for m in members[1:]), [m.result() for m in members[1:]]
        assert not members[0].done()
        wait_for("the member that asked the hung source to end", members[0].done, 15)
    assert not members[0].result().ok and members[0].result().unfilled_blocks == [40, 41], members[0].result()
    _fine_members_exact(h)
    no_transfer_in_flight(a, b)


def test_a_batch_member_that_gathers_two_source_ranks_steps_apart_and_all_arrive(
    ring_pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn
) -> None:
    """A member from a TP 2 prefill engine (handshake cached) joins the batch's unit but is two reads,
    which open the request with an OpenRead first: it steps apart onto the pool, and every member, its
    own and the one-read members the unit reads together, lands bit-exact."""
    a, b = ring_pair
    prefill, decode = _engines_after_one_pull(a, b, spawn, "stp")
    tp2 = spawn(
        EngineProcess(a.socket, "stp-p2", EngineSpec.from_dict(spec_dict(num_blocks=160, tp_size=2)), env=ENV)
    )
    warm = prefilled(tp2, "stp2-warm", [30, 31, 32], TOKENS, seed=396)
    assert decode.send({"cmd": "pull", "params": warm, "block_ids": [96, 97, 98], "seed": 396})["verified"]
    pulls = [
        {
            "params": prefilled(tp2, "stp2-g", [3, 4, 5], TOKENS, seed=450),
            "block_ids": [10, 11, 12],
            "seed": 450,
        }
    ]
    for i in range(3):
        params = prefilled(prefill, f"stp-f{i}", [40 + 3 * i, 41 + 3 * i, 42 + 3 * i], TOKENS, seed=460 + i)
        pulls.append({"params": params, "block_ids": [20 + 3 * i, 21 + 3 * i, 22 + 3 * i], "seed": 460 + i})
    _pull_all_exact(decode, b, pulls)
    assert consumed_events(tp2, 4) == 4  # each of its two ranks, for the warm pull and the batch's
    assert consumed_events(prefill, 4) == 4  # the first pull's and the three members'
    no_transfer_in_flight(a, b)


@pytest.mark.parametrize("decode_spec", [SPEC, BLOCK32], ids=["blocks-16", "decode-blocks-32"])
def test_reads_past_a_prefix_and_into_larger_blocks_group_too(
    ring_pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn, decode_spec: EngineSpec
) -> None:
    """Decode engines with a prefix cache pull from a later token (start_token, a block boundary), and
    a decode engine may keep larger blocks than its prefill engine (a multiple of them): such reads
    group too (PushMember.start_token; member_block_range), each taking only its own source blocks,
    and land exactly where a pull of its own would; the prefix blocks stay untouched."""
    a, b = ring_pair
    name = f"sp{decode_spec.block_size}"
    prefill, decode = spawn.together(
        lambda: EngineProcess(a.socket, f"{name}-p", SPEC, env=ENV),
        lambda: EngineProcess(b.socket, f"{name}-d", decode_spec, env=ENV),
    )
    n, bd = 24, decode_spec.block_size
    spread = 4 * n * 16 // bd  # the decode blocks the pulls use, scattered over them (37 is prime to it)
    used = 0
    pulls = []
    for i in range(n):
        tokens = TOKENS + 16 - (i % 5)  # 4 source blocks, the last partial; 52 to 56 tokens
        start = bd * (i % (51 // bd + 1))  # from 0 to 3 blocks of 16 of prefix, or 0 or 1 of 32
        src = [159 - i, 4 * i, 100 + i, 4 * i + 1]  # scattered, so a wrong slice shows
        params = prefilled(prefill, f"s{i}", src, tokens, seed=400 + i)
        k = -(-tokens // bd) - start // bd  # only the blocks after the prefix are named
        dst = [(used + j) * 37 % spread for j in range(k)]
        used += k
        pulls.append({"params": params, "block_ids": dst, "seed": 400 + i, "start_token": start})
    transfers, reads = _pull_all_exact(decode, b, pulls)
    assert reads == n and transfers < n / 2, (transfers, reads)
    assert consumed_events(prefill, n) == n
    no_transfer_in_flight(a, b)


def test_a_request_the_source_refuses_fails_alone_and_the_rest_of_its_group_arrives(
    ring_pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn
) -> None:
    a, b = ring_pair
    prefill, other_size, decode = spawn.together(
        lambda: EngineProcess(a.socket, "sb-p", SPEC, env=ENV),
        lambda: EngineProcess(a.socket, "sb-p32", BLOCK32, env=ENV),
        lambda: EngineProcess(b.socket, "sb-d", SPEC, env=ENV),
    )
    # A pull first: the reader then Pushes by notification (a wired link) and takes refusals back the
    # same way (PushRequest.refusal_notice).
    warm = prefilled(prefill, "warm", [40], 16, seed=199)
    res = decode.send({"cmd": "pull", "params": warm, "block_ids": [140], "seed": 199})
    assert res["ok"] and res["verified"], res
    pulls = []
    for i in range(12):
        params = prefilled(prefill, f"r{i}", [3 * i, 3 * i + 1, 3 * i + 2], TOKENS, seed=200 + i)
        pulls.append(
            {"params": params, "block_ids": [100 + 3 * i, 101 + 3 * i, 102 + 3 * i], "seed": 200 + i}
        )
    # The source frees two of them before the reader gets there: its records are gone, the params not.
    for i in (5, 9):
        assert prefill.send({"cmd": "abort", "request_id": f"r{i}"})["found"]
    # Larger source blocks than the reader's go alone (member_spans pads to whole reader blocks, and
    # a member would start inside a source block), and arrive too.
    p32 = prefilled(other_size, "r32", [4, 5], 50, seed=300)
    pulls.append({"params": p32, "block_ids": [150, 151, 152, 153], "seed": 300})
    transfers = metric(b.metrics_port, f"{READS}_count")
    failed_calls = metric(b.metrics_port, "kvsidecar_push_calls_total", '{why="failed"}')
    by_notification = metric(a.metrics_port, "kvsidecar_push_starts_total", '{by="notification"}')
    out = decode.send({"cmd": "pull_many", "pulls": pulls, "timeout_s": 60})
    assert out["untouched_outside"], out
    res = out["results"]
    for i, r in enumerate(res):
        if i in (5, 9):
            assert not r["ok"] and r["unfilled_blocks"] == pulls[i]["block_ids"], r
        else:
            assert r["ok"] and r["verified"], (i, r)
    # A group refused for r5 (or r9) sends its other reads again as one: a few transfers in all, where
    # each of its reads going again alone took ten more (14 in all, measured).
    assert metric(b.metrics_port, f"{READS}_count") - transfers < 10
    # The source names both refused reads of the group in its one refusal (the trailer that
    # member_refusals adds), so the others go again once, not once per refused read.
    assert logged(b, "refused for 'r5', 'r9'"), "both refusals in one"
    # The group's Push went by notification and its refusal came back the same way: no call for it.
    assert metric(a.metrics_port, "kvsidecar_push_starts_total", '{by="notification"}') > by_notification
    assert metric(b.metrics_port, "kvsidecar_push_calls_total", '{why="failed"}') == failed_calls
    # Each refused request gets what a pull of it alone gets, word for word.
    with SidecarClient(b.socket) as client:
        for i in (5, 9):
            alone = client.pull(params_from_json(pulls[i]["params"]), decode.engine_id, pulls[i]["block_ids"])
            assert (alone.error_code, alone.error) == (res[i]["error_code"], res[i]["error"]), (i, alone)
    assert consumed_events(prefill, 11) == 11  # the warm-up's too
    no_transfer_in_flight(a, b)


def test_aborting_requests_that_wait_for_their_transfer_stops_them_at_once(
    ring_pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn
) -> None:
    """The source hangs (SIGSTOP). Two reads of it run first; four more come after them and, grouped,
    wait behind the two. Aborting the four ends them within the ~2.4 s an aborted pull takes to tell a
    hung source (its CloseRead times out), while the two before them still hang: each left the queue
    rather than wait for them. Once the source runs again, the two arrive. The two are pulls of their
    own, a transfer each: in one batch they would go as one transfer (StagedReader.read_all), and the
    four would start the pair's second transfer instead of waiting."""
    a, b = ring_pair
    prefill, decode = _engines_after_one_pull(a, b, spawn, "sa")
    pulls = [
        BatchPull(
            params_from_json(
                prefilled(prefill, f"w{i}", [3 * i, 3 * i + 1, 3 * i + 2], TOKENS, seed=400 + i)
            ),
            [60 + 3 * i, 61 + 3 * i, 62 + 3 * i],
        )
        for i in range(6)
    ]
    aborted = [f"w{i}" for i in range(2, 6)]
    with frozen(a), SidecarClient(b.socket) as first, SidecarClient(b.socket) as later:
        running = [first.pull_async(p.params, decode.engine_id, p.block_ids, timeout_s=60) for p in pulls[:2]]
        wait_for("two reads to run", lambda: all(pulls_in_flight(b.socket, f"w{i}") for i in range(2)), 10)
        time.sleep(0.3)  # they reach the staged reader, and their transfers start
        waiting = later.pull_batch_async(decode.engine_id, pulls[2:], timeout_s=60)
        wait_for("four more to start", lambda: all(pulls_in_flight(b.socket, r) for r in aborted), 10)
        time.sleep(0.3)
        t0 = time.monotonic()
        for request_id in aborted:
            assert first.abort(decode.engine_id, request_id)
        ended: dict[str, float] = {}
        while len(ended) < len(aborted) and time.monotonic() - t0 < 8:
            for request_id in aborted:
                if request_id not in ended and not pulls_in_flight(b.socket, request_id):
                    ended[request_id] = time.monotonic() - t0
            time.sleep(0.02)
        assert not any(r.done() for r in running)  # the two before them still hang
    # Each left the queue: not held by the transfers before it.
    assert len(ended) == len(aborted) and max(ended.values()) < 3.5, ended
    for r in waiting:
        res = r.result()
        assert res.error_code == "CANCELLED" and "aborted by the engine" in res.error, res
    for r in running:
        assert r.result().ok, r.result()
    no_transfer_in_flight(a, b)


def test_a_batch_member_whose_source_hangs_holds_up_no_other(
    ring_pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn
) -> None:
    """A PullBatch's staged members run as one unit on the call's thread, with a thread per source rank
    pair (StagedReader.read_all). A member whose source hangs (SIGSTOP, its handshake made before) comes
    first, so that its pair is the call's own thread's: the members from another source are read, answer
    and arrive bit-exact while it hangs; aborted, it ends by itself, CANCELLED, within the time a lone
    aborted pull takes to tell a hung source."""
    a, b = ring_pair
    h = _a_hung_source_and_a_running_one(a, b, spawn, "sh", 398)
    stuck = BatchPull(
        params_from_json(prefilled(h.hung, "sh-stuck", [0, 1, 2], FULL, seed=410)), [40, 41, 42]
    )
    with frozen(h.far), SidecarClient(b.socket) as client:
        members = client.pull_batch_async(h.decode.engine_id, [stuck, *h.fine], timeout_s=60)
        wait_for(
            "the members from the running source to answer", lambda: all(m.done() for m in members[1:]), 10
        )
        for m in members[1:]:
            assert m.result().ok, m.result()
        assert not members[0].done()
        t0 = time.monotonic()
        assert client.abort(h.decode.engine_id, "sh-stuck")
        wait_for("the stuck member to end", members[0].done, 5)
        took = time.monotonic() - t0
    res = members[0].result()
    assert res.error_code == "CANCELLED" and "aborted by the engine" in res.error, res
    assert took < 3.5, took
    _fine_members_exact(h)
    # Not `far`: a source thawed after its reader gave up keeps that served read until its release is
    # retried or it goes stale (a lone pull's too; noted on issue 32).
    no_transfer_in_flight(a, b)


@pytest.mark.parametrize("as_batch", [True, False], ids=["batch", "calls"])
def test_a_source_that_dies_mid_transfer_fails_its_reads_together_and_leaves_room_for_the_others(
    ring_pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn, as_batch: bool
) -> None:
    """Six reads from one source (a PullBatch's members, or separate Pull calls), enough to want every
    receive slot of the decode sidecar's ring, and that source's sidecar stops (SIGSTOP) and dies
    (SIGKILL) with them in flight:
    - three reads from a live source, sent after them, arrive bit-exact while it hangs: no one peer holds
      more than all but `gpu_staging_reserve` slots of a ring (SlotPool), so a hung peer cannot hold
      the whole ring until its pulls' deadline (30 s here);
    - once it dies, a group's transfer that fails so fails its reads together (StagedReader._lead,
      PeerUnreachable) and each pull's own retry finds the peer gone: all six fail within seconds,
      each naming the peer and its unfilled blocks. Sent again one by one, each waited for the receive
      slots of the one before, which wait out a lost source's quarantine: 10 s a round;
    - no other block changes, and the decode sidecar pulls on from the live source."""
    a, _ = ring_pair
    b = spawn(SidecarProcess(f"groups-die-d{int(as_batch)}", extra=RING, env=ENV))  # its ring its own
    h = _a_hung_source_and_a_running_one(a, b, spawn, f"sdie{int(as_batch)}", 394)
    _, doomed = _whole_block_pulls(h.hung, [f"die{i}" for i in range(6)], 680, 100)
    timeout_s = 30
    untouched = [60, 61, 62, 99, 118]  # around the members' blocks: no pull names them
    kept = h.decode.send({"cmd": "digest", "block_ids": untouched})["digests"]
    with SidecarClient(b.socket) as client, _killed_at_the_end(h.far):
        os.kill(h.far.proc.pid, signal.SIGSTOP)
        if as_batch:
            members = client.pull_batch_async(h.decode.engine_id, [*doomed, *h.fine], timeout_s=timeout_s)
        else:
            members = [
                client.pull_async(p.params, h.decode.engine_id, p.block_ids, timeout_s=timeout_s)
                for p in doomed
            ]
            wait_for(
                "the doomed pulls to start",
                lambda: all(pulls_in_flight(b.socket, f"die{i}") for i in range(6)),
                10,
            )
            time.sleep(0.3)  # their transfers' slots taken, their Pushes out
            members += [
                client.pull_async(p.params, h.decode.engine_id, p.block_ids, timeout_s=timeout_s)
                for p in h.fine
            ]
        wait_for("the live source's reads to answer", lambda: all(m.done() for m in members[6:]), 10)
        assert not any(m.done() for m in members[:6])
        t0 = time.monotonic()
        h.far.proc.kill()
        h.far.proc.wait(5)
        wait_for("the doomed reads to end", lambda: all(m.done() for m in members[:6]), timeout_s)
        took = time.monotonic() - t0
    for m in members[6:]:
        assert m.result().ok, m.result()
    for m, pull in zip(members[:6], doomed, strict=True):
        res = m.result()
        assert res.error_code == "UNAVAILABLE", res
        assert h.far.peer_address in res.error, res
        assert res.unfilled_blocks == pull.block_ids, res
    assert took < 5, took
    _fine_members_exact(h)
    assert h.decode.send({"cmd": "digest", "block_ids": untouched})["digests"] == kept
    again = prefilled(h.prefill, f"sdie{int(as_batch)}-after", [20, 21, 22], TOKENS, seed=690)
    res = h.decode.send(
        {"cmd": "pull", "params": again, "block_ids": [70, 71, 72], "seed": 690}, timeout_s=60
    )
    assert res["ok"] and res["verified"], res
    no_transfer_in_flight(a, b)
