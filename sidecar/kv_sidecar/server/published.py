"""Published requests: blocks held for readers under a lease, and who has read them.

A prefill engine publishes a request; its blocks stay valid until every decode
rank that depends on each prefill rank has read (then that rank gets
"consumed"), the lease runs out (every rank gets "lease expired" and later
reads fail), the engine aborts, or the reader releases it (decode Abort, or
the decode engine died).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.plan.blocks import check_start, source_block_list
from kv_sidecar.plan.pair import PairPlan
from kv_sidecar.plan.spec import PlanError
from kv_sidecar.server.gone_readers import ReaderSidecar

log = logging.getLogger(__name__)

_TOMBSTONES = 10_000  # remember this many ended requests, to explain late reads


@dataclass
class Published:
    engine_id: str
    request_id: str
    block_ids: list[int]  # as published: the blocks of tokens [first_token, num_tokens)
    num_tokens: int
    lease_s: float
    deadline: float  # time.monotonic()
    reader: str | None = None  # decode engine id reading it
    # The sidecars that opened it for the reader: sidecar id -> where it answers and its calls came
    # from, for server/gone_readers.py to ask whether they still run.
    reader_sidecars: dict[str, ReaderSidecar] = field(default_factory=dict)
    # Why nothing of the reader's read runs any more ("" while it may): its read failed here (its
    # transfer failed, or it said so), or each of its sidecars is proven gone. Another engine may then
    # take the request over, as a router that retries it on another decode instance does once that
    # reader's sidecar died (`open_read`).
    reader_failed: str = ""
    consumed_any: bool = False  # a prefill rank's "consumed" fired: its blocks may be gone
    # Prefill ranks this sidecar tracks; None: all of them. An engine spread over
    # several sidecars (docs/multinode.md) is tracked by each for its own ranks.
    ranks: list[int] | None = None
    pending: dict[int, set[int]] = field(default_factory=dict)  # prefill rank -> decode ranks not done
    # 0, or where a sliding-window request's published range starts (a block boundary): nothing
    # before it is held, and no read may start before it (`check_read_from`).
    first_token: int = 0
    # The blocks by position from token 0, as the executors index them (plan.blocks.source_block_list):
    # block_ids after placeholders for the positions before first_token. Set by PublishedStore.publish.
    source_blocks: list[int] = field(default_factory=list)
    # The prefill ranks registered here when it was published -> which registration each was
    # (engines.RankEntry.generation): only those hold its bytes here (check_sources).
    generations: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.source_blocks and not self.first_token:
            self.source_blocks = list(self.block_ids)

    def check_read_from(self, start_token: int) -> None:
        """A source about to send tokens [start_token, num_tokens) refuses to read before the range it
        holds (OUT_OF_RANGE): those positions hold placeholders, not this request's KV."""
        try:
            check_start(start_token, self.first_token, self.num_tokens)
        except PlanError as e:
            raise SidecarError(Code.OUT_OF_RANGE, f"request {self.request_id!r}: {e}") from None

    def check_sources(self, current: Mapping[int, int]) -> None:
        """Before this sidecar sends a prefill rank's blocks of the request (`current`: those ranks ->
        their registration now): NOT_FOUND unless each is the registration that held the request when
        it was published. A rank that moved here from another sidecar, or whose process registered
        again, has other bytes in blocks of the same ids, and a read of them would succeed, wrong."""
        for rank, now in current.items():
            held = self.generations.get(rank)
            if held == now:
                continue
            why = (
                "registered here after the request was published (it was on another sidecar then: "
                "a rank that moves takes none of its requests along)"
                if held is None
                else "registered here again after the request was published (a new process: its blocks "
                "hold other bytes)"
            )
            raise SidecarError(
                Code.NOT_FOUND,
                f"request {self.request_id!r} of engine {self.engine_id!r} is not held by its rank {rank} "
                f"here: rank {rank} {why}; prefill it again",
            )

    def deadline_unix_ms(self) -> int:
        return int((time.time() + self.deadline - time.monotonic()) * 1000)


