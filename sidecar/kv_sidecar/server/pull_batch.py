"""PullBatch: a decode engine's pulls for one step in one call.

Each member runs as its own Pull would (admitted, stoppable by Abort of its request, its own deadline
and its own outcome), so a member that fails fails alone. What the batch saves is per call: one
engine-lane frame each way instead of one per request, and fewer threads per member, whose hand-offs
contend for the one interpreter:

- members from other sidecars on the staged protocol (GPU ranks, or host_transfer: ring), with
  staged_batch_reads: one unit on the call's thread. Each runs its steps (Puller.pull_steps: checks,
  plan, open) up to its staged read; then the reads go together (StagedReader.read_all: one transfer
  per rank pair, one thread per pair); each member goes on to its answer on the thread that finished
  its read, the moment it is read (a further read of it, a TP gather's, alone there). A member whose
  read failed goes on on the pool (its retry, or its failure's own calls to the source, which may
  hang), so that one member's trouble holds up no other;
- other members from other sidecars (host-nixl READs; a first handshake, or OpenReads, which may
  wait for a peer that hangs) wait side by side on this module's pool;
- same-sidecar copies run one after another on the call's thread (on the pool when the call's thread
  runs staged members).

The work a member leaves for after its answer (its log record, "consumed" events) runs once that
member's outcome is out when outcomes are streamed (the engine lane), else once the whole answer is.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import NamedTuple

from kv_sidecar.errors import Code, SidecarError, as_sidecar_error
from kv_sidecar.server.after_answer import Later, run_later
from kv_sidecar.server.staged_reader import StagedRead, Steps, run_steps
from kv_sidecar_client._proto.kvsidecar.v1 import engine_pb2

log = logging.getLogger(__name__)

# engine_calls' own alias (that module builds PullBatches, so this one cannot import it).
OnHangup = Callable[[Callable[[], None]], None]
# Runs one member as EngineCalls.pull does: the request, its hang-up registration, its `later`.
MemberFn = Callable[[engine_pb2.PullRequest, OnHangup, Later], engine_pb2.PullResponse]
# Told each member's outcome the moment it ends (from whichever thread ran it), its index set.
OnOutcome = Callable[[engine_pb2.PullOutcome], None]


class _Hangup:
    """The batch's one hang-up: stops every member admitted so far, and each one admitted later at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stops: list[Callable[[], None]] = []
        self._hung_up = False

    def register(self, stop: Callable[[], None]) -> None:
        with self._lock:
            if not self._hung_up:
                self._stops.append(stop)
                return
        stop()

    def fire(self) -> None:
        with self._lock:
            self._hung_up = True
            stops, self._stops = self._stops, []
        for stop in stops:
            stop()


class Together(NamedTuple):
    """How staged members run as one unit: their steps (EngineCalls.pull_steps), which members take the
    staged protocol (Puller.goes_staged), and how their reads move together (StagedReader.read_all)."""

    steps: Callable[[engine_pb2.PullRequest, OnHangup, Later], Steps[engine_pb2.PullResponse]]
    goes_staged: Callable[[engine_pb2.PullRequest], bool]
    read_all: Callable[[Sequence[StagedRead], Executor, Callable[[int, int | BaseException], None]], None]
    read: Callable[[StagedRead], int]  # one read alone (StagedReader.read)


def _group(p: engine_pb2.PullRequest) -> int | None:
    return p.group if p.HasField("group") else None


def _overlap(a: engine_pb2.PullRequest, b: engine_pb2.PullRequest) -> bool:
    """Whether two members pull the same request's group into the same ranks (no ranks: every rank)."""
    if _group(a) != _group(b):
        return False  # a hybrid model's groups of one request are pulls of their own
    return not a.ranks or not b.ranks or bool(set(a.ranks) & set(b.ranks))


def repeated_members(pulls: list[engine_pb2.PullRequest]) -> dict[int, int]:
    """Members that repeat an earlier one (the same request and group into overlapping ranks): index -> the
    earlier one."""
    out: dict[int, int] = {}
    by_request: dict[tuple[str, str, str], list[int]] = {}
    for i, p in enumerate(pulls):
        seen = by_request.setdefault((p.engine_id, p.params.engine_id, p.params.request_id), [])
        for j in seen:
            if _overlap(pulls[j], p):
                out[i] = j
                break
        seen.append(i)
    return out


def failed(e: BaseException, index: int) -> engine_pb2.PullOutcome:
    err = as_sidecar_error(e)
    return engine_pb2.PullOutcome(
        code=err.code.name, message=err.message, trailers=dict(err.metadata), index=index
    )


