"""The staged protocol's bookkeeping on its own: notifications, chunking, the shared slot pool and
both ends' state machines, including the two ends driven against each other by threads."""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_sidecar.dataplane import staged_protocol as sp


def forever() -> float:
    return 10.0


# -- notifications -------------------------------------------------------------------------
def test_notifications_round_trip_and_share_a_fixed_prefix() -> None:
    tid = sp.new_transfer_id()
    assert sp.is_transfer_id(tid)
    msgs = [sp.chunk_notif(tid, 3, 9, 1, 48, 64), sp.credit_notif(tid, 7), sp.stop_notif(tid)]
    for m in msgs:
        assert m[: sp.PREFIX_LEN] == sp.prefix(tid)
    assert sp.parse_notif(msgs[0]) == (tid, sp.CHUNK, [3, 9, 1, 48, 64])
    assert sp.parse_notif(msgs[1]) == (tid, sp.CREDIT, [7])
    assert sp.parse_notif(msgs[2]) == (tid, sp.STOP, [])


@pytest.mark.parametrize(
    "msg",
    [
        b"",
        b"kvs1\x1fengine\x1freq\x1freader\x1f0\x1f0",  # a done notification is not ours
        sp.prefix("0" * 16) + b"c\x1f1\x1f2",  # too few fields
        sp.prefix("0" * 16) + b"k\x1fx",  # not a number
        sp.prefix("0" * 16) + b"k\x1f-1",  # negative
        sp.prefix("0" * 16) + b"z",  # unknown kind
        sp.prefix("ZZZZZZZZZZZZZZZZ") + b"x",  # not a transfer id
    ],
)
def test_malformed_notifications_parse_to_none(msg: bytes) -> None:
    assert sp.parse_notif(msg) is None


# -- chunks ------------------------------------------------------------------------------
def test_chunks_are_whole_blocks_and_cover_the_request() -> None:
    assert sp.plan_chunks(0, 150, 16, 3) == [(0, 48), (48, 96), (96, 144), (144, 150)]
    assert sp.plan_chunks(32, 150, 16, 4) == [(32, 96), (96, 150)]
    assert sp.plan_chunks(160, 150, 16, 4) == []
    with pytest.raises(ValueError):
        sp.plan_chunks(8, 150, 16, 4)
    with pytest.raises(ValueError):
        sp.plan_chunks(0, 150, 16, 0)
    assert sp.blocks_in(16, 144, 150) == 1
    assert sp.blocks_in(16, 32, 96) == 4


# -- the slot pool ---------------------------------------------------------------------------
def test_pool_grants_what_is_free_first_come_first_served() -> None:
    changes: list[int] = []
    pool = sp.SlotPool(4, on_change=changes.append)
    a = pool.acquire(3, forever)
    b = pool.acquire(3, forever)  # only one left: granted at once, not after `a` is done
    assert len(a) == 3 and len(b) == 1 and not set(a) & set(b)
    assert pool.free == 0
    got: list[list[int]] = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(2, forever)))
    t.start()
    time.sleep(0.1)
    assert not got and pool.waiting == 1
    pool.release(b)
    t.join(5)
    assert got == [b]  # one free slot: a waiter starts with what there is
    pool.release(a)
    pool.release(got[0])
    assert pool.free == 4 and sum(changes) == 0


def test_pool_waiters_are_served_in_order_and_time_out_cleanly() -> None:
    pool = sp.SlotPool(1)
    held = pool.acquire(1, forever)
    order: list[str] = []

    def take(name: str) -> None:
        s = pool.acquire(1, forever)
        order.append(name)
        time.sleep(0.01)
        pool.release(s)

    threads = []
    for name in "abc":
        threads.append(threading.Thread(target=take, args=(name,)))
        threads[-1].start()
        time.sleep(0.05)  # a, b, c queue in this order

    deadline = time.monotonic() + 0.2

    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("gave up")
        return left

    with pytest.raises(TimeoutError):
        pool.acquire(1, remaining)  # queued behind a, b, c; times out without taking a slot
    pool.release(held)
    for t in threads:
        t.join(5)
    assert order == ["a", "b", "c"]
    assert pool.free == 1 and pool.waiting == 0


