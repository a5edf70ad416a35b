"""A device worker stuck in a copy past its deadline (dataplane/workers.py, KILL_AFTER_S): it is killed
and started again, and the copies it held fail with DEADLINE_EXCEEDED, so that nothing of ours writes
into an engine's cache after the pull answered. A stopped worker stands in for a stuck one."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kv_sidecar.dataplane import workers
from kv_sidecar.dataplane.jobs import HOST, LocalCopy, RankKey, RankRead, Tokens
from kv_sidecar.dataplane.workers import CopyWorker
from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.metrics import Metrics

DEADLINE_S = 0.3
KILL_AFTER_S = 0.5


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self._at = time.monotonic() + seconds

    def remaining(self) -> float:
        return self._at - time.monotonic()


def _copy(first: int) -> LocalCopy:
    read = RankRead(RankKey("d", 0), RankKey("p", 0), None)
    return LocalCopy((read,), Tokens(np.array([first]), np.array([first + 1]), 16, 0), True)


@pytest.fixture
def stopped(monkeypatch: pytest.MonkeyPatch) -> Iterator[CopyWorker]:
    """A host worker that takes no message: alive, answering nothing."""
    monkeypatch.setattr(workers, "KILL_AFTER_S", KILL_AFTER_S)
    worker = CopyWorker(HOST, Metrics())
    try:
        worker.ask_metrics().result(timeout=60)  # started and answering
        assert worker.pid is not None
        os.kill(worker.pid, signal.SIGSTOP)
        yield worker
    finally:
        worker.close()


def _restarted(worker: CopyWorker, stuck_pid: int) -> None:
    deadline = time.monotonic() + 30
    while worker.incarnation < 2 or worker.pid == stuck_pid:
        assert time.monotonic() < deadline, "the stuck worker was not started again"
        time.sleep(0.01)
    worker.ask_metrics().result(timeout=60)  # the new one answers


def test_a_copy_stuck_past_its_deadline_kills_its_worker_and_names_its_blocks(stopped: CopyWorker) -> None:
    pid = stopped.pid
    assert pid is not None
    t0 = time.monotonic()
    with pytest.raises(SidecarError) as e:
        stopped.copy(_copy(7), _Deadline(DEADLINE_S))
    waited = time.monotonic() - t0
    assert e.value.code is Code.DEADLINE_EXCEEDED
    assert "its worker was restarted" in e.value.message and "blocks not filled: [8]" in e.value.message
    assert DEADLINE_S + KILL_AFTER_S - 0.05 <= waited < DEADLINE_S + KILL_AFTER_S + 5
    _restarted(stopped, pid)


def test_a_batch_stuck_past_its_deadlines_fails_every_copy_it_held(stopped: CopyWorker) -> None:
    pid = stopped.pid
    assert pid is not None
    posted = stopped.post_copies([(_copy(3), _Deadline(DEADLINE_S)), (_copy(5), _Deadline(DEADLINE_S / 2))])
    out = posted.wait()
    assert len(out) == 2
    for failed in out:
        assert isinstance(failed, SidecarError) and failed.code is Code.DEADLINE_EXCEEDED, failed
        assert "their worker was restarted" in failed.message
    _restarted(stopped, pid)
