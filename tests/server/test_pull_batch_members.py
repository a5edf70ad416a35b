"""PullBatch members, pure (server/pull_batch.py): which repeat an earlier one; in what order members run
as one unit tell their outcomes and run their leftovers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor

import pytest

from kv_sidecar.server.after_answer import Joined, Later, run_later
from kv_sidecar.server.pull_batch import OnHangup, PullBatches, Together, repeated_members
from kv_sidecar.server.pull_steps import DirectCopy, Made, Steps, Want
from kv_sidecar_client._proto.kvsidecar.v1 import common_pb2, engine_pb2


def pull(
    request: str = "r", ranks: tuple[int, ...] = (), group: int | None = None, local: str = "d"
) -> engine_pb2.PullRequest:
    return engine_pb2.PullRequest(
        params=common_pb2.TransferParams(engine_id="p", request_id=request),
        engine_id=local,
        ranks=list(ranks),
        group=group,
    )


@pytest.mark.parametrize(
    ("members", "repeated"),
    [
        ([pull(), pull("s")], {}),  # other requests
        ([pull(ranks=(0,)), pull(ranks=(1,))], {}),  # one request, disjoint ranks: a TP engine's ranks
        ([pull(ranks=(0, 1)), pull(ranks=(1, 2))], {1: 0}),
        ([pull(), pull(ranks=(3,))], {1: 0}),  # no ranks: every rank
        ([pull(group=0), pull(group=1)], {}),  # a hybrid request's groups
        ([pull(group=0), pull()], {}),  # group 0 is not "no group"
        ([pull(group=1), pull(group=1)], {1: 0}),
        ([pull(local="d"), pull(local="e")], {}),  # other local engines
        ([pull(), pull("s"), pull(), pull()], {2: 0, 3: 0}),  # each names the first it repeats
    ],
)
def test_repeated_members(members: list[engine_pb2.PullRequest], repeated: dict[int, int]) -> None:
    assert repeated_members(members) == repeated


class _Mine(Joined):
    def __init__(self, run_all: Callable[[list[_Mine]], None], i: int) -> None:
        super().__init__(run_all)
        self.i = i


def _unit(
    ends: list[list[int]], log: list[tuple[str, object]]
) -> tuple[PullBatches, engine_pb2.PullBatchRequest]:
    """A batch of as many members as `ends` names, run as one unit whose moves end in the groups `ends`
    lists (one transfer's members each); each member's steps leave a record of their leftovers, and work
    joined with that of the members it runs with (as its done notifications are)."""

    def joined(all_: list[_Mine]) -> None:
        log.append(("joined", [m.i for m in all_]))

    def steps(req: engine_pb2.PullRequest, _hangup: OnHangup, later: Later) -> Steps[engine_pb2.PullResponse]:
        i = int(req.params.request_id)
        moved = yield DirectCopy(None, None)  # type: ignore[arg-type]  # what moves is not looked at here
        later.append(lambda: log.append(("later", i)))
        later.append(_Mine(joined, i))
        return engine_pb2.PullResponse(bytes=moved)

    def move_all(wants: Sequence[Want], _pool: Executor, made: Made) -> None:
        assert len(wants) == sum(map(len, ends))
        for group in ends:
            made([(i, 100 + i) for i in group])

    def no_member(*_: object) -> engine_pb2.PullResponse:
        raise AssertionError("every member goes in the unit")

    together = Together(steps, lambda _: True, move_all, lambda _: 0)
    batches = PullBatches(no_member, 64, "d", 2, lambda _: None, together)
    n = sum(map(len, ends))
    return batches, engine_pb2.PullBatchRequest(pulls=[pull(str(i)) for i in range(n)])


def test_members_that_end_together_are_told_at_once_before_any_leftover_runs() -> None:
    """A transfer's members: their outcomes go in one call (one lane frame), and the last member's does
    not wait for the others' records, done notifications and "consumed" events; a transfer's leftovers
    do not wait for a later transfer."""
    log: list[tuple[str, object]] = []
    batches, req = _unit([[0, 1, 2], [3, 4]], log)
    try:
        later: Later = []
        told = lambda outcomes: log.append(("told", [o.index for o in outcomes]))  # noqa: E731
        answer = batches.run(req, lambda _: None, later, told)
    finally:
        batches.stop()
    assert [o.response.bytes for o in answer.outcomes] == [100, 101, 102, 103, 104]
    assert log == [
        ("told", [0, 1, 2]), ("joined", [0, 1, 2]), ("later", 0), ("later", 1), ("later", 2),
        ("told", [3, 4]), ("joined", [3, 4]), ("later", 3), ("later", 4),
    ]  # fmt: skip
    assert not later  # streamed: nothing left for after the call's answer


def test_without_streamed_outcomes_the_leftovers_wait_for_the_calls_answer() -> None:
    log: list[tuple[str, object]] = []
    batches, req = _unit([[0, 1], [2]], log)
    try:
        later: Later = []
        batches.run(req, lambda _: None, later)
    finally:
        batches.stop()
    assert log == [] and len(later) == 6
    run_later(later)
    assert log[0] == ("joined", [0, 1, 2])  # every member's joined work at once, first
    assert sorted(log[1:]) == [("later", 0), ("later", 1), ("later", 2)]
