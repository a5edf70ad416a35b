"""A pull's block ids become int64 arrays (server/pull_job.ids_array) the same way whatever container they
came in: a list (a published request's), or a protobuf repeated field (the engine's request, a peer's
answer), short or long (each size its cheaper conversion)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_sidecar.server.pull_job import ids_array
from kv_sidecar_client._proto.kvsidecar.v1 import engine_pb2

uint32 = st.integers(0, 2**32 - 1)


# Lists of 1,000+ ids draw slowly on two loaded cores (0.13 s each beside the suite's other worker): as
# the other large property tests, no deadline and no health check on generation speed.
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(uint32, max_size=200) | st.lists(uint32, min_size=1000, max_size=1200))
def test_ids_come_out_the_same_from_a_list_and_from_a_repeated_field(ids: list[int]) -> None:
    repeated = engine_pb2.PullRequest(block_ids=ids).block_ids
    for values in (ids, repeated):
        got = ids_array(values)
        assert got.dtype == np.int64 and got.shape == (len(ids),)
        assert got.tolist() == ids
