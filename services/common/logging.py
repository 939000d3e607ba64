"""structlog set-up shared by every service: key=value lines on stderr."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import MutableMapping
from datetime import datetime
from typing import Any

import structlog

from opentinker.auth import redact

# A line as configure_logging renders it: timestamp='…' level=… service=… event='…' …
_LINE = re.compile(r"^timestamp='([^']+)'.*? event='([^']+)'")


def parse_log_line(line: str) -> tuple[float, str] | None:
    """(unix seconds, event) of a line this module's renderer wrote; None for any other line
    (a library's own output, a traceback)."""
    match = _LINE.match(line)
    if match is None:
        return None
    return datetime.fromisoformat(match[1].replace("Z", "+00:00")).timestamp(), match[2]


def redact_credentials(
    _logger: object, _method: str, event_dict: MutableMapping[str, Any]
) -> dict[str, Any]:
    """Replace the secret part of any credential in a log line's text values with ``…``: a key
    pasted into an error message or a URL never reaches a log file."""
    return {k: redact(v) if isinstance(v, str) else v for k, v in event_dict.items()}


def configure_logging(service: str, *, level: str = "INFO") -> structlog.stdlib.BoundLogger:
    """Configure structlog once per process and return a logger bound to ``service``."""
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            redact_credentials,
            structlog.processors.KeyValueRenderer(
                key_order=["timestamp", "level", "service", "event"], drop_missing=True
            ),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger().bind(service=service)