def test_pool_wakes_only_the_waiter_whose_turn_it_is() -> None:
    """A release lets the first waiter in, and only it looks again: with many pulls queued on a ring,
    waking every waiter at each release had each of them take the GIL for nothing."""
    n = 12
    pool = sp.SlotPool(n)
    held = pool.acquire(n, forever)
    looks = [0] * n  # calls of each waiter's `remaining()`: one per time it woke up and looked
    order: list[int] = []
    done = threading.Event()

    def waiter(i: int) -> None:
        def remaining() -> float:
            looks[i] += 1
            return 60.0

        s = pool.acquire(1, remaining)
        order.append(i)
        done.wait(10)
        pool.release(s)

    threads = [threading.Thread(target=waiter, args=(i,)) for i in range(n)]
    for i, t in enumerate(threads):
        t.start()
        while pool.waiting < i + 1:  # queued in this order
            time.sleep(0.001)
    before = sum(looks)
    for s in held:
        pool.release([s])
        time.sleep(0.002)  # time for every woken waiter to look
    deadline = time.monotonic() + 5
    while len(order) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    done.set()
    for t in threads:
        t.join(5)
    assert order == list(range(n))
    # Each waiter looks once when its turn comes, plus at most a timed wake-up or two (every 50 ms);
    # waking all of them at each release makes it ~n * n / 2.
    assert sum(looks) - before <= 3 * n, looks
    assert pool.free == n and pool.waiting == 0


def test_pool_refuses_double_release_and_delays_quarantined_slots() -> None:
    pool = sp.SlotPool(2)
    s = pool.acquire(2, forever)
    pool.release(s[:1])
    with pytest.raises(ValueError):
        pool.release(s[:1])
    pool.release_later(s[1:], 0.2)
    assert pool.free == 1 and pool.quarantined == 1
    time.sleep(0.5)
    assert pool.free == 2 and pool.quarantined == 0


def test_pool_gives_slots_back_when_the_peer_settles_at_once_if_confirmed_else_after_the_delay() -> None:
    pool = sp.SlotPool(4)
    s = pool.acquire(4, forever)
    settles: list[Callable[[bool], None]] = []
    pool.release_when(s[:2], 0.2, settles.append)
    pool.release_when(s[2:], 0.2, settles.append)
    assert pool.free == 0 and pool.quarantined == 4  # until the peer says
    settles[0](True)  # it confirmed: nothing more will be written
    assert pool.free == 2 and pool.quarantined == 2
    settles[1](False)  # it did not: the delay from now
    assert pool.free == 2 and pool.quarantined == 2
    time.sleep(0.5)
    assert pool.free == 4 and pool.quarantined == 0


def test_one_peer_holds_at_most_all_but_the_reserve_and_the_rest_goes_to_others() -> None:
    """A peer that hangs or dies keeps what it was given until its transfers end or their quarantine
    passes: with a reserve it cannot take the whole ring, and a waiter of it holds up no other peer's."""
    pool = sp.SlotPool(4, reserve=1)
    assert pool.per_peer == 3
    hung = pool.acquire(4, forever, "hung")
    assert len(hung) == 3 and pool.free == 1  # one left for the others
    more: list[list[int]] = []
    t = threading.Thread(target=lambda: more.append(pool.acquire(2, forever, "hung")))
    t.start()  # its share is taken: it waits, though a slot is free
    while pool.waiting < 1:
        time.sleep(0.001)
    other = pool.acquire(4, forever, "live")  # not behind the hung peer's waiter
    assert len(other) == 1 and pool.held_by("live") == 1 and pool.held_by("hung") == 3
    pool.release(other)
    time.sleep(0.1)
    assert not more  # the free slot is not the hung peer's to take
    pool.release_later(hung[:1], 0.2)  # quarantined slots still count as its own
    time.sleep(0.05)
    assert not more and pool.held_by("hung") == 3
    t.join(5)  # ... until they come back: then its waiter gets one
    assert len(more) == 1 and len(more[0]) == 1 and pool.held_by("hung") == 3
    pool.release(hung[1:])
    pool.release(more[0])
    assert pool.free == 4 and pool.held_by("hung") == 0 and pool.waiting == 0


