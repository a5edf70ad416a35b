"""Span tracing for a sidecar process, for bench/trace_pull.py (not used in production).

Put this directory first on PYTHONPATH and set KV_SIDECAR_TRACE=<file>: once the
sidecar's modules are imported, the functions named in KV_SIDECAR_TRACE_SPANS
(module:attr or module:Class.method, comma-separated) are wrapped so that each call
records (thread, name, start, end) with time.perf_counter(); SIGUSR2 writes the spans
recorded so far to the file as JSON lines and clears them. A device worker the sidecar
starts (a spawned process: the environment is inherited) traces the same functions, once
its own modules are in, into <file>.worker<pid>.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import signal
import sys
import threading
import time

_OUT = os.environ.get("KV_SIDECAR_TRACE", "")
_SPANS: list[tuple[str, str, float, float]] = []


def _wrap(name: str, fn):  # type: ignore[no-untyped-def]
    @functools.wraps(fn)
    def traced(*a, **k):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _SPANS.append((threading.current_thread().name, name, t0, time.perf_counter()))

    traced.__traced__ = True  # type: ignore[attr-defined]
    return traced


def _patch(target: str) -> bool:
    mod_name, _, attr = target.partition(":")
    mod = sys.modules.get(mod_name)
    if mod is None:
        try:
            mod = importlib.import_module(mod_name)
        except Exception:
            return False
    owner, _, leaf = attr.rpartition(".")
    obj = getattr(mod, owner) if owner else mod
    fn = getattr(obj, leaf)
    if getattr(fn, "__traced__", False):
        return True
    traced = _wrap(attr.rsplit(".", 1)[-1] if not owner else attr, fn)
    # A static method stays one: wrapped as a plain function it would be given the instance too.
    static = owner and isinstance(inspect.getattr_static(obj, leaf), staticmethod)
    setattr(obj, leaf, staticmethod(traced) if static else traced)
    return True


def _dump(*_: object) -> None:
    spans = list(_SPANS)
    del _SPANS[: len(spans)]
    with open(_OUT, "a") as f:
        for s in spans:
            f.write(json.dumps(s) + "\n")


def _install(ready_module: str) -> None:
    targets = [t for t in os.environ.get("KV_SIDECAR_TRACE_SPANS", "").split(",") if t]
    # Wait for the process to import its own modules (torch and NIXL take seconds), then patch.
    while ready_module not in sys.modules:
        time.sleep(0.05)
    time.sleep(0.5)
    for t in targets:
        try:
            _patch(t)
        except Exception as e:  # a wrong name: say so, keep the sidecar running
            print(f"pulltrace: cannot wrap {t}: {e}", file=sys.stderr)


_WORKER = "--multiprocessing-fork" in sys.argv  # a spawned child: of a sidecar, a device worker
if _OUT and ("serve" in sys.argv or _WORKER):
    if _WORKER:
        _OUT = f"{_OUT}.worker{os.getpid()}"
    signal.signal(signal.SIGUSR2, _dump)
    ready = "kv_sidecar.dataplane.workers" if _WORKER else "kv_sidecar.server.sidecar"
    threading.Thread(target=_install, args=(ready,), daemon=True, name="pulltrace").start()