class PullBatches:
    """Runs the members of PullBatch calls."""

    def __init__(
        self,
        run_member: MemberFn,
        max_members: int,
        local_sidecar_id: str,
        threads: int,
        observe_size: Callable[[int], None],
        together: Together | None = None,
    ) -> None:
        """together: staged members from other sidecars run as one unit (staged_batch_reads); None: each
        on the pool, as other members from other sidecars."""
        self._together = together
        self._run_member = run_member
        self._observe_size = observe_size
        self._max = max_members
        self._me = local_sidecar_id
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pull-batch")

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def run(
        self,
        batch: engine_pb2.PullBatchRequest,
        on_hangup: OnHangup,
        later: Later,
        on_outcome: OnOutcome | None = None,
    ) -> engine_pb2.PullBatchResponse:
        """Every member's outcome, in order. Raises only for the batch as a whole (before any member ran,
        so before any `on_outcome`)."""
        pulls = list(batch.pulls)
        if not pulls:
            raise SidecarError(Code.INVALID_ARGUMENT, "a PullBatch needs at least one pull")
        if len(pulls) > self._max:
            raise SidecarError(
                Code.INVALID_ARGUMENT,
                f"a PullBatch of {len(pulls)} pulls is more than this sidecar takes in one call "
                f"(max_pull_batch {self._max}); split it",
            )
        self._observe_size(len(pulls))  # a batch served (refused ones are not)
        start = time.perf_counter()
        hangup = _Hangup()
        on_hangup(hangup.fire)
        outcomes: list[engine_pb2.PullOutcome | None] = [None] * len(pulls)
        told = on_outcome or (lambda _: None)
        # Streamed, a member's own "after its answer" comes after its own outcome; else after the batch's.
        streamed = on_outcome is not None
        for i, j in repeated_members(pulls).items():
            p = pulls[i]
            outcomes[i] = failed(
                SidecarError(
                    Code.INVALID_ARGUMENT,
                    f"pulls[{i}] pulls request {p.params.request_id!r} of engine {p.params.engine_id!r} into "
                    f"ranks that pulls[{j}] fills too",
                ),
                i,
            )
            told(outcomes[i])
        # Pulls from another sidecar wait on the network: staged ones as one unit on this thread, others
        # side by side on the pool. Copies on this node are CPU work: one after another here (on the
        # pool when this thread runs the staged ones), while those wait.
        together = self._together
        todo = [i for i, o in enumerate(outcomes) if o is None]
        local = [i for i in todo if pulls[i].params.sidecar_id == self._me]
        staged = [
            i for i in todo if together is not None and i not in local and together.goes_staged(pulls[i])
        ]
        on_this_thread = set(staged) or set(local)  # the rest of `todo` on the pool
        waiting: list[tuple[int, Future[engine_pb2.PullOutcome]]] = []
        for i in todo:
            if i not in on_this_thread:
                waiting.append(
                    (i, self._pool.submit(self._member, i, pulls[i], hangup, later, told, streamed))
                )
        if staged:
            assert together is not None
            for i, outcome in self._together_run(
                together, staged, pulls, hangup, later, told, streamed
            ).items():
                outcomes[i] = outcome
        else:
            for i in local:
                outcomes[i] = self._member(i, pulls[i], hangup, later, told, streamed)
        for i, fut in waiting:
            outcomes[i] = fut.result()
        return engine_pb2.PullBatchResponse(
            outcomes=outcomes, duration_us=int((time.perf_counter() - start) * 1e6)
        )

    def _together_run(
        self,
        together: Together,
        members: list[int],
        pulls: list[engine_pb2.PullRequest],
        hangup: _Hangup,
        later: Later,
        told: OnOutcome,
        streamed: bool,
    ) -> dict[int, engine_pb2.PullOutcome]:
        """Staged members as one unit: each runs its steps up to its read, the reads go together, and each
        goes on from its read to its answer (on the pool where its read failed)."""
        outcomes: dict[int, engine_pb2.PullOutcome] = {}
        mine: dict[int, Later] = {i: [] for i in members}
        steps = {i: together.steps(pulls[i], hangup.register, mine[i]) for i in members}
        failing: list[tuple[int, Future[engine_pb2.PullOutcome]]] = []

        def go_on(i: int, start: Callable[[], StagedRead]) -> engine_pb2.PullOutcome:
            try:
                response = run_steps(steps[i], together.read, start)
                outcome = engine_pb2.PullOutcome(response=response, index=i)
            except Exception as e:
                outcome = failed(e, i)
            return self._settle(i, outcome, mine[i], later, told, streamed)

        wanted: list[int] = []
        wants: list[StagedRead] = []
        for i in members:
            try:
                wants.append(next(steps[i]))
                wanted.append(i)
            except StopIteration as done:  # answered without a staged read
                outcome = engine_pb2.PullOutcome(response=done.value, index=i)
                outcomes[i] = self._settle(i, outcome, mine[i], later, told, streamed)
            except Exception as e:
                outcomes[i] = self._settle(i, failed(e, i), mine[i], later, told, streamed)

        def read(k: int, moved: int | BaseException) -> None:
            i, member = wanted[k], steps[wanted[k]]
            if isinstance(moved, BaseException):
                failing.append((i, self._pool.submit(go_on, i, functools.partial(member.throw, moved))))
            else:
                outcomes[i] = go_on(i, functools.partial(member.send, moved))

        together.read_all(wants, self._pool, read)
        for i, fut in failing:  # complete: read_all returned after its last `read`
            outcomes[i] = fut.result()
        return outcomes

    def _member(
        self,
        index: int,
        req: engine_pb2.PullRequest,
        hangup: _Hangup,
        later: Later,
        told: OnOutcome,
        streamed: bool,
    ) -> engine_pb2.PullOutcome:
        mine: Later = []
        try:
            outcome = engine_pb2.PullOutcome(
                response=self._run_member(req, hangup.register, mine), index=index
            )
        except Exception as e:
            outcome = failed(e, index)
        return self._settle(index, outcome, mine, later, told, streamed)

    @staticmethod
    def _settle(
        index: int,
        outcome: engine_pb2.PullOutcome,
        mine: Later,
        later: Later,
        told: OnOutcome,
        streamed: bool,
    ) -> engine_pb2.PullOutcome:
        """A member ended: tell its outcome, and run (streamed) or hand on what it left for later."""
        if not streamed:
            later.extend(mine)  # list.extend is atomic: members on the pool append side by side
        try:
            told(outcome)
        except Exception:  # the engine went away: the call's own answer will fail the same way
            log.debug("could not send pulls[%d]'s outcome ahead", index, exc_info=True)
        if streamed:  # the prefill engine hears "consumed" when this member ends, not the step's slowest
            run_later(mine)
        return outcome
