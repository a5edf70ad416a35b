"""Links to peer sidecars: one PeerClient each (server/peer_calls.py), and handshakes cached per engine pair."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from kv_sidecar import PROTOCOL_VERSION
from kv_sidecar.dataplane.jobs import RemoteRank
from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.metrics import Metrics
from kv_sidecar.plan.chunks import ChunkGeometry, chunk_geometry
from kv_sidecar.plan.pair import PairPlan, plan_pair
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.server.engines import spec_from_proto, spec_to_proto
from kv_sidecar.server.inflight import Stop
from kv_sidecar.server.peer_calls import STOP_POLL_S, Connect, PeerCallError, PeerClient, stoppable
from kv_sidecar.server.push_runs import READERS_S
from kv_sidecar.transport.nixl_driver import NixlDriver
from kv_sidecar_client._proto.kvsidecar.v1 import common_pb2, peer_pb2

log = logging.getLogger(__name__)


@lru_cache(maxsize=1024)
def cached_plan(prefill: EngineSpec, decode: EngineSpec) -> PairPlan:
    """Plans are pure functions of the two specs: compute each pairing once."""
    return plan_pair(prefill, decode)


@dataclass(frozen=True)
class Holder:
    """The sidecar that holds a source rank: OpenRead/CloseRead go to `address`, READs and notifications to `agent_name`."""

    sidecar_id: str
    address: str
    agent_name: str
    agent_metadata: bytes = field(default=b"", repr=False)
    # It takes PushRequest.reader_worker_agent and source_in_worker (the leader's handshake says so of
    # the leader, a member's report of the member: members may run another version).
    staged_workers: bool = False


@dataclass
class RemoteEngine:
    """What a handshake taught us about one engine behind a peer (leader) sidecar."""

    sidecar_id: str
    agent_name: str
    engine_id: str
    spec: EngineSpec
    plan: PairPlan
    geometry: ChunkGeometry
    regions: dict[int, list[int]]  # prefill rank -> region base addresses
    memory_kind: str
    # prefill rank -> its sidecar; the leader for every rank of a one-node engine
    holders: dict[int, Holder] = field(default_factory=dict)
    # The fields every OpenRead of this engine pair shares, and the reader's spec that those sent as
    # calls or notifications carry (server/routing.py: Opener.request).
    open_template: peer_pb2.OpenReadRequest | None = None
    open_spec: common_pb2.EngineSpec | None = None
    # The peer takes Pushes of several requests (PushRequest.members; server/staged_reader.py); v2: also
    # members that start past token 0 (PushMember.start_token), and decode blocks a multiple of its own.
    push_members: bool = False
    push_members_v2: bool = False
    # The peer takes PushRequest.reader_worker_agent and source_in_worker; and for its ranks whose
    # staged transfers run in a worker (staged_workers), that worker's agent and metadata.
    staged_workers: bool = False
    workers: dict[int, tuple[str, bytes]] = field(default_factory=dict)
    # The peer takes done notifications of several requests in one (to its own agent: DONES_TAG).
    done_batches: bool = False
    agent_metadata: bytes = field(default=b"", repr=False)
    # The version of the leader's rank->sidecar map this handshake holds (HandshakeResponse.map_version).
    map_version: int = 0
    # prefill rank -> which registration of it `regions` are (RankMemory.generation; 0: not said).
    generations: dict[int, int] = field(default_factory=dict)

    def agent_of(self, rank: int) -> str:
        holder = self.holders.get(rank)
        return holder.agent_name if holder is not None else self.agent_name

    def sender_of(self, rank: int) -> tuple[str, bytes, bool]:
        """Where a staged transfer out of `rank` comes from: the agent, its metadata, and whether it
        is the rank's worker (else its sidecar's own agent)."""
        worker = self.workers.get(rank)
        if worker is not None:
            return worker[0], worker[1], True
        holder = self.holders.get(rank)
        if holder is not None:
            return holder.agent_name, holder.agent_metadata or self.agent_metadata, False
        return self.agent_name, self.agent_metadata, False

    def remote_rank(self, rank: int) -> RemoteRank:
        """A source rank as the data plane reads it; FAILED_PRECONDITION if the peer does not hold it."""
        bases = self.regions.get(rank)
        if bases is None:
            raise SidecarError(
                Code.FAILED_PRECONDITION, f"peer does not hold rank {rank} of engine {self.engine_id!r}"
            )
        return RemoteRank(self.agent_of(rank), self.engine_id, rank, self.spec, tuple(bases))

    def complete(self) -> bool:
        """Every rank has a known holder (a multi-node engine may still be registering)."""
        return set(range(self.spec.tp_size)) <= set(self.regions)


# Opens in a row whose call answered before their notification that make a link open by call only
# (server/notified_opens.py), and for how long.
MISSES_TO_BACK_OFF = 3
BACKOFF_S = 30.0


class PeerLink:
    def __init__(self, address: str, client: PeerClient) -> None:
        self.address = address
        self.client = client
        self.engines: dict[tuple[str, str], RemoteEngine] = {}
        self.lock = threading.Lock()
        # What our staged Push notifications to this peer are signed with (from its handshake or its
        # last Push answer; empty: send the Push by gRPC only).
        self.push_key = b""
        # A staged transfer from this peer has completed: the NIXL connections both ways are set up.
        # Until then Pushes go by call only: a first Push by notification makes the two sidecars set up
        # their connections to each other at once (our notification, the source's first WRITE), and
        # that WRITE then hung until the pull's deadline in 2 of ~8 runs of tests/e2e/test_staged_ring.py.
        self.wired = False
        # A pull from this peer has completed (our NIXL connection to it is set up): opens may go as
        # notifications (server/notified_opens.py), from `notified_opens_from` on (monotonic time).
        self.reads_done = False
        self.notified_opens_from = 0.0
        self.open_misses = 0  # opens in a row whose call answered before their notification
        # When the peer last heard from us as a reader (a handshake, a pull's open or Push; monotonic).
        self.last_read = float("-inf")
        # What our notified Pushes to this peer lately took, notification to last byte (s, a moving
        # average): when their calls go (server/staged_reader.py, call_after_s).
        self.notified_push_s = 0.0

    def read_lately(self) -> bool:
        """Whether the peer still gets ready for our notifications: for READERS_S after it last heard
        from a reader it polls for them at the serving rate once a request is published. Past that it
        polls every 50 ms, and a notification would wait 2 ms (open) or 5 ms (Push) for nothing before
        the call went; the call then goes at once. 10 s short of READERS_S: this clock starts later."""
        return time.monotonic() - self.last_read < READERS_S - 10.0

    # -- what happened on this link (the only writers of its flags) -----------------------------------
    def handshaken(self, push_key: bytes) -> None:
        """A handshake answered: a restarted peer's new key (empty: it wants Pushes by gRPC only)."""
        self.push_key = push_key
        self.last_read = time.monotonic()

    def learn_push_key(self, push_key: bytes) -> None:
        """A Push answer's key (a restarted source gives a new one; empty: it wants none)."""
        self.push_key = push_key

    def read_completed(self) -> None:
        """A pull from this peer completed: our NIXL connection to it is set up."""
        self.reads_done = True
        self.last_read = time.monotonic()

    def staged_read_completed(self) -> None:
        """A staged transfer from this peer completed: the NIXL connections both ways are set up."""
        self.wired = True
        self.last_read = time.monotonic()

    def notified_push_done(self, elapsed_s: float) -> None:
        """A notified Push's transfer completed after elapsed_s. A moving average over ~8 transfers:
        it follows load within a few pulls and forgets one slow transfer as fast."""
        self.notified_push_s += 0.125 * (elapsed_s - self.notified_push_s)

    def open_answered_by_notification(self) -> None:
        self.open_misses = 0

    def open_missed(self) -> bool:
        """An open's call answered before its notification. True when that happened
        MISSES_TO_BACK_OFF times in a row: opens then go by call only for BACKOFF_S."""
        self.open_misses += 1
        if self.open_misses < MISSES_TO_BACK_OFF:
            return False
        self.open_misses = 0
        self.notified_opens_from = time.monotonic() + BACKOFF_S
        return True

    # -- what the link allows -------------------------------------------------------------------------
    def push_key_for_push(self) -> bytes:
        """The key to sign a Push notification with; empty (push by call) until the link is wired, or
        for a source that no longer expects us (it would see the notification only 50 ms on)."""
        return self.push_key if self.wired and self.read_lately() else b""

    def push_key_for_open(self) -> bytes:
        """The key to sign an open notification with; empty (open by call) before a pull from this peer
        completed, for a source that no longer expects us, and while opens back off."""
        if not self.reads_done or not self.read_lately() or time.monotonic() < self.notified_opens_from:
            return b""
        return self.push_key


