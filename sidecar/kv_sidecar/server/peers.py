"""Links to peer sidecars: one gRPC channel each, and handshakes cached per engine pair."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import grpc

from kv_sidecar import PROTOCOL_VERSION
from kv_sidecar.plan.chunks import ChunkGeometry, chunk_geometry
from kv_sidecar.plan.pair import PairPlan, plan_pair
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.server.adapters.grpc_status import from_grpc
from kv_sidecar.server.engines import spec_from_proto, spec_to_proto
from kv_sidecar.server.errors import Code, SidecarError
from kv_sidecar.server.push_runs import READERS_S
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2, peer_pb2_grpc

if TYPE_CHECKING:
    from kv_sidecar.server.sidecar import Sidecar

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
    dlists: dict[int, int] = field(default_factory=dict)  # prefill rank -> prepared NIXL dlist key
    # prefill rank -> its sidecar; the leader for every rank of a one-node engine
    holders: dict[int, Holder] = field(default_factory=dict)
    # The fields every OpenRead of this engine pair shares (server/routing.py: open_read_request).
    open_template: peer_pb2.OpenReadRequest | None = None

    def agent_of(self, rank: int) -> str:
        holder = self.holders.get(rank)
        return holder.agent_name if holder is not None else self.agent_name

    def complete(self) -> bool:
        """Every rank has a known holder (a multi-node engine may still be registering)."""
        return set(range(self.spec.tp_size)) <= set(self.regions)


# Opens in a row whose call answered before their notification that make a link open by call only
# (server/notified_opens.py), and for how long.
MISSES_TO_BACK_OFF = 3
BACKOFF_S = 30.0


class PeerLink:
    def __init__(self, address: str, channel: grpc.Channel) -> None:
        self.address = address
        self.channel = channel
        self.stub = peer_pb2_grpc.PeerServiceStub(channel)
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


# How grpc core words a failed TLS handshake (certificate not trusted, wrong name).
_STOP_POLL_S = 0.05  # how soon a peer call notices that its pull was stopped
_TLS_FAILURE = re.compile(r"handshake failed|verification check failed|CERTIFICATE_VERIFY_FAILED", re.I)


def rpc_error(e: grpc.RpcError, peer: str, what: str) -> SidecarError:
    code = from_grpc(e.code()) if isinstance(e, grpc.Call) else Code.UNAVAILABLE
    details = e.details() if isinstance(e, grpc.Call) else str(e)
    return peer_error(code, details or "", peer, what)


def peer_error(code: Code, details: str, peer: str, what: str) -> SidecarError:
    """What a peer's refusal (a failed call, or a refusal it sent by notification) tells our caller."""
    if code is Code.UNAVAILABLE and _TLS_FAILURE.search(details or ""):
        # A certificate problem does not heal on retry, unlike a peer that is down.
        return SidecarError(
            Code.UNAUTHENTICATED,
            f"TLS handshake with peer sidecar {peer} failed ({what}); check tls_ca, tls_server_name and "
            f"the certificates: {details}",
        )
    if code in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED):
        return SidecarError(Code.UNAVAILABLE, f"peer sidecar {peer} is not reachable ({what}): {details}")
    return SidecarError(code, f"peer sidecar {peer} refused {what}: {details}")


def stoppable_call(
    method: grpc.UnaryUnaryMultiCallable,
    msg: Any,
    timeout_s: float,
    metadata: tuple[tuple[str, str], ...],
    stop: threading.Event,
    on_stop: Callable[[], Exception],
) -> Any:
    """A unary peer call that a stopped pull gives up at once (raising on_stop()), not at its deadline:
    a peer that hangs must not hold the pull, its engine's rank or a drain for the whole timeout."""
    call = method.future(msg, timeout=timeout_s, metadata=metadata)
    while True:
        try:
            return call.result(timeout=_STOP_POLL_S)  # wakes at the answer, not at the poll
        except grpc.FutureTimeoutError:
            if stop.is_set():
                call.cancel()
                raise on_stop() from None


