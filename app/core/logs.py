"""Logs: one configuration for the API, the workers and the CLI's long-running commands.

A process logs JSON lines (one object per line) when its stderr is not a terminal, which is
what a log collector reads, and plain text when a person watches it; ``log_format`` (a
setting: ``auto``, ``json`` or ``text``) overrides the guess. Every line carries what is known
of where it came from — ``run_id``, ``task_id``, ``request_id``, ``project_id`` — from a
context variable that :func:`log_context` sets for a run's drive or a request, so nothing has
to pass the ids around and a line logged deep inside a service still says which run it was.

The API's access log is :class:`RequestLog`, a pure ASGI middleware: it gives each request an
id (the caller's ``X-Request-ID`` when it is sane, else a new one), echoes it on the response
and logs one ``trainyard.access`` line per request, a batch of lines at a time
(:class:`RequestBatch`, within :data:`ACCESS_BATCH_SECONDS`), each batch written with one
``write`` (:class:`BatchedStreamHandler`). Uvicorn's own access log stays off. A thread that
drained a queue of lines cost an API process more than the lines themselves.
"""

from __future__ import annotations

import asyncio
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

# A record made in one scope and handled later (an access line) carries the scope's fields.
SCOPE_ATTRIBUTE = "log_scope"
# What every LogRecord has: anything else on a record came from ``extra=`` and is logged.
_RECORD_ATTRIBUTES = frozenset(
    logging.LogRecord("", 0, "", 0, "", (), None).__dict__.keys()
    | {"message", "asctime", "color_message"}  # uvicorn's coloured copy of the message
    | {SCOPE_ATTRIBUTE}
)
#: How long an access line may wait to be logged with others, and how many may wait.
ACCESS_BATCH_SECONDS = 0.1
ACCESS_BATCH_LINES = 512


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


def current_log_context(scope: dict[str, str] | None = None) -> dict[str, str]:
    """The open scopes' fields (or ``scope``'s), the well-known ids first in a fixed order."""
    if scope is None:
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
        context = current_log_context(record.__dict__.get(SCOPE_ATTRIBUTE))
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
                "class": f"{__name__}.BatchedStreamHandler",
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


class BatchedStreamHandler(logging.StreamHandler):
    """A stream handler that keeps what it formats until :meth:`flush`, then writes it with
    one ``write``: the access log's, flushed by :class:`RequestBatch` after each batch of
    lines (and by :mod:`logging` at exit), or once :data:`ACCESS_BATCH_LINES` are waiting."""

    def __init__(self, stream: Any = None) -> None:
        super().__init__(stream)
        self._lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._lines.append(self.format(record) + self.terminator)
        except Exception:
            self.handleError(record)
        if len(self._lines) >= ACCESS_BATCH_LINES:
            self.flush()

    def flush(self) -> None:
        self.acquire()
        try:
            if self._lines:
                text = "".join(self._lines)
                self._lines.clear()
                self.stream.write(text)
            super().flush()
        finally:
            self.release()


def configure_logging(level: int | str = "INFO", *, json: bool | None = None) -> None:
    """Set up this process's logging (``json``: None follows the ``log_format`` setting).
    Calling it again replaces the handler rather than adding a second one."""
    logging.config.dictConfig(logging_config(level, json=json))
    logging.captureWarnings(True)


# -- the API's request ids, access log and request metrics -------------------------------------
class RequestMetrics(Protocol):
    """What :class:`RequestLog` reports requests to (the API's Prometheus metrics): the
    requests in flight as they come and go, and each answered one with its batch."""

    def begin(self) -> None: ...

    def end(self) -> None: ...

    def answered(self, method: str, route: str, status: int, seconds: float) -> None: ...


# One answered request, as it waits for its batch: when it ended, method, route template,
# status, seconds, and the fields of its log scope.
_Answered = tuple[float, str, str, int, float, dict[str, str]]


