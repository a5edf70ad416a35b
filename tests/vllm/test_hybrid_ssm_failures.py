"""Issue 10's failure cases on the Mamba hybrid (test_hybrid_ssm.py's Granite-4-shaped model, the
hybrid manager on, prefix caching off): the prefill sidecar and the decode sidecar each killed while
the decode engine pulls a request's state block and attention blocks, then restarted; abort of a
waiting request; a waiting request kept alive past its lease; a request nobody pulls freed when its
lease expires. Every case ends with the prefill engine's free blocks (both groups': the state block
and the attention blocks) back at their starting count, and the killed sidecars' cases with a request
through the pair again (tests/vllm/failures.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .failures import (
    FailurePair,
    Side,
    a_request_nobody_pulls_is_freed_at_lease_expiry,
    a_waiting_request_is_kept_alive_past_the_lease,
    abort_of_a_waiting_request_releases_every_group,
    sidecar_killed_mid_pull_then_restarted,
)
from .test_hybrid import prompt
from .test_hybrid_ssm import SsmPair

PULL_TIMEOUT_S = 8.0
# Short, so that the lease cases wait less; a third of it (EnginePair.settled) still tells a release
# from an expiry.
LEASE_MS = 20000
GROUPS = 2  # the Mamba group (one state block) and the attention group


class SsmFailures(SsmPair, FailurePair):
    groups, pull_timeout_s = GROUPS, PULL_TIMEOUT_S


@pytest.fixture(scope="module")
def ssm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SsmFailures]:
    fixture = SsmFailures(
        str(tmp_path_factory.mktemp("vllm-ssm-fail")),
        prefix="ssmf",
        pull_timeout_s=PULL_TIMEOUT_S,
        lease_ms=LEASE_MS,
        keepalive_interval_s=1.0,
    )
    yield fixture
    fixture.close()


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_sidecar_killed_mid_pull_then_restarted(ssm: SsmFailures, side: Side) -> None:
    """Either sidecar dies while both groups' pulls are in flight: the decode engine computes the
    request from its first token (a Mamba group's state cannot be patched block by block)."""
    seed = 61 if side == "prefill" else 62
    pulls = sidecar_killed_mid_pull_then_restarted(
        ssm, side, prompt(700, seed=seed), prompt(300, seed=seed + 10)
    )
    assert not any(q["ok"] for q in pulls), pulls  # neither group was pulled from a dead sidecar


def test_abort_of_a_waiting_request_releases_the_state_block_too(ssm: SsmFailures) -> None:
    abort_of_a_waiting_request_releases_every_group(ssm, ssm.P, ssm.D, prompt(300, seed=63))


def test_a_waiting_request_is_kept_alive_past_the_lease(ssm: SsmFailures) -> None:
    a_waiting_request_is_kept_alive_past_the_lease(ssm, ssm.P, ssm.D, prompt(250, seed=64), GROUPS)


def test_a_request_nobody_pulls_is_freed_when_its_lease_expires(ssm: SsmFailures) -> None:
    a_request_nobody_pulls_is_freed_at_lease_expiry(ssm, ssm.P, prompt(200, seed=65), GROUPS)
