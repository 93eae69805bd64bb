"""Logging for reservoir's processes: plain text or one JSON object a line
(``--log-format json``), and the ``request_id`` of the conversation a line belongs to.

The protocol core never logs; its drivers do. While a driver handles a message or a
timer of a conversation, or a caller starts one, :data:`REQUEST_ID` holds the request
id (a context variable, so each thread and each asyncio task sees its own), and
:class:`ConversationFilter` puts it on every record logged meanwhile: a JSON line then
carries ``"request_id"``. Code that logs about a request outside such a stretch passes
``extra={"request_id": ...}``.

The facts of a line go in ``extra`` too (``node``, ``outcome``, ``elapsed_ms``...): every
field given so becomes a field of its JSON line, for any logger (the HTTP access lines
too), so that a query reads ``outcome`` rather than parsing ``message``.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Final, Literal

__all__ = [
    "CLIENT_LIBRARY_LOGGERS",
    "LOG_FORMATS",
    "REQUEST_ID",
    "ConversationFilter",
    "JsonFormatter",
    "LogFormat",
    "configure",
    "say",
]

LogFormat = Literal["text", "json"]
LOG_FORMATS: Final = ("text", "json")

#: the request id of the conversation being handled in this thread or task, if any
REQUEST_ID: ContextVar[str | None] = ContextVar("reservoir_request_id", default=None)

TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: attributes every LogRecord has: anything else on a record came from ``extra=``
_STANDARD: Final = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
    # uvicorn's copy of the message with terminal colours in it
    "color_message",
}


class ConversationFilter(logging.Filter):
    """Sets ``record.request_id`` from :data:`REQUEST_ID` unless the caller gave one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (UTC, ISO 8601), ``level``, ``logger``,
    ``message``, ``request_id`` when the record belongs to a conversation, any ``extra``
    fields, and ``exception`` with the traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and value is not None:
                line[key] = value if isinstance(value, str | int | float | bool) else str(value)
        if record.exc_info:
            line["exception"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        return json.dumps(line, ensure_ascii=False)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record comes (a test runner swaps it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


_format: LogFormat = "text"


#: the AMQP client libraries' loggers: their own narration of every frame
CLIENT_LIBRARY_LOGGERS: Final = ("pika", "kombu", "amqp")


def configure(verbose: int, log_format: LogFormat = "text") -> None:
    """Log to stderr at WARNING, INFO with ``-v``, DEBUG with ``-vv``, as text or JSON.
    The AMQP client libraries (pika, kombu) narrate every frame at DEBUG, hundreds of
    lines for one request: their loggers stay silent unless ``-vvv`` asks for them too
    (the adapters say in one line what matters)."""
    global _format
    _format = log_format
    level = max(logging.WARNING - 10 * verbose, logging.DEBUG)
    for chatty in CLIENT_LIBRARY_LOGGERS:
        logging.getLogger(chatty).setLevel(logging.DEBUG if verbose >= 3 else logging.CRITICAL)
    handler = _StderrHandler(sys.stderr)
    handler.addFilter(ConversationFilter())
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_reservoir", False):
            root.removeHandler(old)
    handler._reservoir = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)


def json_logs() -> bool:
    """Whether this process logs JSON (``--log-format json``)."""
    return _format == "json"


def say(text: str, **fields: str | int | float | None) -> None:
    """A line for the operator on stderr (ready, stopped, retrying), whatever the level:
    in the process's one log format (text, with the time and level every log line has, or
    JSON, so that every line of its stderr parses); ``fields`` (``node="n1"``) are that
    line's facts, fields of their own in JSON."""
    record = logging.LogRecord("reservoir", logging.INFO, "", 0, text, None, None)
    record.request_id = None
    for key, value in fields.items():
        setattr(record, key, value)
    formatter = JsonFormatter() if _format == "json" else logging.Formatter(TEXT_FORMAT)
    sys.stderr.write(formatter.format(record) + "\n")
    sys.stderr.flush()