def test_a_staged_workers_agent_counts_as_its_sidecar() -> None:
    assert sp.peer_of("kvs-a1") == "kvs-a1"
    assert sp.peer_of("kvs-a1/gpu3") == sp.peer_of("kvs-a1/gpu12") == sp.peer_of("kvs-a1/host") == "kvs-a1"
    assert sp.peer_of("team/kvs-a1/gpu0") == "team/kvs-a1"  # a sidecar_id may hold a slash itself
    assert sp.peer_of("kvs-a1/gpux") == "kvs-a1/gpux"


def test_a_pool_without_a_reserve_or_of_one_slot_lets_one_peer_take_all() -> None:
    assert len(sp.SlotPool(4).acquire(4, forever, "p")) == 4
    assert len(sp.SlotPool(4, reserve=0).acquire(4, forever, "p")) == 4
    assert len(sp.SlotPool(1, reserve=1).acquire(1, forever, "p")) == 1  # at least one, or none could go
    assert sp.SlotPool(4, reserve=9).per_peer == 1


def test_waiters_of_peers_with_room_go_in_order_past_those_of_peers_at_their_share() -> None:
    pool = sp.SlotPool(3, reserve=1)
    a = pool.acquire(2, forever, "a")  # a's share
    b = pool.acquire(1, forever, "b")  # the ring is full
    order: list[str] = []
    got: dict[str, list[int]] = {}

    def take(name: str, peer: str) -> None:
        got[name] = pool.acquire(1, forever, peer)
        order.append(name)

    threads = []
    for name, peer in (("a1", "a"), ("b1", "b"), ("c1", "c")):
        threads.append(threading.Thread(target=take, args=(name, peer)))
        threads[-1].start()
        while pool.waiting < len(threads):
            time.sleep(0.001)
    pool.release(b)  # a1 is first but at its share: b1 goes, then c1 once b1's slot comes back
    while len(order) < 1:
        time.sleep(0.001)
    assert order == ["b1"]
    pool.release(got["b1"])
    while len(order) < 2:
        time.sleep(0.001)
    assert order == ["b1", "c1"]
    pool.release(a[:1])
    for t in threads:
        t.join(5)
    assert order == ["b1", "c1", "a1"]
    pool.release(a[1:] + got["a1"] + got["c1"])
    assert pool.free == 3 and pool.waiting == 0


def test_pool_shared_by_many_threads_never_hands_out_a_slot_twice() -> None:
    pool = sp.SlotPool(5)
    owners: dict[int, int] = {}
    lock = threading.Lock()
    errors: list[str] = []

    def worker(me: int) -> None:
        rng = random.Random(me)
        for _ in range(200):
            got = pool.acquire(rng.randint(1, 4), forever)
            with lock:
                for s in got:
                    if s in owners:
                        errors.append(f"slot {s} held by {owners[s]} and {me}")
                    owners[s] = me
            time.sleep(rng.random() * 1e-4)
            with lock:
                for s in got:
                    del owners[s]
            pool.release(got)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and pool.free == 5 and pool.waiting == 0


# -- the source's state ---------------------------------------------------------------------
def test_send_state_gathers_ahead_writes_in_order_and_needs_credits() -> None:
    chunks = sp.plan_chunks(0, 80, 16, 1)  # 5 chunks
    st = sp.SendState(chunks, send_slots=[0, 1], recv_slots=[0, 1])
    assert st.next_gather(forever) == (0, 0)
    assert st.next_gather(forever) == (1, 1)
    st.gathered(0, 0, "e0")
    st.gathered(1, 1, "e1")
    not_ready = st.next_write(lambda m: m != "e0")
    assert not_ready is None  # in order: chunk 0 first
    w0 = st.next_write(lambda m: True)
    w1 = st.next_write(lambda m: True)
    assert (w0.index, w0.send_slot, w0.recv_slot) == (0, 0, 0)
    assert (w1.index, w1.recv_slot) == (1, 1)
    st.write_done(0)
    assert st.next_gather(forever) == (2, 0)  # send slot 0 is free again
    st.gathered(2, 0, "e2")
    assert st.next_write(lambda m: True) is None  # no credit: the reader holds both slots
    st.credit(0)
    w2 = st.next_write(lambda m: True)
    assert (w2.index, w2.recv_slot) == (2, 0)
    # The reader scattered chunk 1 before our poll saw its WRITE complete (its notification overtook
    # our completion poll): an early credit, honoured on completion; a second one is an error.
    st.credit(1)
    with pytest.raises(sp.ProtocolError):
        st.credit(1)
    assert st.next_write(lambda m: True) is None
    st.write_done(1)
    assert st.next_gather(forever) == (3, 1)
    st.gathered(3, 1, "e3")
    w3 = st.next_write(lambda m: True)
    assert (w3.index, w3.recv_slot) == (3, 1)
    st.write_done(2)
    st.write_done(3)
    assert st.written == 4 and not st.finished


