"""The sidecar's log lines: the text format's fields and timestamps, and the writer thread's batches."""

from __future__ import annotations

import io
import json
import logging
import queue
import re
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_sidecar import logs
from kv_sidecar.logs import JsonFormatter, TextFormatter, configure_logging
from kv_sidecar.server.transfers import TransferTracker

STDLIB = logging.Formatter("ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")


def _record(msg: str = "pull finished", created: float | None = None, **fields: object) -> logging.LogRecord:
    r = logging.LogRecord("kv_sidecar.transfer", logging.INFO, __file__, 1, msg, None, None)
    if created is not None:
        r.created, r.msecs = created, (created - int(created)) * 1000
    r.fields = fields  # type: ignore[attr-defined]
    return r


def test_text_fields_are_quoted_only_where_a_reader_would_misparse_them() -> None:
    t = time.time()  # both records of one instant: two made a moment apart may be a millisecond apart
    line = TextFormatter().format(
        _record(
            created=t,
            bytes=2097152,
            gbps=1.5,
            ok=True,
            path="gpu-staged",
            error='a "b"=c',
            empty="",
            peer=None,
        )
    )
    head, fields = line.split(" msg=pull finished ")
    assert head == STDLIB.format(_record(created=t)).split(" msg=")[0]
    assert fields == 'bytes=2097152 gbps=1.5 ok=True path=gpu-staged error="a \\"b\\"=c" empty="" peer=None'


@pytest.mark.parametrize("created", [1_700_000_000.0, 1_700_000_000.999, 1_700_000_001.001, 1_700_086_399.5])
def test_text_timestamps_are_the_stdlib_format(created: float) -> None:
    f = TextFormatter()
    f.format(_record(created=created - 1.0))  # a cached second, then the next one
    assert f.formatTime(_record(created=created)) == STDLIB.formatTime(_record(created=created))


@pytest.mark.parametrize("created", [1_700_000_000.0, 1_700_000_000.999, 1_700_000_001.001, 1_700_086_399.5])
def test_json_timestamps_are_iso_8601_utc_to_the_millisecond(created: float) -> None:
    f = JsonFormatter()
    f.format(_record(created=created - 1.0))
    want = datetime.fromtimestamp(created, timezone.utc).isoformat(timespec="milliseconds")
    assert json.loads(f.format(_record(created=created)))["ts"] == want


def test_json_keeps_reserved_field_names_apart() -> None:
    out = json.loads(JsonFormatter().format(_record(msg="x", level="mine", bytes=3)))
    assert out["msg"] == "x" and out["level"] == "INFO" and out["field_level"] == "mine" and out["bytes"] == 3


@pytest.fixture
def root_logger() -> Iterator[None]:
    """configure_logging replaces the root logger's handlers and level: put pytest's back after."""
    root, transfers = logging.getLogger(), logging.getLogger(logs.TRANSFER_LOGGER)
    handlers, level, transfer_level = root.handlers[:], root.level, transfers.level
    yield
    logs._stop_writer()
    root.handlers[:] = handlers
    root.setLevel(level)
    transfers.setLevel(transfer_level)


