"""The reader's end of the staged protocol, its control half: one Push per transfer, sent as a NIXL
notification or a gRPC call, its answer and its stop. The bytes, slots and credits are the data
plane's (dataplane/receive.py; docs/gpu.md says how the protocol flows).

A transfer moves one (decode rank, source rank) read, or, under load, several: the reads of other
requests between the same two ranks that wait while one runs go as one transfer next, their tokens
concatenated (server/group_commit.py; PushRequest.members). A group that fails does not fail its
reads: a group the source refused for one request fails that read with the refusal it would get alone
and sends the others again as one; after any other failure each read that may still go runs again
alone, so that a bad request fails by itself.

A pull asks for its reads as `StagedRead`s (its steps yield them: server/pull_steps.py): `read` runs
one on the pull's own thread; `read_all` runs the reads of a PullBatch's members together, queued at
once per rank pair and finished on one thread per pair, without a thread per member
(server/pull_batch.py)."""

from __future__ import annotations

import functools
import hmac
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass, field
from typing import Any

from kv_sidecar.dataplane import staged_protocol as sp
from kv_sidecar.dataplane.jobs import CANCEL_WAIT_S, Halt, Receive, Tokens, join_tokens
from kv_sidecar.dataplane.plane import DataPlane, Reception, WorkerReception
from kv_sidecar.errors import Code, SidecarError, waited_for
from kv_sidecar.metrics import Metrics
from kv_sidecar.server.engines import RankEntry, spec_to_proto
from kv_sidecar.server.group_commit import GroupCommit, Waiter
from kv_sidecar.server.peer_calls import PeerCallError, PeerUnreachable, peer_error
from kv_sidecar.server.peers import PeerLink, Peers, RemoteEngine
from kv_sidecar.server.pull_job import PullJob, require_gpu
from kv_sidecar.server.push_runs import KEY_BYTES
from kv_sidecar.server.push_threads import PushThreads
from kv_sidecar.server.staged_common import MAX_PUSH_MEMBERS, read_heads, refused_member, refused_members
from kv_sidecar.transport.nixl_driver import NixlDriver
from kv_sidecar.transport.notifications import PUSH_TAG, parse_push_failed, parse_push_refused, signed_notif
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2

log = logging.getLogger(__name__)

# A Push sent as a notification sends its gRPC call only if the transfer has not finished this long
# after: a small pull (~2 ms on two GPUs) then never runs a call on either sidecar, whose handler
# threads competed with the transfer's launches for the GIL (~0.5 ms each side, traced). A larger
# one gets the call's answer, errors and deadline as before; a refused notification (the source
# restarted: it no longer knows our key) costs this much once before the call starts the transfer.
CALL_AFTER_S = 0.005
# Under load a notified transfer waits at its source longer than CALL_AFTER_S (16 pulls in flight: tens
# of ms), and a call sent then only adds a gRPC call's work to both sidecars, which are already what
# the pulls wait for (10-55 % of a core across the two, docs/benchmarks.md, issue 32). So the call
# waits CALL_AFTER_FACTOR times what this link's notified transfers lately took, up to CALL_AFTER_MAX_S:
# how late a reader learns that its source died, or that a restarted source refused the notification.
CALL_AFTER_FACTOR = 3.0
CALL_AFTER_MAX_S = 0.1


def call_after_s(recent_s: float) -> float:
    """How long after its notification a Push's call goes, given the link's recent transfer time."""
    return min(CALL_AFTER_MAX_S, max(CALL_AFTER_S, CALL_AFTER_FACTOR * recent_s))


# How long a reader waits for its Push notification to leave before preparing its copies: the NIXL
# thread needs the GIL for that, usually within ~0.1 ms; a busier driver is not waited for.
NOTIFY_WAIT_S = 0.001