def test_send_state_says_when_its_pump_may_park_and_when_to_wake_it() -> None:
    """The source's NIXL-thread pump parks unless `may_write`; every event that can make a chunk
    writable (a gather launched, a credit back, an early credit honoured) calls `on_writable`."""
    chunks = sp.plan_chunks(0, 48, 16, 1)  # 3 chunks
    st = sp.SendState(chunks, send_slots=[0, 1], recv_slots=[0])
    woken: list[int] = []
    st.on_writable = lambda: woken.append(1)
    assert not st.may_write()  # nothing gathered
    st.next_gather(forever)
    st.gathered(0, 0, "e0")
    assert len(woken) == 1 and st.may_write()  # its gather may still run: keep polling
    w0 = st.next_write(lambda m: True)
    assert w0 is not None and not st.may_write()
    st.next_gather(forever)
    st.gathered(1, 1, "e1")
    assert len(woken) == 2 and not st.may_write()  # gathered, but the reader holds the one slot
    st.credit(0)  # early: before our poll saw the WRITE complete
    assert len(woken) == 2 and not st.may_write()
    st.write_done(0)  # the early credit is honoured now
    assert len(woken) == 3 and st.may_write()
    st.fail(sp.Stopped("stop"))
    assert not st.may_write()


def test_where_a_transfer_stands_is_described_for_its_error() -> None:
    """A transfer that runs out of time says what it was waiting for: its ends' state, the pool's."""
    pool = sp.SlotPool(2)
    pool.acquire(2, forever)
    assert pool.describe() == "0 of 2 slots free, 0 quarantined, 0 transfers waiting"
    st = sp.SendState([(0, 16), (16, 32), (32, 48)], [0, 1], [0])
    assert st.next_gather(forever) == (0, 0)
    st.gathered(0, 0, None)
    w = st.next_write(lambda m: True)
    assert w is not None
    st.write_done(w.index)
    assert st.describe() == (
        "1 of 3 chunks gathering or gathered, 0 of them waiting to be written, 0 being written, "
        "1 written; receive slots {0: 'reader'}, early credits []"
    )
    rs = sp.RecvState(0, 48, 16, {0: 1 << 20}, lambda k: k)
    assert rs.arrived == 0
    rs.arrive(0, 3, 0, 0, 16)
    assert rs.arrived == 1


def test_send_state_refuses_credits_it_never_gave_and_stops() -> None:
    st = sp.SendState([(0, 16)], [0], [0])
    with pytest.raises(sp.ProtocolError):
        st.credit(0)  # the reader already holds the credit for slot 0
    with pytest.raises(sp.ProtocolError):
        st.credit(5)
    with pytest.raises(sp.ProtocolError):
        sp.SendState([(0, 16)], [0], [1, 1])
    st.stop("reader gone")
    with pytest.raises(sp.Stopped):
        st.next_gather(forever)
    assert st.next_write(lambda m: True) is None
    with pytest.raises(sp.Stopped):
        st.wait_finished(forever)


# -- the reader's state ---------------------------------------------------------------------
def recv(start: int = 0, tokens: int = 150, slots: int = 2, slot_blocks: int = 3) -> sp.RecvState:
    return sp.RecvState(start, tokens, 16, dict.fromkeys(range(slots), slot_blocks * 100), lambda k: k * 100)