class Peers:
    """Our links to peer sidecars, dialled on first use, and the handshakes with their engines."""

    def __init__(self, sidecar_id: str, nixl: NixlDriver, metrics: Metrics, connect: Connect) -> None:
        self._sidecar_id = sidecar_id
        self._nixl = nixl
        self._metrics = metrics
        self._connect = connect
        self._links: dict[str, PeerLink] = {}
        self._lock = threading.Lock()
        self._closed = False

    def link(self, address: str) -> PeerLink:
        with self._lock:
            link = self._links.get(address)
            if link is None:
                link = PeerLink(address, self._connect(address))
                self._links[address] = link
            return link

    def known_engine(
        self, address: str, engine_id: str, reader_engine: str, sidecar_id: str = "", map_version: int = 0
    ) -> RemoteEngine | None:
        """The cached handshake with the peer's engine, if any (a pull from it need not wait for one).
        `sidecar_id`: the sidecar that published what is pulled (its params say); a handshake made with
        another sidecar at that address is stale (the peer restarted: its agent, memory and plans are
        another process's), and dropped. `map_version`: the multi-node engine's map version it was
        published under; a handshake with an older map is stale too (a rank moved to another sidecar)."""
        link = self._links.get(address)  # a dict read: no lock, no link made
        known = None if link is None else link.engines.get((engine_id, reader_engine))
        if known is not None and sidecar_id and known.sidecar_id != sidecar_id:
            log.info(
                "peer sidecar %s is %s now, not %s: handshaking with it again",
                address, sidecar_id, known.sidecar_id,
            )  # fmt: skip
            self.forget_engine(address, engine_id, reader_engine)
            return None
        if known is not None and map_version > known.map_version:
            log.info(
                "engine %s's rank->sidecar map at %s changed (version %d, ours %d): handshaking with it again",
                engine_id, address, map_version, known.map_version,
            )  # fmt: skip
            self.forget_engine(address, engine_id, reader_engine)
            return None
        return known

    def remote_engine(
        self,
        address: str,
        engine_id: str,
        reader_engine: str,
        reader_spec: EngineSpec,
        timeout_s: float,
        stop: Stop,
        on_stop: Callable[[], Exception],
        publisher: str = "",
    ) -> tuple[PeerLink, RemoteEngine]:
        """The plan with a peer's engine, from the cache or a handshake; a pull that is stopped meanwhile
        raises on_stop() at once (it may be waiting behind another pull's handshake to a hung peer).
        `timeout_s`: what remains of the pull's deadline (a handshake that outlasts it: DEADLINE_EXCEEDED).
        `publisher`: the sidecar that published what is pulled, where known (its params say): one that
        another sidecar replaced at `address` took the request with it (NOT_FOUND, saying so)."""
        if self._closed:  # a pull still running at shutdown must not dial anew (and hang the exit)
            raise SidecarError(Code.UNAVAILABLE, f"this sidecar is shutting down; not calling {address}")
        link = self.link(address)
        key = (engine_id, reader_engine)
        while not link.lock.acquire(timeout=STOP_POLL_S):
            if stop.is_set():
                raise on_stop()
        try:
            known = link.engines.get(key)
            if known is not None and known.plan.decode == reader_spec:
                return link, known
            remote = self._handshake(
                link, engine_id, reader_engine, reader_spec, timeout_s, stop, on_stop, publisher
            )
            if remote.complete():  # else ask again next time: more ranks may have registered
                link.engines[key] = remote
            return link, remote
        finally:
            link.lock.release()

    def _handshake(
        self,
        link: PeerLink,
        engine_id: str,
        reader_engine: str,
        reader_spec: EngineSpec,
        timeout_s: float,
        stop: Stop,
        on_stop: Callable[[], Exception],
        publisher: str = "",
    ) -> RemoteEngine:
        me, nixl, metrics = self._sidecar_id, self._nixl, self._metrics
        start = time.perf_counter()
        req = peer_pb2.HandshakeRequest(
            protocol_version=PROTOCOL_VERSION,
            sidecar_id=me,
            agent_name=me,
            agent_metadata=nixl.metadata(),
            engine_id=engine_id,
            reader_engine_id=reader_engine,
            reader_spec=spec_to_proto(reader_spec),
        )
        try:
            resp = stoppable(link.client.handshake(req, timeout_s), stop, on_stop)
        except PeerCallError as e:
            metrics.handshakes.labels("error").inc()
            raise e.explain(link.address, "the handshake", caller_deadline=True) from None
        if publisher and resp.sidecar_id != publisher:  # before the next check: it may be this sidecar
            metrics.handshakes.labels("error").inc()
            raise SidecarError(
                Code.NOT_FOUND,
                f"the request was published by sidecar {publisher}, but {link.address} is sidecar "
                f"{resp.sidecar_id}{' (this one)' if resp.sidecar_id == me else ''} now: the other restarted "
                f"or moved, and the request is gone with it; prefill it again",
            )
        itself = resp.sidecar_id == me
        if itself and publisher != me:  # never NIXL-read from our own agent
            metrics.handshakes.labels("error").inc()
            raise SidecarError(
                Code.INVALID_ARGUMENT,
                f"{link.address} is this sidecar itself; params of a request published here must carry "
                f"its sidecar_id {me!r}",
            )
        if resp.protocol_version != PROTOCOL_VERSION:
            metrics.handshakes.labels("error").inc()
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"peer {link.address} speaks protocol {resp.protocol_version}, this sidecar {PROTOCOL_VERSION}",
            )
        spec = spec_from_proto(resp.spec)
        plan = cached_plan(spec, reader_spec)
        if plan.hash() != resp.plan_hash:
            metrics.handshakes.labels("error").inc()
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"plan mismatch with peer {link.address}: ours {plan.hash()}, theirs {resp.plan_hash} "
                f"(different kv-sidecar versions?)",
            )
        # This sidecar leads an engine spread over it and others, and reads the others' ranks (its own
        # it copies: own_ranks.py): its own agent is never loaded as a peer's.
        agent = resp.agent_name if itself else nixl.add_remote(resp.agent_metadata, resp.agent_name)
        link.handshaken(resp.push_key)
        remote = RemoteEngine(
            sidecar_id=resp.sidecar_id,
            agent_name=agent,
            engine_id=engine_id,
            spec=spec,
            plan=plan,
            geometry=chunk_geometry(spec),
            regions={r.rank: [g.address for g in r.regions] for r in resp.ranks},
            memory_kind=resp.ranks[0].memory_kind if resp.ranks else "DRAM",
            push_members=resp.push_members,
            push_members_v2=resp.push_members_v2,
            staged_workers=resp.staged_workers,
            done_batches=resp.done_batches,
            workers={r.rank: (r.worker_agent, r.worker_agent_metadata) for r in resp.ranks if r.worker_agent},
            agent_metadata=resp.agent_metadata,
            map_version=resp.map_version,
            generations={r.rank: r.generation for r in resp.ranks},
        )
        leader = Holder(resp.sidecar_id, link.address, agent, resp.agent_metadata, resp.staged_workers)
        remote.holders = {r.rank: leader for r in resp.ranks}
        for m in resp.members:  # a multi-node engine: the rank->sidecar map (docs/multinode.md)
            # Our own ranks need no NIXL connection; routing refuses to read them over the wire.
            member_agent = m.agent_name if m.sidecar_id == me else nixl.add_remote(m.agent_metadata)
            holder = Holder(m.sidecar_id, m.peer_address, member_agent, m.agent_metadata, m.staged_workers)
            for r in m.ranks:
                remote.holders[r.rank] = holder
                remote.regions[r.rank] = [g.address for g in r.regions]
                remote.generations[r.rank] = r.generation
                if r.worker_agent:
                    remote.workers[r.rank] = (r.worker_agent, r.worker_agent_metadata)
                else:
                    remote.workers.pop(r.rank, None)
        metrics.handshakes.labels("ok").inc()
        metrics.handshake_duration.observe(time.perf_counter() - start)
        log.info(
            "handshake with %s for engine %s: %d ranks on %d sidecars, plan %s",
            link.address,
            engine_id,
            len(remote.regions),
            len({h.sidecar_id for h in remote.holders.values()}),
            plan.hash(),
        )
        return remote

    def forget_engine(self, address: str, engine_id: str, reader_engine: str) -> None:
        """Drop one cached handshake, so that the next pull handshakes again."""
        with self._lock:
            link = self._links.get(address)
        if link is not None:
            with link.lock:
                link.engines.pop((engine_id, reader_engine), None)

    def links(self) -> list[PeerLink]:
        with self._lock:
            return list(self._links.values())

    def forget(self, address: str) -> None:
        """Drop cached handshakes (e.g. after the peer restarted)."""
        with self._lock:
            link = self._links.pop(address, None)
        if link is not None:
            link.client.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.client.close()
