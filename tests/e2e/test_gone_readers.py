"""A decode sidecar that dies mid-read over plain NIXL READs (host_transfer: read) leaves its request to
another reader at once, not after the lease: the source, asked by another engine, dials the dead
reader's sidecar and finds its port refusing (server/gone_readers.py). A reader that is only stopped
keeps its request. The probe itself is tested against real processes and ports."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from kv_sidecar.config import Settings
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess
from kv_sidecar.security import PeerSecurity
from kv_sidecar.server.adapters.peer_client import probe_sidecar
from kv_sidecar.server.gone_readers import Probe, ReaderSidecar, Seen

from .conftest import Spawn, consumed_events, frozen, logged, metric, spec_dict
from .events import no_event
from .long_pull import BLOCKS, DST, READS, SRC, STAGING_BYTES, start_long_pull, wait_transfer_started

TAKEN_OVER = ("kvsidecar_failures_total", '{reason="read_taken_over"}')


@pytest.fixture(scope="module")
def probe() -> Probe:
    s = Settings()
    return probe_sidecar(s, PeerSecurity.from_settings(s))


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A port that accepts connections (the kernel's backlog) and never says a word."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield sock
    sock.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _from_here(address: str) -> ReaderSidecar:
    """A sidecar answering at `address` whose calls came from this machine's loopback (as they do here)."""
    return ReaderSidecar(address, "ipv4:127.0.0.1:40000")


def test_the_probe_tells_a_running_sidecar_from_a_gone_one(
    probe: Probe, spawn: Spawn, listener: socket.socket
) -> None:
    sc = spawn(SidecarProcess("probed"))
    assert probe(sc.sidecar_id, _from_here(sc.peer_address), 2.0).seen is Seen.RUNS
    port = sc.peer_address.rpartition(":")[2]
    assert probe(sc.sidecar_id, _from_here(f"localhost:{port}"), 2.0).seen is Seen.RUNS  # loopback is one
    replaced = probe("kvs-an-earlier-one", _from_here(sc.peer_address), 2.0)  # the port is another's now
    assert replaced.seen is Seen.GONE and sc.sidecar_id in replaced.detail
    refused = probe("kvs-x", _from_here(f"127.0.0.1:{_free_port()}"), 2.0)
    assert refused.seen is Seen.GONE and "refuses" in refused.detail
    silent = probe("kvs-x", _from_here(f"127.0.0.1:{listener.getsockname()[1]}"), 0.3)
    assert silent.seen is Seen.UNKNOWN, silent  # connected, but no one answers: proves nothing
    with frozen(sc):  # alive, answering nothing
        t0 = time.monotonic()
        stopped = probe(sc.sidecar_id, _from_here(sc.peer_address), 0.3)
        assert stopped.seen is Seen.UNKNOWN and time.monotonic() - t0 < 2, stopped
    assert probe(sc.sidecar_id, _from_here("no-such-host.invalid:1"), 0.3).seen is Seen.UNKNOWN


def test_the_probe_asks_only_where_the_readers_calls_came_from(probe: Probe) -> None:
    """A refusing port proves a reader gone only if that address is the reader's own: one that names
    another host than its calls came from (a Service in front of several sidecars, a stale name) is
    not asked, however it would answer."""
    closed = f"127.0.0.1:{_free_port()}"
    elsewhere = probe("kvs-x", ReaderSidecar(closed, "ipv4:10.1.2.3:40000"), 2.0)
    assert elsewhere.seen is Seen.UNKNOWN, elsewhere
    assert "resolves to 127.0.0.1 but its calls came from 10.1.2.3" in elsewhere.detail
    for calls_from in ("unix:/run/x.sock", ""):
        assert probe("kvs-x", ReaderSidecar(closed, calls_from), 2.0).seen is Seen.UNKNOWN
    assert probe("kvs-x", ReaderSidecar(closed, "ipv6:[::ffff:127.0.0.1]:40000"), 2.0).seen is Seen.GONE


def _reader_sidecar(spawn: Spawn, name: str) -> SidecarProcess:
    return spawn(SidecarProcess(name, extra=["--staging-bytes", str(STAGING_BYTES)]))


def _pull_again(decode: EngineProcess, params: dict[str, object], seed: int) -> dict[str, object]:
    dst = list(range(BLOCKS))
    return decode.send(
        {"cmd": "pull", "params": params, "block_ids": dst, "seed": seed, "timeout_s": 30}, timeout_s=60
    )


