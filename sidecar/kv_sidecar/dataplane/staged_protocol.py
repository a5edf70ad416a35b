"""The staged protocol's bookkeeping, free of CUDA, NIXL and gRPC: slots, chunks, credits, notifications.

A staged transfer moves one (decode rank, source rank) read between two
sidecars through rings they own (docs/gpu.md):

- The reader takes receive slots from its ring's `SlotPool` and asks the
  source, in one `Push` call, to send the request into them.
- The source takes send slots from its own pool, gathers chunk after chunk
  (a token range of whole reader blocks, already in the reader's layout) into
  them, and WRITEs each gathered chunk over NIXL into a receive slot it holds
  a *credit* for, with a NIXL notification naming the chunk and the slot.
- The reader scatters each chunk into its engine's blocks and, once the
  scatter has finished reading the slot, gives the credit back by
  notification, or returns the slot to its pool when the chunks still to come
  fit the credits the source already holds.

No gRPC message per chunk: the data and both control directions ride on
NIXL. `SendState` and `RecvState` are the two ends' state machines; they are
shared between a handler thread and the NIXL driver thread, so every method
takes the state's lock.
"""

from __future__ import annotations

import re
import secrets
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kv_sidecar.transport.notifications import SEP, TRANSFER_TAG

ID_LEN = 16  # hex characters of a transfer id
PREFIX_LEN = len(TRANSFER_TAG) + 1 + ID_LEN + 1  # a transfer's notifications: tag, SEP, id, SEP

CHUNK, CREDIT, STOP = b"c", b"k", b"x"


class ProtocolError(Exception):
    """The other side broke the protocol (or a bug here did): the transfer must stop."""


class Stopped(Exception):
    """The transfer was stopped (by the reader, a failure, or a deadline) before it finished."""


