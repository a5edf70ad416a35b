"""The shard processes: `kv-sidecar serve` each, with the front door's settings but an engine socket,
peer port, metrics port and id of its own; started together, watched, and started again when one dies.

A shard is a whole sidecar. Its settings go to it as flags (which beat the environment and the config
file it would also read), every one of them, so that it runs exactly as the front door was told to.
A shard puts itself in a process group of its own, so that a Ctrl-C at a terminal reaches the
front door alone, which passes it on once; not in a session of its own, which Linux's autogroup
scheduling makes a scheduling group of its own: beside vLLM engines on a busy 2-core host, shards in
sessions of their own went unanswered for seconds and their NIXL connections for minutes
(tests/vllm/test_control_shards.py failed 4 runs in 6, and passed 5 in 5 in the front door's
session). It also asks for SIGTERM when the front door dies (PR_SET_PDEATHSIG), so that no shard
outlives its node sidecar (`die_with_front_door`). The kernel sends that signal when the thread that
started the shard ends, so every shard is started on the front door's main thread (`ShardSet`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

from kv_sidecar.config import Settings

log = logging.getLogger(__name__)

SHARD_SUFFIX = ".shard"
SHARD_METRICS_HOST = "127.0.0.1"  # a shard's /metrics: read by its front door alone
PARENT_ENV = "KVS_SHARD_FRONT_DOOR_PID"  # set for a shard: its front door's pid
_READY = re.compile(r"^kv-sidecar ready id=(\S+) .*peer=(\S+) metrics_port=(-?\d+)")
_PR_SET_PDEATHSIG = 1
# How long a shard that died waits before it is started again: doubling from the first, up to the last.
RESTART_BACKOFF_S = (0.5, 10.0)


def shard_socket(engine_socket: str, index: int) -> str:
    return f"{engine_socket}{SHARD_SUFFIX}{index}"


def advertised_host(address: str) -> str:
    """The host of an advertise_address ("host", "host:port", "[v6]" or "[v6]:port"): a shard adds its
    own peer port to it."""
    if address.startswith("["):
        return address[: address.index("]") + 1]
    return address.split(":")[0] if address.count(":") == 1 else address


def shard_settings(settings: Settings, index: int) -> dict[str, object]:
    """Shard `index`'s settings: the front door's, with its own socket, ports and id, and no shards."""
    values: dict[str, object] = {f.name: getattr(settings, f.name) for f in fields(Settings)}
    values.update(
        engine_socket=shard_socket(settings.engine_socket, index),
        peer_port=settings.peer_port + 1 + index if settings.peer_port else 0,
        metrics_port=0 if settings.metrics_port >= 0 else -1,  # the front door serves them merged
        metrics_host=SHARD_METRICS_HOST,
        advertise_address=advertised_host(settings.advertise_address),
        sidecar_id=f"{settings.sidecar_id}-shard{index}" if settings.sidecar_id else "",
        control_shards=1,
        control_shard_gpus="",
    )
    return values


def serve_argv(values: dict[str, object]) -> list[str]:
    argv = [sys.executable, "-m", "kv_sidecar", "serve"]
    for name, value in values.items():
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        argv += ["--" + name.replace("_", "-"), text]
    return argv


def die_with_front_door() -> bool:
    """In a shard (`kv-sidecar serve` started by a front door): leave the front door's process group
    for one of its own (a Ctrl-C at a terminal then reaches the front door alone), and ask the kernel
    for SIGTERM when the front door goes, however it goes. False: it is gone already. Done by the shard
    itself, not between fork and exec in the front door (a `preexec_fn`), which forks a process whose
    gRPC threads run: a shard started that way now and then aborted at start-up on an epoll error."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return True
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    return os.getppid() == int(parent)  # else it died before the request: no signal will come


class ShardError(RuntimeError):
    pass


@dataclass
class ShardInfo:
    """What a running shard told us in its ready line; replaced when it is started again."""

    sidecar_id: str
    peer_address: str
    metrics_port: int
    pid: int


