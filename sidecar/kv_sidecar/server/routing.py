"""Reader side of a pull: send each control call and notification to the sidecar that holds the source rank.

A one-node source engine has one holder (its sidecar) for every rank. A
multi-node engine's handshake with its leader returns the rank->sidecar map
(`RemoteEngine.holders`); a pull then opens the request on every holder of a
rank its decode ranks read or notify, READs each rank from its holder's NIXL
agent, and tells each holder which of *its* ranks a decode rank is done with.
See docs/multinode.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable, Sequence
from typing import NamedTuple

from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.metrics import Metrics
from kv_sidecar.plan.pair import DecodeRankPlan
from kv_sidecar.server.engines import spec_to_proto
from kv_sidecar.server.identity import Identity
from kv_sidecar.server.notified_opens import NotifiedOpens
from kv_sidecar.server.peer_calls import PeerCallError, PeerFuture
from kv_sidecar.server.peers import Holder, Peers, RemoteEngine
from kv_sidecar.transport.notifications import done_batch, done_notification
from kv_sidecar_client._proto.kvsidecar.v1 import engine_pb2, peer_pb2

log = logging.getLogger(__name__)

# Done notifications joined into one at most (a NIXL notification is one active message).
MAX_DONES = 64


def depends_on(rank_plan: DecodeRankPlan) -> list[int]:
    """Prefill ranks one decode rank reads or only notifies, in plan order."""
    return [r.prefill_rank for r in rank_plan.reads] + list(rank_plan.notify_only)


def by_holder(
    remote: RemoteEngine, prefill_ranks: Iterable[int], own_sidecar_id: str, own: Collection[int] = ()
) -> dict[Holder, list[int]]:
    """Group prefill ranks by the sidecar holding them (dict order: first seen), less `own`: those this
    sidecar holds itself and reads as copies (server/own_ranks.py)."""
    out: dict[Holder, list[int]] = {}
    for p in prefill_ranks:
        if p in own:
            continue
        holder = remote.holders.get(p)
        if holder is None:
            known = sorted(remote.holders)
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"no sidecar holds rank {p} of engine {remote.engine_id!r} (its leader knows ranks {known}); "
                f"are all its ranks registered?",
            )
        if holder.sidecar_id == own_sidecar_id:  # the map is older than this sidecar's registrations
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"rank {p} of engine {remote.engine_id!r} is not registered on this sidecar any more, where "
                "the handshake put it; handshake again",
            )
        ranks = out.setdefault(holder, [])
        if p not in ranks:
            ranks.append(p)
    return out


class DoneReads(NamedTuple):
    """What one pull read, for its done notifications: the request, the local engine, and each local
    rank with its plan."""

    remote: RemoteEngine
    request_id: str
    reader: str
    ranks: Sequence[tuple[int, DecodeRankPlan]]
    own: Collection[int] = ()  # prefill ranks held here: marked done here, not notified


def done_messages(
    pulls: Iterable[DoneReads], own_sidecar_id: str
) -> tuple[list[tuple[str, bytes]], set[str]]:
    """The done notifications of pulls that end together, (agent, message) each, and the addresses of the
    sidecars they go to. Each local rank tells each holder which of its ranks it is done with; those to
    a leader whose handshake said done_batches go joined (MAX_DONES at most in one), the rest (a member
    sidecar, which the reader never handshook with; an older peer) one by one. A pull whose holders
    cannot be named is logged and left out: the others' sources still hear theirs."""
    out: list[tuple[str, bytes]] = []
    joined: dict[str, list[bytes]] = {}
    addresses: set[str] = set()
    for pull in pulls:
        remote = pull.remote
        try:
            dones = [
                (rank, holder, done)
                for rank, rank_plan in pull.ranks
                for holder, done in by_holder(remote, depends_on(rank_plan), own_sidecar_id, pull.own).items()
            ]
        except SidecarError as e:
            log.warning("no done notification for request %r: %s", pull.request_id, e.message)
            continue
        for rank, holder, done in dones:
            msg = done_notification(remote.engine_id, pull.request_id, pull.reader, rank, done)
            if remote.done_batches and holder.agent_name == remote.agent_name:
                joined.setdefault(holder.agent_name, []).append(msg)
            else:
                out.append((holder.agent_name, msg))
            addresses.add(holder.address)
    for agent, msgs in joined.items():
        for i in range(0, len(msgs), MAX_DONES):
            part = msgs[i : i + MAX_DONES]
            out.append((agent, part[0] if len(part) == 1 else done_batch(part)))
    return out, addresses


def holders_needed(
    remote: RemoteEngine, rank_plans: Sequence[DecodeRankPlan], own_sidecar_id: str, own: Collection[int] = ()
) -> dict[Holder, list[int]]:
    """Every other holder the given decode ranks depend on, with the prefill ranks they need there."""
    return by_holder(remote, (p for rp in rank_plans for p in depends_on(rp)), own_sidecar_id, own)


CLOSE_TIMEOUT_S = 2.0


