"""Log formatting: `text` (key=value) or `json` (one object per line).

Structured fields travel on a record as `extra={"fields": {...}}`; both formats
print them (json as top-level keys, text as key=value after the message).
"""

from __future__ import annotations

import json
import logging
import sys
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


def configure_logging(level: str, fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt.lower() == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
