"""The fork server the suite starts its sidecars and engines from (refengine/forkserver.py): each child is
a process of its own, with the argv, environment, working directory and stdio it was given, and its exit
code, or the signal that killed it, is reported as `subprocess.Popen` would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kv_sidecar.refengine.procs import ForkedProcess, _ForkServer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    forks = _ForkServer()  # its socket's directory goes with it
    yield forks.path()


def _child(
    server: str, tmp: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[ForkedProcess, Path]:
    err = tmp / "stderr.log"
    # From another working directory `python -m tests.forked_child` finds it only on PYTHONPATH, as here.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    with open(err, "wb") as f:
        proc = ForkedProcess(
            server,
            "tests.forked_child",
            list(args),
            {**os.environ, "PYTHONPATH": path, **(env or {})},
            f.fileno(),
        )
    return proc, err


def test_a_child_runs_its_module_with_its_own_argv_env_cwd_and_stdio(server: str, tmp_path: Path) -> None:
    os.chdir(tmp_path)
    try:
        proc, err = _child(server, tmp_path, "3", "more", env={"FORKED_CHILD_VALUE": "v1"})
    finally:
        os.chdir(ROOT)
    said = json.loads(proc.stdout.readline())
    assert said == {
        "argv": ["3", "more"],
        "env": "v1",
        "cwd": str(tmp_path),
        "pid": proc.pid,
        "main": "__main__",
    }
    assert said["pid"] != os.getpid()
    proc.stdin.write("hello\n")
    assert proc.stdout.readline().strip() == "HELLO"
    assert proc.wait(30) == 3
    assert proc.poll() == 3 and proc.returncode == 3
    assert err.read_text().strip() == "to stderr"
    # The next child does not see the first one's environment.
    other, _ = _child(server, tmp_path, "0")
    assert json.loads(other.stdout.readline())["env"] is None
    other.stdin.write("x\n")
    assert other.wait(30) == 0


def test_a_killed_child_reports_its_signal_and_a_running_one_polls_none(server: str, tmp_path: Path) -> None:
    proc, _ = _child(server, tmp_path, "0")
    proc.stdout.readline()
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    proc.kill()
    assert proc.wait(30) == -signal.SIGKILL
    proc.kill()  # a process already gone is not signalled again


def test_the_server_leaves_when_its_parent_does() -> None:
    path = os.path.join(tempfile.mkdtemp(prefix="kvsidecar-forks-"), "s.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kv_sidecar.refengine.forkserver", "--socket", path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    assert proc.stdin is not None
    proc.stdin.close()  # what this process's exit does
    assert proc.wait(30) == 0