@pytest.mark.usefixtures("root_logger")
def test_the_writer_writes_every_record_in_order_in_batches(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """More records than one batch, logged faster than the writer wakes: all of them, in order, once the
    writer stops; and a record logged while the writer idles is out within a few of its wake-ups."""
    out = tmp_path / "stderr"
    with out.open("w") as stream:
        monkeypatch.setattr(sys, "stderr", stream)
        configure_logging("info")
        log = logging.getLogger("kv_sidecar.test_logs")
        n = 3 * logs._BATCH + 7
        for i in range(n):
            log.info("record %d", i, extra={"fields": {"i": i}})
        log.debug("not at this level")
        logs._stop_writer()
        lines = out.read_text().splitlines()
        assert [line.rsplit(" i=", 1)[1] for line in lines] == [str(i) for i in range(n)]
        assert all(f"msg=record {i} i={i}" in line for i, line in enumerate(lines))

        configure_logging("info")
        log.warning("alone")
        for _ in range(100):  # the writer wakes every 20 ms
            if "msg=alone" in out.read_text():
                break
            time.sleep(0.02)
        assert "level=WARNING" in out.read_text().splitlines()[-1]
        logs._stop_writer()  # before the file closes


def _finish_transfers(tracker: TransferTracker) -> None:
    """A pull and a served read that succeed, and one of each that fails, their records run as a pull's
    adapter runs them (after its answer)."""
    for rid, outcome in (("ok-1", "ok"), ("bad-1", "error")):
        pull = tracker.begin_pull("dec", f"pull-{rid}", "pre", "10.0.0.2:50061")
        tracker.end_pull(
            pull, 4096 if outcome == "ok" else 0, "host-nixl", outcome, "" if outcome == "ok" else "X"
        )()
        tracker.begin_serve("pre", f"serve-{rid}", "dec", "ipv4:10.0.0.3:1", [0], 4096, "host-nixl")
        if outcome == "ok":
            tracker.serve_rank_done("pre", f"serve-{rid}", "dec", 0)
        else:
            tracker.serve_failed("pre", f"serve-{rid}", "dec")


@pytest.mark.parametrize(
    ("setting", "kept"),
    [
        ("failed", ["pull-bad-1 WARNING", "serve-bad-1 WARNING"]),
        ("all", ["pull-ok-1 INFO", "serve-ok-1 INFO", "pull-bad-1 WARNING", "serve-bad-1 WARNING"]),
    ],
)
@pytest.mark.usefixtures("root_logger")
def test_transfer_log_keeps_the_failed_transfers_or_all_of_them(
    monkeypatch: pytest.MonkeyPatch, setting: str, kept: list[str]
) -> None:
    """transfer_log: failed (the default) writes no record of a transfer that succeeded, and every record
    of one that failed; all writes each. Other records at INFO are written either way."""
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    configure_logging("info", "json", setting)
    _finish_transfers(TransferTracker())
    logging.getLogger("kv_sidecar.server").info("registered")
    logs._stop_writer()
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [f"{r['request_id']} {r['level']}" for r in records if "request_id" in r] == kept
    assert [r["msg"] for r in records if "request_id" not in r] == ["registered"]


@pytest.mark.usefixtures("root_logger")
def test_a_broken_stream_does_not_stop_the_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken(io.StringIO):
        fail = True

        def write(self, s: str) -> int:
            if self.fail:
                raise OSError("stderr is gone")
            return super().write(s)

    stream = Broken()
    monkeypatch.setattr(sys, "stderr", stream)
    configure_logging("info")
    log = logging.getLogger("kv_sidecar.test_logs")
    log.info("lost")
    time.sleep(0.2)  # ten of the writer's wake-ups: it has tried to write "lost"
    stream.fail = False
    log.info("kept")
    logs._stop_writer()
    assert "msg=kept" in stream.getvalue() and "msg=lost" not in stream.getvalue()


def _stdlib_text_value(v: object) -> str:
    """The text format's field values as the formatter wrote them before its fast path."""
    if type(v) in (int, float, bool):
        return str(v)
    s = str(v)
    return json.dumps(s) if not s or re.search(r'[ ="\n]', s) else s


_values = st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(), st.text(max_size=12), st.none())


@settings(max_examples=300, deadline=None)
@given(
    msg=st.text(max_size=30),
    fields=st.dictionaries(st.text("abcdefgh_", min_size=1, max_size=8), _values, max_size=6),
    created=st.floats(1_600_000_000, 1_900_000_000),
    level=st.sampled_from([logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR]),
)
def test_text_lines_are_the_stdlib_line_and_the_fields(
    msg: str, fields: dict[str, object], created: float, level: int
) -> None:
    """The fast path writes what the stdlib formatter and the fields' join wrote, byte for byte."""
    r = _record(msg, created, **fields)
    r.levelno, r.levelname = level, logging.getLevelName(level)
    want = STDLIB.format(r)
    if fields:
        want += " " + " ".join(f"{k}={_stdlib_text_value(v)}" for k, v in fields.items())
    assert TextFormatter().format(r) == want


def test_text_lines_with_an_exception_keep_the_traceback_before_the_fields() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        r = logging.LogRecord("kv_sidecar.x", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    r.fields = {"bytes": 3}  # type: ignore[attr-defined]
    line = TextFormatter().format(r)
    assert line.startswith(STDLIB.format(r)) and "ValueError: boom" in line and line.endswith(" bytes=3")


def test_the_writer_pauses_between_slices_of_records_unless_it_falls_behind() -> None:
    """Woken with records queued, the writer takes _SLICE of them, then sleeps _PAUSE_S (the GIL goes
    to the threads that wait for it), and so on; a backlog of _BACKLOG or more it takes without pauses."""
    pauses: list[float] = []
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    writer = logs._Writer(records, logging.NullHandler(), sleep=pauses.append)
    for i in range(3 * logs._SLICE + 1):
        records.put(_record(f"r{i}"))
    taken = [writer.dequeue(False).msg for _ in range(3 * logs._SLICE + 1)]
    assert taken == [f"r{i}" for i in range(3 * logs._SLICE + 1)]
    assert pauses == [logs._PAUSE_S] * 3

    pauses.clear()
    for i in range(logs._BACKLOG + 2 * logs._SLICE):
        records.put(_record(f"b{i}"))
    for _ in range(2 * logs._SLICE + 1):
        writer.dequeue(False)
    assert pauses == []  # behind: every record at once, until the backlog is below _BACKLOG
