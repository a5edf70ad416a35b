"""PullBatch: a decode engine's pulls for one step in one call.

Each member runs as its own Pull would (admitted, stoppable by Abort of its request, its own deadline
and its own outcome), so a member that fails fails alone. What the batch saves is per call: one
engine-lane frame each way instead of one per request, one thread serving the call instead of one
per request (pulls from another sidecar wait side by side on this module's pool, same-sidecar copies
run one after another on the call's thread, without the hand-offs between many threads that
contend for the one interpreter). The work a member leaves for after its answer (its log record,
"consumed" events) runs once that member's outcome is out when outcomes are streamed (the engine
lane), else once the whole answer is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from kv_sidecar.errors import Code, SidecarError, as_sidecar_error
from kv_sidecar.server.after_answer import Later, run_later
from kv_sidecar.server.batch_reads import BatchReads
from kv_sidecar_client._proto.kvsidecar.v1 import engine_pb2

log = logging.getLogger(__name__)

# engine_calls' own alias (that module builds PullBatches, so this one cannot import it).
OnHangup = Callable[[Callable[[], None]], None]
# Runs one member as EngineCalls.pull does: the request, its hang-up registration, its `later`, and its
# batch's staged reads (those from other sidecars go together: server/batch_reads.py).
MemberFn = Callable[[engine_pb2.PullRequest, OnHangup, Later, BatchReads | None], engine_pb2.PullResponse]
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
        reads_together: bool = False,
    ) -> None:
        """reads_together: members from other sidecars hold their staged reads for each other, so that
        they go as one transfer per rank pair (server/batch_reads.py; staged_batch_reads)."""
        self._reads_together = reads_together
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
        # Pulls from another sidecar wait on the network: side by side on the pool. Copies on this node
        # are CPU work: one after another here, while those wait.
        remote: list[tuple[int, Future[engine_pb2.PullOutcome]]] = []
        local: list[int] = []
        todo = [i for i, o in enumerate(outcomes) if o is None]
        others = sum(1 for i in todo if pulls[i].params.sidecar_id != self._me)
        reads = BatchReads(others) if self._reads_together and others > 1 else None
        for i in todo:
            p = pulls[i]
            if p.params.sidecar_id == self._me:
                local.append(i)
            else:
                remote.append(
                    (i, self._pool.submit(self._member, i, p, hangup, later, told, streamed, reads))
                )
        for i in local:
            outcomes[i] = self._member(i, pulls[i], hangup, later, told, streamed, None)
        for i, fut in remote:
            outcomes[i] = fut.result()
        return engine_pb2.PullBatchResponse(
            outcomes=outcomes, duration_us=int((time.perf_counter() - start) * 1e6)
        )

    def _member(
        self,
        index: int,
        req: engine_pb2.PullRequest,
        hangup: _Hangup,
        later: Later,
        told: OnOutcome,
        streamed: bool,
        reads: BatchReads | None,
    ) -> engine_pb2.PullOutcome:
        mine: Later = []
        try:
            outcome = engine_pb2.PullOutcome(
                response=self._run_member(req, hangup.register, mine, reads), index=index
            )
        except Exception as e:
            outcome = failed(e, index)
        finally:
            if not streamed:
                later.extend(mine)  # list.extend is atomic: members on the pool append side by side
        try:
            told(outcome)
        except Exception:  # the engine went away: the call's own answer will fail the same way
            log.debug("could not send pulls[%d]'s outcome ahead", index, exc_info=True)
        if streamed:  # the prefill engine hears "consumed" when this member ends, not the step's slowest
            run_later(mine)
        return outcome
