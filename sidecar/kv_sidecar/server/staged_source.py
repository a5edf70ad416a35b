"""The source's end of the staged protocol, its control half: the Push handler checks the request (or
opens it, when the Push carries the open) and hands the transfer to the data plane, which gathers
chunks into its send ring and WRITEs each into a receive slot the reader granted (dataplane/send.py;
docs/gpu.md says how the protocol flows)."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from kv_sidecar.dataplane import staged_protocol as sp
from kv_sidecar.dataplane.jobs import RankKey, Send
from kv_sidecar.dataplane.plane import DataPlane
from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.metrics import Metrics
from kv_sidecar.plan.blocks import check_tokens
from kv_sidecar.plan.pair import PairPlan
from kv_sidecar.server.engines import EngineRegistry, spec_from_proto
from kv_sidecar.server.peers import cached_plan
from kv_sidecar.server.published import Published, PublishedStore
from kv_sidecar.server.push_runs import DuplicateTransfer, PushKeys, PushRun, PushRuns
from kv_sidecar.server.push_threads import PushThreads
from kv_sidecar.server.reads import SourceReads
from kv_sidecar.server.staged_common import (
    MAX_PUSH_MEMBERS,
    MAX_SLOTS,
    PATH_HOST_RING,
    PATH_STAGED,
    member_refusals,
    read_heads,
)
from kv_sidecar.transport.notifications import PUSH_TAG, push_failed, push_refused
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2

log = logging.getLogger(__name__)

# A reader whose notified transfer has not finished 5 ms after its notification (under load up to
# 100 ms: staged_reader.call_after_s) sends the Push call, which then carries its liveness. A transfer its call has not joined this long after
# it started has lost its reader (it died before the call went out): stop it, rather than hold send
# slots until the request's timeout (30 s by default) waiting for credits that never come. A live
# reader's call arrives within milliseconds; the rest is margin for a loaded machine.
ALONE_S = 2.0


class PushCall(Protocol):
    """What the source asks of the Push call it serves (a gRPC call, or a notification's stand-in)."""

    def peer(self) -> str: ...

    def time_remaining(self) -> float | None: ...

    def add_callback(self, fn: Callable[[], None]) -> bool:
        """Run fn when the call ends (the reader went away, or we answered)."""
        ...

    def ended(self) -> None:
        """Our answer will say that nothing of the transfer is in flight (the reader may reuse its slots)."""
        ...


class _ReaderGone(SidecarError):
    """A notified transfer whose Push call never came (ALONE_S)."""


class _RunContext:
    """The PushCall of a transfer a notification started, until its call joins."""

    def __init__(self, run: PushRun, peer: str) -> None:
        self._run = run
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        """None once the call joined (the request's own timeout_ms bounds the transfer); until then,
        what is left of ALONE_S, and past it the transfer stops."""
        if self._run.called:
            return None
        left = self._run.started + ALONE_S - time.monotonic()
        if left <= 0:
            raise _ReaderGone(
                Code.CANCELLED,
                f"transfer {self._run.transfer_id}: its reader's Push call did not follow the notification "
                f"within {ALONE_S:g} s; the reader is taken for gone",
            )
        return left

    def add_callback(self, fn: Callable[[], None]) -> bool:
        self._run.add_callback(fn)  # runs if the call that joins goes away first
        return True

    def ended(self) -> None:
        pass  # the run keeps that itself (PushRun.finish), for the call that joins it


@dataclass
class _PushHalt:
    """May a Push go on: not once its call ended (the reader went away), nor past its deadline, nor,
    for a transfer its notification started, once its call is ALONE_S late (`alone`)."""

    what: str  # the request pushed, quoted, or "N requests (...)"
    deadline: float
    stopped: threading.Event
    alone: _RunContext | None

    def remaining(self) -> float:
        if self.stopped.is_set():
            raise SidecarError(Code.CANCELLED, f"push of request {self.what}: the reader went away")
        left = self.deadline - time.monotonic()
        alone_left = self.alone.time_remaining() if self.alone is not None else None  # raises past ALONE_S
        if alone_left is not None:
            left = min(left, alone_left)
        if left <= 0:
            raise SidecarError(Code.DEADLINE_EXCEEDED, f"pushing request {self.what} timed out")
        return left


class StagedSource:
    """The Pushes served here: started by a reader's call or its notification."""

    def __init__(
        self,
        engines: EngineRegistry,
        published: PublishedStore,
        reads: SourceReads,
        plane: DataPlane,
        threads: PushThreads,
        metrics: Metrics,
        push_keys: PushKeys,
        push_runs: PushRuns,
        notifications: bool,
        pull_timeout_s: float,
        notify: Callable[[str, bytes], object],
        agent: str,
    ) -> None:
        """agent: this sidecar's NIXL agent's name; notifications: the push_notifications setting
        (readers get keys to push by notification);
        notify: sends a NIXL notification to a reader's agent if it is loaded here (the failure notice:
        a reader whose agent is not, e.g. one that never handshook with this member of a multi-node
        engine, learns of the failure from its call, when due)."""
        self._engines = engines
        self._published = published
        self._reads = reads
        self._plane = plane
        self._threads = threads
        self._metrics = metrics
        self._push_keys = push_keys
        self._push_runs = push_runs
        self._notifications = notifications
        self._pull_timeout_s = pull_timeout_s
        self._notify = notify
        self._agent = agent

    def serve(self, req: peer_pb2.PushRequest, context: PushCall) -> peer_pb2.PushResponse:
        """Send one source rank's share of an opened request into the reader's receive slots, or, when
        its notification already started that (`req.notified`), wait for that transfer and answer for it
        (`req.stopping`: stop it first; start nothing).

        Every answer given while nothing of the transfer is in flight (success, a
        refusal, a stop after the WRITEs ended) says so (`PushCall.ended`), so that the
        reader may reuse its slots at once.
        """
        key = self._push_keys.grant(req.reader_agent, context.peer()) if self._notifications else b""
        if req.notified or req.stopping:
            try:
                run = self._push_runs.claim_by_call(req.transfer_id)
            except DuplicateTransfer:
                raise SidecarError(
                    Code.ALREADY_EXISTS, f"transfer {req.transfer_id} was pushed before"
                ) from None
            if req.stopping:
                if run is None:  # claimed: its notification, should it still come, starts nothing
                    context.ended()
                    raise SidecarError(
                        Code.CANCELLED, f"transfer {req.transfer_id}: the reader stopped it before it started"
                    )
                run.cancel()
            if run is not None:
                return self._join(run, context, key)
        else:
            self._push_runs.reader_seen()
        self._metrics.push_starts.labels("call").inc()
        quiet = [True]
        try:
            resp = self._push(req, context, quiet)
            resp.push_key = key
            return resp
        finally:
            if quiet[0]:
                context.ended()

    def from_notification(self, agent: str, msg: bytes) -> None:
        """A Push sent as a NIXL notification (driver thread): start its transfer on a source thread,
        unless its call came first. Refused notifications are dropped; the call then does the work."""
        signed = self._push_keys.verify(agent, PUSH_TAG, msg, peer_pb2.PushRequest.FromString)
        if signed is None or signed[1].reader_agent != agent or not sp.is_transfer_id(signed[1].transfer_id):
            # Wrong key (this sidecar restarted since the reader got it, or not a reader at all), or no
            # key at all: with push_notifications off none is ever given.
            self._metrics.failures.labels("push_notification_refused").inc()
            log.debug("refused a Push notification from %s", agent)
            return
        peer, req = signed
        run = self._push_runs.start_by_notif(req.transfer_id)
        if run is not None:
            self._metrics.push_starts.labels("notification").inc()
            self._threads.run_source(functools.partial(self._run_push, req, run, peer, agent))

    def _run_push(self, req: peer_pb2.PushRequest, run: PushRun, peer: str, agent: str) -> None:
        quiet = [True]
        try:
            run.finish(self._push(req, _RunContext(run, peer), quiet), None, quiet[0])
        except BaseException as e:
            if isinstance(e, _ReaderGone):
                self._metrics.failures.labels("push_call_missing").inc()
                log.warning("%s", e.message)
            elif not isinstance(e, SidecarError):
                log.exception("push %s started by notification failed", req.transfer_id)
            run.finish(None, e, quiet[0])
            if req.failure_notice and not run.called and not isinstance(e, _ReaderGone):
                self._tell_failed(agent, req, e if quiet[0] else None)
        finally:
            self._push_runs.ended(run)

    def _tell_failed(self, agent: str, req: peer_pb2.PushRequest, ended: BaseException | None) -> None:
        """The reader's call is not due for up to 100 ms (staged_reader.call_after_s), and under load
        that wait made a batch with a refused member several times slower than one without (issue 32,
        docs/benchmarks.md): tell it now. `ended`: the error, where nothing of the transfer is in flight;
        a reader that takes it (refusal_notice) gets the answer its call would get, and sends none;
        otherwise its call comes for the error (and, mid-transfer, the stop's confirmation)."""
        key = self._push_keys.key_of(agent) if req.refusal_notice else None
        if key and isinstance(ended, SidecarError):
            msg = push_refused(key, req.transfer_id, ended.code.name, ended.message, ended.metadata)
        else:
            msg = push_failed(req.transfer_id)
        try:
            self._notify(agent, msg)
        except Exception:
            log.debug(
                "could not tell reader %s that transfer %s failed", agent, req.transfer_id, exc_info=True
            )

    def _join(self, run: PushRun, context: PushCall, key: bytes) -> peer_pb2.PushResponse:
        """Answer for a transfer the Push's notification started: its result, once it has one."""
        context.add_callback(run.cancel)  # the reader went away: stop, as for a call that started it
        try:
            if not run.wait(context.time_remaining()):
                raise SidecarError(Code.DEADLINE_EXCEEDED, f"transfer {run.transfer_id} did not end in time")
            if run.quiet:
                context.ended()
            if run.error is not None:
                raise run.error
            resp = peer_pb2.PushResponse()
            resp.CopyFrom(run.response)
            resp.push_key = key
            return resp
        finally:
            self._push_runs.joined(run)

    def _push(self, req: peer_pb2.PushRequest, context: PushCall, quiet: list[bool]) -> peer_pb2.PushResponse:
        group = len(req.members) > 0
        src_entry = self._engines.get(req.engine_id, req.source_rank)
        source = {src_entry.rank: src_entry.generation}  # the rank this Push sends, as registered now
        item = None if group or req.HasField("open") else self._opened(req, req.request_id, source)
        self._check_sender(req, src_entry.key)
        if not req.HasField("reader_spec"):
            raise SidecarError(Code.INVALID_ARGUMENT, "reader_spec is required")
        reader_spec = spec_from_proto(req.reader_spec)
        plan = cached_plan(src_entry.spec, reader_spec)
        if plan.hash() != req.plan_hash:
            raise SidecarError(
                Code.FAILED_PRECONDITION, f"plan mismatch: ours {plan.hash()}, the reader's {req.plan_hash}"
            )
        if not 0 <= req.reader_rank < reader_spec.tp_size:
            raise SidecarError(Code.INVALID_ARGUMENT, f"reader rank {req.reader_rank} out of range")
        heads = read_heads(plan, req.reader_rank, req.source_rank)  # from our plan, not the reader's word
        if src_entry.memory_kind != req.memory_kind:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"engine {req.engine_id!r} rank {req.source_rank} is in {src_entry.memory_kind} memory, "
                f"the reader's ring in {req.memory_kind!r}",
            )
        if not sp.is_transfer_id(req.transfer_id):
            raise SidecarError(Code.INVALID_ARGUMENT, "transfer_id must be 16 lowercase hex characters")
        if not 1 <= len(req.slots) <= MAX_SLOTS or any(s.length == 0 for s in req.slots):
            raise SidecarError(Code.INVALID_ARGUMENT, f"between 1 and {MAX_SLOTS} non-empty slots are needed")
        per_chunk = self._plane.blocks_per_chunk(src_entry.key, reader_spec, [s.length for s in req.slots])
        # The opens it carries, checked like OpenReads once the rest of the Push is sound.
        if group:
            block_ids, num_tokens = self._members(req, plan, context.peer(), src_entry.on_gpu, source)
            what = f"{len(req.members)} requests ({req.members[0].request_id!r}, ...)"
            # No request's own uploaded ids: the data plane uploads the joined ones at once.
            ids_of: tuple[str, str] | None = None
        else:
            if item is None:
                item = self._open_from_push(
                    req, req.request_id, req.open, req.open_num_tokens, plan, context.peer(), src_entry.on_gpu
                )
            check_tokens(item.num_tokens, req.start_token, reader_spec.block_size)
            item.check_read_from(req.start_token)
            block_ids, num_tokens = item.source_blocks, item.num_tokens  # from our own record
            what = repr(req.request_id)
            ids_of = (req.engine_id, req.request_id)
        chunks = sp.plan_chunks(req.start_token, num_tokens, reader_spec.block_size, per_chunk)
        if not chunks:
            return peer_pb2.PushResponse()
        left = req.timeout_ms / 1000 if req.timeout_ms else self._pull_timeout_s
        # A transfer a notification started asks its context at each wait instead (ALONE_S, until its
        # call joins); its deadline, which its WRITEs get too, is the request's own.
        alone = context if isinstance(context, _RunContext) else None
        call_left = None if alone is not None else context.time_remaining()
        deadline = time.monotonic() + (left if call_left is None else min(left, call_left))
        stopped = threading.Event()
        context.add_callback(stopped.set)  # the call ended: the reader went away (or we answered)

        tx = self._plane.send(
            Send(
                src_entry.key,
                reader_spec,
                req.reader_rank,
                heads,
                ids_of,
                block_ids,  # from our own records: the reader names only a start token (and counts)
                num_tokens,
                req.start_token,
                tuple(chunks),
                req.transfer_id,
                req.reader_worker_agent or req.reader_agent,  # where the chunks go, credits come from
                req.reader_agent_metadata,
                tuple((s.address, s.length) for s in req.slots),
                req.device_id,
                deadline,
            ),
            in_worker=req.source_in_worker,
        )
        context.add_callback(lambda: tx.stop("the reader cancelled the Push"))
        try:
            sent = tx.run(_PushHalt(what, deadline, stopped, alone))
            return peer_pb2.PushResponse(chunks=sent.chunks, bytes=sent.nbytes)
        except sp.Stopped as e:
            self._read_failed(req)
            raise SidecarError(Code.CANCELLED, f"push of request {what} stopped: {e}") from None
        except SidecarError as e:
            self._read_failed(req)
            if e.code is Code.DEADLINE_EXCEEDED:  # its reader times out too, and may not see this answer
                log.warning("transfer %s to %s: %s", req.transfer_id, req.reader_agent, e.message)
            raise
        finally:
            quiet[0] = tx.quiet

    def _read_failed(self, req: peer_pb2.PushRequest) -> None:
        """The transfer of the Push's request(s) failed, and no gather of it runs any more: another
        reader may take them over (PublishedStore.read_failed), e.g. where this reader's sidecar died."""
        for request_id in [m.request_id for m in req.members] or [req.request_id]:
            self._published.read_failed(req.engine_id, request_id, req.reader_engine_id)

    def _opened(self, req: peer_pb2.PushRequest, request_id: str, source: Mapping[int, int]) -> Published:
        """A request opened before the Push (OpenRead): it must be open for this reader, and held by the
        registration of the source rank that sends it (`source`: that rank -> its registration now)."""
        item = self._published.get_live(req.engine_id, request_id)
        item.check_sources(source)
        if item.reader != req.reader_engine_id:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"request {request_id!r} is not open for engine {req.reader_engine_id!r}: OpenRead first",
            )
        return item

    def _check_sender(self, req: peer_pb2.PushRequest, key: RankKey) -> None:
        """The agent the reader takes the chunks from must be the one that sends them here: else its
        handshake is with a sidecar before this one at this address (it would refuse every chunk)."""
        if not req.source_agent:
            return
        # The name only: asking the worker for its agent (worker_agent) is a round trip to its process.
        worker = self._plane.worker_agent_name(key) if req.source_in_worker else None
        ours = worker or self._agent
        if req.source_agent != ours:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"this sidecar sends rank {req.source_rank} of engine {req.engine_id!r} from agent {ours}, "
                f"not {req.source_agent}: the reader's handshake is with a sidecar before this one "
                f"(restarted since); handshake again",
            )

    def _open_from_push(
        self,
        req: peer_pb2.PushRequest,
        request_id: str,
        o: peer_pb2.OpenReadRequest,
        planned_tokens: int,
        plan: PairPlan,
        peer: str,
        on_gpu: bool,
    ) -> Published:
        """The open a Push carries (for one of its members: `request_id`): it must name the request, the
        Push's reader and plan, and the token count the reader planned its slots for; then it opens the
        request exactly as OpenRead does."""
        self._check_open(req, request_id, o, planned_tokens)
        (opened,) = self._open_checked([o], plan, peer, on_gpu)
        if isinstance(opened, SidecarError):
            raise opened
        return opened

    def _check_open(
        self, req: peer_pb2.PushRequest, request_id: str, o: peer_pb2.OpenReadRequest, planned_tokens: int
    ) -> Published:
        """_open_from_push's checks, which change nothing: the request's live record."""
        if (o.engine_id, o.request_id, o.reader_engine_id, o.plan_hash) != (
            req.engine_id,
            request_id,
            req.reader_engine_id,
            req.plan_hash,
        ) or req.reader_rank not in o.reader_ranks:
            raise SidecarError(
                Code.INVALID_ARGUMENT,
                "the open a Push carries must name the Push's engine, request, reader engine, plan and reader rank",
            )
        item = self._published.get_live(req.engine_id, request_id)
        if item.num_tokens != planned_tokens:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"request {request_id!r} holds {item.num_tokens} tokens here, the reader planned "
                f"{planned_tokens}: its transfer params are out of date",
            )
        return item

    def _open_checked(
        self, opens: list[peer_pb2.OpenReadRequest], plan: PairPlan, peer: str, on_gpu: bool
    ) -> list[Published | SidecarError]:
        """The opens a Push carries, checked: each one's record, or what refused it."""
        path = PATH_STAGED if on_gpu else PATH_HOST_RING
        return self._reads.open_pushed(opens, plan, peer, path)

    def _members(
        self, req: peer_pb2.PushRequest, plan: PairPlan, peer: str, on_gpu: bool, source: Mapping[int, int]
    ) -> tuple[list[int], int]:
        """A Push of several requests: each checked (and opened, where it carries its open) as a Push of
        its own would be; their blocks from each member's start concatenated as
        staged_protocol.member_spans lays them out, and the tokens that moves. A member refused
        refuses the Push, naming every member refused (`member_refusals`: the reader fails those reads
        and sends the others again as one)."""
        bp, bd = plan.prefill.block_size, plan.decode.block_size
        if len(req.members) > MAX_PUSH_MEMBERS:
            raise SidecarError(
                Code.INVALID_ARGUMENT,
                f"a Push of {len(req.members)} requests is more than {MAX_PUSH_MEMBERS}, the most one transfer carries",
            )
        if req.start_token or bd % bp:
            raise SidecarError(
                Code.INVALID_ARGUMENT,
                "a Push of several requests has start_token 0 (each member names its own start), into "
                f"reader blocks a multiple of the source's (here {bd} and {bp} tokens)",
            )
        # Every member checked before any is opened: a refused Push opens nothing that its reader,
        # sending the others again, would only open again (~45 us each on a GPU source).
        items = []
        refusals: list[tuple[int, SidecarError]] = []
        for i, m in enumerate(req.members):
            try:
                if m.start_token % bd or m.start_token >= m.num_tokens:
                    raise SidecarError(
                        Code.INVALID_ARGUMENT,
                        f"start_token {m.start_token} is not a block boundary below num_tokens {m.num_tokens} "
                        f"(reader blocks of {bd})",
                    )
                if m.HasField("open"):
                    item = self._check_open(req, m.request_id, m.open, m.num_tokens)
                    item.check_sources(source)
                else:
                    item = self._opened(req, m.request_id, source)
                _check_member_tokens(m, item)
            except SidecarError as e:
                refusals.append((i, e))  # the others checked too: the reader drops all in one go
                continue
            items.append(item)
        if not refusals:
            with_open = [i for i, m in enumerate(req.members) if m.HasField("open")]
            opened = self._open_checked([req.members[i].open for i in with_open], plan, peer, on_gpu)
            for i, got in zip(with_open, opened, strict=True):
                if isinstance(got, SidecarError):
                    refusals.append((i, got))
                    continue
                items[i] = got
                try:
                    _check_member_tokens(req.members[i], got)  # the record opened (published again since?)
                except SidecarError as e:
                    refusals.append((i, e))
        if refusals:
            raise member_refusals(refusals)
        spans = sp.member_spans([m.num_tokens - m.start_token for m in req.members], bd)
        block_ids: list[int] = []
        for m, item, (_, moved) in zip(req.members, items, spans, strict=True):
            own = item.source_blocks
            first, stop, repeats = sp.member_block_range(len(own), m.start_token, moved, bp)
            block_ids += own[first:stop]
            block_ids += own[-1:] * repeats
        return block_ids, spans[-1][0] + spans[-1][1]


def _check_member_tokens(m: peer_pb2.PushMember, item: Published) -> None:
    """A group member's record holds the tokens its reader planned, from token 0."""
    if item.num_tokens != m.num_tokens or item.first_token:
        raise SidecarError(
            Code.FAILED_PRECONDITION,
            f"request {m.request_id!r} holds tokens [{item.first_token}, {item.num_tokens}) here, "
            f"the reader planned [0, {m.num_tokens})",
        )
