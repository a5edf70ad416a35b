"""Real sidecar processes on loopback, shared by the end-to-end tests of a session."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import grpc
import pytest

from kv_sidecar import PROTOCOL_VERSION
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine import scrape
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess, side_by_side, together
from kv_sidecar.server.engines import spec_to_proto
from kv_sidecar.transport.nixl_driver import NixlDriver
from kv_sidecar_client import SidecarClient
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2, peer_pb2_grpc
from kv_sidecar_client.lane import LANE_SUFFIX

P = TypeVar("P", EngineProcess, SidecarProcess)

# A sidecar whose NIXL thread, once quiet for a second, polls only every 10 s: a notification it was not
# woken for waits seconds, not the default 50 ms, so no race on a busy machine hides a missing wake-up.
SLEEPY_WHEN_QUIET = ["--nixl-quiet-poll-ms", "10000"]


@pytest.fixture(scope="session")
def sidecar_pair() -> Iterator[tuple[SidecarProcess, SidecarProcess]]:
    a, b = together(lambda: SidecarProcess("prefill-node"), lambda: SidecarProcess("decode-node"))
    yield a, b
    codes = tuple(side_by_side(a.stop, b.stop))
    # A sidecar that hung was asked for its threads' stacks before it was killed: show them.
    hung = "\n".join(line for sc in (a, b) if sc.hung_on_stop for line in [sc.name, *sc.stderr_lines(1500)])
    left = [p for sc in (a, b) for p in (sc.socket, sc.socket + LANE_SUFFIX) if os.path.exists(p)]
    assert not left, f"SIGTERM must remove the engine socket and its lane: {left}\n{hung}"
    assert codes == (0, 0), f"sidecars exited with {codes}:\n" + "\n".join(
        list(a.stderr_tail) + list(b.stderr_tail)
    )


_quiet_ids = iter(range(10**6))


def pulls_after_quiet_spells(
    prefill: SidecarProcess, decode: SidecarProcess, path: str, count: Callable[[], float], pulls: int = 10
) -> list[float]:
    """One-block pulls from `prefill` into `decode`, all but the first two after 1.3 s of quiet (past
    the second in which both sidecars poll fast after a pull); how much `count()` grew over each.

    The engines are this process's clients, which wait while the sidecars work: engine processes busy
    beside them on 2 cores stall a sidecar's threads for a scheduler slice (~3 ms) now and then, which
    is not what these tests are about. Every pull is checked: its blocks arrive, no other block changes."""
    import torch

    from kv_sidecar_client.shm import ShmKVCache

    spec = EngineSpec.from_dict(spec_dict())
    n = next(_quiet_ids)
    src, dst = (ShmKVCache(spec.rank_tensor_shapes(), torch.float16) for _ in range(2))
    for t in src.tensors:
        t.copy_(torch.randn_like(t))
    grew = []
    try:
        with SidecarClient(prefill.socket) as pc, SidecarClient(decode.socket) as dc:
            pc.register_rank(f"quiet-p{n}", 0, spec.to_dict(), src.handles())
            dc.register_rank(f"quiet-d{n}", 0, spec.to_dict(), dst.handles())
            for i in range(pulls):
                if i >= 2:  # two pulls first: the first opens (or pushes) by call
                    time.sleep(1.3)
                before = count()
                params = pc.publish(f"quiet-p{n}", f"q{i}", [3 + i], spec.block_size)
                res = dc.pull(params, f"quiet-d{n}", [40 + i])
                assert res.ok and res.path == path, res
                grew.append(count() - before)
            pc.unregister_rank(f"quiet-p{n}", 0)
            dc.unregister_rank(f"quiet-d{n}", 0)
        for s, d in zip(src.tensors, dst.tensors, strict=True):  # [K/V, block, token, head, dim] per layer
            assert torch.equal(d[:, 40 : 40 + pulls], s[:, 3 : 3 + pulls])
            assert not d[:, :40].any() and not d[:, 40 + pulls :].any()
    finally:
        src.close()
        dst.close()
    return grew


def agent_handshake(
    sc: SidecarProcess, agent: NixlDriver, engine: str, spec: EngineSpec, reader_engine: str = "forger-engine"
) -> peer_pb2.HandshakeResponse:
    """A Handshake with `sc` for `engine`, as a reader sidecar whose NIXL agent is the test's own
    `agent` (an authenticated call: it gets the push key that agent's notifications must carry)."""
    with grpc.insecure_channel(sc.peer_address) as ch:
        return peer_pb2_grpc.PeerServiceStub(ch).Handshake(
            peer_pb2.HandshakeRequest(
                protocol_version=PROTOCOL_VERSION,
                sidecar_id=agent.name,
                agent_name=agent.name,
                agent_metadata=agent.metadata(),
                engine_id=engine,
                reader_engine_id=reader_engine,
                reader_spec=spec_to_proto(spec),
            ),
            timeout=30,
        )


def prefilled(engine: EngineProcess, request_id: str, blocks: list[int], tokens: int, seed: int) -> Any:
    """The params of a request the engine filled (from `seed`) and published."""
    pub = engine.send(
        {"cmd": "prefill", "request_id": request_id, "block_ids": blocks, "num_tokens": tokens, "seed": seed}
    )
    assert pub["ok"], pub
    return pub["params"]


def batch_with_one_unpublished(decode: EngineProcess, pulls: list[dict[str, Any]], blocks: list[int]) -> None:
    """One PullBatch of `pulls` and a member naming a request never published (into `blocks`): every
    pull of `pulls` arrives exact by host-direct, that one fails alone (NOT_FOUND, `blocks` named
    unfilled), and no byte outside the members' blocks is written."""
    gone = {"params": dict(pulls[0]["params"], request_id="never-published"), "block_ids": blocks, "seed": 0}
    out = decode.send({"cmd": "pull_many", "pulls": [*pulls, gone]})
    *good, refused = out["results"]
    for res in good:
        assert res["ok"] and res["verified"] and res["path"] == "host-direct", (res.get("error"), res)
    assert refused["error_code"] == "NOT_FOUND" and refused["unfilled_blocks"] == blocks, refused
    assert out["untouched_outside"], out["outside_errors"]


def consumed_events(engine: EngineProcess, expect: int) -> int:
    """How many "consumed" events the engine got, waiting up to 10 s for `expect` of them (taken off
    its queue)."""
    got = engine.send({"cmd": "count_events", "kind": "consumed", "timeout_s": 10, "expect": expect})
    return int(got["count"])


def spec_dict(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "tp_size": 1,
        "num_layers": 2,
        "num_kv_heads": 4,
        "head_dim": 16,
        "dtype": "float16",
        "block_size": 16,
        "num_blocks": 64,
        "layout": "flash_attn_nhd",
    }
    return base | over


class Spawn:
    """Processes a test started, stopped after it (engines first), even when a later start fails."""

    def __init__(self) -> None:
        self.procs: list[EngineProcess | SidecarProcess] = []

    def __call__(self, proc: P) -> P:
        self.procs.append(proc)
        return proc

    def together(self, *makers: Callable[[], P]) -> list[P]:
        """Started at once (refengine.procs.together), each kept like spawn(proc)."""
        return [self(proc) for proc in together(*makers)]

    def stop_all(self) -> None:
        # Engines first: each unregisters its ranks from its sidecar as it quits. Each kind side by side:
        # a stop is mostly waiting (a sidecar's ~1 s of shutdown), and one after another they added up
        # to minutes of the suite.
        side_by_side(*(p.stop for p in self.procs if isinstance(p, EngineProcess)))
        side_by_side(*(functools.partial(p.stop, 10) for p in self.procs if isinstance(p, SidecarProcess)))


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """spawn(EngineProcess(...)) or spawn.together(...) stops the processes after the test."""
    kept = Spawn()
    yield kept
    kept.stop_all()


@contextmanager
def frozen(sidecar: SidecarProcess) -> Iterator[None]:
    """The sidecar process stopped (SIGSTOP) for the block: alive, but answering nothing."""
    os.kill(sidecar.proc.pid, signal.SIGSTOP)
    try:
        # kill() returns before every thread has stopped; a call sent at once could still be answered.
        wait_for("the sidecar to stop", lambda: _state(sidecar.proc.pid) == "T", timeout_s=5)
        yield
    finally:
        os.kill(sidecar.proc.pid, signal.SIGCONT)


def _state(pid: int) -> str:
    """The process state letter of /proc/<pid>/stat (R, S, T, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def in_background(fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """Run `fn` on a thread; the returned function waits for its answer (at most 120 s)."""
    box: list[dict[str, Any]] = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    t.start()

    def result() -> dict[str, Any]:
        t.join(120)
        assert box, "the background call never answered"
        return box[0]

    return result


def no_transfer_in_flight(*sidecars: SidecarProcess, within_s: float = 5.0) -> None:
    """Every pull and served read on these sidecars has ended. A served read ends when each reader
    rank that depends on this sidecar has notified, or when its request ends otherwise (released,
    aborted, expired); one left waiting would show here until it timed out, and would hold a
    SIGTERM's drain as long."""
    busy: dict[str, list[str]] = {}
    deadline = time.monotonic() + within_s
    while True:
        for sc in sidecars:
            with SidecarClient(sc.socket) as client:
                busy[sc.name] = [f"{t.kind} {t.request_id}" for t in client.status().inflight]
        if not any(busy.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    # A read left open is a race between the two sidecars: their logs say which came first.
    assert not any(busy.values()), "\n".join(
        [
            repr(busy),
            *(f"--- {sc.name}:\n" + "\n".join(sc.stderr_lines(30)) for sc in sidecars if busy[sc.name]),
        ]
    )


def metric(port: int, name: str, labels: str = "") -> float:
    """A sample of a sidecar's /metrics, its labels as exposed (`{reason="x"}`): 0 when absent."""
    return scrape.value(port, name, **scrape.labels(labels))


def logged(proc: SidecarProcess, fragment: str, within_s: float = 5.0) -> bool:
    """Whether a line of the sidecar's stderr holds `fragment` within `within_s` (its log writer
    writes every 20 ms)."""
    deadline = time.monotonic() + within_s
    while not any(fragment in line for line in proc.stderr_tail):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def wait_for(what: str, cond: Callable[[], object], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def pulls_in_flight(socket: str, request_id: str) -> int:
    """Pulls of this request that the sidecar on `socket` runs now (its Status)."""
    with SidecarClient(socket, lane=False) as client:
        return sum(1 for t in client.status().inflight if t.kind == "pull" and t.request_id == request_id)