# -- notifications --------------------------------------------------------------------
def new_transfer_id() -> str:
    return secrets.token_hex(ID_LEN // 2)


def is_transfer_id(value: str) -> bool:
    return len(value) == ID_LEN and all(c in "0123456789abcdef" for c in value)


def prefix(transfer_id: str) -> bytes:
    """What every notification of one transfer starts with (fixed length: a dict key)."""
    return TRANSFER_TAG + SEP + transfer_id.encode() + SEP


def chunk_notif(transfer_id: str, index: int, count: int, slot: int, t0: int, t1: int) -> bytes:
    """Source -> reader, carried by the WRITE itself: chunk `index` of `count` is in `slot`."""
    return prefix(transfer_id) + SEP.join([CHUNK, *(str(v).encode() for v in (index, count, slot, t0, t1))])


def credit_notif(transfer_id: str, slot: int) -> bytes:
    """Reader -> source: `slot` may be written again."""
    return prefix(transfer_id) + CREDIT + SEP + str(slot).encode()


def stop_notif(transfer_id: str) -> bytes:
    """Reader -> source: stop writing (the pull failed); answer the Push once nothing is in flight."""
    return prefix(transfer_id) + STOP


def parse_notif(msg: bytes) -> tuple[str, bytes, list[int]] | None:
    """(transfer id, kind, integer fields), or None if `msg` is not a well-formed staged notification."""
    if (
        len(msg) < PREFIX_LEN + 1
        or not msg.startswith(TRANSFER_TAG + SEP)
        or msg[PREFIX_LEN - 1 : PREFIX_LEN] != SEP
    ):
        return None
    tid = msg[len(TRANSFER_TAG) + 1 : PREFIX_LEN - 1].decode(errors="replace")
    parts = msg[PREFIX_LEN:].split(SEP)
    kind, fields = parts[0], parts[1:]
    want = {CHUNK: 5, CREDIT: 1, STOP: 0}.get(kind)
    if want is None or len(fields) != want or not is_transfer_id(tid):
        return None
    try:
        values = [int(f) for f in fields]
    except ValueError:
        return None
    if any(v < 0 for v in values):
        return None
    return tid, kind, values


# -- chunks ------------------------------------------------------------------------------
def plan_chunks(
    start_token: int, num_tokens: int, block_size: int, blocks_per_chunk: int
) -> list[tuple[int, int]]:
    """Token ranges [t0, t1) of whole reader blocks, `blocks_per_chunk` blocks each (the last may be short)."""
    if blocks_per_chunk < 1 or block_size < 1:
        raise ValueError("a chunk holds at least one block")
    if start_token % block_size:
        raise ValueError(f"start_token {start_token} is not a multiple of the block size {block_size}")
    step = blocks_per_chunk * block_size
    return [(t, min(t + step, num_tokens)) for t in range(start_token, num_tokens, step)]


def member_spans(num_tokens: Sequence[int], block_size: int) -> list[tuple[int, int]]:
    """A transfer that carries several requests (PushRequest.members) moves their tokens one after
    another: each member's (first token in the concatenation, tokens it moves there). Every member but
    the last is padded to whole reader blocks (`block_size`, a multiple of the source's), so that each
    starts on a block boundary on both sides; the padding is the rest of the member's own last reader
    block, which it owns (member_block_range: where its source tokens come from)."""
    if block_size < 1 or not num_tokens or any(n < 1 for n in num_tokens):
        raise ValueError("a member moves at least one token, in blocks of at least one")
    spans, at = [], 0
    for i, n in enumerate(num_tokens):
        moved = n if i == len(num_tokens) - 1 else -(-n // block_size) * block_size
        spans.append((at, moved))
        at += moved
    return spans


def member_block_range(
    num_blocks: int, start_token: int, moved: int, block_size: int
) -> tuple[int, int, int]:
    """Where a member's source blocks come from in its request's list of `num_blocks` (blocks of
    `block_size` from token 0): from the block holding `start_token`, enough for the `moved` tokens of
    its span (member_spans), as a slice [first, stop) and how many times the request's last block
    follows it. Padding to a larger reader block can reach past the request's last block: that last
    block again, whose tokens land in the padding of the member's own last reader block."""
    if block_size < 1 or start_token % block_size or moved < 1:
        raise ValueError("a member moves at least one token from a block boundary")
    first = start_token // block_size
    if first >= num_blocks:
        raise ValueError(f"start_token {start_token} is past the request's {num_blocks} blocks")
    end = first + -(-moved // block_size)
    return first, min(end, num_blocks), max(0, end - num_blocks)


def blocks_in(block_size: int, t0: int, t1: int) -> int:
    """Reader blocks covering tokens [t0, t1), t0 block aligned."""
    return -(-t1 // block_size) - t0 // block_size


# -- slots ---------------------------------------------------------------------------------
_WORKER_AGENT = re.compile(r"/(gpu\d+|host)$")


def peer_of(agent: str) -> str:
    """The sidecar a NIXL agent speaks for, as a ring's slots are shared out (SlotPool): a staged
    worker's agent (<sidecar_id>/gpu<N>, <sidecar_id>/host) is its sidecar's, so that a source node
    of several GPUs that hangs holds one peer's share of a ring, not one per GPU."""
    return _WORKER_AGENT.sub("", agent)


def _after(delay_s: float, fn: Callable[[], None]) -> None:
    timer = threading.Timer(delay_s, fn)
    timer.daemon = True
    timer.start()


class SlotPool:
    """The slots of one ring, shared by every transfer on it.

    `acquire` serves waiters first come, first served, and grants what is
    free up to what was asked (at least one slot): a transfer starts as soon
    as one slot is free instead of waiting for the whole ring, and slots a
    transfer gives back (as its last chunks need fewer) go to the next one.
    Only the first waiter is woken, and only when it may proceed: with many
    pulls queued on a GPU, waking them all at every release made each take
    the GIL in turn beside the running pulls.

    One peer's transfers hold at most `per_peer` slots together, quarantined
    ones included (`reserve` fewer than the ring has): slots given to a peer
    stay its own until it ends the transfer or, if it cannot say, until
    QUARANTINE_S has passed, so a peer that hangs or dies could otherwise hold
    the whole ring and stop every other peer's transfers for that long. A
    waiter whose peer holds its share waits for its own peer's slots and
    holds up no one behind it.
    """

    def __init__(self, slots: int, on_change: Callable[[int], None] | None = None, reserve: int = 0) -> None:
        if slots < 1:
            raise ValueError("a ring has at least one slot")
        self.slots = slots
        self.per_peer = max(1, slots - max(0, reserve))
        self._free: deque[int] = deque(range(slots))
        self._lock = threading.Lock()
        # One Condition per waiter, on `_lock`, with its peer, in arrival order.
        self._waiting: deque[tuple[threading.Condition, str]] = deque()
        self._owner: dict[int, str] = {}  # slot -> the peer it was given to, until it is free again
        self._held: dict[str, int] = {}  # peer -> slots given to it (quarantined ones too)
        self._on_change = on_change  # called with +n / -n slots in use (metrics)
        self.quarantined = 0  # slots waiting out a delayed release (a transfer that did not confirm its end)

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    def held_by(self, peer: str) -> int:
        with self._lock:
            return self._held.get(peer, 0)

    def describe(self) -> str:
        with self._lock:
            free, waiting = len(self._free), len(self._waiting)
        return (
            f"{free} of {self.slots} slots free, {self.quarantined} quarantined, {waiting} transfers waiting"
        )

    def _may(self, peer: str) -> bool:
        """With `_lock` held: whether a transfer of `peer` may take a slot now."""
        return bool(self._free) and self._held.get(peer, 0) < self.per_peer

    def _next(self) -> threading.Condition | None:
        """With `_lock` held: the first waiter that may take a slot now, if any."""
        for cond, peer in self._waiting:
            if self._may(peer):
                return cond
        return None

    def _wake_first(self) -> None:
        """With `_lock` held: the first waiter that may proceed looks again."""
        cond = self._next()
        if cond is not None:
            cond.notify()

    def acquire(self, want: int, remaining: Callable[[], float], peer: str = "") -> list[int]:
        """Between 1 and `want` slots for a transfer of `peer`, in arrival order. `remaining()` returns
        the seconds left to wait, or raises (deadline, cancellation): that exception propagates."""
        want = max(1, min(want, self.slots))
        with self._lock:
            # Making a Condition cost each pull ~20 us of CPU (bench/slot_pool.py): only one that queues does.
            if not self._may(peer) or self._next() is not None:
                self._wait_turn(peer, remaining)
            held = self._held.get(peer, 0)
            got = [self._free.popleft() for _ in range(min(want, len(self._free), self.per_peer - held))]
            self._held[peer] = held + len(got)
            for s in got:
                self._owner[s] = peer
            self._wake_first()  # slots left over: the next waiter's turn
        if self._on_change is not None:
            self._on_change(len(got))
        return got

    def _wait_turn(self, peer: str, remaining: Callable[[], float]) -> None:
        """With `_lock` held: queue until a slot is free for `peer` and every earlier waiter that may
        take one has been served."""
        me = threading.Condition(self._lock)
        entry = (me, peer)
        self._waiting.append(entry)
        try:
            while self._next() is not me:
                me.wait(max(0.0, min(remaining(), 0.05)))
        except BaseException:
            self._waiting.remove(entry)
            self._wake_first()  # it gave up: if it was next, the next one's turn
            raise
        self._waiting.remove(entry)

    def release(self, slots: Iterable[int]) -> None:
        slots = list(slots)
        if not slots:
            return
        with self._lock:
            for s in slots:
                if not 0 <= s < self.slots or s in self._free:
                    raise ValueError(f"slot {s} released twice or never acquired")
                self._free.append(s)
                peer = self._owner.pop(s, "")
                left = self._held.get(peer, 0) - 1
                if left > 0:
                    self._held[peer] = left
                else:
                    self._held.pop(peer, None)
            self._wake_first()
        if self._on_change is not None:
            self._on_change(-len(slots))

    def release_later(self, slots: Iterable[int], delay_s: float) -> None:
        """Give slots back `delay_s` after now: a peer may still be writing into them (it did not
        confirm, and nothing will say when it stops). Quarantined until then."""
        back = self._quarantine(slots)
        if back is not None:
            _after(delay_s, back)

    def release_when(
        self,
        slots: Iterable[int],
        delay_s: float,
        settles: Callable[[Callable[[bool], None]], None],
        unconfirmed: Callable[[], None] = lambda: None,
    ) -> None:
        """Give slots back once `settles` calls the function it is given: at once with True (the peer
        confirmed it writes into them no more), `delay_s` later with False, after `unconfirmed()`.
        Quarantined until then."""
        back = self._quarantine(slots)
        if back is None:
            return

        def settled(confirmed: bool) -> None:
            if confirmed:
                back()
            else:
                unconfirmed()
                _after(delay_s, back)

        settles(settled)

    def _quarantine(self, slots: Iterable[int]) -> Callable[[], None] | None:
        """Count `slots` as quarantined; what gives them back (None: no slots)."""
        slots = list(slots)
        if not slots:
            return None
        with self._lock:
            self.quarantined += len(slots)

        def back() -> None:
            with self._lock:
                self.quarantined -= len(slots)
            self.release(slots)

        return back


# -- the source's end ----------------------------------------------------------------------
@dataclass
class _Write:
    index: int
    send_slot: int
    recv_slot: int
    future: Any = None  # set by whoever posts the WRITE


class SendState:
    """Source side of one transfer: which chunk to gather next into which send slot, which
    gathered chunk to write into which receive slot, and the credits the reader gave back.

    The handler thread calls `next_gather`/`gathered`/`wait_finished`; the NIXL driver thread
    calls `next_write`/`write_done` and, from notifications, `credit`/`stop`.
    """

    def __init__(self, chunks: list[tuple[int, int]], send_slots: list[int], recv_slots: list[int]) -> None:
        if not chunks or not send_slots or not recv_slots:
            raise ValueError("a transfer needs a chunk, a send slot and a receive slot")
        if len(set(recv_slots)) != len(recv_slots):
            raise ProtocolError(f"receive slots {recv_slots} repeat")
        self.chunks = chunks
        self._cond = threading.Condition()
        self._free_send: deque[int] = deque(send_slots)
        self._credits: deque[int] = deque(recv_slots)
        # Receive slot -> "credit" (we may write), "writing", "reader" (written, not given back yet).
        self._recv: dict[int, str] = {r: "credit" for r in recv_slots}
        self._early: set[int] = set()  # credits that came back before we saw our WRITE complete
        self._to_gather = 0
        self._gathered: deque[tuple[int, int, Any]] = deque()  # (index, send slot, marker), in order
        self._writing: dict[int, _Write] = {}
        self.written = 0
        self.error: BaseException | None = None
        # Called (under the state's lock, so it must not block) when a chunk may have become
        # writable: one was gathered, or a credit came back. The NIXL thread's pump parks otherwise.
        self.on_writable: Callable[[], None] = lambda: None

    # handler thread
    def next_gather(self, remaining: Callable[[], float]) -> tuple[int, int] | None:
        """(chunk index, send slot) to gather next, waiting for a free send slot; None once every
        chunk is gathered. Raises the transfer's error once it failed or was stopped."""
        with self._cond:
            while True:
                self._raise_if_failed()
                if self._to_gather >= len(self.chunks):
                    return None
                if self._free_send:
                    i = self._to_gather
                    self._to_gather += 1
                    return i, self._free_send.popleft()
                self._cond.wait(max(0.0, min(remaining(), 0.05)))

    def gathered(self, index: int, send_slot: int, marker: Any) -> None:
        """Chunk `index` is being gathered into `send_slot`; `marker` says when it is done."""
        with self._cond:
            self._gathered.append((index, send_slot, marker))
            self.on_writable()

    def wait_finished(self, remaining: Callable[[], float]) -> None:
        with self._cond:
            while self.written < len(self.chunks):
                self._raise_if_failed()
                self._cond.wait(max(0.0, min(remaining(), 0.05)))
            self._raise_if_failed()

    # NIXL driver thread
    def may_write(self) -> bool:
        """Whether a write may become possible without news: a gathered chunk (its gather may still
        be running) and a credit to write it with."""
        with self._cond:
            return self.error is None and bool(self._gathered) and bool(self._credits)

    def next_write(self, ready: Callable[[Any], bool]) -> _Write | None:
        """The oldest gathered chunk, if its gather is done and a credit is free; None otherwise."""
        with self._cond:
            if self.error is not None or not self._gathered or not self._credits:
                return None
            index, send_slot, marker = self._gathered[0]
            if not ready(marker):
                return None
            self._gathered.popleft()
            recv_slot = self._credits.popleft()
            self._recv[recv_slot] = "writing"
            w = _Write(index, send_slot, recv_slot)
            self._writing[index] = w
            return w

    def write_done(self, index: int) -> None:
        with self._cond:
            w = self._writing.pop(index)
            self._free_send.append(w.send_slot)
            if w.recv_slot in self._early:
                self._early.discard(w.recv_slot)
                self._give_credit(w.recv_slot)
            else:
                self._recv[w.recv_slot] = "reader"
            self.written += 1
            self._cond.notify_all()

    def credit(self, recv_slot: int) -> None:
        """The reader scattered out of `recv_slot`: it may be written again."""
        with self._cond:
            state = self._recv.get(recv_slot)
            if state == "reader":
                self._give_credit(recv_slot)
            elif state == "writing" and recv_slot not in self._early:
                self._early.add(recv_slot)  # its notification overtook our completion poll
            else:
                raise ProtocolError(f"credit for receive slot {recv_slot}, which the reader does not hold")

    def _give_credit(self, recv_slot: int) -> None:
        self._recv[recv_slot] = "credit"
        self._credits.append(recv_slot)
        self.on_writable()
        self._cond.notify_all()

    # any thread
    def fail(self, error: BaseException) -> None:
        """Stop with `error` (the first one wins): no new gather or WRITE starts."""
        with self._cond:
            if self.error is None:
                self.error = error
            self._cond.notify_all()

    def stop(self, reason: str) -> None:
        self.fail(Stopped(reason))

    @property
    def finished(self) -> bool:
        with self._cond:
            return self.written == len(self.chunks)

    def in_flight(self) -> list[_Write]:
        with self._cond:
            return list(self._writing.values())

    def describe(self) -> str:
        """Where the transfer stands, for an error that ends it (a deadline says what it waited for)."""
        with self._cond:
            return (
                f"{self._to_gather} of {len(self.chunks)} chunks gathering or gathered, {len(self._gathered)} "
                f"of them waiting to be written, {len(self._writing)} being written, {self.written} "
                f"written; receive slots {self._recv}, early credits {sorted(self._early)}"
            )

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error


# -- the reader's end ----------------------------------------------------------------------
@dataclass(frozen=True)
class Chunk:
    index: int
    slot: int
    t0: int
    t1: int
    first_block: int  # position in the pull's destination block list
    blocks: int


class RecvState:
    """Reader side of one transfer: checks each arriving chunk and decides what a scattered slot becomes.

    The reader never trusts the source's chunking: a chunk must be whole blocks
    inside the request, fit its slot, land in a slot the source holds a credit
    for, and cover no block twice; the transfer is complete when every block
    arrived and the source's announced chunk count is reached.
    """

    def __init__(
        self,
        start_token: int,
        num_tokens: int,
        block_size: int,
        slot_lengths: dict[int, int],
        chunk_bytes: Callable[[int], int],
    ) -> None:
        self.start_token = start_token
        self.num_tokens = num_tokens
        self.block_size = block_size
        self._first = start_token // block_size
        self._covered = bytearray(blocks_in(block_size, start_token, num_tokens))
        self._left = len(self._covered)
        self._lengths = dict(slot_lengths)
        self._slot: dict[int, str] = {s: "credit" for s in slot_lengths}  # "credit" | "busy" | "released"
        self._chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self.count: int | None = None
        self._seen: set[int] = set()

    def arrive(self, index: int, count: int, slot: int, t0: int, t1: int) -> Chunk:
        with self._lock:
            if self.count is None:
                if count < 1:
                    raise ProtocolError(f"chunk count {count}")
                self.count = count
            elif count != self.count:
                raise ProtocolError(f"chunk {index} says {count} chunks, an earlier one {self.count}")
            if not 0 <= index < count or index in self._seen:
                raise ProtocolError(f"chunk {index} of {count} is out of range or came twice")
            if self._slot.get(slot) != "credit":
                raise ProtocolError(
                    f"chunk {index} landed in slot {slot}, which the source holds no credit for"
                )
            bs = self.block_size
            if not (t0 % bs == 0 and self.start_token <= t0 < t1 <= self.num_tokens):
                raise ProtocolError(
                    f"chunk {index}: tokens [{t0}, {t1}) are not a block-aligned range of "
                    f"[{self.start_token}, {self.num_tokens})"
                )
            k = blocks_in(bs, t0, t1)
            if self._chunk_bytes(k) > self._lengths[slot]:
                raise ProtocolError(f"chunk {index} ({k} blocks) does not fit slot {slot}")
            first = t0 // bs - self._first
            if any(self._covered[first : first + k]):
                raise ProtocolError(f"chunk {index}: tokens [{t0}, {t1}) arrived before")
            self._covered[first : first + k] = b"\x01" * k
            self._left -= k
            self._seen.add(index)
            self._slot[slot] = "busy"
            return Chunk(index, slot, t0, t1, first, k)

    def scattered(self, slot: int) -> bool:
        """The scatter out of `slot` finished. True: give the source its credit back; False: the
        chunks still to come fit the credits it holds, so the slot goes back to the pool."""
        with self._lock:
            if self._slot.get(slot) != "busy":
                raise ProtocolError(f"slot {slot} was not holding a chunk")
            to_come = (self.count or 0) - len(self._seen)
            credited = sum(1 for s in self._slot.values() if s == "credit")
            if credited >= to_come:
                self._slot[slot] = "released"
                return False
            self._slot[slot] = "credit"
            return True

    @property
    def complete(self) -> bool:
        with self._lock:
            if self.count is None or len(self._seen) < self.count:
                return False
            if self._left:
                raise ProtocolError(f"all {self.count} chunks arrived but {self._left} blocks are missing")
            return True

    @property
    def arrived(self) -> int:
        """How many chunks arrived."""
        with self._lock:
            return len(self._seen)

    def held(self) -> list[int]:
        """Slots not yet given back to the pool."""
        with self._lock:
            return [s for s, st in self._slot.items() if st != "released"]

    def release_all(self) -> list[int]:
        """Mark every slot given back; returns those that were still held."""
        with self._lock:
            held = [s for s, st in self._slot.items() if st != "released"]
            for s in held:
                self._slot[s] = "released"
            return held
