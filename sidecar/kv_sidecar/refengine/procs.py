"""Start real sidecar and reference-engine processes (demo, tests, benchmarks)."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar_client.shm import SHM_DIR


class ProcessError(RuntimeError):
    pass


def tcp_only_env(emulation: bool = False) -> dict[str, str]:
    """Environment of a sidecar whose UCX may use TCP only (no shared memory): where NVIDIA GPUs are
    present NIXL refuses a UCX_TLS without CUDA memory support (docs/operations.md 5.9), and cuda_copy
    adds that and no path between two processes' host memory. `emulation`: UCX may also emulate the
    READs TCP cannot do natively (the sidecar turns that off by default)."""
    import torch  # only where it is asked for: the demo's processes start without it here

    env = {"UCX_TLS": "tcp,cuda_copy" if torch.cuda.is_available() else "tcp"}
    return {**env, "UCX_PROTO_EMULATION_ENABLE": "y"} if emulation else env


def cpu_ticks(pid: int, tid: int | None = None) -> int:
    """User + system CPU time of a process (or of one of its threads), in clock ticks: fields 14 and 15
    of /proc/PID[/task/TID]/stat. Benchmarks report what each process used; tests see one working."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def children(pid: int) -> list[int]:
    """The processes `pid` started, in the order /proc lists them (each under the thread that started
    it); none once it is gone."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    return out


def descendants(pid: int) -> list[int]:
    """Every process below `pid`: its children, theirs, and so on."""
    out: list[int] = []
    todo = [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


P = TypeVar("P", bound="_Proc")


def gpu_memory_by_process() -> dict[int, dict[str, int]]:
    """MiB of GPU memory each process holds, by GPU, as `nvidia-smi` lists its compute processes (a
    process with a CUDA context on a GPU is listed there): pid -> {GPU index (its UUID where nvidia-smi
    names no index for it, e.g. a MIG instance): MiB}."""
    smi = shutil.which("nvidia-smi") or "nvidia-smi"
    gpus = subprocess.run(
        [smi, "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True, text=True, check=True
    ).stdout
    index = {uuid.strip(): i.strip() for i, uuid in (line.split(",") for line in gpus.splitlines() if line)}
    apps = subprocess.run(
        [smi, "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    out: dict[int, dict[str, int]] = {}
    for line in apps.splitlines():
        pid, uuid, mib = (f.strip() for f in line.split(","))
        held = out.setdefault(int(pid), {})
        gpu = index.get(uuid, uuid)
        held[gpu] = held.get(gpu, 0) + int(mib)
    return out


def together(*makers: Callable[[], P]) -> list[P]:
    """Start several processes at once and wait until every one is ready; their start-up is mostly
    imports on one core each, so two take about the time of one where there are two cores. If any
    fails to start, the others are killed and its error is raised."""
    with ThreadPoolExecutor(len(makers)) as pool:
        futures = [pool.submit(m) for m in makers]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for f in futures:
            if f.exception() is None:
                f.result().kill()
        raise failed[0]  # type: ignore[misc]
    return [f.result() for f in futures]


R = TypeVar("R")


def side_by_side(*stops: Callable[[], R]) -> list[R]:
    """Run each (a process's stop, mostly waiting for it to exit) at once; their results in order, or
    the first error once all have ended."""
    if not stops:
        return []
    with ThreadPoolExecutor(len(stops)) as pool:
        futures = [pool.submit(stop) for stop in stops]
    return [f.result() for f in futures]


# Directories SidecarProcess made, with how many of them use each: a restarted sidecar reuses its
# predecessor's, and the directory goes when the last of them is collected.
_made_dirs: dict[str, int] = {}
_made_lock = threading.Lock()


def _hold_dir(owner: object, path: str) -> None:
    with _made_lock:
        _made_dirs[path] = _made_dirs.get(path, 0) + 1
    weakref.finalize(owner, _drop_dir, path)


def _drop_dir(path: str) -> None:
    with _made_lock:
        _made_dirs[path] -= 1
        if _made_dirs[path] > 0:
            return
        del _made_dirs[path]
    shutil.rmtree(path, ignore_errors=True)


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


_TAIL_LINES = 200
_TAIL_BYTES = 1 << 18


class ForkedProcess:
    """A process the fork server (refengine/forkserver.py) started: the part of `subprocess.Popen` that
    `_Proc` and its users need (pid, stdin, stdout, poll, wait, send_signal, kill, returncode)."""

    def __init__(self, server: str, module: str, args: list[str], env: dict[str, str], stderr: int) -> None:
        self.args = [sys.executable, "-m", module, *args]
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(server)
            request = {"module": module, "argv": args, "env": env, "cwd": os.getcwd()}
            socket.send_fds(self._conn, [json.dumps(request).encode() + b"\n"], [in_r, out_w, stderr])
        finally:
            os.close(in_r)
            os.close(out_w)
        self.stdin = open(in_w, "w", buffering=1)  # noqa: SIM115 (as Popen's: closed with the object)
        self.stdout = open(out_r)  # noqa: SIM115
        self._lock = threading.Lock()
        self._buf = b""
        self.returncode: int | None = None
        self.pid = int(self._message(None)["pid"])

    def _message(self, timeout_s: float | None) -> dict[str, int]:
        """The server's next line; TimeoutError if none within `timeout_s` (None: wait for it)."""
        while b"\n" not in self._buf:
            self._conn.settimeout(timeout_s)
            try:
                more = self._conn.recv(4096)
            except (TimeoutError, BlockingIOError):
                raise TimeoutError from None
            if not more:
                raise ProcessError(f"the fork server went away before {self.args[2]}'s exit was known")
            self._buf += more
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def _collect(self, timeout_s: float | None) -> None:
        """Take the exit message if it comes within `timeout_s`; the caller holds the lock."""
        if self.returncode is None:
            self.returncode = int(self._message(timeout_s)["exit"])
            self._conn.close()

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        try:
            self._collect(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
        finally:
            self._lock.release()
        assert self.returncode is not None
        return self.returncode

    def poll(self) -> int | None:
        """The exit code if known; None while it runs, or while another thread waits for it (as Popen)."""
        if not self._lock.acquire(blocking=False):
            return self.returncode
        try:
            self._collect(0)
        except TimeoutError:
            pass
        finally:
            self._lock.release()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not to a pid that may be someone else's by now
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class _ForkServer:
    """This process's fork server, started on first use and gone when this process is (its stdin)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._path = ""

    def path(self) -> str:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                workdir = tempfile.mkdtemp(prefix="kvsidecar-forks-")
                self._path = os.path.join(workdir, "forkserver.sock")
                proc = subprocess.Popen(
                    [sys.executable, "-m", "kv_sidecar.refengine.forkserver", "--socket", self._path],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                assert proc.stdout is not None
                if proc.stdout.readline().strip() != "ready":
                    proc.kill()
                    raise ProcessError(f"the fork server did not start (exit code {proc.wait()})")
                self._proc = proc
                weakref.finalize(self, shutil.rmtree, workdir, True)
            return self._path


_fork_server: _ForkServer | None = None
# What the fork server starts: the modules whose imports it holds (forkserver.PRELOAD).
FORKED_MODULES = frozenset({"kv_sidecar", "kv_sidecar.refengine"})


@contextlib.contextmanager
def from_scratch() -> Iterator[None]:
    """Processes started in the block start as `python -m` would, without the fork server: a restart
    that takes a real process's start-up (seconds), where a test's timing depends on it."""
    global _fork_server
    kept, _fork_server = _fork_server, None
    try:
        yield
    finally:
        _fork_server = kept


def use_fork_server(on: bool = True) -> None:
    """Start this process's sidecars and reference engines (those of this interpreter) from a fork
    server that has imported their modules once (refengine/forkserver.py): ~2 s of CPU less a process.
    The test suite turns it on; benchmarks and the demo start every process from scratch."""
    global _fork_server
    _fork_server = _ForkServer() if on else None


def pin_tasks(pid: int, cpus: Collection[int]) -> None:
    """`sched_setaffinity` for each thread of process `pid` (it sets one thread's alone)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


class _Proc:
    def __init__(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        # stderr goes to a file, not a pipe: no thread of ours wakes for every log line (in a
        # benchmark it would take the engine's GIL in the middle of the calls it times).
        fd, self.log_path = tempfile.mkstemp(prefix="kvsidecar-", suffix=".log")
        full_env = {**os.environ, **(env or {})}
        with os.fdopen(fd, "wb") as log:
            self.proc: subprocess.Popen[str] | ForkedProcess
            server = _fork_server
            if server is not None and argv[:2] == [sys.executable, "-m"] and argv[2] in FORKED_MODULES:
                self.proc = ForkedProcess(server.path(), argv[2], argv[3:], full_env, log.fileno())
            else:
                self.proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    bufsize=1,
                    env=full_env,
                )
        weakref.finalize(self, _remove, self.log_path)

    @property
    def stderr_tail(self) -> list[str]:
        """The last lines the process wrote to stderr."""
        return self.stderr_lines(_TAIL_LINES)

    def stderr_lines(self, n: int) -> list[str]:
        """The last `n` lines the process wrote to stderr (at most the last 256 KiB)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - _TAIL_BYTES))
                text = f.read().decode(errors="replace")
        except OSError:
            return []
        return text.splitlines()[-n:]

    def readline(self, timeout_s: float) -> str:
        """One stdout line, or ProcessError with the stderr tail if the process died or hung."""
        assert self.proc.stdout is not None
        box: list[str] = []
        t = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        t.start()
        t.join(timeout_s)
        if not box or not box[0]:
            tail = "\n".join(self.stderr_tail)
            raise ProcessError(f"{self.name} gave no answer (exit code {self.proc.poll()}); stderr:\n{tail}")
        return box[0]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pin(self, cpus: Collection[int]) -> None:
        """Run the process on `cpus` only (Linux): every thread it has now, and so every thread and
        process they start later, which inherit it. A benchmark's processes on cores of their own."""
        pin_tasks(self.proc.pid, cpus)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class SidecarProcess(_Proc):
    """`kv-sidecar serve` on a temporary unix socket and free ports on loopback."""

    def __init__(
        self,
        name: str = "sidecar",
        workdir: str | None = None,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
        start_timeout_s: float = 60,
    ) -> None:
        self.workdir = workdir or tempfile.mkdtemp(prefix="kvsidecar-")
        if workdir is None or workdir in _made_dirs:
            _hold_dir(self, self.workdir)
        self.socket = os.path.join(self.workdir, f"{name}.sock")
        argv = [
            sys.executable,
            "-m",
            "kv_sidecar",
            "serve",
            "--engine-socket",
            self.socket,
            "--peer-host",
            "127.0.0.1",
            "--peer-port",
            "0",
            "--metrics-port",
            "0",
            *(extra or []),
        ]
        super().__init__(argv, name, env)
        deadline = time.monotonic() + start_timeout_s
        try:
            while True:  # NIXL prints its own log lines to stdout before ours
                line = self.readline(max(0.1, deadline - time.monotonic()))
                m = re.search(r"^kv-sidecar ready id=(\S+) .*peer=(\S+) metrics_port=(\d+)", line)
                if m:
                    break
        except BaseException:
            self.kill()  # never leave a half-started sidecar behind
            raise
        self.sidecar_id, self.peer_address, self.metrics_port = m.group(1), m.group(2), int(m.group(3))
        self.hung_on_stop = False
        # Keep reading stdout (NIXL/UCX may print there): a full pipe would block the sidecar.
        self.stdout_tail: deque[str] = deque(maxlen=200)
        threading.Thread(target=self._drain_stdout, daemon=True).start()

    def _drain_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout_tail.append(line.rstrip())

    def worker_pids(self) -> list[int]:
        """The sidecar's data-plane worker processes (device_workers, staged_workers): its children
        that multiprocessing's spawn started, in the order /proc lists them."""
        out = []
        for c in children(self.proc.pid):
            with contextlib.suppress(OSError), open(f"/proc/{c}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    out.append(c)
        return out

    def answering_workers(self) -> list[tuple[int, int]]:
        """(device, pid) of each data-plane worker that `kv-sidecar status` shows started and answering,
        by device: a worker starts at the first local copy into its device, and copies run in the
        sidecar until it answers."""
        from kv_sidecar_client import SidecarClient

        with SidecarClient(self.socket, lane=False) as client:
            return sorted((w.device, w.pid) for w in client.status().workers if w.pid and not w.starting)

    def stop(self, timeout_s: float = 30) -> int:
        """SIGTERM, and the exit code. A sidecar still running after `timeout_s` is asked for its
        threads' stacks (SIGUSR1, in its stderr: see `hung_on_stop`) and killed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.hung_on_stop = True
                self.proc.send_signal(signal.SIGUSR1)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(2)  # faulthandler writes from its signal handler, GIL or not
                self.kill()
        return self.proc.wait()  # ended by now (waited for above, or killed): its code at once


class EngineProcess(_Proc):
    def __init__(
        self,
        socket: str,
        engine_id: str,
        spec: EngineSpec,
        ranks: list[int] | None = None,
        start_timeout_s: float = 60,
        devices: list[str] | None = None,
        leader: str = "",
        env: dict[str, str] | None = None,
        python: list[str] | None = None,
        shm_names: str = "",
        placement: str = "",
    ) -> None:
        """`leader`: the engine's leader sidecar (peer address) when its ranks span several sidecars.
        `shm_names`: host caches in /dev/shm/<shm_names>-<rank> (refengine --shm-names).
        `placement`: control shards' placement key (refengine --placement).
        `env`: added to the engine's environment (e.g. KV_SIDECAR_ENGINE_LANE=0).
        `python`: the command that runs Python (default: this interpreter), e.g. one in a container
        (scripts/image_smoke.py)."""
        argv = [
            *(python or [sys.executable]),
            "-m",
            "kv_sidecar.refengine",
            "--socket",
            socket,
            "--engine-id",
            engine_id,
            "--spec",
            spec.canonical_json(),
        ]
        if ranks:
            argv += ["--ranks", ",".join(map(str, ranks))]
        if devices:
            argv += ["--devices", ",".join(devices)]
        if leader:
            argv += ["--leader", leader]
        if shm_names:
            argv += ["--shm-names", shm_names]
        if placement:
            argv += ["--placement", placement]
        super().__init__(argv, f"engine {engine_id}", env)
        self.spec = spec
        self.engine_id = engine_id
        try:
            ready = json.loads(self.readline(start_timeout_s))
        except BaseException:
            self.kill()  # never leave a half-started engine behind
            raise
        if not ready.get("ok"):
            self.kill()
            raise ProcessError(f"engine {engine_id} failed to start: {ready}")

    def kill(self) -> None:
        """SIGKILL, and the shared memory the engine can no longer remove: its caches, named by its pid
        (kv_sidecar_client/shm.py). A sidecar that mapped them keeps its mapping."""
        super().kill()
        for path in glob.glob(os.path.join(SHM_DIR, f"kvsidecar-{self.proc.pid}-*")):
            _remove(path)

    def send(self, cmd: dict[str, Any], timeout_s: float = 120) -> dict[str, Any]:
        self.post(cmd)
        return json.loads(self.readline(timeout_s))

    def post(self, cmd: dict[str, Any]) -> None:
        """Send a command without waiting for its answer (readline takes it): several engines' commands
        then run at once."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def stop(self, timeout_s: float = 30) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"cmd": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
