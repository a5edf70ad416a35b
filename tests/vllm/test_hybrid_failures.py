"""Issue 10's sidecar failures on a hybrid model (tests/vllm/test_hybrid.py's Gemma-3-shaped model,
the hybrid manager on): the prefill sidecar, and then the decode sidecar, killed while the decode
engine pulls a request's groups, then restarted. The decode engine computes the request from its start
(its sliding-window groups' blocks before the window are null), the prefill engine frees every group's
blocks, and the pair works again (tests/vllm/failures.py). Abort, keep-alive and lease expiry on this
model are in test_hybrid.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kv_sidecar.refengine.procs import SidecarProcess

from .failures import FailurePair, sidecar_killed_mid_pull_then_restarted
from .harness import VllmEngine
from .models import write_random_model
from .test_hybrid import ALIGNMENT, GROUPS, prompt

PULL_TIMEOUT_S = 8.0
LEASE_MS = 30000


class Pair(FailurePair):
    max_tokens, lease_ms = 8, LEASE_MS
    params_key = "kv_sidecar_groups"
    groups, pull_timeout_s = GROUPS, PULL_TIMEOUT_S

    def __init__(self, tmp: str) -> None:
        model = write_random_model(f"{tmp}/model", "gemma3")
        self.sp, self.sd = SidecarProcess("hyf-prefill-node"), SidecarProcess("hyf-decode-node")
        conn = {"keepalive_interval_s": 1.0, "pull_timeout_s": PULL_TIMEOUT_S, "lease_ms": LEASE_MS}
        base = {"model": model, "hybrid": True}
        self.P = VllmEngine(
            "hyf-prefill",
            base
            | {
                "connector": conn
                | {"sidecar_socket": self.sp.socket, "engine_id": "hyf-p", "window_alignment": ALIGNMENT}
            },
        )
        self.D = VllmEngine(
            "hyf-decode",
            base | {"connector": conn | {"sidecar_socket": self.sd.socket, "engine_id": "hyf-d"}},
        )
        self.ref = VllmEngine("hyf-reference", base)
        self.start(self.P, self.D, self.ref)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    fixture = Pair(str(tmp_path_factory.mktemp("vllm-hybrid-fail")))
    yield fixture
    fixture.close()


def test_prefill_sidecar_killed_mid_pull_then_restarted(pair: Pair) -> None:
    sidecar_killed_mid_pull_then_restarted(pair, "prefill", prompt(600, seed=21), prompt(300, seed=22))


def test_decode_sidecar_killed_mid_pull_then_restarted(pair: Pair) -> None:
    pulls = sidecar_killed_mid_pull_then_restarted(pair, "decode", prompt(500, seed=31), prompt(200, seed=32))
    assert not any(q["ok"] for q in pulls), pulls  # no group was pulled through a dead sidecar