def test_recv_state_checks_every_chunk() -> None:
    st = recv()
    c = st.arrive(0, 4, 0, 0, 48)
    assert (c.first_block, c.blocks) == (0, 3)
    bad = [
        (1, 5, 1, 48, 96),  # another chunk count
        (0, 4, 1, 48, 96),  # chunk index again
        (1, 4, 0, 48, 96),  # slot 0 is busy: the source holds no credit for it
        (1, 4, 7, 48, 96),  # not our slot
        (1, 4, 1, 40, 96),  # not block aligned
        (1, 4, 1, 48, 160),  # past the request
        (1, 4, 1, 48, 112),  # 4 blocks do not fit a 3-block slot
        (1, 4, 1, 32, 64),  # overlaps chunk 0
        (4, 4, 1, 48, 96),  # index out of range
    ]
    for args in bad:
        with pytest.raises(sp.ProtocolError):
            st.arrive(*args)
    assert not st.complete


def test_recv_state_credits_while_chunks_remain_then_gives_slots_back() -> None:
    st = recv(slots=2)
    st.arrive(0, 4, 0, 0, 48)
    st.arrive(1, 4, 1, 48, 96)
    assert st.scattered(0) is True  # two chunks to come, no credit out: give slot 0 back to the source
    st.arrive(2, 4, 0, 96, 144)
    assert st.scattered(1) is True  # one to come, no credit out
    assert st.scattered(0) is False  # one to come, slot 1 already credited: slot 0 goes to the pool
    st.arrive(3, 4, 1, 144, 150)
    assert st.held() == [1]
    assert st.scattered(1) is False
    assert st.complete and st.held() == []


def test_recv_state_notices_missing_tokens() -> None:
    st = recv(tokens=64, slots=1, slot_blocks=4)
    st.arrive(0, 1, 0, 0, 48)  # one chunk announced, but it leaves tokens [48, 64) out
    with pytest.raises(sp.ProtocolError, match="missing"):
        _ = st.complete


def test_recv_state_with_a_prefix_start() -> None:
    st = recv(start=32, tokens=100, slots=1, slot_blocks=8)
    c = st.arrive(0, 1, 0, 32, 100)
    assert (c.first_block, c.blocks) == (0, 5)
    assert st.complete


# -- both ends against each other -------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_source_and_reader_threads_move_every_chunk_exactly_once(seed: int) -> None:
    """A source thread gathering and a 'driver' thread writing, a reader thread scattering and
    returning credits, with random delays: every chunk lands once, slots are never shared."""
    rng = random.Random(seed)
    tokens, bs = 16 * 37 + 5, 16
    send_pool, recv_pool = sp.SlotPool(3), sp.SlotPool(4)
    recv_slots = recv_pool.acquire(rng.randint(1, 4), forever)
    reader = sp.RecvState(0, tokens, bs, dict.fromkeys(range(len(recv_slots)), 2), lambda k: k)
    chunks = sp.plan_chunks(0, tokens, bs, 2)
    send_slots = send_pool.acquire(len(recv_slots) + 1, forever)
    source = sp.SendState(chunks, send_slots, list(range(len(recv_slots))))
    wire: queue.Queue[tuple[int, int, int] | None] = queue.Queue()
    occupied: dict[int, int] = {}  # receive slot -> chunk it holds
    landed: list[int] = []
    errors: list[str] = []

    def gather() -> None:
        while (g := source.next_gather(forever)) is not None:
            time.sleep(rng.random() * 2e-4)
            source.gathered(g[0], g[1], time.monotonic() + rng.random() * 2e-4)

    def driver() -> None:
        pending: list[tuple[float, object]] = []
        while not source.finished:
            w = source.next_write(lambda ready_at: time.monotonic() >= ready_at)
            if w is not None:
                if w.recv_slot in occupied:
                    errors.append(f"chunk {w.index} written over chunk {occupied[w.recv_slot]}")
                occupied[w.recv_slot] = w.index
                pending.append((time.monotonic() + rng.random() * 2e-4, w))
            for item in [p for p in pending if time.monotonic() >= p[0]]:
                pending.remove(item)
                w = item[1]
                t0, t1 = chunks[w.index]  # type: ignore[attr-defined]
                wire.put((w.index, w.recv_slot, t0, t1))  # type: ignore[attr-defined]
                source.write_done(w.index)  # type: ignore[attr-defined]
            time.sleep(1e-5)
        wire.put(None)

    def read() -> None:
        while (m := wire.get()) is not None:
            index, slot, t0, t1 = m
            reader.arrive(index, len(chunks), slot, t0, t1)
            landed.append(index)
            time.sleep(rng.random() * 2e-4)
            del occupied[slot]
            if reader.scattered(slot):
                source.credit(slot)
            else:
                recv_pool.release([recv_slots[slot]])

    threads = [threading.Thread(target=f) for f in (gather, driver, read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert sorted(landed) == list(range(len(chunks))) and reader.complete
    recv_pool.release([recv_slots[s] for s in reader.release_all()])
    send_pool.release(send_slots)
    assert recv_pool.free == 4 and send_pool.free == 3


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"layout": "flash_attn_hnd"},
        {"layout": "flashinfer_nhd", "kernel_block_size": 8},
        {"layout": "packed", "tp_size": 2},
        {"layout": "mla", "num_kv_heads": 1, "head_dim": 576},
        {"cross_layer": True, "dtype": "float8_e4m3fn"},
    ],
)
def test_staging_bytes_are_linear_in_blocks(over: dict[str, object]) -> None:
    """Both ends size chunks as blocks x bytes of one block; the staging layout must agree."""
    from kv_sidecar.execute import gpu
    from kv_sidecar.plan.spec import EngineSpec

    base = {"tp_size": 1, "num_layers": 3, "num_kv_heads": 4, "head_dim": 64, "dtype": "bfloat16"}
    spec = EngineSpec.from_dict(base | {"block_size": 16, "num_blocks": 8, "layout": "flash_attn_nhd"} | over)
    one = gpu.staging_bytes(spec, 1)
    assert all(gpu.staging_bytes(spec, k) == k * one for k in (2, 3, 17, 1000))


