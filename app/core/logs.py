"""Logs: one configuration for the API, the workers and the CLI's long-running commands.

A process logs JSON lines (one object per line) when its stderr is not a terminal, which is
what a log collector reads, and plain text when a person watches it; ``log_format`` (a
setting: ``auto``, ``json`` or ``text``) overrides the guess. Every line carries what is known
of where it came from — ``run_id``, ``task_id``, ``request_id``, ``project_id`` — from a
context variable that :func:`log_context` sets for a run's drive or a request, so nothing has
to pass the ids around and a line logged deep inside a service still says which run it was.

The API's access log is :class:`RequestLog`, a pure ASGI middleware: it gives each request an
id (the caller's ``X-Request-ID`` when it is sane, else a new one), echoes it on the response
and logs one ``trainyard.access`` line per request. Uvicorn's own access log stays off. The
line is formatted and written by the request, through the standard library's
``StreamHandler``: a thread that formatted and wrote queued lines in batches cost an API
process more CPU per request than the lines themselves (docs/benchmarks.md, "The request
path against 224089f").
"""

from __future__ import annotations

import json as jsonlib
import logging
import logging.config
import os
import re
import sys
import time
import traceback
from contextvars import ContextVar, Token
from datetime import UTC, datetime
from typing import Any, Literal, Protocol

import pydantic_core
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LogFormat = Literal["auto", "json", "text"]
ACCESS_LOGGER = "trainyard.access"
REQUEST_ID_HEADER = b"x-request-id"
# A caller's request id is kept when it is short and printable (a UUID, a trace id, a ULID);
# anything else could forge log fields or flood the log, and is replaced.
_SANE_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:/+=-]{1,128}")

# The ids every line carries when known, in this order, ahead of a record's extra fields.
CONTEXT_FIELDS = ("run_id", "task_id", "request_id", "project_id")

# One dict per scope (a run's drive, a request); a scope's own dict is filled in as it learns
# more (the project once the caller is authenticated), so inner code needs no new scope.
_context: ContextVar[dict[str, str] | None] = ContextVar("trainyard_log_context", default=None)

# What every LogRecord has: anything else on a record came from ``extra=`` and is logged.
_RECORD_ATTRIBUTES = frozenset(
    logging.LogRecord("", 0, "", 0, "", (), None).__dict__.keys()
    | {"message", "asctime", "color_message"}  # uvicorn's coloured copy of the message
)


class log_context:
    """Every record logged inside the block (and in tasks it starts) carries ``fields``, on
    top of those of the enclosing scope; ``None`` values are left out. A class rather than a
    ``@contextmanager`` generator: every API request opens one, and this costs a third."""

    __slots__ = ("_token", "scope")

    def __init__(self, **fields: object) -> None:
        scope = dict(_context.get() or {})
        scope.update({name: str(value) for name, value in fields.items() if value is not None})
        self.scope = scope
        self._token: Token[dict[str, str] | None] | None = None

    def __enter__(self) -> dict[str, str]:
        self._token = _context.set(self.scope)
        return self.scope

    def __exit__(self, *_: object) -> None:
        if self._token is not None:
            _context.reset(self._token)
            self._token = None


def bind_log_context(**fields: object) -> None:
    """Add ``fields`` to the innermost open scope (nothing outside any scope): the access
    line of a request, logged by the middleware that opened the scope, then carries them."""
    scope = _context.get()
    if scope is not None:
        scope.update({name: str(value) for name, value in fields.items() if value is not None})


def current_log_context() -> dict[str, str]:
    """The open scopes' fields, the well-known ids first in a fixed order."""
    scope = _context.get()
    if not scope:
        return {}
    known = {name: scope[name] for name in CONTEXT_FIELDS if name in scope}
    return known | scope if len(known) != len(scope) else known


class LogFormatter(logging.Formatter):
    """JSON lines (``as_json``) or plain text, both with the context's ids."""

    def __init__(self, as_json: bool = True) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        context = current_log_context()
        if not self.as_json:  # for a person: the ids, not every extra field
            text = super().format(record)
            if context:
                ids = " ".join(f"{name}={value}" for name, value in context.items())
                first, nl, rest = text.partition("\n")  # after the message, before a traceback
                text = f"{first} [{ids}]{nl}{rest}"
            return text
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(context)
        line.update(_extra(record))
        if record.exc_info:
            line["exc_info"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        elif record.exc_text:
            line["exc_info"] = record.exc_text
        if record.stack_info:
            line["stack_info"] = record.stack_info
        try:  # pydantic-core's JSON: a fifth of the standard library's time on a line
            return pydantic_core.to_json(line, fallback=str).decode()
        except ValueError:  # nested deeper than it goes
            return jsonlib.dumps(line, default=str, ensure_ascii=False)


def _extra(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _RECORD_ATTRIBUTES}


def wants_json(log_format: LogFormat | None = None) -> bool:
    """JSON unless stderr is a terminal, or as ``log_format`` (default: the setting) says."""
    if log_format is None:
        from app.core.settings import get_settings

        log_format = get_settings().log_format
    if log_format == "auto":
        return not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())
    return log_format == "json"