class Peers:
    def __init__(self, sidecar: Sidecar) -> None:
        self._sc = sidecar
        self._links: dict[str, PeerLink] = {}
        self._lock = threading.Lock()
        self._closed = False

    def link(self, address: str) -> PeerLink:
        with self._lock:
            link = self._links.get(address)
            if link is None:
                link = PeerLink(address, self._sc.peer_channel(address))
                self._links[address] = link
            return link

    def remote_engine(
        self,
        address: str,
        engine_id: str,
        reader_engine: str,
        reader_spec: EngineSpec,
        timeout_s: float,
        stop: threading.Event,
        on_stop: Callable[[], Exception],
    ) -> tuple[PeerLink, RemoteEngine]:
        """The plan with a peer's engine, from the cache or a handshake; a pull that is stopped meanwhile
        raises on_stop() at once (it may be waiting behind another pull's handshake to a hung peer)."""
        if self._closed:  # a pull still running at shutdown must not dial anew (and hang the exit)
            raise SidecarError(Code.UNAVAILABLE, f"this sidecar is shutting down; not calling {address}")
        link = self.link(address)
        key = (engine_id, reader_engine)
        while not link.lock.acquire(timeout=_STOP_POLL_S):
            if stop.is_set():
                raise on_stop()
        try:
            known = link.engines.get(key)
            if known is not None and known.plan.decode == reader_spec:
                return link, known
            remote = self._handshake(link, engine_id, reader_engine, reader_spec, timeout_s, stop, on_stop)
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
        stop: threading.Event,
        on_stop: Callable[[], Exception],
    ) -> RemoteEngine:
        sc = self._sc
        start = time.perf_counter()
        req = peer_pb2.HandshakeRequest(
            protocol_version=PROTOCOL_VERSION,
            sidecar_id=sc.sidecar_id,
            agent_name=sc.sidecar_id,
            agent_metadata=sc.nixl.metadata(),
            engine_id=engine_id,
            reader_engine_id=reader_engine,
            reader_spec=spec_to_proto(reader_spec),
        )
        try:
            resp = stoppable_call(link.stub.Handshake, req, timeout_s, sc.peer_metadata(), stop, on_stop)
        except grpc.RpcError as e:
            sc.metrics.handshakes.labels("error").inc()
            raise rpc_error(e, link.address, "the handshake") from None
        if resp.sidecar_id == sc.sidecar_id:  # never NIXL-read from our own agent
            sc.metrics.handshakes.labels("error").inc()
            raise SidecarError(
                Code.INVALID_ARGUMENT,
                f"{link.address} is this sidecar itself; params of a request published here must carry "
                f"its sidecar_id {sc.sidecar_id!r}",
            )
        if resp.protocol_version != PROTOCOL_VERSION:
            sc.metrics.handshakes.labels("error").inc()
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"peer {link.address} speaks protocol {resp.protocol_version}, this sidecar {PROTOCOL_VERSION}",
            )
        spec = spec_from_proto(resp.spec)
        plan = cached_plan(spec, reader_spec)
        if plan.hash() != resp.plan_hash:
            sc.metrics.handshakes.labels("error").inc()
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"plan mismatch with peer {link.address}: ours {plan.hash()}, theirs {resp.plan_hash} "
                f"(different kv-sidecar versions?)",
            )
        agent = sc.nixl.add_remote(resp.agent_metadata, resp.agent_name)
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
        )
        leader = Holder(resp.sidecar_id, link.address, agent)
        remote.holders = {r.rank: leader for r in resp.ranks}
        for m in resp.members:  # a multi-node engine: the rank->sidecar map (docs/multinode.md)
            # Our own ranks need no NIXL connection; routing refuses to read them over the wire.
            member_agent = (
                m.agent_name if m.sidecar_id == sc.sidecar_id else sc.nixl.add_remote(m.agent_metadata)
            )
            holder = Holder(m.sidecar_id, m.peer_address, member_agent)
            for r in m.ranks:
                remote.holders[r.rank] = holder
                remote.regions[r.rank] = [g.address for g in r.regions]
        sc.metrics.handshakes.labels("ok").inc()
        sc.metrics.handshake_duration.observe(time.perf_counter() - start)
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
            link.channel.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.channel.close()
