"""Engines whose ranks span several sidecars (multi-node TP): leaders and members.

Every engine has one leader sidecar: the one its ranks register on without a
leader address. Ranks on other nodes register on their own sidecar naming
the leader; that sidecar (a member) reports the ranks it holds, with its NIXL
metadata and memory regions, to the leader, which keeps the rank->sidecar
map and hands it to readers in the handshake. The engine publishes on the
leader only; the leader holds the request on every member too, so each
sidecar keeps the lease for, and tells "consumed"/"expired" to, the ranks it
holds. See docs/multinode.md.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from kv_sidecar import PROTOCOL_VERSION
from kv_sidecar.dataplane.jobs import RankKey
from kv_sidecar.errors import Code, SidecarError, check_id, ranks_text
from kv_sidecar.plan.blocks import check_published
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.server.engines import EngineRegistry, RankEntry, generations, spec_from_proto, spec_to_proto
from kv_sidecar.server.identity import Identity
from kv_sidecar.server.peer_calls import PeerCallError
from kv_sidecar.server.peers import Peers
from kv_sidecar.server.published import Published, PublishedStore
from kv_sidecar.transport.nixl_driver import NixlDriver
from kv_sidecar_client._proto.kvsidecar.v1 import common_pb2, peer_pb2

log = logging.getLogger(__name__)

REPORT_TIMEOUT_S = 10.0  # a rank registration waits this long for its leader
FANOUT_TIMEOUT_S = 5.0  # publish/keep-alive/abort forwarded to members
# Members repeat their report this often: a leader whose engine re-registered (or
# that restarted) forgot its map and gets it back within this time.
REFRESH_S = 2.0
_LEADER_POLL_S = 0.1  # how often a member's first report asks a leader that holds no rank of the engine yet


class _NotLedYet(SidecarError):
    """The leader holds no rank of the engine: its ranks may not have registered yet."""


def rank_memory(entry: RankEntry, worker: tuple[str, bytes] | None = None) -> peer_pb2.RankMemory:
    """What a reader needs to READ one registered rank over NIXL; `worker`: the agent (name, metadata)
    that runs the rank's staged transfers, if not this sidecar's own (staged_workers)."""
    msg = peer_pb2.RankMemory(
        rank=entry.rank,
        memory_kind=entry.memory_kind,
        regions=[peer_pb2.MemoryRegion(address=a, length=n, device_id=d) for a, n, d in entry.regions],
        generation=entry.generation,
    )
    if worker is not None:
        msg.worker_agent, msg.worker_agent_metadata = worker
    return msg


class Membership:
    """Leader side: engine -> member sidecars. Member side: engine -> leader address."""

    def __init__(
        self,
        identity: Identity,
        engines: EngineRegistry,
        published: PublishedStore,
        peers: Peers,
        nixl: NixlDriver,
        lease_ms: int,
        on_published: Callable[[Published, Iterable[RankEntry]], None],
        leader_wait_s: float = 10.0,
        worker_agents: Callable[[RankKey], tuple[str, bytes] | None] = lambda key: None,
        refresh_s: float = REFRESH_S,
    ) -> None:
        """on_published: a request was published here (the leader's, or a member's share); leader_wait_s:
        how long a rank registering as a member waits for its leader to hold a rank of the engine;
        worker_agents: the ready worker agent that runs a rank's staged transfers, if any
        (DataPlane.ready_worker_agent): a member reports it to its leader, which hands it to readers;
        refresh_s: how often a member reports again unasked (member_refresh_ms)."""
        self._leader_wait_s = leader_wait_s
        self._refresh_s = refresh_s
        self._worker_agents = worker_agents
        self._me = identity
        self._engines = engines
        self._published = published
        self._peers = peers
        self._nixl = nixl
        self._lease_ms = lease_ms
        self._on_published = on_published
        self._lock = threading.Lock()
        self._members: dict[str, dict[str, peer_pb2.SidecarRanks]] = {}  # engine -> sidecar id -> ranks
        self._leaders: dict[str, str] = {}  # engine -> leader address, for engines this sidecar follows
        self._report_locks: dict[str, threading.Lock] = {}
        # engine -> the version of its map (members), from one counter that only grows, so that a version
        # is never handed out twice in this process, not even after the map was forgotten and made again.
        self._versions: dict[str, int] = {}
        self._next_version = itertools.count(1)
        self._refresher: threading.Thread | None = None
        self._refresh_now = threading.Event()

    # -- queries --------------------------------------------------------------
    def leader_of(self, engine_id: str) -> str | None:
        """The leader's address if this sidecar is a member for `engine_id`, else None."""
        return self._leaders.get(engine_id)

    def members(self, engine_id: str) -> list[peer_pb2.SidecarRanks]:
        with self._lock:
            return list(self._members.get(engine_id, {}).values())

    def map_version(self, engine_id: str) -> int:
        """The version of the engine's rank->sidecar map here (leader side); 0 where it never had one."""
        return self._versions.get(engine_id, 0)

    def members_and_version(self, engine_id: str) -> tuple[list[peer_pb2.SidecarRanks], int]:
        """The map and its version, read together: a reader must not take an older map for a newer one."""
        with self._lock:
            return list(self._members.get(engine_id, {}).values()), self._versions.get(engine_id, 0)

    def _map_changed(self, engine_id: str) -> None:  # holds self._lock
        self._versions[engine_id] = next(self._next_version)

    def member_ranks(self, engine_id: str) -> dict[int, str]:
        """Rank -> sidecar id, for the ranks members hold (leader side)."""
        return {r.rank: m.sidecar_id for m in self.members(engine_id) for r in m.ranks}

    def is_split(self, engine_id: str) -> bool:
        """Whether the engine's ranks span this sidecar and others (asked on every pull: no copy)."""
        if engine_id in self._leaders:
            return True
        with self._lock:
            return bool(self._members.get(engine_id))

    def held_here(self, engine_id: str) -> list[int] | None:
        """Prefill ranks a published request waits for on this sidecar; None: all (a one-sidecar engine)."""
        if not self.is_split(engine_id):
            return None
        return [e.rank for e in self._engines.all() if e.engine_id == engine_id]

    # -- registration (engine API) ---------------------------------------------------
    def register_rank(
        self,
        engine_id: str,
        rank: int,
        spec: EngineSpec,
        handles: list[common_pb2.TensorHandle],
        leader_address: str,
    ) -> str:
        """Register a rank here; as a member also report to the leader. Returns the leader's address."""
        if not leader_address or self._me.is_me(leader_address):
            return self._register_as_leader(engine_id, rank, spec, handles)
        with self._lock:
            followed = self._leaders.get(engine_id)
            if followed is not None and followed != leader_address:
                raise SidecarError(
                    Code.FAILED_PRECONDITION,
                    f"engine {engine_id!r} rank {rank} names leader {leader_address}, but its other ranks "
                    f"on this sidecar follow the leader at {followed}",
                )
            if followed is None and any(e.engine_id == engine_id for e in self._engines.all()):
                raise SidecarError(
                    Code.FAILED_PRECONDITION,
                    f"this sidecar leads engine {engine_id!r} (its ranks here name no leader); "
                    f"rank {rank} names the leader {leader_address}",
                )
            self._leaders[engine_id] = leader_address
        try:
            self._engines.register(engine_id, rank, spec, handles)
        except BaseException:
            self._forget_leader_if_idle(engine_id)
            raise
        try:
            self._report_once_led(engine_id)
        except BaseException:
            self._engines.unregister(engine_id, rank)
            self._forget_leader_if_idle(engine_id)
            raise
        self._ensure_refresher()
        return leader_address

    def _register_as_leader(
        self, engine_id: str, rank: int, spec: EngineSpec, handles: list[common_pb2.TensorHandle]
    ) -> str:
        followed = self._leaders.get(engine_id)
        if followed is not None:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"engine {engine_id!r} has ranks on this sidecar that follow the leader at {followed}; "
                f"rank {rank} names no leader",
            )
        holder = self.member_ranks(engine_id).get(rank)
        if holder is not None:
            raise SidecarError(
                Code.ALREADY_EXISTS,
                f"engine {engine_id!r} rank {rank} is already registered on sidecar {holder}",
            )
        self._engines.register(engine_id, rank, spec, handles)
        with self._lock:
            if self._members.get(engine_id):  # a rank of a split engine came to the leader (from a member)
                self._map_changed(engine_id)
        return self._me.peer_address

    def _forget_leader_if_idle(self, engine_id: str) -> None:
        with self._lock:
            if not any(e.engine_id == engine_id for e in self._engines.all()):
                self._leaders.pop(engine_id, None)

    def _ensure_refresher(self) -> None:
        with self._lock:
            if self._refresher is None:
                self._refresher = threading.Thread(target=self._refresh, name="leader-refresh", daemon=True)
                self._refresher.start()

    def refresh_now(self) -> None:
        """Report every followed engine again now, not at the next refresh (any thread; never blocks):
        a worker of ours was replaced (the agent readers were given is gone) or became ready (its agent
        may be handed out)."""
        self._refresh_now.set()

    def _refresh(self) -> None:
        """Re-report every followed engine; ends when this sidecar follows none."""
        failing: set[str] = set()
        while True:
            self._refresh_now.wait(self._refresh_s)
            self._refresh_now.clear()
            with self._lock:
                engines = list(self._leaders)
                if not engines:
                    self._refresher = None
                    return
            for eid in engines:
                try:
                    self.report(eid, quiet=True)
                    failing.discard(eid)
                except SidecarError as e:
                    if eid not in failing:  # once per outage, not every round
                        log.warning("cannot refresh engine %s on its leader: %s", eid, e.message)
                    failing.add(eid)

    def _report_once_led(self, engine_id: str) -> None:
        """The first report of a member's rank. An engine's ranks start together, so its leader's own may
        register a moment later: while the leader holds no rank of the engine, ask again, up to
        leader_wait_s; then its refusal is the registration's error."""
        deadline = time.monotonic() + self._leader_wait_s
        while True:
            try:
                self.report(engine_id)
                return
            except _NotLedYet as e:
                if time.monotonic() >= deadline:
                    waited = f"waited {self._leader_wait_s:g} s for the leader's ranks (leader_wait_ms)"
                    raise SidecarError(e.code, f"{e.message}; {waited}") from None
                time.sleep(_LEADER_POLL_S)

    def report(self, engine_id: str, quiet: bool = False) -> None:
        """Tell the leader which ranks of `engine_id` this sidecar holds now (none: it left)."""
        with self._lock:
            lock = self._report_locks.setdefault(engine_id, threading.Lock())
        # One report at a time per engine, so the leader never sees an older rank set last.
        with lock:
            leader = self._leaders.get(engine_id)
            if leader is None:
                return
            entries = sorted(
                (e for e in self._engines.all() if e.engine_id == engine_id), key=lambda e: e.rank
            )
            req = peer_pb2.ReportRanksRequest(
                protocol_version=PROTOCOL_VERSION,
                engine_id=engine_id,
                member=peer_pb2.SidecarRanks(
                    sidecar_id=self._me.sidecar_id,
                    peer_address=self._me.peer_address,
                    agent_name=self._me.sidecar_id,
                    agent_metadata=self._nixl.metadata() if entries else b"",
                    # A worker still starting (or restarting) is left out: its ranks' transfers run in
                    # this sidecar until it is ready, when this is reported again (refresh_now).
                    ranks=[rank_memory(e, self._worker_agents(e.key)) for e in entries],
                    staged_workers=True,  # server/staged_source.py takes reader_worker_agent, source_in_worker
                ),
            )
            if entries:
                req.spec.CopyFrom(spec_to_proto(entries[0].spec))
            try:
                self._peers.link(leader).client.report_ranks(req, REPORT_TIMEOUT_S)
            except PeerCallError as e:
                err = e.explain(leader, f"the ranks of engine {engine_id!r}")
                if err.code is Code.UNAVAILABLE:
                    raise SidecarError(
                        Code.UNAVAILABLE, f"leader sidecar of engine {engine_id!r}: {err.message}"
                    ) from None
                message = f"leader sidecar of engine {engine_id!r}: {err.message}"
                if err.code is Code.NOT_FOUND:  # it holds no rank of the engine (yet): a precondition here
                    raise _NotLedYet(Code.FAILED_PRECONDITION, message) from None
                raise SidecarError(err.code, message) from None
        (log.debug if quiet else log.info)(
            "reported ranks %s of engine %s to leader %s",
            ranks_text([e.rank for e in entries]),
            engine_id,
            leader,
        )

    def after_unregister(self, engine_id: str) -> None:
        """A rank left: a member updates its leader; a leader with no ranks left stops leading."""
        remaining = any(e.engine_id == engine_id for e in self._engines.all())
        if engine_id in self._leaders:
            try:
                self.report(engine_id)
            except SidecarError as e:
                log.warning("could not update the leader of engine %s: %s", engine_id, e.message)
            if not remaining:
                self._forget_leader_if_idle(engine_id)
        elif not remaining:
            with self._lock:
                dropped = self._members.pop(engine_id, None)
                if dropped:
                    self._map_changed(engine_id)
            if dropped:
                log.info("engine %s left this (leader) sidecar; forgot %d members", engine_id, len(dropped))

    # -- leader side (peer API) ------------------------------------------------------
    def accept_report(self, req: peer_pb2.ReportRanksRequest) -> None:
        if req.protocol_version != PROTOCOL_VERSION:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"protocol version {req.protocol_version} is not supported; this sidecar speaks {PROTOCOL_VERSION}",
            )
        check_id("engine_id", req.engine_id)
        m = req.member
        check_id("member.sidecar_id", m.sidecar_id)
        eid = req.engine_id
        followed = self._leaders.get(eid)
        if followed is not None:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"this sidecar does not lead engine {eid!r}: its ranks here follow the leader at {followed}",
            )
        local = [e for e in self._engines.all() if e.engine_id == eid]
        if not m.ranks:
            with self._lock:
                gone = self._members.get(eid, {}).pop(m.sidecar_id, None)
                if gone is not None:
                    self._map_changed(eid)
            if gone is not None:
                log.info("sidecar %s holds no rank of engine %s any more", m.sidecar_id, eid)
            return
        if not local:
            raise SidecarError(
                Code.NOT_FOUND,
                f"this sidecar does not lead engine {eid!r}: no rank of it is registered here "
                f"(register the leader's ranks first, naming no leader)",
            )
        spec = local[0].spec
        if not req.HasField("spec") or spec_from_proto(req.spec) != spec:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"engine {eid!r} on sidecar {m.sidecar_id} declares a spec that differs from the leader's",
            )
        ranks = [r.rank for r in m.ranks]
        bad = [r for r in ranks if r >= spec.tp_size]
        if bad or len(set(ranks)) != len(ranks):
            raise SidecarError(
                Code.INVALID_ARGUMENT,
                f"ranks {ranks} of engine {eid!r} repeat or fall outside tp_size {spec.tp_size}",
            )
        on_leader = sorted(set(ranks) & {e.rank for e in local})
        if on_leader:
            raise SidecarError(
                Code.ALREADY_EXISTS,
                f"engine {eid!r} rank(s) {ranks_text(on_leader)} are already registered on the leader",
            )
        with self._lock:
            members = self._members.setdefault(eid, {})
            for sid, other in list(members.items()):
                if sid == m.sidecar_id:
                    continue
                if other.peer_address == m.peer_address:
                    del members[sid]  # the same address under a new id: that sidecar restarted
                    continue
                clash = sorted(set(ranks) & {r.rank for r in other.ranks})
                if clash:
                    raise SidecarError(
                        Code.ALREADY_EXISTS,
                        f"engine {eid!r} rank(s) {ranks_text(clash)} are already held by sidecar {sid} "
                        f"at {other.peer_address}",
                    )
            if members.get(m.sidecar_id) == m:
                return  # a refresh: nothing changed
            members[m.sidecar_id] = peer_pb2.SidecarRanks()
            members[m.sidecar_id].CopyFrom(m)
            self._map_changed(eid)
        log.info("sidecar %s at %s holds ranks %s of engine %s", m.sidecar_id, m.peer_address, ranks, eid)

    def check_publish(self, engine_id: str, tp_size: int) -> None:
        """Publish happens on the leader, once every rank is registered somewhere (else no reader could finish)."""
        leader = self._leaders.get(engine_id)
        if leader is not None:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"engine {engine_id!r} is led by the sidecar at {leader}: publish there "
                f"(it holds the request on every sidecar of the engine)",
            )
        held = set(self.member_ranks(engine_id)) | {
            e.rank for e in self._engines.all() if e.engine_id == engine_id
        }
        missing = sorted(set(range(tp_size)) - held)
        if missing:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"engine {engine_id!r} rank(s) {ranks_text(missing)} are registered on no sidecar; "
                f"register every rank before publishing",
            )

    def publish_on_members(
        self,
        engine_id: str,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        lease_ms: int,
        first_token: int = 0,
    ) -> None:
        """Hold the request on every member; undo everywhere if one refuses."""
        req = peer_pb2.PeerPublishRequest(
            engine_id=engine_id,
            request_id=request_id,
            block_ids=block_ids,
            num_tokens=num_tokens,
            lease_ms=lease_ms,
            leader_id=self._me.sidecar_id,
            first_token=first_token,
        )
        done: list[peer_pb2.SidecarRanks] = []
        for m in self.members(engine_id):
            try:
                self._peers.link(m.peer_address).client.publish(req, FANOUT_TIMEOUT_S)
            except PeerCallError as e:
                for d in done:
                    self._abort_on(d, engine_id, request_id)
                err = e.explain(
                    m.peer_address,
                    f"to hold request {request_id!r} for ranks {ranks_text([r.rank for r in m.ranks])}",
                )
                raise err from None
            done.append(m)

    def abort_on_members(self, engine_id: str, request_id: str) -> None:
        for m in self.members(engine_id):
            self._abort_on(m, engine_id, request_id)

    def _abort_on(self, m: peer_pb2.SidecarRanks, engine_id: str, request_id: str) -> None:
        try:
            self._peers.link(m.peer_address).client.abort(
                peer_pb2.PeerAbortRequest(engine_id=engine_id, request_id=request_id), FANOUT_TIMEOUT_S
            )
        except PeerCallError as e:
            # Its lease still runs out; the member's ranks then hear "expired".
            log.warning("could not release request %s on member %s: %s", request_id, m.peer_address, e)

    def keep_alive(self, engine_id: str, request_ids: Sequence[str]) -> list[int]:
        """Extend leases here and on every member; a request counts as alive only where all hold it."""
        out = [self._published.keep_alive(engine_id, r) for r in request_ids]
        for m in self.members(engine_id):
            try:
                resp = self._peers.link(m.peer_address).client.keep_alive(
                    peer_pb2.PeerKeepAliveRequest(engine_id=engine_id, request_ids=request_ids),
                    FANOUT_TIMEOUT_S,
                )
            except PeerCallError as e:
                raise e.explain(m.peer_address, "keep-alive") from None
            out = [min(a, b) for a, b in zip(out, resp.lease_deadline_unix_ms, strict=True)]
        return out

    # -- member side (peer API) ---------------------------------------------------------
    def accept_publish(self, req: peer_pb2.PeerPublishRequest) -> None:
        check_id("engine_id", req.engine_id)
        check_id("request_id", req.request_id)
        if req.engine_id not in self._leaders:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"this sidecar holds no rank of engine {req.engine_id!r} for a leader",
            )
        ranks = self._engines.engine_ranks(req.engine_id)  # those registered here now: one look
        spec = ranks[0].spec
        check_published(
            "prefill", req.block_ids, req.num_tokens, req.first_token, spec.block_size, spec.num_blocks
        )
        item = self._published.publish(
            req.engine_id,
            req.request_id,
            list(req.block_ids),
            req.num_tokens,
            (req.lease_ms or self._lease_ms) / 1000,
            ranks=self.held_here(req.engine_id),
            first_token=req.first_token,
            block_size=spec.block_size,
            generations=generations(ranks),
        )
        self._on_published(item, ranks)