# -- a transfer that carries several requests --------------------------------------------------


@given(st.lists(st.integers(1, 200), min_size=1, max_size=12), st.integers(1, 64))
def test_member_spans_lay_members_end_to_end_each_from_a_block_boundary(counts: list[int], bs: int) -> None:
    spans = sp.member_spans(counts, bs)
    at = 0
    for i, ((first, moved), n) in enumerate(zip(spans, counts, strict=True)):
        assert first == at and first % bs == 0  # both sides' blocks of a member start with it
        if i == len(counts) - 1:
            assert moved == n  # the last one moves its own tokens
        else:
            assert n <= moved < n + bs and moved % bs == 0  # padded within its own last block
        at += moved
    # Whole reader blocks of the concatenation are exactly the members' own blocks, in order.
    assert -(-at // bs) == sum(-(-n // bs) for n in counts)


def test_member_spans_refuse_an_empty_member() -> None:
    with pytest.raises(ValueError):
        sp.member_spans([16, 0], 16)
    with pytest.raises(ValueError):
        sp.member_spans([], 16)


@given(
    st.integers(1, 200),  # the request's tokens
    st.integers(0, 12),  # reader blocks of prefix held
    st.sampled_from([(16, 16), (16, 32), (8, 64), (1, 16), (32, 32)]),  # source, reader block sizes
    st.booleans(),  # the member is the last of its transfer (not padded)
)
def test_member_block_range_gives_each_token_its_own_source_block(
    n: int, prefix: int, sizes: tuple[int, int], last: bool
) -> None:
    bp, bd = sizes
    start = prefix * bd
    if start >= n:
        return
    (_, moved), *_ = sp.member_spans([n - start] if last else [n - start, 1], bd)
    num_blocks = -(-n // bp)
    first, stop, repeats = sp.member_block_range(num_blocks, start, moved, bp)
    idx = [*range(first, stop), *[num_blocks - 1] * repeats]
    assert len(idx) == -(-moved // bp) and all(0 <= i < num_blocks for i in idx)
    for t in range(start, n):  # every token of the request the member moves comes from its own block
        assert idx[(t - start) // bp] == t // bp
    # Padding past the request's last block repeats that block: read, and written only into the
    # padding of the member's own last reader block.
    assert all(i == num_blocks - 1 for i in idx[num_blocks - start // bp :])


def test_member_block_range_refuses_what_no_member_moves() -> None:
    for args in [(4, 8, 16, 16), (4, 0, 0, 16), (4, 64, 16, 16), (4, 0, 16, 0)]:
        with pytest.raises(ValueError):
            sp.member_block_range(*args)
