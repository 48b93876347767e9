"""The server's log lines: plain text, or one JSON object a line (`--log-format json`) for log
collectors that parse fields instead of text."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone

TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """{"time", "level", "logger", "message"[, "exception"]}: the record's message formatted, its
    time in UTC (ISO 8601), a traceback as one string."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
               "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(level: str, fmt: str = "text") -> None:
    """The root logger's one handler (stderr) in `fmt` ("text" or "json"), at `level`; a root
    logger that has handlers already (an embedding program's, a test runner's) keeps them."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    logging.getLogger("strata").setLevel(level.upper())
