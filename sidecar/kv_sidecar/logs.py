"""Log formatting: `text` (key=value) or `json` (one object per line).

Structured fields travel on a record as `extra={"fields": {...}}`; both formats
print them (json as top-level keys, text as key=value after the message).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import logging.handlers
import math
import queue
import re
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

_RESERVED = ("ts", "level", "logger", "msg")


class _UtcStamp:
    """A record's time as ISO 8601 in UTC to the millisecond, its date and time of day made once a second
    (the writer formats thousands of records a second)."""

    def __init__(self) -> None:
        self._second: tuple[int, str] = (-1, "")

    def __call__(self, record: logging.LogRecord) -> str:
        frac, whole = math.modf(record.created)  # rounded to the microsecond as datetime does
        us = round(frac * 1_000_000)
        now = int(whole) + us // 1_000_000
        second, text = self._second
        if now != second:
            text = datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds")[:-6]
            self._second = (now, text)  # one assignment: another thread sees the old pair or the new
        return f"{text}.{us % 1_000_000 // 1000:03d}+00:00"


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    """The record's structured fields (read only)."""
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


class JsonFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._stamp = _UtcStamp()

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": self._stamp(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in _fields(record).items():
            out[f"field_{k}" if k in _RESERVED else k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))


_NEEDS_QUOTES = re.compile(r'[ ="\n]')


def _text_value(v: Any) -> str:
    t = type(v)
    if t is str:  # ids, paths, peers: quoted only where a reader would misparse them
        s: str = v
    elif t is int or t is float or t is bool:  # byte counts, durations, flags: never quoted
        return str(v)
    else:
        s = str(v)
    return json.dumps(s) if not s or _NEEDS_QUOTES.search(s) else s


_TEXT_FORMAT = "ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s"


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)
        self._second: tuple[int, str] = (-1, "")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """logging's own format, its strftime done once a second: a busy sidecar writes a record per
        transfer, thousands a second, and strftime was about a sixth of formatting one."""
        if datefmt:
            return super().formatTime(record, datefmt)
        second, text = self._second
        if int(record.created) != second:
            second = int(record.created)
            text = time.strftime(self.default_time_format, self.converter(record.created))
            self._second = (second, text)  # one assignment: another thread sees the old pair or the new
        return (self.default_msec_format or "%s,%03d") % (text, record.msecs)

    def format(self, record: logging.LogRecord) -> str:
        """The stdlib's line for this format, then the fields. A record without an exception or stack
        (every transfer's record) is written out directly: the stdlib's `format` took ~40 % of a
        record's formatting, which the writer thread does holding the GIL that the pulls need."""
        if record.exc_info or record.exc_text or record.stack_info:
            line = super().format(record)
        else:
            record.message = record.getMessage()
            record.asctime = self.formatTime(record)
            line = f"ts={record.asctime} level={record.levelname} logger={record.name} msg={record.message}"
        fields = _fields(record)
        if not fields:
            return line
        return line + " " + " ".join([f"{k}={_text_value(v)}" for k, v in fields.items()])


class _Deferred(logging.handlers.QueueHandler):
    """Hands records to a writer thread: formatting and writing leave the caller's critical path
    (a pull's "pull finished" record cost ~0.3 ms of its answer on a busy 2-core machine).

    The queue stays in this process, so the record keeps its fields and its exc_info, and the
    writer's formatter prints exactly what it printed when it ran on the caller's thread. The
    message is rendered now (its arguments may change later); the record itself is not copied, as
    the stdlib's QueueHandler does, because the rendered message is what any later handler would
    print too.
    """

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        record.msg, record.args = record.getMessage(), None
        return record


class _Batched(logging.StreamHandler):
    """Formats each record as it comes and writes them in one go when the writer runs dry, or every
    `_BATCH` records: one write and flush per batch, not per record."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._lines.append(self.format(record))
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)
            return
        if len(self._lines) >= _BATCH:
            self.flush()

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            lines, self._lines = self._lines, []
            # A closed or broken stderr must not kill the writer thread (or the exit that stops it).
            with contextlib.suppress(Exception):
                if lines:
                    self.stream.write("\n".join(lines) + "\n")
                super().flush()


class _Writer(logging.handlers.QueueListener):
    """Looks for records every 20 ms instead of waking for each one: a writer that wakes at once takes
    the GIL (to format and write) just as the pull that logged is answering, which cost ~0.1 ms of a
    0.5 ms same-sidecar pull (bench/trace_pull.py --local, log level INFO against WARNING).

    Woken, it formats `_SLICE` records at a time and then sleeps a moment: a busy sidecar queues a
    record per transfer, dozens in 20 ms, and formatting them in one go held the GIL for a millisecond
    or more, while the pulls in flight waited for it (the interpreter takes it back from a thread only
    after its switch interval, 5 ms). A real sleep, not `sleep(0)`: a thread that gives the GIL up and
    asks for it again at once gets it back before a waiter on another core wakes. Only a backlog of
    `_BACKLOG` records is written without the pauses, so that the writer keeps up under any load."""

    def __init__(
        self,
        records: queue.SimpleQueue[logging.LogRecord],
        *handlers: logging.Handler,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(records, *handlers)
        self._records = records  # as itself: the base class knows only that it takes records
        self._sleep = sleep
        self._in_slice = 0

    def dequeue(self, block: bool) -> logging.LogRecord:
        if self._in_slice >= _SLICE:
            self._in_slice = 0
            if self._records.qsize() < _BACKLOG:
                self._sleep(_PAUSE_S)
        while True:
            try:
                record = self._records.get_nowait()
            except queue.Empty:
                if not block:
                    raise
                self._flush()
                self._in_slice = 0
                self._sleep(_WRITE_EVERY_S)
            else:
                self._in_slice += 1
                return record

    def stop(self) -> None:
        super().stop()
        self._flush()

    def _flush(self) -> None:
        for handler in self.handlers:
            handler.flush()


_WRITE_EVERY_S = 0.02
_BATCH = 256
_SLICE = 8  # records formatted between pauses: ~0.1-0.2 ms of GIL on a loaded sidecar
_PAUSE_S = 1e-4
_BACKLOG = 4 * _BATCH
_listener: logging.handlers.QueueListener | None = None


def _stop_writer() -> None:
    """Write what is queued and stop the writer thread (at exit, or before reconfiguring)."""
    global _listener
    listener, _listener = _listener, None
    if listener is not None:
        listener.stop()


TRANSFER_LOGGER = "kv_sidecar.transfer"


def configure_logging(level: str, fmt: str = "text", transfer_log: str = "failed") -> None:
    """`transfer_log`: "all" logs every finished transfer (at `level` and above); "failed" only those
    that failed, which are WARNING records: a busy node finishes thousands a second, and formatting a
    record each holds the interpreter that the pulls need."""
    global _listener
    # A busy sidecar with transfer_log: all makes a record per transfer, thousands a second, and neither
    # format prints the caller's file and line, thread or process: skip collecting them (the logging
    # HOWTO's "Optimization"; 33 -> 27 us a record here, writer included).
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    handler = _Batched(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt.lower() == "json" else TextFormatter())
    _stop_writer()
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    _listener = _Writer(records, handler)
    _listener.start()
    atexit.register(_stop_writer)  # once per call; a stopped writer is not stopped again
    root = logging.getLogger()
    root.handlers[:] = [_Deferred(records)]
    root.setLevel(level.upper())
    quiet = transfer_log.lower() == "failed"
    logging.getLogger(TRANSFER_LOGGER).setLevel(logging.WARNING if quiet else logging.NOTSET)
