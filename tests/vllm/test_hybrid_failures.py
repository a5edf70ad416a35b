"""Issue 10's sidecar failures on a hybrid model (tests/vllm/test_hybrid.py's, the hybrid manager on):
the prefill sidecar killed while the decode engine pulls one of a request's groups, then restarted. The
decode engine computes the request from its start (its sliding-window groups' blocks before the window
are null), the prefill engine frees every group's blocks once its new sidecar knows none of them, and
the pair works again."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from kv_sidecar.refengine.procs import SidecarProcess
from kv_sidecar_client import SidecarClient

from .harness import VllmEngine, start_all, wait_until
from .models import write_random_model
from .test_hybrid import ALIGNMENT, GROUPS, prompt

PULL_TIMEOUT_S = 8.0


class Pair:
    def __init__(self, tmp: str) -> None:
        model = write_random_model(f"{tmp}/model", "gemma3")
        self.sp, self.sd = SidecarProcess("hyf-prefill-node"), SidecarProcess("hyf-decode-node")
        conn = {"keepalive_interval_s": 1.0, "pull_timeout_s": PULL_TIMEOUT_S, "lease_ms": 30000}
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
        self.R = VllmEngine("hyf-reference", base)
        start_all(self.P, self.D, self.R)
        self.p_free = self.P.ready["free_blocks"]

    def close(self) -> None:
        for e in (self.P, self.D, self.R):
            e.stop()
        self.sp.stop()
        self.sd.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    fixture = Pair(str(tmp_path_factory.mktemp("vllm-hybrid-fail")))
    yield fixture
    fixture.close()


def _pulling(sidecar: SidecarProcess) -> bool:
    with SidecarClient(sidecar.socket) as c:
        return len(c.status().inflight) > 0


def _registered_ranks(sidecar: SidecarProcess) -> int:
    with SidecarClient(sidecar.socket) as c:
        return len(c.status().ranks)


def test_prefill_sidecar_killed_mid_pull_then_restarted(pair: Pair) -> None:
    p = prompt(600, seed=21)
    want = pair.R.generate({"r1": p}, 8)["r1"]["tokens"]
    params = pair.P.generate({"p1": p}, 1, {"p1": {"do_remote_decode": True}})["p1"]["kv_transfer_params"]
    assert len(params["kv_sidecar_groups"]) == GROUPS
    held = pair.P.state()["free_blocks"]
    assert held < pair.p_free

    os.kill(pair.sp.proc.pid, signal.SIGSTOP)  # the pulls stay in flight until the sidecar dies

    def kill_when_pulling() -> None:
        wait_until(lambda: _pulling(pair.sd), 30, "the decode sidecar to start the pulls")
        pair.sp.kill()

    killer = threading.Thread(target=kill_when_pulling)
    killer.start()
    t0 = time.monotonic()
    out = pair.D.generate({"d1": p}, 8, {"d1": params})["d1"]
    killer.join()
    assert out["tokens"] == want, "the decode engine must compute the request from its start"
    assert time.monotonic() - t0 < PULL_TIMEOUT_S + 30, "the request must not hang"
    pulls = [q for q in pair.D.state()["pulls"] if q["request_id"].startswith("d1")]
    assert len(pulls) == GROUPS and not all(q["ok"] for q in pulls), pulls

    # Every group's blocks are still held; the new sidecar knows none of the records: all are freed.
    assert pair.P.state()["free_blocks"] == held
    pair.sp = SidecarProcess("hyf-prefill-node", workdir=pair.sp.workdir)
    settled = pair.P.settle(30)
    assert settled["ok"] and settled["free_blocks"] == pair.p_free, settled

    # And the pair works again through the new sidecar.
    wait_until(lambda: _registered_ranks(pair.sp) == 1, 30, "the prefill engine to register again")
    q = prompt(300, seed=22)
    again = pair.P.generate({"p2": q}, 1, {"p2": {"do_remote_decode": True}})["p2"]["kv_transfer_params"]
    assert again is not None
    assert (
        pair.D.generate({"d2": q}, 6, {"d2": again})["d2"]["tokens"]
        == pair.R.generate({"r2": q}, 6)["r2"]["tokens"]
    )
    pulls = [q for q in pair.D.state()["pulls"] if q["request_id"].startswith("d2")]
    assert len(pulls) == GROUPS and all(q["ok"] for q in pulls), pulls
    assert pair.P.settle(30)["free_blocks"] == pair.p_free
