"""The source side of a read: open a published request for one reader.

OpenRead does this, as a gRPC call or as a NIXL notification (server/notified_opens.py),
and so does a staged Push that carries the open (which saves the pull a round
trip). Either way the request is fixed to one reader engine, its lease is held
for at least a pull's length, and a served read is tracked until every reader
rank that depends on a rank held here has sent its completion notification.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from kv_sidecar.dataplane.jobs import PeerRead, RankKey
from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.metrics import Metrics
from kv_sidecar.plan.pair import PairPlan
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.server.engines import EngineRegistry, RankEntry, generations, spec_from_proto
from kv_sidecar.server.gone_readers import GoneReaders, ReaderSidecar, Seen
from kv_sidecar.server.peers import cached_plan
from kv_sidecar.server.published import Published, PublishedStore, ReadByAnother, ReadOpen
from kv_sidecar.server.transfers import TransferTracker
from kv_sidecar.transport.nixl_driver import NixlDriver
from kv_sidecar.transport.notifications import parse_done_batch, parse_done_notification
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2

log = logging.getLogger(__name__)


class ReadPlans:
    """The (source, reader) plans agreed in handshakes here, by hash: what an open names."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plans: dict[str, PairPlan] = {}

    def add(self, plan: PairPlan) -> None:
        with self._lock:
            self._plans[plan.hash()] = plan

    def resolve(self, request: peer_pb2.OpenReadRequest, spec_of: Callable[[str], EngineSpec]) -> PairPlan:
        with self._lock:
            plan = self._plans.get(request.plan_hash)
        if plan is None and request.HasField("reader_spec"):
            # A member of a multi-node engine: the reader handshook with the leader, not with us.
            plan = cached_plan(spec_of(request.engine_id), spec_from_proto(request.reader_spec))
            if plan.hash() != request.plan_hash:
                raise SidecarError(
                    Code.FAILED_PRECONDITION,
                    f"plan mismatch: ours {plan.hash()}, the reader's {request.plan_hash} "
                    f"(different kv-sidecar versions, or engine {request.engine_id!r} changed; handshake again)",
                )
        if plan is None:
            raise SidecarError(
                Code.FAILED_PRECONDITION, f"unknown plan {request.plan_hash!r}: handshake before reading"
            )
        return plan


def begin_serve(
    published: PublishedStore,
    transfers: TransferTracker,
    item: Published,
    reader: str,
    peer: str,
    served: list[int],
    nbytes: int,
    path: str,
) -> None:
    """Track the read of `item` just opened for these reader ranks. A request that ended between its
    open and here (a reader's release racing its own late open, on a source that was slow) ends the
    serve as that end ended the others: it would otherwise wait for a done notification that never
    comes, until it timed out."""
    transfers.begin_serve(item.engine_id, item.request_id, reader, peer, served, nbytes, path)
    why = published.ended_since(item.engine_id, item.request_id, item)
    if why is not None:
        transfers.end_serves(item.engine_id, item.request_id, why)


class ProbeFirst(SidecarError):
    """An open that only a probe of the reader's sidecars could decide, on a thread that must not wait
    for one: the OpenRead call that the reader makes when no answer came decides it."""


def prove_reader_gone(
    gone: GoneReaders,
    published: PublishedStore,
    engine_id: str,
    request_id: str,
    refused: ReadByAnother,
    probe: bool = True,
) -> None:
    """A request read by another engine (`refused`): marks that reader gone where its sidecars are proven
    so, after which an open takes the request over; else raises the refusal, saying what was seen
    (ProbeFirst where `probe` is False and nothing is known yet). For every open of a request published
    here: a reader's OpenRead, and a spread engine's own record (server/own_ranks.py)."""
    probed = gone.verdict(refused.sidecars, probe)
    if probed is None:
        raise ProbeFirst(refused.code, refused.message)
    if probed.seen is not Seen.GONE:
        raise SidecarError(refused.code, f"{refused.message} ({probed.detail})")
    published.reader_gone(engine_id, request_id, refused.reader, refused.sidecars, probed.detail)


class PeerPins(Protocol):
    """The data plane keeps host ranks mapped while a peer may READ them by address (DataPlane)."""

    def pin_for_peer(
        self, keys: Sequence[RankKey], read: PeerRead, reader_ranks: Sequence[int], until: float
    ) -> list[int]: ...

    def peer_read_done(self, read: PeerRead, reader_ranks: Sequence[int] = ()) -> None: ...