class _PushCall:
    """A read's Push: its notification (when we hold the source's key) and its gRPC call, sent at once
    without a key, else only when due (CALL_AFTER_S) or to stop the transfer."""

    def __init__(
        self,
        threads: PushThreads,
        metrics: Metrics,
        link: PeerLink,
        req: peer_pb2.PushRequest,
        halt: Halt,
        reception: Reception | WorkerReception,
        key: bytes,
    ) -> None:
        """key: the push key its notification was signed with (empty: it goes by call only)."""
        self.threads = threads
        self.metrics = metrics
        self.link = link
        self.req = req
        self.halt = halt
        self.reception = reception
        self.call: Any = None
        self.called_at = 0.0
        self.notified = req.notified
        self.sent_at = time.monotonic()
        self.due = self.sent_at + call_after_s(link.notified_push_s) if req.notified else 0.0
        self.failed = False  # the source said its transfer failed: the call goes now, for the error
        # The source's answer, sent back by notification (a refusal, nothing in flight): no call goes.
        self.refused: PeerCallError | None = None
        self.key = key  # a refusal sent back carries it

    @property
    def asked(self) -> bool:
        """The source may be moving the transfer: we sent its notification or its call."""
        return self.notified or self.call is not None

    def wait_s(self) -> float:
        """How long until the call is due (inf once it was sent)."""
        return float("inf") if self.call is not None else max(0.0, self.due - time.monotonic())

    def send_if_due(self) -> None:
        if self.call is None and self.refused is None and time.monotonic() >= self.due:
            # Longer than the pull: the source stops at timeout_ms, and its answer says when nothing
            # is in flight any more, which a timed-out reader still needs.
            why = "failed" if self.failed else "slow" if self.notified else "no_key"
            self._send(self.req, self.halt.remaining() + CANCEL_WAIT_S + 1, why)

    def hurry(self) -> None:
        """The source's failure notice (any thread): the call is due now; `_receive` sends it."""
        self.failed = True
        self.due = 0.0
        self.reception.poke()

    def answered(self, refusal: PeerCallError) -> None:
        """The source's answer by notification (any thread): `_receive` raises it; no call goes."""
        self.refused = refusal
        self.reception.poke()

    def send_stopping(self) -> None:
        """We gave the transfer up before its call went out: ask the source to stop what the
        notification started (and start nothing), and to answer once nothing is in flight."""
        stop = peer_pb2.PushRequest()
        stop.CopyFrom(self.req)
        stop.stopping = True
        self._send(stop, CANCEL_WAIT_S + 1, "stop")

    def describe(self) -> str:
        """Where the Push stands, for an error that ends its read."""
        ago = time.monotonic() - self.sent_at
        how = "by notification" if self.notified else "by call"
        if self.call is None:
            return f"Push sent {how} {ago * 1000:.0f} ms ago, its call not sent"
        state = "not answered"
        if self.call.done():
            err = None if self.call.cancelled() else self.call.exception()
            state = "answered OK" if err is None else f"answered {type(err).__name__}: {err}"
        return f"Push sent {how} {ago * 1000:.0f} ms ago, its call {(self.called_at - self.sent_at) * 1000:.0f} ms after: {state}"

    def _send(self, req: peer_pb2.PushRequest, timeout_s: float, why: str) -> None:
        self.metrics.push_calls.labels(why).inc()
        self.called_at = time.monotonic()
        self.call = self.threads.call(self.link.client.push, req, timeout_s)
        self.call.add_done_callback(functools.partial(_learn_key, self.link))
        self.call.add_done_callback(lambda _: self.reception.poke())


# How often a group refused for one of its reads sends the others again as one (StagedReader._lead).
REGROUPS = 2
# Staged transfers of one (source rank, decode rank) pair that run side by side; reads that arrive
# while that many run wait and go together next (server/group_commit.py).
GROUPS_AT_ONCE = 2


@dataclass
class StagedRead:
    """What a pull asks of the staged reader: a (decode rank, source rank) read of its job, and the
    open its Push carries (None: the request was opened before). Also an item of a group."""

    job: PullJob
    remote: RemoteEngine
    entry: RankEntry
    src_rank: int
    open_msg: peer_pb2.OpenReadRequest | None = None
    since: float = field(default_factory=time.monotonic)  # when it was asked for (_UntilLost)