def logging_config(level: int | str = "INFO", *, json: bool | None = None) -> dict[str, Any]:
    """The ``dictConfig`` of every Trainyard process: one stderr handler on the root logger,
    which every other logger (Celery's, uvicorn's, ours) reaches; the access log at INFO
    whatever ``level`` says, since turning it off is not what a level is for. Uvicorn takes
    it as its ``log_config``, so each of its worker processes applies it too."""
    if isinstance(level, str):
        level = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "trainyard": {
                "()": f"{__name__}.LogFormatter",
                "as_json": wants_json() if json is None else json,
            }
        },
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stderr",
                "formatter": "trainyard",
            },
            "access": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stderr",
                "formatter": "trainyard",
            },
        },
        "root": {"handlers": ["stderr"], "level": level},
        "loggers": {
            ACCESS_LOGGER: {"level": "INFO", "handlers": ["access"], "propagate": False},
            # Uvicorn's defaults give these handlers of their own: here they reach the root's.
            "uvicorn": {"handlers": [], "propagate": True},
            "uvicorn.error": {"handlers": [], "propagate": True},
        },
    }


def configure_logging(level: int | str = "INFO", *, json: bool | None = None) -> None:
    """Set up this process's logging (``json``: None follows the ``log_format`` setting).
    Calling it again replaces the handler rather than adding a second one."""
    logging.config.dictConfig(logging_config(level, json=json))
    logging.captureWarnings(True)


# -- the API's request ids, access log and request metrics -------------------------------------
class RequestMetrics(Protocol):
    """What :class:`RequestLog` reports each request to (the API's Prometheus metrics)."""

    def begin(self) -> None: ...

    def end(self, method: str, route: str, status: int, seconds: float) -> None: ...


class RequestLog:
    """The one pure-ASGI layer that observes requests: request id in, request id out, one
    access line per HTTP request, and the request ``metrics`` when given.

    The line says method, route template (``/runs/{run_id}``, never the raw path, as the
    metrics do), status, duration, and — through the request's log scope — the request id and
    the caller's project. When the access logger is off the request still gets its id. One
    clock and one wrapped ``send`` serve the line and the metrics; as the outermost of the
    app's middleware it also sees the limits' 413s and 429s.
    """

    def __init__(self, app: ASGIApp, metrics: RequestMetrics | None = None) -> None:
        from app.observability.prometheus import UNMATCHED  # the API's, not every process's

        self.app = app
        self.metrics = metrics
        self.log = logging.getLogger(ACCESS_LOGGER)
        self.unmatched = UNMATCHED  # the route of a path no route matches, as in the metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = None
        for name, value in scope["headers"]:
            if name == REQUEST_ID_HEADER:
                given = value
                break
        raw = given if given is not None and _SANE_REQUEST_ID.fullmatch(given) else None
        request_id = raw.decode() if raw is not None else os.urandom(16).hex()  # 4x uuid4's speed
        echoed = (REQUEST_ID_HEADER, raw or request_id.encode())
        status = 500  # an exception out of the app is answered 500 further out

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), echoed]}
            await send(message)

        metrics = self.metrics
        with log_context(request_id=request_id):
            if metrics is not None:
                metrics.begin()
            started = time.perf_counter()
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                elapsed = time.perf_counter() - started
                route = getattr(scope.get("route"), "path", None) or self.unmatched
                if metrics is not None:
                    metrics.end(scope["method"], route, status, elapsed)
                if self.log.isEnabledFor(logging.INFO):
                    self._access(scope["method"], route, status, elapsed * 1000)

    def _access(self, method: str, route: str, status: int, ms: float) -> None:
        # The record made directly: Logger.info would also look up its caller's frame.
        record = self.log.makeRecord(
            ACCESS_LOGGER,
            logging.INFO,
            "",
            0,
            "%s %s %d %.1f ms",
            (method, route, status, ms),
            None,
            extra={
                "method": method,
                "route": route,
                "status": status,
                "duration_ms": round(ms, 2),
            },
        )
        self.log.handle(record)
