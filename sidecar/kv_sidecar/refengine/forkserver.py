"""A fork server: start many `python -m kv_sidecar...` processes without paying their imports each time.

Each sidecar or reference-engine process spends 1.5-3 s of CPU importing torch, numpy, grpc and its own
modules before it does anything, and the CPU test suite starts hundreds of them on two cores. This
server imports those once, then forks a child per request. The child runs its module as `python -m`
would (its own argv, environment, working directory, stdin, stdout and stderr) and leaves through the
interpreter's normal exit (atexit handlers, finalizers, library destructors). The children are real,
separate processes with their own pids, signals and exit codes; only the imports are shared. (`ps`
shows them under the server's command line; `py-spy dump` shows which module each runs.)

The server has a single thread (forking a process with more threads copies locks that the others may
hold). Its stdin is its parent's pipe: at EOF, the parent has gone, and the server leaves too; children
it started live on until they are stopped.

The protocol, over a unix socket: the client sends one JSON line {"module", "argv", "env", "cwd"} with
three file descriptors (the child's stdin, stdout and stderr) attached (SCM_RIGHTS); the server answers
{"pid": N} at once and {"exit": code} when the child exits (negative: killed by that signal, as
`subprocess.Popen.returncode` says), then closes the connection.

    python -m kv_sidecar.refengine.forkserver --socket PATH   # prints "ready" once it listens
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import runpy
import select
import socket
import sys
import traceback

# What both kinds of process import before their first line of work (~95 % of their start-up).
PRELOAD = (
    "torch",
    "numpy",
    "grpc",
    "kv_sidecar.cli",
    "kv_sidecar.commands.serve",
    "kv_sidecar.server.sidecar",
    "kv_sidecar.refengine.engine",
)
_MAX_REQUEST = 1 << 20
_POLL_S = 0.02  # how late an exit is reported at most


def _preload() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    from kv_sidecar.transport.nixl_driver import import_nixl

    saved = os.environ.get("UCX_PROTO_EMULATION_ENABLE")
    import_nixl()  # NIXL's bindings; the child calls it again, in its own environment
    if saved is None:
        os.environ.pop("UCX_PROTO_EMULATION_ENABLE", None)


def _read_request(conn: socket.socket) -> tuple[dict[str, object], list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 3)
    while not data.endswith(b"\n"):
        more = conn.recv(_MAX_REQUEST)
        if not more:
            break
        data += more
    return json.loads(data), list(fds)


def _run_child(request: dict[str, object], fds: list[int]) -> int:
    """In the forked child: become `python -m module argv...` and run it; its exit code."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    # Fresh stdio objects: the server's may hold buffered data, and point at its own pipes.
    # (typeshed calls sys.__stdin__ and the others Final; the child replaces them on purpose)
    sys.stdin = sys.__stdin__ = open(0, closefd=False)  # type: ignore[misc]  # noqa: SIM115 (lives as long as the process)
    sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)  # type: ignore[misc]  # noqa: SIM115
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)  # type: ignore[misc]  # noqa: SIM115
    env = {str(k): str(v) for k, v in dict(request["env"]).items()}  # type: ignore[call-overload]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(str(request["cwd"]))
    # sys.path was built for the server: as `python -m` would, the working directory first, then the
    # child's own PYTHONPATH entries.
    rest = sys.path[1:]
    added = [d for d in env.get("PYTHONPATH", "").split(os.pathsep) if d and d not in rest]
    sys.path[:] = [os.getcwd(), *added, *rest]
    module = str(request["module"])
    sys.argv = [module, *[str(a) for a in request["argv"]]]  # type: ignore[attr-defined]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def serve(path: str) -> int:
    _preload()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)
    watching: dict[int, socket.socket] = {}  # child pid -> its client's connection
    stdin = sys.stdin.fileno()
    while True:
        readable, _, _ = select.select([server, stdin], [], [], _POLL_S)
        if stdin in readable and not os.read(stdin, 4096):
            break  # the parent has gone
        if server in readable:
            conn, _ = server.accept()
            request, fds = _read_request(conn)
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                for other in watching.values():
                    other.close()
                # Leave through this frame and the interpreter's normal exit, not os._exit: atexit
                # handlers and library destructors (UCX's among them) run as in any process.
                raise SystemExit(_run_child(request, fds))
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            watching[pid] = conn
        while watching:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            waiter = watching.pop(pid, None)
            if waiter is not None:
                with contextlib.suppress(OSError):  # else the client is gone: nobody waits for this exit
                    waiter.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                waiter.close()
    server.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True, help="the unix socket to listen on")
    return serve(ap.parse_args(argv).socket)


if __name__ == "__main__":
    raise SystemExit(main())