class _Alone:
    """A read whose group failed, not for its own fault: it runs again, by itself (`ALONE`: what failed the
    group is not known, and a bad read must not fail the others twice), or as one group with the others
    that may go on (`AGAIN`: the group ended because other reads of it were stopped)."""

    def __init__(self, together: bool) -> None:
        self.together = together


ALONE = _Alone(False)
AGAIN = _Alone(True)


class RefusedMember(SidecarError):
    """The source refused a group's Push for some of its reads: `refused[index]` is what that read gets,
    the refusal a Push of its request alone gets (one read, or every one the source listed)."""

    def __init__(self, e: SidecarError, refused: dict[int, SidecarError]) -> None:
        super().__init__(e.code, e.message, e.metadata)
        self.refused = refused


class _SourceLost(PeerUnreachable):
    """A transfer that did not start: its source was found out of reach while its reads waited."""


class _UntilLost:
    """A transfer's halt while it waits for receive slots, which also ends it (with what that Push got)
    once its source's address has been found out of reach (another transfer's Push to it failed so)
    since its oldest read was asked for. A source that dies keeps its share of the ring until its
    quarantine passes (SlotPool), and reads of it that waited for those slots, bound to fail, waited
    that long too."""

    def __init__(
        self, halt: Halt, lost: dict[str, tuple[float, SidecarError]], address: str, since: float
    ) -> None:
        self._halt, self._lost, self._address, self._since = halt, lost, address, since

    def remaining(self) -> float:
        seen = self._lost.get(self._address)
        if seen is not None and seen[0] > self._since:
            raise _SourceLost(seen[1].code, seen[1].message, seen[1].metadata)
        return self._halt.remaining()


class _Halts:
    """A group's halt: it stops when any of its reads must (that read's error)."""

    def __init__(self, jobs: list[PullJob]) -> None:
        self._jobs = jobs

    def remaining(self) -> float:
        return min(j.remaining() for j in self._jobs)


def moved_spans(jobs: list[PullJob], block_size: int) -> list[tuple[int, int]]:
    """Where each read's tokens [start_token, num_tokens) go in its group's transfer (member_spans)."""
    return sp.member_spans([j.num_tokens - j.start_token for j in jobs], block_size)


def joined_tokens(jobs: list[PullJob]) -> Tokens:
    """The group's tokens: each read's after the other's, from token 0 of the transfer. A read's source
    blocks are its request's from token 0 and its destination blocks those of its own tokens only
    (dataplane/jobs.Tokens); staged_protocol.member_block_range says which source blocks a read's
    span takes (the source picks the same from its own records)."""
    plan = jobs[0].plan
    joined, _ = join_tokens([j.tokens for j in jobs], plan.prefill.block_size, plan.decode.block_size)
    return joined


def groupable(job: PullJob, remote: RemoteEngine, src_rank: int) -> bool:
    """Whether a read may share a transfer with others: the source takes members, is the engine's one
    sidecar (a member of a multi-node engine may be another version), the request is held from token 0
    and the read moves at least a token from a block boundary. A source of the first version with
    groups takes only reads from token 0 between equal block sizes; a v2 source also reads past a
    prefix and into decode blocks a multiple of its own (member_spans, member_block_range)."""
    holder = remote.holders.get(src_rank)
    bp, bd = job.plan.prefill.block_size, job.plan.decode.block_size
    v2 = remote.push_members_v2
    return (
        remote.push_members
        and (holder is None or holder.sidecar_id == remote.sidecar_id)
        and (bp == bd or (v2 and bd % bp == 0))
        and (job.start_token == 0 or v2)
        and job.start_token % bd == 0
        and job.params.first_token == 0
        and job.num_tokens > job.start_token
    )