class SourceReads:
    """Opens of requests published here, for their readers (OpenRead, its notification, a staged Push)."""

    def __init__(
        self,
        engines: EngineRegistry,
        published: PublishedStore,
        transfers: TransferTracker,
        nixl: NixlDriver,
        plans: ReadPlans,
        pull_timeout_s: float,
        metrics: Metrics,
        gone: GoneReaders,
        pins: PeerPins,
    ) -> None:
        self._pins = pins
        self._gone = gone
        self._engines = engines
        self._published = published
        self._transfers = transfers
        self._nixl = nixl
        self.plans = plans
        self._pull_timeout_s = pull_timeout_s
        self._metrics = metrics

    def open_read(
        self, request: peer_pb2.OpenReadRequest, peer: str, probe: bool = True
    ) -> peer_pb2.OpenReadResponse:
        """OpenRead, however it came: the plan it names, the open, and what the reader is told. A request
        that another engine reads is taken over where that reader's sidecars are proven gone
        (server/gone_readers.py); probe False (the NIXL thread, which must not wait for a peer): only
        where that is known already, else ProbeFirst."""
        plan = self.plans.resolve(request, self._engines.spec)
        path = "host-nixl" if plan.is_identity() else "host-nixl-staged"
        try:
            item = self.open_for_reader(request, plan, peer, path)
        except ReadByAnother as e:
            prove_reader_gone(self._gone, self._published, request.engine_id, request.request_id, e, probe)
            item = self.open_for_reader(request, plan, peer, path)
        return peer_pb2.OpenReadResponse(
            block_ids=item.block_ids,
            num_tokens=item.num_tokens,
            lease_deadline_unix_ms=item.deadline_unix_ms(),
            first_token=item.first_token,
            generations=item.generations,  # as open_read found them registered here now
        )

    def open_for_reader(
        self, request: peer_pb2.OpenReadRequest, plan: PairPlan, peer: str, path: str
    ) -> Published:
        """An OpenRead, after which the reader READs: `plan`, the (source, reader) plan named by
        request.plan_hash, already resolved by the caller. The opens a staged Push carries, after which
        this sidecar WRITEs, go through `open_pushed`."""
        ranks, held = self._registered(request.engine_id, plan)
        item = self._published.open_read(
            request.engine_id,
            request.request_id,
            request.reader_engine_id,
            plan,
            list(request.reader_ranks),
            self._pull_timeout_s,
            request.sidecar_id,
            ReaderSidecar(request.reader_address, peer),
            # Every rank of the engine here: the reader takes from this sidecar the ranks its map puts
            # here, which are those registered here now.
            held,
        )
        served = self._published.readers_here(item, list(request.reader_ranks))
        if served:
            self._pin(request, ranks, held, served, item)
            self._serve(item, request.reader_engine_id, peer, served, plan, path)
        self._nixl.wake()  # its READs complete only once our NIXL worker answers their flush
        return item

    def open_pushed(
        self, opens: Sequence[peer_pb2.OpenReadRequest], plan: PairPlan, peer: str, path: str
    ) -> list[Published | SidecarError]:
        """The opens that a staged Push carries (one, or its members'), all of its engine and reader
        (checked by the caller), opened as `open_for_reader` opens one, less what a READ needs (this
        sidecar WRITEs): the engine's ranks looked up once and the records opened under one hold of the
        store's lock, not one of each per request (~45 us a request on a GPU source, 16 of them before
        a batch's first gather). Each open's record, or what refused it."""
        if not opens:
            return []
        engine_id = opens[0].engine_id
        try:
            _, held = self._registered(engine_id, plan)
        except SidecarError as e:
            return [e] * len(opens)
        opened = self._published.open_reads(
            engine_id,
            [
                ReadOpen(
                    o.request_id,
                    o.reader_engine_id,
                    list(o.reader_ranks),
                    o.sidecar_id,
                    ReaderSidecar(o.reader_address, peer),
                )
                for o in opens
            ],
            plan,
            self._pull_timeout_s,
            held,
        )
        out: list[Published | SidecarError] = []
        for o, got in zip(opens, opened, strict=True):
            if isinstance(got, SidecarError):
                out.append(got)
                continue
            item, served = got
            if served:
                self._serve(item, o.reader_engine_id, peer, served, plan, path)
            out.append(item)
        return out

    def _registered(self, engine_id: str, plan: PairPlan) -> tuple[list[RankEntry], dict[int, int]]:
        """The engine's ranks here and their registrations, in one look; FAILED_PRECONDITION where its
        spec is no longer the one `plan` was made for."""
        ranks = self._engines.engine_ranks(engine_id)
        if ranks[0].spec != plan.prefill:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"engine {engine_id!r} changed since the handshake; handshake again",
            )
        return ranks, generations(ranks)

    def _serve(
        self, item: Published, reader: str, peer: str, served: list[int], plan: PairPlan, path: str
    ) -> None:
        begin_serve(
            self._published,
            self._transfers,
            item,
            reader,
            peer,
            served,
            opened_bytes(plan, served, len(item.block_ids)),
            path,
        )

    def _pin(
        self,
        request: peer_pb2.OpenReadRequest,
        ranks: list[RankEntry],
        held: dict[int, int],
        served: list[int],
        item: Published,
    ) -> None:
        """The reader READs the ranks' memory by the addresses of its handshake once it has the answer:
        keep that memory mapped until it is done, even if the engine leaves meanwhile (a new
        registration could map other pages there). Then make sure the pinned memory is the
        registration the answer names (`held`, the ranks' registrations the open checked): one that
        changed between the look-up and the pin is refused."""
        host = [e.key for e in ranks if not e.on_gpu]
        if not host:
            return  # peers never READ GPU ranks (they go through the staged rings)
        read = (request.engine_id, request.request_id, request.reader_engine_id)
        added = self._pins.pin_for_peer(host, read, served, item.deadline)
        try:
            now = generations(self._engines.engine_ranks(request.engine_id))
            if now != held:
                item.check_sources(now)  # the precise NOT_FOUND where the request's own rank changed
                raise SidecarError(
                    Code.UNAVAILABLE,
                    f"engine {request.engine_id!r} registered a rank while request "
                    f"{request.request_id!r} was opened; open it again",
                )
        except BaseException:
            if added:  # an earlier open of the same read keeps its own pin
                self._pins.peer_read_done(read, added)
            raise

    def closed(self, request: peer_pb2.CloseReadRequest) -> None:
        """The reader ranks of a CloseRead (all, if none named) READ nothing more of the request."""
        read = (request.engine_id, request.request_id, request.reader_engine_id)
        self._pins.peer_read_done(read, list(request.reader_ranks))

    def reader_done(self, agent: str, msg: bytes) -> None:
        """A decode rank's done notification (NIXL thread): it has read these ranks of a request."""
        parsed = parse_done_notification(msg)
        if parsed is not None:
            self._metrics.done_notifications.labels("one").inc()
        self._done(agent, parsed)

    def readers_done(self, agent: str, msg: bytes) -> None:
        """Done notifications of several requests in one (NIXL thread): a PullBatch's members that ended
        together. A malformed one is counted and skipped; the others count."""
        self._metrics.done_notifications.labels("joined").inc()
        for parsed in parse_done_batch(msg) or [None]:
            self._done(agent, parsed)

    def _done(self, agent: str, parsed: tuple[str, str, str, int, list[int]] | None) -> None:
        """One done notification's effect; a malformed one (None) is logged and counted."""
        if parsed is None:
            log.warning("ignoring a malformed done notification from %s", agent)
            self._metrics.failures.labels("bad_notification").inc()
            return
        engine_id, request_id, reader, decode_rank, prefill_ranks = parsed
        self._published.mark_done(engine_id, request_id, reader, decode_rank, prefill_ranks)
        self._transfers.serve_rank_done(engine_id, request_id, reader, decode_rank)
        self._pins.peer_read_done((engine_id, request_id, reader), [decode_rank])


def opened_bytes(plan: PairPlan, reader_ranks: Sequence[int], num_blocks: int) -> int:
    """Bytes of the source blocks the reader ranks may read: whole blocks of every prefill rank they read."""
    block_bytes = plan.prefill.rank_bytes() // plan.prefill.num_blocks
    reads = sum(len(plan.decode_ranks[r].reads) for r in reader_ranks if 0 <= r < len(plan.decode_ranks))
    return reads * num_blocks * block_bytes