class Opener:
    """The reader's opens and closes of a request on the sidecars that hold its source ranks."""

    def __init__(self, me: Identity, peers: Peers, notified: NotifiedOpens, metrics: Metrics) -> None:
        self.me = me
        self.peers = peers
        self.notified = notified
        self.metrics = metrics

    def open(
        self,
        remote: RemoteEngine,
        holders: Sequence[Holder],
        req: engine_pb2.PullRequest,
        reader_ranks: list[int],
    ) -> Opening:
        return Opening(self, remote, holders, req, reader_ranks)

    def request(
        self, remote: RemoteEngine, req: engine_pb2.PullRequest, reader_ranks: list[int], pushed: bool = False
    ) -> peer_pb2.OpenReadRequest:
        """What opens the request for these reader ranks: sent as OpenRead, or carried by a staged Push
        (`pushed`). A carried open leaves out the reader's spec, which its Push names once (the source
        plans with the Push's, however many requests the Push opens)."""
        if remote.open_template is None or remote.open_spec is None:  # ~20-40 us to build
            remote.open_spec = spec_to_proto(remote.plan.decode)  # first: a template is read with it
            remote.open_template = peer_pb2.OpenReadRequest(
                sidecar_id=self.me.sidecar_id,
                # Where the source may ask whether this sidecar still runs (server/gone_readers.py).
                reader_address=self.me.peer_address,
                plan_hash=remote.plan.hash(),
            )
        msg = peer_pb2.OpenReadRequest()
        msg.CopyFrom(remote.open_template)
        if not pushed:  # a member sidecar of a multi-node engine plans from it (it saw no handshake)
            msg.reader_spec.CopyFrom(remote.open_spec)
        msg.engine_id = req.params.engine_id
        msg.request_id = req.params.request_id
        msg.reader_engine_id = req.engine_id
        msg.reader_ranks.extend(reader_ranks)
        return msg

    def close_reads(
        self,
        holders: Sequence[Holder],
        req: engine_pb2.PullRequest,
        reader_ranks: list[int],
        failed: bool,
        release: bool = False,
    ) -> None:
        """release: the reader is gone for good (abort, dead engine); the holders free the blocks now."""
        msg = peer_pb2.CloseReadRequest(
            engine_id=req.params.engine_id,
            request_id=req.params.request_id,
            reader_engine_id=req.engine_id,
            reader_ranks=reader_ranks,
            failed=failed,
            release=release,
        )
        for holder in holders:
            try:
                self.peers.link(holder.address).client.close_read(msg, CLOSE_TIMEOUT_S)
            except PeerCallError:
                log.warning("could not tell %s that request %s failed", holder.address, req.params.request_id)


class Opening:
    """A pull's opens on the holders it reads from: sent at once as notifications where a holder's link
    allows (server/notified_opens.py), as OpenRead calls in `finish` otherwise or where no answer came.
    `touched`: the holders that may have opened it, which a failed pull must close."""

    def __init__(
        self,
        opener: Opener,
        remote: RemoteEngine,
        holders: Sequence[Holder],
        req: engine_pb2.PullRequest,
        reader_ranks: list[int],
    ) -> None:
        self._opener = opener
        self._req = req
        self._remote = remote
        self._holders = list(holders)
        self._msg = opener.request(remote, req, reader_ranks)
        self._notified = {h: opener.notified.send(h, self._msg) for h in self._holders}
        self.touched = [h for h, sent in self._notified.items() if sent is not None]

    def finish(self, deadline: float) -> peer_pb2.OpenReadResponse:
        """Every holder's answer; they must agree on the request."""
        p = self._req.params
        first: peer_pb2.OpenReadResponse | None = None
        try:
            for holder in self._holders:
                resp = self._open(holder, deadline)
                self._check_registrations(holder, resp)
                if first is None:
                    first = resp
                elif (list(resp.block_ids), resp.num_tokens, resp.first_token) != (
                    list(first.block_ids),
                    first.num_tokens,
                    first.first_token,
                ):
                    raise SidecarError(
                        Code.FAILED_PRECONDITION,
                        f"sidecars of engine {p.engine_id!r} disagree on request {p.request_id!r} "
                        f"({self._holders[0].address} and {holder.address})",
                    )
        finally:
            self.abandon()
        if first is None:
            raise SidecarError(Code.INTERNAL, f"request {p.request_id!r}: no source sidecar to read from")
        return first

    def _check_registrations(self, holder: Holder, resp: peer_pb2.OpenReadResponse) -> None:
        """The ranks that hold the request must be the registrations whose regions the handshake gave:
        a rank whose process registered again has new memory, and another engine's may lie at the old
        addresses, which a READ would take without a word (one host's UCX reads by address). The pull
        then handshakes again and retries (its early READs are dropped)."""
        for rank, now in resp.generations.items():
            had = self._remote.generations.get(rank, 0)
            if had and now != had:
                raise SidecarError(
                    Code.FAILED_PRECONDITION,
                    f"engine {self._req.params.engine_id!r} rank {rank} at {holder.address} registered again "
                    "since this sidecar's handshake with it; handshake again",
                )

    def abandon(self) -> None:
        """Stop waiting for answers to notifications (a late one is dropped)."""
        for sent in self._notified.values():
            if sent is not None:
                sent.abandon()

    def _open(self, holder: Holder, deadline: float) -> peer_pb2.OpenReadResponse:
        client = self._opener.peers.link(holder.address).client

        def call() -> PeerFuture[peer_pb2.OpenReadResponse]:
            return client.open_read_future(self._msg, max(0.001, deadline - time.monotonic()))

        sent = self._notified.get(holder)
        try:
            if sent is not None:
                resp = sent.result(call, deadline)
            else:
                resp = client.open_read(self._msg, max(0.001, deadline - time.monotonic()))
                self._opener.metrics.opens.labels("call").inc()
        except PeerCallError as e:
            self._not_opened(holder)
            raise e.explain(
                holder.address, f"to open request {self._req.params.request_id!r}", caller_deadline=True
            ) from None
        except SidecarError:
            self._not_opened(holder)
            raise
        if holder not in self.touched:
            self.touched.append(holder)
        return resp

    def _not_opened(self, holder: Holder) -> None:
        """It refused, or did not answer: as before notifications, such a holder is not closed."""
        if holder in self.touched:
            self.touched.remove(holder)