class StagedReader:
    """The reads of pulls that run the staged protocol, into this sidecar's receive rings."""

    def __init__(
        self,
        sidecar_id: str,
        peers: Peers,
        plane: DataPlane,
        threads: PushThreads,
        nixl: NixlDriver,
        metrics: Metrics,
        group_reads: int,
    ) -> None:
        """group_reads: the most reads one transfer carries (the staged_group_reads setting; 1: none)."""
        self._sidecar_id = sidecar_id
        self._peers = peers
        self._plane = plane
        self._threads = threads
        self._nixl = nixl
        self._metrics = metrics
        self._group_reads = min(group_reads, MAX_PUSH_MEMBERS)
        self._groups: GroupCommit[StagedRead, int | _Alone] = GroupCommit(
            max(1, self._group_reads), GROUPS_AT_ONCE
        )
        # Pushes sent as notifications whose transfer runs, by transfer id: a failure notice finds its
        # call there (source_failed). Set and popped by one key each: the GIL keeps the dict whole.
        self._notified: dict[str, tuple[str, _PushCall]] = {}
        # Source addresses a Push found out of reach, since when and what it got (_UntilLost); gone
        # again once a transfer from there completes.
        self._lost: dict[str, tuple[float, SidecarError]] = {}

    def source_failed(self, agent: str, msg: bytes) -> None:
        """A source's failure notice (NIXL thread): the transfer its Push notification started failed;
        that read's call goes now and gets the error. Only from the agent the notification went to."""
        tid = parse_push_failed(msg)
        push = self._notified_from(agent, tid)
        if push is None:
            log.debug("failure notice for transfer %s from %s, which no read here waits for", tid, agent)
            return
        push.hurry()

    def source_refused(self, agent: str, msg: bytes) -> None:
        """A source's refusal by notification (NIXL thread): the answer the read's call would get, for a
        transfer that failed with nothing in flight. Only from the agent the Push went to, with the key
        it was signed with (NIXL notifications carry no TLS: the key binds it to that source)."""
        parsed = parse_push_refused(msg, KEY_BYTES)
        push = self._notified_from(agent, parsed[1]) if parsed is not None else None
        if parsed is None or push is None or not hmac.compare_digest(parsed[0], push.key):
            log.debug("a refusal by notification from %s, which no read here waits for", agent)
            return
        _, _, code, message, trailers = parsed
        push.answered(
            PeerCallError(Code[code] if code in Code.__members__ else Code.UNKNOWN, message, True, trailers)
        )

    def _notified_from(self, agent: str, tid: str | None) -> _PushCall | None:
        """The Push that went by notification to `agent` as transfer `tid` and still waits, if any."""
        held = self._notified.get(tid) if tid is not None else None
        return held[1] if held is not None and held[0] == agent else None

    def read(self, want: StagedRead) -> int:
        """Move one (decode rank, source rank) read through the two sidecars' rings; returns bytes written.

        `want.open_msg`: the Push opens the request itself (no OpenRead before it); the job was planned
        from the params, and the source refuses before any WRITE if its record holds another token count.
        """
        if not self._groups_it(want):
            return self._transfer(want.remote, want.src_rank, [want])
        key = self._pair(want)
        lead = functools.partial(self._lead, want.remote, want.src_rank)
        while True:
            me: Waiter[StagedRead, int | _Alone] = Waiter(want)
            self._groups.enqueue(key, [me])
            outcome = self._groups.finish(key, me, lead, want.job.remaining)
            if not isinstance(outcome, _Alone):
                return outcome
            if not outcome.together:
                return self._transfer(want.remote, want.src_rank, [want])
            # AGAIN: queued anew, it goes with those of its group that come back while a transfer runs.

    def read_all(
        self,
        wants: Sequence[StagedRead],
        pool: Executor,
        made: Callable[[list[tuple[int, int | BaseException]]], None],
    ) -> None:
        """Move the reads of a PullBatch's members together; `made([(i, bytes or what failed it), ..])` with
        the reads that ended together (one transfer's), on the thread that finished them. Those of one
        (source rank, decode rank) pair are queued at once (one transfer, or as few as
        `staged_group_reads` allows) and finished on one thread, the first pair's on this one and the
        others' on `pool`, so that a hung source holds up only its own pair's reads; a read that goes alone
        (not groupable, or its group failed) goes on `pool` too. Returns once every `made` has returned."""
        tasks: list[Future[None]] = []
        pairs: dict[Hashable, list[tuple[int, Waiter[StagedRead, int | _Alone]]]] = {}

        def alone(i: int, run: Callable[[], int]) -> None:
            try:
                moved: int | BaseException = run()
            except Exception as e:
                moved = e
            made([(i, moved)])

        for i, want in enumerate(wants):
            if self._groups_it(want):
                waiter: Waiter[StagedRead, int | _Alone] = Waiter(want)
                pairs.setdefault(self._pair(want), []).append((i, waiter))
            else:
                tasks.append(pool.submit(alone, i, functools.partial(self.read, want)))

        def finish(key: Hashable, waiters: list[tuple[int, Waiter[StagedRead, int | _Alone]]]) -> None:
            # Queued by the thread that finishes them: a queued read's thread is always running, so a
            # group never waits for a lead that waits for a pool thread.
            while waiters:
                self._groups.enqueue(key, [w for _, w in waiters])
                ended: list[tuple[int, int | BaseException]] = []
                again: list[int] = []
                for i, waiter in waiters:  # in queue order: a group this thread leads starts with its first
                    if ended and not waiter.settled:  # it leads or waits next: what ended goes on first
                        made(ended)
                        ended = []
                    want = wants[i]
                    lead = functools.partial(self._lead, want.remote, want.src_rank)
                    try:
                        outcome = self._groups.finish(key, waiter, lead, want.job.remaining)
                    except Exception as e:
                        ended.append((i, e))
                        continue
                    if outcome is AGAIN:
                        again.append(i)
                    elif isinstance(outcome, _Alone):
                        run = functools.partial(self._transfer, want.remote, want.src_rank, [want])
                        tasks.append(pool.submit(alone, i, run))
                    else:
                        ended.append((i, outcome))
                if ended:
                    made(ended)  # the stopped reads of a group that goes again answer before it runs
                # Those whose group ended because others of it were stopped: queued again, as one group.
                waiters = [(i, Waiter(wants[i])) for i in again]

        groups = list(pairs.items())
        finishers = [pool.submit(finish, key, waiters) for key, waiters in groups[1:]]
        if groups:
            finish(*groups[0])
        for f in finishers:
            f.result()
        for t in tasks:  # complete: every finisher that adds to it has returned
            t.result()

    def _groups_it(self, want: StagedRead) -> bool:
        return self._group_reads >= 2 and groupable(want.job, want.remote, want.src_rank)

    @staticmethod
    def _pair(want: StagedRead) -> Hashable:
        """A group's key: the reads of one (source rank, decode rank) pair under one plan."""
        r = want.remote
        return (r.sidecar_id, r.engine_id, want.src_rank, want.entry.key, want.job.plan.hash())

    def _lead(
        self, remote: RemoteEngine, src_rank: int, reads: list[StagedRead], regroups: int = REGROUPS
    ) -> list[int | _Alone | BaseException]:
        """Run a group as one transfer; each read's share of the bytes, or, if it failed, what each does.
        A read alone fails as itself: GroupCommit gives it what `_transfer` raises. Refused for one read,
        the others go again as one, `regroups` times at most: a source that refuses read after read (its
        engine gone) is then asked for each alone, side by side, not once per read in a row."""
        if len(reads) == 1:
            return [self._transfer(remote, src_rank, reads)]
        try:
            total = self._transfer(remote, src_rank, reads)
        except Exception as e:
            if isinstance(e, RefusedMember) and regroups > 0 and all(0 <= k < len(reads) for k in e.refused):
                log.info(
                    "a staged transfer of %d reads was refused for %s (%s); the others go again as one",
                    len(reads),
                    ", ".join(repr(reads[k].job.params.request_id) for k in e.refused),
                    "; ".join(err.message for err in e.refused.values()),
                )
                return self._again(remote, src_rank, reads, e.refused, regroups - 1)
            out: list[int | _Alone | BaseException] = [_stopped(r) or ALONE for r in reads]
            if isinstance(e, PeerUnreachable):
                # The source is out of reach (its sidecar gone, the connection reset). Sent again one by
                # one, each read would meet the same, and each transfer that the source cannot confirm
                # ended keeps its receive slots out of the ring for a while (dataplane/receive.py), so
                # the reads waited for each other's slots, 10 s a round. Each fails now with it; its pull
                # handshakes again and retries once, as a lone pull does (Puller._pull_remote_fresh).
                log.info("a staged transfer of %d reads failed (%s); they fail with it", len(reads), e)
                return [SidecarError(e.code, e.message, e.metadata) if o is ALONE else o for o in out]
            going = sum(o is ALONE for o in out)
            if 2 <= going < len(reads):
                # Reads of it were stopped (aborted, past their deadline), which ends the transfer (the
                # group's halt is theirs too): the others go again as one transfer, not one each, and the
                # stopped ones answer now, not after it. Each time, at least one read fewer.
                log.info(
                    "a staged transfer of %d reads ended as %d of them were stopped (%s); the %d others go "
                    "again as one",
                    len(reads), len(reads) - going, e, going,
                )  # fmt: skip
                return [AGAIN if o is ALONE else o for o in out]
            log.info("a staged transfer of %d reads failed (%s); they go again one by one", len(reads), e)
            return out
        # Each read's share of the bytes, by the tokens it moved (its padding included).
        spans = moved_spans([r.job for r in reads], reads[0].job.plan.decode.block_size)
        moved = [n for _, n in spans]
        shares = [total * n // sum(moved) for n in moved]
        shares[-1] = total - sum(shares[:-1])
        return list(shares)

    def _again(
        self,
        remote: RemoteEngine,
        src_rank: int,
        reads: list[StagedRead],
        refused: dict[int, SidecarError],
        regroups: int,
    ) -> list[int | _Alone | BaseException]:
        """A group refused for the reads `refused`: each fails as it would alone; the others that may
        still go are sent again as one transfer (refused again for others, again without them)."""
        out: list[int | _Alone | BaseException] = []
        rest = []
        for k, r in enumerate(reads):
            own = refused.get(k) or _stopped(r)
            out.append(own if own is not None else ALONE)
            if own is None:
                rest.append(k)
        if len(rest) == 1:
            try:
                out[rest[0]] = self._transfer(remote, src_rank, [reads[rest[0]]])
            except Exception as own:
                out[rest[0]] = own
        elif rest:
            again = self._lead(remote, src_rank, [reads[k] for k in rest], regroups)
            for k, got in zip(rest, again, strict=True):
                out[k] = got
        return out

    def _transfer(self, remote: RemoteEngine, src_rank: int, reads: list[StagedRead]) -> int:
        """One staged transfer of `reads` (one, or a group of the same two ranks); returns bytes written."""
        first = reads[0]
        job, entry = first.job, first.entry
        # The sidecar holding the source rank: the peer itself, or a member of a multi-node engine.
        holder = remote.holders.get(src_rank)
        address = holder.address if holder is not None else job.params.sidecar_address
        link = self._peers.link(address)
        agent = remote.agent_of(src_rank)
        if not entry.on_gpu and remote.memory_kind == "VRAM":
            require_gpu([entry], "decode")
        heads = read_heads(job.plan, entry.rank, src_rank)
        group = len(reads) > 1
        halt: Halt = _Halts([r.job for r in reads]) if group else job
        tokens = joined_tokens([r.job for r in reads]) if group else job.tokens
        label = (
            f"{len(reads)} requests ({job.params.request_id!r}, ...)"
            if group
            else repr(job.params.request_id)
        )
        tid = sp.new_transfer_id()
        # The chunks come from the source rank's worker where its handshake named one (staged_workers),
        # else from its sidecar; ours arrive in our worker where we run them and the source knows how.
        sender, sender_md, from_worker = remote.sender_of(src_rank)
        # Only into a source that said it knows how: the leader in its handshake, a member of a
        # multi-node engine (holder) in its report to the leader (it may run another version).
        in_worker = self._plane.staged_workers and (
            remote.staged_workers if holder is None else holder.staged_workers
        )
        if from_worker and not in_worker:
            self._nixl.load_remote(sender, sender_md)  # our own agent sends it credits
        waiting = _UntilLost(halt, self._lost, address, min(r.since for r in reads))
        waiting.remaining()  # found out of reach while these waited: not even the slots
        rx = self._plane.receive(
            Receive(entry.key, job.plan.decode, heads, tokens, sender, tid, sender_md if in_worker else b""),
            waiting,
            in_worker,
        )
        if rx is None:
            return 0  # a prefix hit covering the whole request: nothing to move
        self._metrics.staged_transfer_reads.observe(len(reads))
        push: _PushCall | None = None
        done = False
        try:
            slots = rx.slots
            # Once: another pull's answer may replace it meanwhile. None until the link is wired, nor
            # for a source that no longer expects us (it would see the notification only 50 ms on).
            key = link.push_key_for_push()
            req = peer_pb2.PushRequest(
                engine_id=job.params.engine_id,
                request_id=job.params.request_id,
                reader_engine_id=entry.engine_id,
                reader_spec=spec_to_proto(job.plan.decode),
                reader_rank=entry.rank,
                source_rank=src_rank,
                plan_hash=job.plan.hash(),
                start_token=0 if group else job.start_token,  # a group's members each name their own
                transfer_id=tid,
                reader_agent=self._sidecar_id,
                reader_agent_metadata=slots.metadata,
                memory_kind=slots.memory_kind,
                device_id=slots.device_id,
                slots=[peer_pb2.PushSlot(address=a, length=slots.slot_bytes) for a in slots.addresses],
                timeout_ms=max(1, int(halt.remaining() * 1000)),
                notified=bool(key),
                failure_notice=bool(key),
                refusal_notice=bool(key),
                reader_worker_agent=slots.agent if in_worker else "",
                source_in_worker=from_worker,
                source_agent=sender,  # a source that restarted since our handshake refuses, not sends
            )
            if group:
                req.members.extend(
                    peer_pb2.PushMember(
                        request_id=r.job.params.request_id,
                        open=r.open_msg,
                        num_tokens=r.job.num_tokens,
                        start_token=r.job.start_token,
                    )
                    for r in reads
                )
            elif first.open_msg is not None:
                req.open.CopyFrom(first.open_msg)
                req.open_num_tokens = job.num_tokens
            push = _PushCall(self._threads, self._metrics, link, req, halt, rx, key or b"")
            if req.notified:
                self._notified[tid] = (agent, push)
                # The request as a NIXL notification: the source's NIXL thread starts the transfer
                # from it (server/push_runs.py); the call follows only if it is slow.
                sent = self._nixl.notify(agent, signed_notif(PUSH_TAG, key, req.SerializeToString()))
                # Let the NIXL thread send it before the preparation below holds the GIL for
                # ~0.35 ms: the notification otherwise left ~0.2 ms later (traced on a GPU).
                wait((sent,), timeout=NOTIFY_WAIT_S)
            else:
                push.send_if_due()
            rx.prepare()  # while the source gathers its first chunk
            nbytes = _receive(halt, rx, push, address, label)
            done = True
            self._lost.pop(address, None)
            link.staged_read_completed()
            if push.notified:
                link.notified_push_done(time.monotonic() - push.sent_at)
            return nbytes
        except SidecarError as e:
            if isinstance(e, PeerUnreachable) and not isinstance(e, _SourceLost):
                self._lost[address] = (time.monotonic(), e)
            if push is None:
                raise
            pushed = push  # narrowed, for the description asked only if the error needs it
            raise waited_for(
                e, lambda: f"staged read from {address}: {pushed.describe()}; {rx.describe()}"
            ) from None
        except sp.ProtocolError as e:
            self._metrics.failures.labels("staged_protocol").inc()
            raise SidecarError(
                Code.INTERNAL, f"peer sidecar {address} broke the staged protocol: {e}"
            ) from None
        finally:
            self._notified.pop(tid, None)
            if done or push is None or not push.asked or push.refused is not None:
                rx.close(True)  # (a refusal by notification: the source said nothing is in flight)
            else:
                # Given up while the source may still WRITE into our slots: ask it to stop and answer now
                # (our scatters stop in close); the slots wait for the source's confirmation. Its Push
                # call ends at its deadline at the latest, and a source whose call ended stops within its
                # cancel wait.
                call = _stop_source(rx, push)
                rx.close(False, None if call is None else _confirmation(call))


def _stopped(read: StagedRead) -> BaseException | None:
    """Why a read of a failed group may not go again (it was stopped, or is past its deadline), or
    None: it may."""
    try:
        read.job.remaining()
    except Exception as e:
        return e
    return None


def _receive(halt: Halt, rx: Reception | WorkerReception, push: _PushCall, address: str, label: str) -> int:
    """Scatter chunks as their notifications arrive, until the transfer is complete."""
    grace: float | None = None
    while True:
        if push.refused is not None and push.call is None:
            raise _push_error(push.refused, address, label, [m.request_id for m in push.req.members])
        left = halt.remaining()
        if grace is not None and time.monotonic() > grace:
            raise sp.ProtocolError(f"the source answered but sent only part of the {rx.chunks} chunks")
        push.send_if_due()
        if rx.wait(min(0.05, left, push.wait_s()) or 1e-4):
            return rx.nbytes
        if grace is None and push.call is not None and push.call.done():
            _raise_push_error(push.call, address, label, [m.request_id for m in push.req.members])
            # It answered OK: every WRITE is done, but their notifications may trail the answer.
            grace = time.monotonic() + CANCEL_WAIT_S


def _learn_key(link: PeerLink, call: Any) -> None:
    """Keep the key of the source's answer (a restarted source gives a new one; empty: it wants none)."""
    if not call.cancelled() and call.exception() is None:
        link.learn_push_key(call.result().push_key)


def _raise_push_error(call: Any, address: str, label: str, members: Sequence[str]) -> None:
    try:
        call.result(timeout=0)
    except PeerCallError as e:
        raise _push_error(e, address, label, members) from None


def _push_error(e: PeerCallError, address: str, label: str, members: Sequence[str] = ()) -> SidecarError:
    """`label`: what was pushed, as "'request-id'" or "N requests (...)"; `members`: a group's request
    ids, one of which the source may have refused it for (RefusedMember)."""
    err = _refusal(e.code, e.details, e.ended, address, label)
    named = refused_member(e.details) if members else None
    if named is None or not 0 <= named[0] < len(members):
        return err
    # Every member the source listed (a source that lists none names only the first, in its message).
    words = {named[0]: (e.code, named[1]), **refused_members(e.trailers)}
    return RefusedMember(
        err,
        {
            k: _refusal(code, details, e.ended, address, repr(members[k]))
            for k, (code, details) in sorted(words.items())
            if 0 <= k < len(members)
        },
    )


def _refusal(code: Code, details: str, ended: bool, address: str, label: str) -> SidecarError:
    if ended:
        # The source's own verdict (e.g. UNAVAILABLE: its NIXL WRITE failed).
        return SidecarError(code, f"{details} (peer sidecar {address})")
    return peer_error(code, details, address, f"to push request {label}")


def _stop_source(rx: Reception | WorkerReception, push: _PushCall) -> Any:
    """Ask the source to stop; the Push call whose answer confirms it, None if none could be sent."""
    if push.call is None or not push.call.done():
        rx.stop_source()
    else:
        rx.stop_credits()
    if push.call is None:  # only the notification went: the call confirms the stop (and starts nothing)
        try:
            push.send_stopping()
        except Exception:
            return None
    return push.call


def _confirmation(call: Any) -> Callable[[Callable[[bool], None]], None]:
    """Tells its callback, once the source's Push call ends, whether nothing is in flight any more: an
    answer, or the source's own error (PeerCallError.ended); not a lost or cancelled call."""

    def settles(settled: Callable[[bool], None]) -> None:
        def ended(c: Any) -> None:
            if c.cancelled():
                settled(False)
                return
            e = c.exception()
            settled(e is None or (isinstance(e, PeerCallError) and e.ended))

        call.add_done_callback(ended)

    return settles
