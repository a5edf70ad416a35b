"""`kv-sidecar status` against live sidecars, and one JSON log record per transfer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess, together

from .conftest import metric, spec_dict

SPEC = EngineSpec.from_dict(spec_dict())
BYTES = 3 * 2 * 2 * 16 * 4 * 16 * 2  # 3 blocks x layers x K/V x tokens x heads x dim x fp16


@pytest.fixture(scope="module")
def pulled() -> Iterator[tuple[SidecarProcess, SidecarProcess, str]]:
    """A pair logging JSON and every transfer (flags on one, environment on the other) after one pull
    a -> b."""
    a, b = together(
        lambda: SidecarProcess("obs-prefill", extra=["--log-format", "json", "--transfer-log", "all"]),
        lambda: SidecarProcess(
            "obs-decode", env={"KV_SIDECAR_LOG_FORMAT": "json", "KV_SIDECAR_TRANSFER_LOG": "all"}
        ),
    )
    prefill, decode = together(
        lambda: EngineProcess(a.socket, "obs-p", SPEC), lambda: EngineProcess(b.socket, "obs-d", SPEC)
    )
    try:
        pub = prefill.send(
            {"cmd": "prefill", "request_id": "obs-1", "block_ids": [4, 5, 6], "num_tokens": 48, "seed": 2}
        )
        res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [7, 8, 9], "seed": 2})
        assert res["ok"] and res["verified"], res
        bad = decode.send(
            {
                "cmd": "pull",
                "params": {**pub["params"], "request_id": "obs-never"},
                "block_ids": [1],
                "seed": 2,
            }
        )
        assert bad["error_code"] == "NOT_FOUND", bad
        yield a, b, "obs-1"
    finally:
        prefill.stop()
        decode.stop()
        assert (a.stop(), b.stop()) == (0, 0)


def _json_records(sidecar: SidecarProcess, lines: int | None = None) -> list[dict[str, Any]]:
    """The JSON records among the last lines of stderr (`lines`: that many, else its tail)."""
    tail = sidecar.stderr_tail if lines is None else sidecar.stderr_lines(lines)
    return [json.loads(line) for line in tail if line.startswith("{")]


def _record(sidecar: SidecarProcess, **match: Any) -> dict[str, Any]:
    deadline = time.monotonic() + 30  # the served-read record follows the NIXL notification
    while True:
        found = [r for r in _json_records(sidecar) if match.items() <= r.items()]
        if found:
            assert len(found) == 1, found
            return found[0]
        assert time.monotonic() < deadline, f"no log record {match}:\n" + "\n".join(sidecar.stderr_tail)
        time.sleep(0.1)


def test_json_logs_one_record_per_transfer(pulled: tuple[SidecarProcess, SidecarProcess, str]) -> None:
    a, b, rid = pulled
    for sidecar in (a, b):
        assert not any(line.startswith("ts=") for line in sidecar.stderr_tail), "text lines in json mode"
        assert all({"ts", "level", "logger", "msg"} <= r.keys() for r in _json_records(sidecar))
    pull = _record(b, event="pull", request_id=rid)
    assert pull["logger"] == "kv_sidecar.transfer" and pull["level"] == "INFO"
    assert (pull["peer"], pull["bytes"], pull["path"], pull["outcome"]) == (
        a.peer_address,
        BYTES,
        "host-nixl",
        "ok",
    )
    assert pull["engine_id"] == "obs-d" and pull["source_engine"] == "obs-p"
    assert pull["duration_ms"] > 0 and pull["gbps"] > 0
    failed = _record(b, event="pull", request_id="obs-never")
    assert failed["level"] == "WARNING" and failed["outcome"] == "error" and failed["bytes"] == 0
    assert failed["error"].startswith("NOT_FOUND: peer sidecar")
    assert "request 'obs-never' was never published" in failed["error"]
    served = _record(a, event="serve", request_id=rid)
    assert (served["bytes"], served["path"], served["outcome"]) == (BYTES, "host-nixl", "ok")
    assert served["reader_engine"] == "obs-d" and served["peer"].startswith("ipv4:127.0.0.1:")
    assert served["duration_ms"] > 0


def _status_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KV_SIDECAR_")}
    return subprocess.run(
        [sys.executable, "-m", "kv_sidecar", "status", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_status_command(pulled: tuple[SidecarProcess, SidecarProcess, str]) -> None:
    a, b, _ = pulled
    out = _status_cli("--engine-socket", b.socket, "--json")
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    assert st["sidecar_id"] == b.sidecar_id and st["draining"] is False
    # The decode engine pulled over the lane and keeps its connection for the next call.
    assert (st["engine_lane"], st["engine_lane_connections"]) == (b.socket + ".lane", 1)
    assert [(r["engine_id"], r["rank"], r["sessions"]) for r in st["ranks"]] == [("obs-d", 0, 1)]
    (peer,) = st["peers"]
    assert (peer["direction"], peer["address"], peer["sidecar_id"]) == (
        "outgoing",
        a.peer_address,
        a.sidecar_id,
    )
    assert (peer["engine_id"], peer["reader_engine_id"]) == ("obs-p", "obs-d")
    assert st["inflight"] == []
    recent = st["recent"]
    assert (recent["pulls"], recent["failed_pulls"], int(recent["bytes"])) == ("2", "1", BYTES)
    assert recent["window_s"] == 60 and recent["busy_s"] > 0
    assert st["device_workers"] == "false" and st.get("workers", []) == []  # none by default

    # Through the peer port: the prefill side saw the decode side's handshake and served one read.
    out = _status_cli("--peer", a.peer_address, "--json")
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    assert [(p["direction"], p["sidecar_id"]) for p in st["peers"]] == [("incoming", b.sidecar_id)]
    assert st["recent"]["served_reads"] == "1" and st["published_requests"] == 0

    text = _status_cli("--engine-socket", b.socket)
    assert text.returncode == 0, text.stderr
    assert f"sidecar {b.sidecar_id}" in text.stdout and "serving" in text.stdout
    assert "obs-d rank 0/1" in text.stdout and f"outgoing {a.peer_address}" in text.stdout
    assert f"engine lane {b.socket}.lane: 1 connections open" in text.stdout
    assert "2 pulls (1 failed), 24.0 KiB" in text.stdout
    assert "data-plane workers: 0 (device_workers false)" in text.stdout


def test_sigusr1_prints_every_threads_stack_and_the_sidecar_goes_on(
    pulled: tuple[SidecarProcess, SidecarProcess, str],
) -> None:
    """docs/operations.md §5.10: the stacks of a sidecar that hangs, without stopping it."""
    _, b, _ = pulled
    b.proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while not any(line.startswith("Current thread") for line in b.stderr_lines(2000)):
        assert time.monotonic() < deadline, "\n".join(b.stderr_tail)
        time.sleep(0.1)
    dump = "\n".join(b.stderr_lines(2000))
    assert "kv_sidecar/commands/serve.py" in dump and 'File "' in dump  # the main thread's wait
    time.sleep(0.5)
    assert b.alive
    out = _status_cli("--engine-socket", b.socket, "--json")
    assert out.returncode == 0, out.stderr


def test_a_served_sidecar_freezes_its_start_up_objects(
    pulled: tuple[SidecarProcess, SidecarProcess, str],
) -> None:
    """Full garbage collections walk only what the sidecar made since it started (commands/serve.py:
    the imported modules alone are ~180k objects, a ~100 ms pause each time)."""
    a, _, _ = pulled
    (record,) = [r for r in _json_records(a, 100_000) if "start-up objects frozen" in r.get("msg", "")]
    assert int(record["msg"].split()[0]) > 50_000, record


def test_status_of_a_sidecar_that_is_not_running(tmp_path: Any) -> None:
    out = _status_cli("--engine-socket", str(tmp_path / "none.sock"), "--timeout-s", "1")
    assert out.returncode == 1
    assert "cannot get the status of the engine socket: UNAVAILABLE" in out.stderr


def test_status_imports_neither_torch_nor_nixl() -> None:
    code = "import sys, kv_sidecar.commands.status; print(sorted({'torch', 'nixl'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out


def test_registry_gauges_are_current_at_every_scrape() -> None:
    """Registered engines and ranks and published requests are read when scraped (bound once), so
    registration, a publish and an engine's exit all show without anyone refreshing them."""
    sidecar = SidecarProcess("gauges")
    engine = None
    try:

        def gauges() -> tuple[float, float, float]:
            names = ("engines", "ranks")
            got = [metric(sidecar.metrics_port, f"kvsidecar_registered_{n}") for n in names]
            return got[0], got[1], metric(sidecar.metrics_port, "kvsidecar_published_requests")

        assert gauges() == (0, 0, 0)
        engine = EngineProcess(sidecar.socket, "gauges-p", SPEC)
        assert gauges() == (1, 1, 0)
        pub = engine.send(
            {"cmd": "prefill", "request_id": "g-1", "block_ids": [1, 2], "num_tokens": 20, "seed": 1}
        )
        assert pub["ok"], pub
        assert gauges() == (1, 1, 1)
        engine.stop()  # it unregisters: its rank and its published request go
        engine = None
        deadline = time.monotonic() + 10
        while gauges() != (0, 0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gauges() == (0, 0, 0)
    finally:
        if engine is not None:
            engine.stop()
        assert sidecar.stop() == 0
