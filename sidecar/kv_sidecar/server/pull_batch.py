"""PullBatch: a decode engine's pulls for one step in one call.

Each member runs as its own Pull would (admitted, stoppable by Abort of its request, its own deadline
and its own outcome), so a member that fails fails alone. What the batch saves is per call: one
engine-lane frame each way instead of one per request, and fewer threads per member, whose hand-offs
contend for the one interpreter:

- with staged_batch_reads, members from engines on this sidecar (copies) and members from other
  sidecars that are one staged read (GPU ranks, or host_transfer: ring) from a source already
  handshaken with run as one unit on the call's thread. Each runs its steps (Puller.pull_steps:
  checks, plan, open) up to its move; then the moves go together (Puller.move_all: the copies launched
  together with one wait; the staged reads one transfer per rank pair, one thread per pair); each
  member goes on to its answer on the thread that made its move, the moment it is made (a further
  move of it, a TP gather's second read, alone there). A member whose move failed goes on on the
  pool (its retry, or its failure's own calls to the source, which may hang), so that one member's
  trouble holds up no other. A member whose next step waits for a peer after all (its params did not
  plan, so it asks the source with an OpenRead; its handshake was dropped meanwhile) says so
  (`Apart`) and goes on on the pool too;
- other members from other sidecars (host-nixl READs; a first handshake, or OpenReads, which may
  wait for a peer that hangs) wait side by side on this module's pool;
- without staged_batch_reads, same-sidecar copies run one after another on the call's thread.

The work a member leaves for after its answer (its log record, done notifications, "consumed"
events) runs once its outcome is out when outcomes are streamed (the engine lane): with those of the
members whose moves ended with its own, after all of their outcomes, which go out together, their
done notifications joined into one per source that takes them so (after_answer.Joined). Otherwise it
runs once the whole answer is, all members' done notifications joined.
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
from kv_sidecar.server.pull_steps import Apart, Made, Steps, Want, run_steps
from kv_sidecar_client._proto.kvsidecar.v1 import engine_pb2

log = logging.getLogger(__name__)

# engine_calls' own alias (that module builds PullBatches, so this one cannot import it).
OnHangup = Callable[[Callable[[], None]], None]
# Runs one member as EngineCalls.pull does: the request, its hang-up registration, its `later`.
MemberFn = Callable[[engine_pb2.PullRequest, OnHangup, Later], engine_pb2.PullResponse]
# Told members' outcomes the moment they end (from whichever thread ran them), each its index set:
# one member's, or those of members that ended together.
OnOutcomes = Callable[[list[engine_pb2.PullOutcome]], None]


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
    """How members run as one unit: their steps (EngineCalls.pull_steps), which members may
    (Puller.goes_together), and how their moves are made together and alone (Puller.move_all, move)."""

    steps: Callable[[engine_pb2.PullRequest, OnHangup, Later], Steps[engine_pb2.PullResponse]]
    goes_together: Callable[[engine_pb2.PullRequest], bool]
    move_all: Callable[[Sequence[Want], Executor, Made], None]
    move: Callable[[Want], int]


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


def failed(e: Exception, index: int) -> engine_pb2.PullOutcome:
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
        """together: members run as one unit where they may (staged_batch_reads); None: members from other
        sidecars each on the pool, same-sidecar ones in turn on the call's thread."""
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
        on_outcome: OnOutcomes | None = None,
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
        told: OnOutcomes = on_outcome or (lambda _: None)
        # Streamed, a member's own "after its answer" comes after its own outcome; else after the batch's.
        streamed = on_outcome is not None
        for i, j in repeated_members(pulls).items():
            p = pulls[i]
            refused = failed(
                SidecarError(
                    Code.INVALID_ARGUMENT,
                    f"pulls[{i}] pulls request {p.params.request_id!r} of engine {p.params.engine_id!r} into "
                    f"ranks that pulls[{j}] fills too",
                ),
                i,
            )
            outcomes[i] = refused
            told([refused])
        # Members that wait for nothing but their moves as one unit on this thread; others from another
        # sidecar side by side on the pool. Without the unit, copies on this node are CPU work: one
        # after another here, while those on the pool wait.
        together = self._together
        todo = [i for i, o in enumerate(outcomes) if o is None]
        if together is not None:
            here = [i for i in todo if together.goes_together(pulls[i])]
        else:
            here = [i for i in todo if pulls[i].params.sidecar_id == self._me]
        waiting: list[tuple[int, Future[engine_pb2.PullOutcome]]] = []
        for i in sorted(set(todo) - set(here)):
            waiting.append((i, self._pool.submit(self._member, i, pulls[i], hangup, later, told, streamed)))
        if together is not None:
            outcomes_here = self._together_run(together, here, pulls, hangup, later, told, streamed)
            for i, outcome in outcomes_here.items():
                outcomes[i] = outcome
        else:
            for i in here:
                outcomes[i] = self._member(i, pulls[i], hangup, later, told, streamed)
        for i, fut in waiting:
            outcomes[i] = fut.result()
        answered = [
            o if o is not None else failed(RuntimeError("the member got no outcome"), i)
            for i, o in enumerate(outcomes)
        ]
        return engine_pb2.PullBatchResponse(
            outcomes=answered, duration_us=int((time.perf_counter() - start) * 1e6)
        )

    def _together_run(
        self,
        together: Together,
        members: list[int],
        pulls: list[engine_pb2.PullRequest],
        hangup: _Hangup,
        later: Later,
        told: OnOutcomes,
        streamed: bool,
    ) -> dict[int, engine_pb2.PullOutcome]:
        """Members as one unit: each runs its steps up to its move, the moves are made together, and each
        goes on from its move to its answer (on the pool where its move failed, or where it stepped
        `Apart` before waiting for a peer)."""
        outcomes: dict[int, engine_pb2.PullOutcome] = {}
        mine: dict[int, Later] = {i: [] for i in members}
        steps = {i: together.steps(pulls[i], hangup.register, mine[i]) for i in members}
        # Members that go on on the pool: a move failed, or what follows may wait for a peer (Apart).
        apart: list[tuple[int, Future[engine_pb2.PullOutcome]]] = []

        def answer(i: int, start: Callable[[], Want]) -> engine_pb2.PullOutcome:
            try:
                return engine_pb2.PullOutcome(response=run_steps(steps[i], together.move, start), index=i)
            except Exception as e:
                return failed(e, i)

        def go_on(i: int, start: Callable[[], Want]) -> engine_pb2.PullOutcome:
            return self._settle([answer(i, start)], [mine[i]], later, told, streamed)[0]

        wanted: list[int] = []
        wants: list[Want] = []
        for i in members:
            try:
                want = next(steps[i])
                if isinstance(want, Apart):  # it will wait for a peer: on the pool, apart from the unit
                    apart.append((i, self._pool.submit(go_on, i, functools.partial(steps[i].send, 0))))
                    continue
                wants.append(want)
                wanted.append(i)
            except StopIteration as done:  # answered without a move
                outcome = engine_pb2.PullOutcome(response=done.value, index=i)
                outcomes[i] = self._settle([outcome], [mine[i]], later, told, streamed)[0]
            except Exception as e:
                outcomes[i] = self._settle([failed(e, i)], [mine[i]], later, told, streamed)[0]

        def made(ended: list[tuple[int, int | BaseException]]) -> None:
            # Moves that ended together (one transfer's, the copies'): their outcomes out at once, then
            # what each member left for after it (records, done notifications, "consumed"), so that the
            # last member's outcome does not wait for the others' leftovers.
            answered: list[int] = []
            for k, moved in ended:
                i, member = wanted[k], steps[wanted[k]]
                if isinstance(moved, BaseException):
                    apart.append((i, self._pool.submit(go_on, i, functools.partial(member.throw, moved))))
                else:
                    outcomes[i] = answer(i, functools.partial(member.send, moved))
                    answered.append(i)
            if answered:
                self._settle(
                    [outcomes[i] for i in answered], [mine[i] for i in answered], later, told, streamed
                )

        together.move_all(wants, self._pool, made)
        for i, fut in apart:  # complete: move_all returned after its last `made`
            outcomes[i] = fut.result()
        return outcomes

    def _member(
        self,
        index: int,
        req: engine_pb2.PullRequest,
        hangup: _Hangup,
        later: Later,
        told: OnOutcomes,
        streamed: bool,
    ) -> engine_pb2.PullOutcome:
        mine: Later = []
        try:
            outcome = engine_pb2.PullOutcome(
                response=self._run_member(req, hangup.register, mine), index=index
            )
        except Exception as e:
            outcome = failed(e, index)
        return self._settle([outcome], [mine], later, told, streamed)[0]

    @staticmethod
    def _settle(
        ended: list[engine_pb2.PullOutcome],
        leftovers: list[Later],
        later: Later,
        told: OnOutcomes,
        streamed: bool,
    ) -> list[engine_pb2.PullOutcome]:
        """Members ended together: tell their outcomes, then run (streamed) or hand on what each left for
        after its answer."""
        if not streamed:
            for mine in leftovers:
                later.extend(mine)  # list.extend is atomic: members on the pool append side by side
        try:
            told(ended)
        except Exception:  # the engine went away: the call's own answer will fail the same way
            log.debug(
                "could not send the outcomes of pulls %s ahead", [o.index for o in ended], exc_info=True
            )
        if streamed:  # the prefill engine hears "consumed" when this member ends, not the step's slowest
            together = [fn for mine in leftovers for fn in mine]
            for mine in leftovers:
                mine.clear()
            run_later(together)  # their done notifications joined per source (after_answer.Joined)
        return ended
