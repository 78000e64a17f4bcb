"""Log output of the server: one JSON object per line (the default) or plain text.

Records carry their structured fields in `extra={"fields": {...}}` (the access log's
request record, the lifecycle events `serving`, `draining`, `stopped`); both formatters
write them out. In JSON every record is one line, an exception's traceback included (in the
field `exception`); the warnings and errors other libraries log (asyncio's, grpc's) are
written the same way.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg and the record's `fields`."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """Time, level, logger, message, then the record's `fields` as key=value."""

    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={v}" for k, v in getattr(record, "fields", {}).items())
        line = f"{self.formatTime(record)} {record.levelname.lower()} {record.name} " \
               f"{record.getMessage()}"
        line = f"{line} {extra}" if extra else line
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(log_format: str, level: str) -> None:
    """Send the `tfserve` loggers to stderr in `log_format` ("json" or "text") at `level`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger("tfserve")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    # the records of other libraries that reach no handler (asyncio's transport errors,
    # grpc's): in the same format, not logging's plain-text last resort, whose tracebacks
    # span many lines (its level: warning, as the last resort's)
    others = logging.StreamHandler(sys.stderr)
    others.setFormatter(handler.formatter)
    others.setLevel(logging.WARNING)
    logging.lastResort = others
