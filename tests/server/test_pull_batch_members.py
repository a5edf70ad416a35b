"""Which members of a PullBatch repeat an earlier one (pure: server/pull_batch.repeated_members)."""

from __future__ import annotations

import pytest

from kv_sidecar.server.pull_batch import repeated_members
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
