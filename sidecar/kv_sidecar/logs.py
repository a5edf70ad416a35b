"""Log formatting: `text` (key=value) or `json` (one object per line).

Structured fields travel on a record as `extra={"fields": {...}}`; both formats
print them (json as top-level keys, text as key=value after the message).
"""

from __future__ import annotations

import atexit
import copy
import json
import logging
import logging.handlers
import queue
import sys
import time
from datetime import datetime, timezone
from typing import Any

_RESERVED = ("ts", "level", "logger", "msg")


def _stamp(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds")


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return dict(fields) if isinstance(fields, dict) else {}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _stamp(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in _fields(record).items():
            out[f"field_{k}" if k in _RESERVED else k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))


def _text_value(v: Any) -> str:
    s = str(v)
    return json.dumps(s) if not s or any(c in s for c in ' ="\n') else s


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = " ".join(f"{k}={_text_value(v)}" for k, v in _fields(record).items())
        return f"{line} {extra}" if extra else line


class _Deferred(logging.handlers.QueueHandler):
    """Hands records to a writer thread: formatting and writing leave the caller's critical path
    (a pull's "pull finished" record cost ~0.3 ms of its answer on a busy 2-core machine).

    The queue stays in this process, so the record keeps its fields and its exc_info, and the
    writer's formatter prints exactly what it printed when it ran on the caller's thread.
    """

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        record = copy.copy(record)
        record.msg, record.args = record.getMessage(), None
        return record


class _Writer(logging.handlers.QueueListener):
    """Looks for records every 20 ms instead of waking for each one: a writer that wakes at once takes
    the GIL (to format and write) just as the pull that logged is answering, which cost ~0.1 ms of a
    0.5 ms same-sidecar pull (bench/trace_pull.py --local, log level INFO against WARNING)."""

    def dequeue(self, block: bool) -> logging.LogRecord:
        while True:
            try:
                return self.queue.get_nowait()  # type: ignore[no-any-return]
            except queue.Empty:
                if not block:
                    raise
                time.sleep(_WRITE_EVERY_S)


_WRITE_EVERY_S = 0.02
_listener: logging.handlers.QueueListener | None = None


def _stop_writer() -> None:
    """Write what is queued and stop the writer thread (at exit, or before reconfiguring)."""
    global _listener
    if _listener is not None:
        _listener.stop()
        _listener = None


def configure_logging(level: str, fmt: str = "text") -> None:
    global _listener
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt.lower() == "json" else TextFormatter())
    _stop_writer()
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    _listener = _Writer(records, handler)
    _listener.start()
    atexit.register(_stop_writer)  # once per call; a stopped writer is not stopped again
    root = logging.getLogger()
    root.handlers[:] = [_Deferred(records)]
    root.setLevel(level.upper())