class RequestBatch:
    """The requests answered since the last batch, and what is done with each batch: the
    access lines logged (``trainyard.access``), the request ``metrics`` recorded.

    A request only notes what it answered (:meth:`add`); the batch is handled on the event
    loop within :data:`ACCESS_BATCH_SECONDS`, at once when :data:`ACCESS_BATCH_LINES` wait,
    and whenever :meth:`flush` is called (a scrape of the API's ``/metrics``, the lifespan's
    end). Inside each request the line and the metrics cost an API process 40-50 µs of CPU,
    a tenth of a GET; in a batch a third of that (docs/benchmarks.md, "The request path
    against 224089f"). A process killed with SIGKILL loses the last batch.
    """

    def __init__(self, metrics: RequestMetrics | None = None) -> None:
        self.metrics = metrics
        self.log = logging.getLogger(ACCESS_LOGGER)
        self._waiting: list[_Answered] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None

    def add(self, request: _Answered) -> None:
        waiting = self._waiting
        waiting.append(request)
        if len(waiting) >= ACCESS_BATCH_LINES:
            self.flush()
            return
        loop = asyncio.get_running_loop()
        if self._timer is None or self._timer_loop is not loop:
            self._timer = loop.call_later(ACCESS_BATCH_SECONDS, self.flush)
            self._timer_loop = loop

    def flush(self) -> None:
        """Log and count the requests answered since the last batch, now."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._waiting = self._waiting, []
        if self.metrics is not None:
            for _, method, route, status, seconds, _ in batch:
                self.metrics.answered(method, route, status, seconds)
        log = self.log
        if not batch or not log.isEnabledFor(logging.INFO):
            return
        for ended, method, route, status, seconds, fields in batch:
            ms = seconds * 1000
            # The record made directly: Logger.info would also look up its caller's frame.
            record = log.makeRecord(
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
                    SCOPE_ATTRIBUTE: fields,  # the project is bound to it once it is known
                },
            )
            _stamp(record, ended)
            log.handle(record)
        for handler in log.handlers:
            handler.flush()


class RequestLog:
    """The one pure-ASGI layer that observes requests: request id in, request id out, one
    access line per HTTP request, and the request ``metrics`` when given.

    The line says method, route template (``/runs/{run_id}``, never the raw path, as the
    metrics do), status, duration, and — through the request's log scope — the request id and
    the caller's project. When the access logger is off the request still gets its id. One
    clock and one wrapped ``send`` serve the line and the metrics; as the outermost of the
    app's middleware it also sees the limits' 413s and 429s. The requests in flight are
    counted live; lines and the other metrics go through a :class:`RequestBatch`, handled
    once more when the lifespan ends.
    """

    def __init__(self, app: ASGIApp, batch: RequestBatch | None = None) -> None:
        from app.observability.prometheus import UNMATCHED  # the API's, not every process's

        self.app = app
        self.batch = batch or RequestBatch()  # no metrics: lines only
        self.metrics = self.batch.metrics
        self.unmatched = UNMATCHED  # the route of a path no route matches, as in the metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            try:
                await self.app(scope, receive, send)
            finally:
                if scope["type"] == "lifespan":
                    self.batch.flush()  # the process is stopping: the last batch now
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
        with log_context(request_id=request_id) as fields:
            if metrics is not None:
                metrics.begin()
            started = time.perf_counter()
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                elapsed = time.perf_counter() - started
                if metrics is not None:
                    metrics.end()
                route = getattr(scope.get("route"), "path", None) or self.unmatched
                self.batch.add((time.time(), scope["method"], route, status, elapsed, fields))


def _stamp(record: logging.LogRecord, created: float) -> None:
    """Date ``record`` at ``created`` (``time.time()``), as :class:`logging.LogRecord` would
    have had it been made then."""
    record.created = created
    record.msecs = int((created - int(created)) * 1000) + 0.0
    record.relativeCreated = (created - logging._startTime) * 1000  # type: ignore[attr-defined]
