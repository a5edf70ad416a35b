"""A staged worker's NIXL agent, as a handshake hands it to peers (dataplane/workers.py: CopyWorker.agent)."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kv_sidecar.config import Settings
from kv_sidecar.dataplane.workers import HOST, CopyWorker, CopyWorkers
from kv_sidecar.metrics import Metrics


def test_a_worker_that_died_hands_out_its_successors_agent_not_its_own() -> None:
    """A reader whose credits meet a dead worker's agent fails its pull and handshakes again at once,
    possibly before the sidecar has seen the death and started another worker: that handshake must wait
    for the next worker's agent (the same name, new connection info). Handing out the dead one's made the
    retry fail with NIXL_ERR_REMOTE_DISCONNECT (2x H100, under load)."""
    worker = CopyWorker(HOST, Metrics(), ("agent-test", Settings(gpu_staging_bytes=4 << 20)))
    try:
        name, first = worker.agent()
        # Hold the window open: the thread that restarts a dead worker first joins it; gate that join.
        proc: Any = worker._proc
        gate, join = threading.Event(), proc.join
        proc.join = lambda timeout=None: (gate.wait(30), join(timeout))
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while proc.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.005)
        with ThreadPoolExecutor(1) as pool:
            handshake = pool.submit(worker.agent)
            time.sleep(0.2)
            assert not handshake.done(), "the dead worker's agent was handed out"
            gate.set()  # the worker is started again
            again, second = handshake.result(timeout=60)
        assert again == name and second != first
        assert worker.incarnation == 2
    finally:
        worker.close()


def test_a_worker_killed_that_still_reads_alive_hands_out_its_successors_agent() -> None:
    """A worker SIGKILLed on a GPU may still read as alive while the kernel tears its CUDA context down
    (our reading of a retried pull failing with NIXL_ERR_REMOTE_DISCONNECT on 4x H200, fifteenth
    session), so a handshake must not trust the process table. It asks the worker, which cannot answer,
    and gets the next worker's agent once the death is seen. A stopped worker stands in for a dying one
    here: alive to `is_alive()`, answering nothing."""
    worker = CopyWorker(HOST, Metrics(), ("agent-test-alive", Settings(gpu_staging_bytes=4 << 20)))
    try:
        name, first = worker.agent()
        pid = worker.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        with ThreadPoolExecutor(1) as pool:
            handshake = pool.submit(worker.agent)
            time.sleep(0.3)
            assert not handshake.done(), "the agent known from before was handed out"
            os.kill(pid, signal.SIGKILL)
            again, second = handshake.result(timeout=60)
        assert again == name and second != first
        assert worker.incarnation == 2
    finally:
        worker.close()


def test_a_members_report_gives_the_agent_a_running_worker_gave_and_a_replaced_worker_says_so() -> None:
    """A member sidecar reports its ranks' worker agents to its leader every refresh: `known_agent` gives
    what the running worker answered without asking it again (a worker busy with a long copy, or
    stopped here, would hold the report up), nothing once that worker died; `on_change` names the
    device as soon as a worker is ready (the first, the next) and as soon as the next one was started
    for a dead one, so that the member reports at once that the agent left, then which one came."""
    changes: list[tuple[int, int, bool]] = []  # (device, its restarts, ready) at each call

    def changed(device: int) -> None:
        changes.extend((d, restarts, ready) for d, _, restarts, ready in workers.processes() if d == device)

    workers = CopyWorkers(Metrics(), ("agent-known", Settings(gpu_staging_bytes=4 << 20)), changed)
    try:
        assert workers.ready_agent(HOST) is None  # none started: none is started for the report
        worker = workers.get(HOST)
        assert worker.known_agent() is None  # never asked
        deadline = time.monotonic() + 60
        while not changes:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert changes == [(HOST, 0, True)]  # told once, when it is ready
        first = workers.ready_agent(HOST)  # asked now that it is ready
        assert first is not None
        assert first == worker.agent()
        pid = worker.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # answers nothing now
        started = time.monotonic()
        assert workers.ready_agent(HOST) == first and time.monotonic() - started < 0.5
        os.kill(pid, signal.SIGKILL)
        while worker.incarnation < 2:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert worker.known_agent() is None  # the dead one's agent is not handed on
        while len(changes) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        # Told when the next one was started (not ready yet), then when it is ready.
        assert changes == [(HOST, 0, True), (HOST, 1, False), (HOST, 1, True)]
        assert worker.ready and worker.incarnation == 2
        second = workers.ready_agent(HOST)
        assert second is not None and second[0] == first[0] and second[1] != first[1]
    finally:
        workers.close()