@pytest.mark.parametrize("after", ["killed", "restarted"])
def test_a_reader_sidecar_killed_mid_read_leaves_the_request_to_another_reader_at_once(
    spawn: Spawn, after: str
) -> None:
    """The decode sidecar dies (SIGKILL) mid-read. The source never sees its one-sided READs fail, but
    the next engine that asks for the request makes it dial the dead reader's sidecar: its port refuses
    (killed), or another sidecar answers there (restarted on the same port, as a crashed container of a
    pod comes back at the pod's address), so that engine takes the request over and pulls it whole and
    exact, long before the 30 s lease; the prefill engine gets exactly one "consumed" event, the new
    reader's. The new reader has pulled from that source before, so its open goes as a NIXL notification
    first, which the source's NIXL thread leaves unanswered rather than wait for the probe: the reader's
    OpenRead call decides it."""
    a = spawn(SidecarProcess("gone-src"))
    b = _reader_sidecar(spawn, "gone-b")
    c = _reader_sidecar(spawn, "gone-c")
    prefill = spawn(EngineProcess(a.socket, "gone-p", SRC))
    decode = spawn(EngineProcess(b.socket, "gone-d1", DST))
    decode2 = spawn(EngineProcess(c.socket, "gone-d2", DST))
    warm = prefill.send(
        {"cmd": "prefill", "request_id": "warm", "block_ids": [1, 2], "num_tokens": 30, "seed": 20}
    )
    ok = decode2.send({"cmd": "pull", "params": warm["params"], "block_ids": [5, 6], "seed": 20})
    assert ok["ok"] and ok["verified"], ok
    assert consumed_events(prefill, 1) == 1
    reads = metric(b.metrics_port, READS)
    _, params = start_long_pull(prefill, decode, 30, seed=21)
    wait_transfer_started(b, reads)
    b.proc.kill()
    b.proc.wait(5)
    if after == "restarted":
        port = b.peer_address.rpartition(":")[2]
        again = spawn(SidecarProcess("gone-b-again", extra=["--peer-port", port]))
        assert again.peer_address == b.peer_address
    t0 = time.monotonic()
    res = _pull_again(decode2, params, 21)
    took = time.monotonic() - t0
    assert res["ok"] and res["verified"] and res["path"] == "host-nixl-staged", res
    assert took < 10, took  # not after the lease (30 s)
    assert metric(a.metrics_port, *TAKEN_OVER) == 1
    assert logged(a, "takes it over from engine gone-d1, whose sidecar is gone")
    assert logged(a, "refuses connections" if after == "killed" else "answers there now")
    assert metric(c.metrics_port, "kvsidecar_peer_opens_total", '{by="call_after_notification"}') == 1
    assert consumed_events(prefill, 1) == 1
    no_event(prefill, "long", wait_s=0.5)
    assert a.alive and c.alive


def test_a_stopped_reader_sidecar_keeps_its_request(spawn: Spawn) -> None:
    """The decode sidecar stops (SIGSTOP) mid-read: alive, it may READ again once it runs, so the
    source, which gets no answer from it, gives the request to no one else (FAILED_PRECONDITION, saying
    why); once it runs again its pull completes, exact."""
    a = spawn(SidecarProcess("stop-src", extra=["--reader-probe-ms", "300"]))
    b = _reader_sidecar(spawn, "stop-b")
    c = _reader_sidecar(spawn, "stop-c")
    prefill = spawn(EngineProcess(a.socket, "stop-p", SRC))
    decode = spawn(EngineProcess(b.socket, "stop-d1", DST))
    decode2 = spawn(EngineProcess(c.socket, "stop-d2", DST))
    reads = metric(b.metrics_port, READS)
    _, params = start_long_pull(prefill, decode, 30, seed=22)
    wait_transfer_started(b, reads)
    with frozen(b):
        res = _pull_again(decode2, params, 22)
        assert not res["ok"] and res["error_code"] == "FAILED_PRECONDITION", res
        assert "already being read by engine 'stop-d1'" in str(res["error"]), res
        assert b.sidecar_id in str(res["error"]) and "Status call failed" in str(res["error"]), res
        assert res["verified"], res  # no byte of its blocks changed
    first = json.loads(decode.readline(60))
    assert first["ok"] and first["verified"], first
    assert metric(a.metrics_port, *TAKEN_OVER) == 0
    assert consumed_events(prefill, 1) == 1


def test_a_reader_that_holds_a_rank_of_the_request_takes_it_over_from_a_gone_reader(spawn: Spawn) -> None:
    """A prefill engine spread over sidecars a (leader, rank 0) and b (rank 1). A reader on c dies mid-read;
    a TP 1 reader on b then reads rank 1 from b's own record of the request (a copy) and rank 0 from a:
    b's record, too, proves c gone and gives the request over, as a's OpenRead does, and the pull
    arrives whole and exact, long before the lease; each prefill rank hears "consumed" once."""
    src = EngineSpec.from_dict(spec_dict(num_blocks=2048, tp_size=2))
    a = spawn(SidecarProcess("own-src-a", extra=["--leader-wait-ms", "5000"]))
    b = spawn(SidecarProcess("own-src-b", extra=["--leader-wait-ms", "5000"]))
    c = _reader_sidecar(spawn, "own-gone-c")
    leader = spawn(EngineProcess(a.socket, "own-p", src, ranks=[0]))
    member = spawn(EngineProcess(b.socket, "own-p", src, ranks=[1], leader=a.peer_address))
    doomed = spawn(EngineProcess(c.socket, "own-d1", DST))
    mixed = spawn(EngineProcess(b.socket, "own-d2", DST))
    fill = {"cmd": "prefill", "request_id": "long", "block_ids": list(range(BLOCKS)), "seed": 23}
    assert member.send(fill | {"num_tokens": BLOCKS * src.block_size, "publish": False})["ok"]
    reads = metric(c.metrics_port, READS)
    _, params = start_long_pull(leader, doomed, 30, seed=23)
    wait_transfer_started(c, reads)
    c.proc.kill()
    c.proc.wait(5)
    t0 = time.monotonic()
    res = _pull_again(mixed, params, 23)
    assert res["ok"] and res["verified"] and res["path"] == "host-nixl-staged", res
    assert time.monotonic() - t0 < 10  # not after the lease (30 s)
    assert logged(b, "takes it over from engine own-d1, whose sidecar is gone")
    assert consumed_events(leader, 1) == 1 and consumed_events(member, 1) == 1