class Shard:
    def __init__(self, index: int, settings: Settings) -> None:
        self.index = index
        self.socket = shard_socket(settings.engine_socket, index)
        self.target = f"unix:{self.socket}"
        self._argv = serve_argv(shard_settings(settings, index))
        self.proc: subprocess.Popen[str] | None = None
        self.info: ShardInfo | None = None  # None while down
        self.restarts = 0

    def spawn(self) -> None:
        """Start the process. On a thread that lives as long as the shard should: the kernel sends the
        parent-death signal when the thread that started a child ends, not only its process."""
        self.proc = subprocess.Popen(
            self._argv,
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, PARENT_ENV: str(os.getpid())},
        )

    def wait_ready(self, timeout_s: float) -> None:
        """Wait for its ready line; ShardError (and nothing left running) if none comes."""
        proc = self.proc
        assert proc is not None
        lines: list[str] = []
        reader = threading.Thread(target=self._read_until_ready, args=(proc, lines), daemon=True)
        reader.start()
        reader.join(timeout_s)
        m = _READY.match(lines[-1]) if lines else None
        if m is None:
            proc.kill()
            proc.wait()
            raise ShardError(
                f"shard {self.index} did not start (exit code {proc.returncode}); its last words are in "
                "the log above"
            )
        self.info = ShardInfo(m.group(1), m.group(2), int(m.group(3)), proc.pid)
        threading.Thread(
            target=self._pass_on, args=(proc,), daemon=True, name=f"shard{self.index}-out"
        ).start()

    @staticmethod
    def _read_until_ready(proc: subprocess.Popen[str], lines: list[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:  # NIXL prints to stdout before the ready line: passed on
            lines.append(line)
            if _READY.match(line):
                return
            sys.stdout.write(line)

    def _pass_on(self, proc: subprocess.Popen[str]) -> None:
        """The rest of its stdout (NIXL, UCX) to ours: a full pipe would stop the shard."""
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)

    def signal(self, sig: int) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)


class ShardSet:
    """Every shard: started together, tended (a dead one started again), stopped by `stop`.

    `start` and `tend` run on the front door's main thread, which lives as long as the front door:
    the kernel sends a shard its parent-death signal when the thread that started it ends, so a shard
    started again by a helper thread would get SIGTERM when that thread ended (at the front door's own
    stop, a second signal that cuts the shard's drain short)."""

    def __init__(self, settings: Settings, on_change: Callable[[], None] = lambda: None) -> None:
        self.shards = [Shard(k, settings) for k in range(settings.control_shards)]
        self._drain_s = settings.drain_timeout_s
        self._on_change = on_change
        self._due: dict[int, float] = {}  # shard index -> when to start it again
        self._backoff = {s.index: RESTART_BACKOFF_S[0] for s in self.shards}

    def start(self, timeout_s: float = 300.0) -> None:
        """Start every shard at once (NIXL's start-up dominates); ShardError, none left, if one fails."""
        errors: list[BaseException] = []

        def one(shard: Shard) -> None:
            try:
                shard.wait_ready(timeout_s)
            except BaseException as e:
                errors.append(e)

        for shard in self.shards:
            shard.spawn()
        threads = [threading.Thread(target=one, args=(s,)) for s in self.shards]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.stop()
            raise errors[0]

    @property
    def all_up(self) -> bool:
        return all(s.info is not None for s in self.shards)

    def tend(self) -> None:
        """Note a shard that died and start it again once its wait is over (0.5 s, doubling up to 10 s
        while it fails to start); its ready line is awaited on a thread of its own. Called every ~0.1 s
        on the thread that ran `start`."""
        now = time.monotonic()
        for shard in self.shards:
            proc = shard.proc
            if proc is None or proc.poll() is None:
                continue  # running, or starting
            index = shard.index
            if shard.info is not None:
                log.error(
                    "shard %d (pid %d) exited with %s: starting it again in %.1f s; its engines "
                    "register again (their sessions reconnect), pulls it held failed",
                    index,
                    proc.pid,
                    proc.returncode,
                    self._backoff[index],
                )
                shard.info = None
                self._on_change()
                self._due[index] = now + self._backoff[index]
            elif index not in self._due:  # a start again that failed: wait longer
                self._backoff[index] = min(RESTART_BACKOFF_S[1], self._backoff[index] * 2)
                self._due[index] = now + self._backoff[index]
            if now >= self._due[index]:
                del self._due[index]
                shard.spawn()
                threading.Thread(target=self._ready_again, args=(shard,), daemon=True).start()

    def _ready_again(self, shard: Shard) -> None:
        try:
            shard.wait_ready(timeout_s=300.0)
        except ShardError as e:
            log.error("%s", e)
            return
        shard.restarts += 1
        self._backoff[shard.index] = RESTART_BACKOFF_S[0]
        info = shard.info
        if info is not None:
            log.info("shard %d started again: pid %d, peer %s", shard.index, info.pid, info.peer_address)
        self._on_change()

    def cut_short(self) -> None:
        """A second signal: the shards skip the rest of their drains. Called from a signal handler, so
        it takes no lock."""
        for shard in self.shards:
            shard.signal(signal.SIGTERM)

    def stop(self) -> list[int | None]:
        """SIGTERM each (each drains, up to drain_timeout_s) and wait; the exit codes (killed: None)."""
        for shard in self.shards:
            shard.signal(signal.SIGTERM)
        codes: list[int | None] = []
        deadline = time.monotonic() + self._drain_s + 10
        for shard in self.shards:
            proc = shard.proc
            if proc is None:
                codes.append(None)
                continue
            try:
                codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                codes.append(None)
        return codes