class ReadOpen(NamedTuple):
    """One request's open among several (`PublishedStore.open_reads`): as `open_read` takes it."""

    request_id: str
    reader: str
    ranks: list[int]
    sidecar_id: str  # the reader's sidecar that opens it (open_read's `reader_sidecar`)
    at: ReaderSidecar


# Callbacks into the engine registry: (engine_id, prefill rank, request) -> None
EventSink = Callable[[str, int, "Published"], None]


class ReadByAnother(SidecarError):
    """Refused: another engine reads the request, and nothing says that its read ended. `sidecars`: that
    reader's sidecars as `Published.reader_sidecars` had them, for `reader_gone`."""

    def __init__(self, request_id: str, reader: str, sidecars: dict[str, ReaderSidecar]) -> None:
        super().__init__(
            Code.FAILED_PRECONDITION, f"request {request_id!r} is already being read by engine {reader!r}"
        )
        self.reader = reader
        self.sidecars = sidecars


class PublishedStore:
    def __init__(
        self,
        on_consumed: EventSink,
        on_expired: Callable[[Published], None],
        clock: Callable[[], float] = time.monotonic,
        on_ended: Callable[[str, str, str], None] | None = None,
        on_dropped: Callable[[str, str], None] | None = None,
        on_taken_over: Callable[[str, str, str], None] | None = None,
    ) -> None:
        """on_ended(engine_id, request_id, why): a request ended otherwise than consumed; on_dropped:
        a request's record is gone, however it ended; on_taken_over(engine_id, request_id, reader):
        another engine took the request over from `reader`, whose read had failed (all called under
        this store's lock: they must not call back into the store)."""
        self._lock = threading.Lock()
        self._items: dict[tuple[str, str], Published] = {}
        self._ended: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._on_consumed = on_consumed
        self._on_expired = on_expired
        self._on_ended = on_ended
        self._on_dropped = on_dropped
        self._on_taken_over = on_taken_over
        self._clock = clock

    def __len__(self) -> int:
        return len(self._items)

    def publish(
        self,
        engine_id: str,
        request_id: str,
        block_ids: list[int],
        num_tokens: int,
        lease_s: float,
        ranks: list[int] | None = None,
        first_token: int = 0,
        block_size: int = 1,
        generations: Mapping[int, int] | None = None,
    ) -> Published:
        """`block_ids` hold tokens [first_token, num_tokens) at `block_size` (checked by the caller:
        plan.blocks.check_published). `generations`: the engine's ranks registered here, each's
        registration (EngineRegistry.generations), the only ones a read may take the request's bytes from."""
        key = (engine_id, request_id)
        with self._lock:
            if key in self._items:
                raise SidecarError(
                    Code.ALREADY_EXISTS,
                    f"request {request_id!r} of engine {engine_id!r} is already published",
                )
            item = Published(
                engine_id,
                request_id,
                list(block_ids),
                num_tokens,
                lease_s,
                self._clock() + lease_s,
                ranks=ranks,
                first_token=first_token,
                source_blocks=source_block_list(block_ids, first_token, block_size),
                generations=dict(generations or {}),
            )
            self._items[key] = item
            self._ended.pop(key, None)
        return item

    def _end(self, key: tuple[str, str], why: str) -> None:
        self._items.pop(key, None)
        if self._on_dropped is not None:
            self._on_dropped(*key)
        if why != "consumed" and self._on_ended is not None:
            self._on_ended(key[0], key[1], why)
        self._ended[key] = why
        self._ended.move_to_end(key)
        while len(self._ended) > _TOMBSTONES:
            self._ended.popitem(last=False)

    def ended_since(self, engine_id: str, request_id: str, item: Published) -> str | None:
        """Why the request `item` was ended (released, aborted, ...) once it was taken; None if it is
        still the live record."""
        key = (engine_id, request_id)
        with self._lock:
            if self._items.get(key) is item:
                return None
            return self._ended.get(key, "ended")

    def get_live(self, engine_id: str, request_id: str) -> Published:
        key = (engine_id, request_id)
        item = self._items.get(key)
        if item is not None and item.deadline > self._clock():
            return item
        why = self._ended.get(key)
        if item is not None or why == "expired":
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"the lease of request {request_id!r} of engine {engine_id!r} has expired; "
                f"its blocks may have been reused, so it cannot be read",
            )
        if why:
            raise SidecarError(
                Code.NOT_FOUND, f"request {request_id!r} of engine {engine_id!r} was already {why}"
            )
        raise SidecarError(
            Code.NOT_FOUND, f"request {request_id!r} was never published by engine {engine_id!r}"
        )

    def open_read(
        self,
        engine_id: str,
        request_id: str,
        reader: str,
        plan: PairPlan,
        ranks: list[int],
        min_hold_s: float,
        reader_sidecar: str = "",
        reader_at: ReaderSidecar | None = None,
        sources: Mapping[int, int] | None = None,
    ) -> Published:
        """Start (part of) a read: fix the reader, and hold the lease while it runs. `reader_sidecar`
        opens it for the reader, answering and calling from `reader_at`. `sources`: the prefill ranks
        the read takes bytes from here, each's registration now (Published.check_sources, before
        anything changes). Another engine takes a
        request over from a reader whose read ended here (`read_failed`, `reader_gone`) before any of
        its "consumed" events fired: a decode instance that died mid-pull leaves the request to the one
        its router retries it on, not lost until its lease runs out. Else raises ReadByAnother."""
        o = ReadOpen(request_id, reader, ranks, reader_sidecar, reader_at or ReaderSidecar("", ""))
        with self._lock:
            return self._open_locked(engine_id, o, plan, min_hold_s, sources)

    def open_reads(
        self,
        engine_id: str,
        opens: Sequence[ReadOpen],
        plan: PairPlan,
        min_hold_s: float,
        sources: Mapping[int, int],
    ) -> list[tuple[Published, list[int]] | SidecarError]:
        """`open_read` for several requests of one engine (a staged Push of several requests), then
        `readers_here` of each, under one hold of the lock: each one's record and the reader ranks that
        owe this sidecar a completion for it, or what refused it (the others open all the same)."""
        out: list[tuple[Published, list[int]] | SidecarError] = []
        with self._lock:
            for o in opens:
                try:
                    item = self._open_locked(engine_id, o, plan, min_hold_s, sources)
                except SidecarError as e:
                    out.append(e)
                    continue
                out.append((item, self._owed(item, o.ranks)))
        return out

    def _open_locked(
        self,
        engine_id: str,
        o: ReadOpen,
        plan: PairPlan,
        min_hold_s: float,
        sources: Mapping[int, int] | None,
    ) -> Published:
        """`open_read`, with the lock held."""
        request_id, reader, ranks, reader_sidecar = o.request_id, o.reader, o.ranks, o.sidecar_id
        item = self.get_live(engine_id, request_id)
        item.check_sources(sources or {})
        taken_from = None
        if item.reader is not None and item.reader != reader:
            if not (item.reader_failed and not item.consumed_any):
                raise ReadByAnother(request_id, item.reader, dict(item.reader_sidecars))
            taken_from, why, item.reader = item.reader, item.reader_failed, None
        if item.reader is None:
            item.reader = reader
            item.reader_sidecars = {}
            held = range(plan.prefill.tp_size) if item.ranks is None else item.ranks
            item.pending = {p: set(plan.consumers_of(p)) for p in held}
        item.reader_failed = ""  # it reads (again)
        if reader_sidecar:
            item.reader_sidecars[reader_sidecar] = o.at
        for r in ranks:
            if not 0 <= r < plan.decode.tp_size:
                raise SidecarError(Code.INVALID_ARGUMENT, f"reader rank {r} out of range")
        item.deadline = max(item.deadline, self._clock() + min_hold_s)
        if taken_from is not None:
            log.warning(
                "request %s of engine %s: engine %s takes it over from engine %s, %s",
                request_id, engine_id, reader, taken_from, why,
            )  # fmt: skip
            if self._on_taken_over is not None:
                self._on_taken_over(engine_id, request_id, taken_from)
        return item

    def readers_here(self, item: Published, reader_ranks: list[int]) -> list[int]:
        """The reader ranks that still owe this sidecar a completion notification for `item`: those
        that read or notify a prefill rank tracked here (a multi-node engine's holders are each opened
        with all of the reader's ranks, and a served read waiting for the others would never end), less
        those that sent theirs already (an open of such a rank is a late copy: its notification and its
        call both came, the call after its read was done)."""
        with self._lock:  # `pending` changes as notifications come
            return self._owed(item, reader_ranks)

    @staticmethod
    def _owed(item: Published, reader_ranks: list[int]) -> list[int]:
        """`readers_here`, with the lock held."""
        owed = {d for waiting in item.pending.values() for d in waiting}
        return [r for r in reader_ranks if r in owed]

    def read_failed(self, engine_id: str, request_id: str, reader: str) -> None:
        """`reader`'s read of the request failed here and nothing of it runs any more: another engine
        may take the request over (`open_read`); `reader` itself may still open it again."""
        with self._lock:
            item = self._items.get((engine_id, request_id))
            if item is not None and item.reader == reader:
                item.reader_failed = "whose read failed"

    def reader_gone(
        self, engine_id: str, request_id: str, reader: str, sidecars: dict[str, ReaderSidecar], why: str
    ) -> None:
        """Every one of `sidecars`, `reader`'s sidecars as a ReadByAnother named them, is proven gone
        (`why`): nothing of its read runs any more. Nothing changes where the reader or its sidecars
        changed since (it opened again meanwhile, from a sidecar that runs)."""
        with self._lock:
            item = self._items.get((engine_id, request_id))
            if item is not None and item.reader == reader and item.reader_sidecars == sidecars:
                item.reader_failed = why

    def mark_done(
        self, engine_id: str, request_id: str, reader: str, decode_rank: int, prefill_ranks: list[int]
    ) -> None:
        """Decode rank finished with these prefill ranks; fire "consumed" where complete."""
        fired: list[int] = []
        with self._lock:
            item = self._items.get((engine_id, request_id))
            if item is None or item.reader != reader:
                return  # aborted, expired, or a stale notification
            for p in prefill_ranks:
                waiting = item.pending.get(p)
                if waiting is None or decode_rank not in waiting:
                    continue
                waiting.discard(decode_rank)
                if not waiting:
                    fired.append(p)
                    item.consumed_any = True
            if item.pending and all(not w for w in item.pending.values()):
                self._end((engine_id, request_id), "consumed")
        for p in fired:
            self._on_consumed(engine_id, p, item)

    def keep_alive(self, engine_id: str, request_id: str) -> int:
        with self._lock:
            item = self._items.get((engine_id, request_id))
            if item is None or item.deadline <= self._clock():
                return 0
            item.deadline = max(item.deadline, self._clock() + item.lease_s)
            return item.deadline_unix_ms()

    def abort(self, engine_id: str, request_id: str) -> bool:
        with self._lock:
            if (engine_id, request_id) not in self._items:
                return False
            self._end((engine_id, request_id), "aborted")
            return True

    def release(self, engine_id: str, request_id: str, reader: str, why: str) -> Published | None:
        """The reader gave the request up for good: end it now. None if unknown or read by another."""
        key = (engine_id, request_id)
        with self._lock:
            item = self._items.get(key)
            if item is None or item.reader not in (None, reader):
                return None
            self._end(key, f"released ({why})")
            return item

    def drop_engine(self, engine_id: str) -> int:
        with self._lock:
            keys = [k for k in self._items if k[0] == engine_id]
            for k in keys:
                self._end(k, "released (the engine unregistered)")
        return len(keys)

    def expire(self) -> int:
        """End every request whose lease ran out; returns how many."""
        now = self._clock()
        with self._lock:
            expired = [item for item in self._items.values() if item.deadline <= now]
            for item in expired:
                self._end((item.engine_id, item.request_id), "expired")
        for item in expired:
            log.info("lease of request %s (engine %s) expired", item.request_id, item.engine_id)
            self._on_expired(item)
        return len(expired)
