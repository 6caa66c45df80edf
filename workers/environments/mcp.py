"""MCP tools for agent runs: one MCP server per run, called synchronously from TRL.

A run's tools may come from an MCP server (``{type: "mcp", command: [...] | url, tools:
[allow-list], env: {...}}``). ``McpToolbox`` is the worker's side of that server, built on
the official ``mcp`` SDK (2.3.0) — its ``stdio_client`` / ``streamable_http_client``
transports and ``ClientSession`` — never a JSON-RPC client of our own.

Why a sync facade: TRL's GRPOTrainer calls tools synchronously from the training thread,
and the SDK is async (anyio). The toolbox runs one asyncio loop in a daemon thread of its
own; the session lives there, and ``call`` submits coroutines to it with
``run_coroutine_threadsafe`` and blocks on the answer.

The contract, which tests/workers/test_mcp.py checks on real server processes:

- ``start()`` connects (spawns the stdio server, or reaches the URL), runs ``initialize``
  and ``list_tools`` within ``startup_timeout``, and applies the allow-list: an allowed
  name the server does not offer is ``McpUnavailable`` naming it, as is a server that
  cannot be started or reached. Tools outside the allow-list are neither returned nor
  callable (``McpToolError``).
- ``call()`` returns the text parts of the result joined with "\\n"; a result with only
  ``structured_content`` returns its JSON. ``is_error`` raises ``McpToolError`` with the
  tool's text, which the model should see; the server is fine and the next call works.
- ``timeout`` bounds the server's answer (the SDK's own request timeout): past it the call
  raises ``TimeoutError``, the server stays up, and its late answer is dropped.
- A server that dies (the process exits, a pipe closes, the HTTP endpoint stops answering:
  any transport error) is restarted ONCE — new process or connection, ``initialize``
  again, the allowed tools checked again — and the call that saw the death is retried
  once on the new server. When it dies again, or the restart fails, the toolbox is gone:
  that call and every later one raise ``McpServerGone`` at once, its text (and ``gone``)
  saying why (exit code or signal, the error, the tail of the server's stderr). A retried
  call may therefore run twice on the server side; MCP has no idempotency key to prevent
  it, and a tool that killed its server once is not trusted with a third process.
- The stdio server's stderr goes to a file in a temporary directory of the toolbox's own
  (removed by ``close``), never into the worker's log; its tail is quoted in the reasons.
- ``env`` is merged over the SDK's safe default environment for the child
  (``mcp.client.stdio.get_default_environment``: HOME, PATH, ...), nothing else of the
  worker's environment (no credentials) leaks into it.
- ``close()`` is idempotent and stops the server process (the SDK's shutdown: stdin
  closed, then SIGTERM and SIGKILL to the process group, each wait bounded).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import shlex
import shutil
import signal
import tempfile
import threading
from collections.abc import Coroutine
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, TypeVar

import anyio
import httpx2
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.types import (
    CONNECTION_CLOSED,
    INVALID_REQUEST,
    REQUEST_TIMEOUT,
    CallToolResult,
    PaginatedRequestParams,
    TextContent,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# What the SDK's stdio shutdown may take on a server that ignores its closed stdin: 2 s
# grace, 2 s after SIGTERM, 2 s to reap after SIGKILL (mcp/client/stdio.py), plus slack.
_STOP_BOUND_S = 8.0
# Characters of the server's stderr quoted in a reason: enough for a traceback's last lines.
_STDERR_TAIL_CHARS = 1500


@dataclass(frozen=True)
class McpTool:
    """A tool the MCP server offers and the run allows."""

    name: str
    description: str
    input_schema: dict[str, Any]  # JSON Schema of the arguments


class McpUnavailable(RuntimeError):
    """The server cannot be started or reached, or it lacks an allow-listed tool."""


class McpToolError(RuntimeError):
    """The tool answered with an error (``is_error``) or is not allowed; the text says which."""


class McpServerGone(RuntimeError):
    """The server died and its one restart is spent or failed; ``str()`` says why."""


class _Death(Exception):
    """A call met a dead transport: the server must be restarted before anything else."""


@dataclass
class _Connection:
    """One live session: the task holding the transport open, and what it offers."""

    session: ClientSession
    tools: dict[str, McpTool]  # everything the server offers, allowed or not
    stop: asyncio.Event  # set to make the holder leave the transport's context
    holder: asyncio.Task[None]
    process: Any  # the SDK's anyio Process (stdio only), for its pid and exit code
    failure: BaseException | None = None  # what ended the transport, when not ``stop``


class McpToolbox:
    """One MCP server for a run: its allowed tools, callable synchronously from any thread.

    ``start()`` before ``call()``; ``close()`` when the run ends (or use it as a context
    manager). Thread-safe: concurrent calls share the session, and a death seen by several
    calls at once is one restart.
    """

    def __init__(
        self,
        *,
        command: list[str] | None = None,
        url: str | None = None,
        env: dict[str, str] | None = None,
        allow: list[str] | None = None,
        startup_timeout: float = 30.0,
    ) -> None:
        if (command is None) == (url is None):
            raise ValueError("give exactly one of command (stdio) or url (streamable HTTP)")
        if command is not None and not command:
            raise ValueError("command must name the server's executable")
        if env and url is not None:
            raise ValueError("env applies to a stdio server (command) only")
        if startup_timeout <= 0:
            raise ValueError("startup_timeout must be positive")
        self._command = list(command) if command is not None else None
        self._url = url
        self._env = dict(env or {})
        self._allow = list(allow) if allow is not None else None
        self._startup_timeout = startup_timeout
        self._label = shlex.join(self._command) if self._command is not None else str(url)

        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._state_lock = threading.Lock()  # guards _closed against concurrent close()
        self._closed = False
        self._conn: _Connection | None = None
        self._generation = 0  # bumped by each restart, so a death is handled once
        self._restarts_left = 1
        self._restart_lock: asyncio.Lock | None = None  # created on the toolbox's loop
        self._holders: set[asyncio.Task[None]] = set()
        self._gone: str | None = None
        self._tools: dict[str, McpTool] = {}  # the allowed ones
        self._logdir: Path | None = None
        self._errlog: TextIO | None = None

    # -- the public, synchronous side -------------------------------------------------

    def start(self) -> list[McpTool]:
        """Connect, ``initialize``, list the tools and apply the allow-list.

        Raises ``McpUnavailable`` (and leaves nothing running) when the server cannot be
        started or reached within ``startup_timeout`` or lacks an allowed tool.
        """
        with self._state_lock:
            if self._closed:
                raise RuntimeError("this MCP toolbox is closed")
            if self._loop is not None:
                raise RuntimeError("this MCP toolbox is already started")
            self._loop = asyncio.new_event_loop()
        if self._command is not None:
            self._logdir = Path(tempfile.mkdtemp(prefix="trainyard-mcp-"))
            self._errlog = (self._logdir / "stderr.log").open("a", encoding="utf-8")
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"mcp {self._label}"[:60], daemon=True
        )
        self._thread.start()
        try:
            conn = self._run(self._open(), timeout=self._startup_timeout + _STOP_BOUND_S)
            self._tools = self._allowed(conn)
        except BaseException as exc:
            self.close()
            if isinstance(exc, McpUnavailable):
                raise McpUnavailable(f"cannot start: {exc}") from exc
            if isinstance(exc, Exception):
                raise McpUnavailable(
                    f"cannot start the MCP server {self._label}: {self._why(exc)}"
                ) from exc
            raise
        return list(self._tools.values())

    def call(self, name: str, arguments: dict[str, Any], *, timeout: float) -> str:
        """Call an allowed tool and return its text.

        ``timeout`` bounds the server's answer on each server the call reaches; a call that
        meets a dead server may also wait for the restart (up to ``startup_timeout``).
        """
        if self._gone is not None:
            raise McpServerGone(self._gone)
        if self._loop is None or self._closed:
            raise RuntimeError("the MCP toolbox is not started, or is closed")
        if name not in self._tools:
            raise McpToolError(
                f"tool {name!r} is not allowed in this run; allowed: {sorted(self._tools)}"
            )
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        # A backstop only: each step inside is bounded by the SDK or by _STOP_BOUND_S.
        bound = 2 * timeout + self._startup_timeout + 2 * _STOP_BOUND_S
        result = self._run(self._call(name, arguments, timeout), timeout=bound)
        return _text_of(name, result)

    def close(self) -> None:
        """Stop the server (the SDK's bounded shutdown) and the loop; safe to call twice."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            future = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
            try:
                future.result(timeout=2 * _STOP_BOUND_S)
            except Exception:
                logger.warning("MCP server %s did not stop cleanly", self._label, exc_info=True)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=_STOP_BOUND_S)
            if not thread.is_alive():
                loop.close()
        if self._errlog is not None:
            self._errlog.close()
        if self._logdir is not None:
            shutil.rmtree(self._logdir, ignore_errors=True)

    @property
    def gone(self) -> str | None:
        """Why the server is gone for good (every call raises ``McpServerGone``), else None."""
        return self._gone

    @property
    def pid(self) -> int | None:
        """The stdio server's current process id (it changes on a restart); None over HTTP."""
        conn = self._conn
        return None if conn is None or conn.process is None else int(conn.process.pid)

    def __enter__(self) -> McpToolbox:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _run(self, coro: Coroutine[Any, Any, T], *, timeout: float) -> T:
        """Run ``coro`` on the toolbox's loop and wait for it, at most ``timeout`` seconds."""
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            if future.done() and not future.cancelled():
                # The coroutine's own TimeoutError (a tool past its deadline): the same class
                # as the wait's since Python 3.11, and the message that says which tool.
                raise
            future.cancel()
            raise TimeoutError(f"the MCP server {self._label} did not answer in time") from None
        except concurrent.futures.CancelledError:
            # close() from another thread cancels what is still running on the loop.
            raise McpServerGone("the MCP toolbox was closed") from None

    # -- the loop's side ----------------------------------------------------------------

    async def _open(self) -> _Connection:
        self._restart_lock = asyncio.Lock()
        self._conn = await self._connect()
        return self._conn

    async def _call(
        self, name: str, arguments: dict[str, Any], answer_within: float
    ) -> CallToolResult:
        """One call, retried once on a restarted server when the first one dies under it.

        Terminates: a failed attempt either restarts (once per toolbox) or finds the
        restart already done by a concurrent call, and a failure on the latest server
        when no restart is left raises ``McpServerGone`` from ``_recover``.
        """
        while True:
            if self._closed:
                raise McpServerGone("the MCP toolbox was closed")
            conn, generation = self._conn, self._generation
            assert conn is not None
            try:
                return await self._attempt(conn, name, arguments, answer_within)
            except _Death as death:
                await self._recover(generation, death)

    async def _attempt(
        self, conn: _Connection, name: str, arguments: dict[str, Any], answer_within: float
    ) -> CallToolResult:
        """Call once, telling a dead transport (``_Death``) from the tool's own answers.

        ``answer_within`` is the SDK's request timeout, so a late answer is dropped by the
        SDK's dispatcher while the server keeps running.
        """
        try:
            return await conn.session.call_tool(name, arguments, read_timeout_seconds=answer_within)
        except MCPError as exc:
            if exc.code == REQUEST_TIMEOUT:
                raise TimeoutError(
                    f"tool {name!r} did not answer within {answer_within} s"
                ) from None
            if exc.code == CONNECTION_CLOSED or conn.holder.done():
                raise _Death(exc.message) from exc
            if self._url is not None and exc.code == INVALID_REQUEST:
                # A streamable HTTP server that lost our session (restarted, or expired
                # it) answers every request so: "Session not found" / "Session terminated".
                raise _Death(f"the server lost the session: {exc.message}") from exc
            raise McpToolError(f"tool {name!r} failed: {exc.message}") from exc
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream) as exc:
            raise _Death(self._why(exc)) from exc
        except (OSError, httpx2.HTTPError) as exc:
            raise _Death(self._why(exc)) from exc

    async def _recover(self, generation: int, death: _Death) -> None:
        """Restart the server after ``death`` (once), or declare it gone and raise."""
        assert self._restart_lock is not None
        async with self._restart_lock:
            if self._gone is not None:
                raise McpServerGone(self._gone)
            if self._closed:
                raise McpServerGone("the MCP toolbox was closed")
            if generation != self._generation:
                return  # a concurrent call already restarted it: retry on the new one
            old = self._conn
            assert old is not None
            why = await self._end(old, str(death))
            if self._restarts_left == 0:
                self._gone = f"{why}; it was already restarted once"
                raise McpServerGone(self._gone)
            self._restarts_left -= 1
            logger.warning("%s; restarting it once", why)
            try:
                conn = await self._connect()
                try:
                    self._allowed(conn)
                except McpUnavailable:
                    await self._end(conn, "")
                    raise
            except Exception as exc:
                failure = str(exc) if isinstance(exc, McpUnavailable) else self._why(exc)
                self._gone = f"{why}; its restart failed: {failure}"
                raise McpServerGone(self._gone) from exc
            self._conn, self._generation = conn, self._generation + 1

    async def _connect(self) -> _Connection:
        """Start a holder task for a new transport and session; return once it is ready."""
        ready: asyncio.Future[_Connection] = asyncio.get_running_loop().create_future()
        stop = asyncio.Event()
        holder = asyncio.ensure_future(self._hold(ready, stop))
        self._holders.add(holder)  # the loop keeps only a weak reference to a task
        holder.add_done_callback(self._holders.discard)
        return await ready

    async def _hold(self, ready: asyncio.Future[_Connection], stop: asyncio.Event) -> None:
        """Hold one transport and session open until ``stop``, in one task.

        One task because anyio's task groups and cancel scopes (inside the SDK's
        transports) must be entered and left by the same task. The startup deadline is a
        cancel scope around the whole block, lifted once the session is ready.
        """
        conn: _Connection | None = None
        process: Any = None
        holder = asyncio.current_task()
        assert holder is not None
        try:
            with anyio.CancelScope() as scope:
                scope.deadline = anyio.current_time() + self._startup_timeout
                async with AsyncExitStack() as stack:
                    transport = self._transport()
                    read, write = await stack.enter_async_context(transport)
                    process = _process_of(transport)
                    session = await stack.enter_async_context(ClientSession(read, write))
                    await session.initialize()
                    tools = await _list_tools(session)
                    scope.deadline = math.inf
                    conn = _Connection(session, tools, stop, holder, process)
                    ready.set_result(conn)
                    await stop.wait()
            if not ready.done():
                ready.set_exception(
                    McpUnavailable(
                        f"the MCP server {self._label} did not answer initialize within "
                        f"{self._startup_timeout} s{self._stderr_tail()}"
                    )
                )
        except Exception as exc:
            if conn is not None:
                conn.failure = exc
            if not ready.done():
                ready.set_exception(McpUnavailable(self._death(process, exc, "")))
        finally:
            if not ready.done():
                ready.set_exception(McpUnavailable("the connection was cancelled while opening"))

    def _transport(self) -> Any:
        """The SDK's transport context for this server: a new process, or a new HTTP session."""
        if self._command is not None:
            params = StdioServerParameters(
                command=self._command[0], args=self._command[1:], env=self._env or None
            )
            assert self._errlog is not None
            return stdio_client(params, errlog=self._errlog)
        assert self._url is not None
        return streamable_http_client(self._url)

    async def _end(self, conn: _Connection, death: str) -> str:
        """Stop ``conn``'s holder (which stops its process) and say how the server died."""
        conn.stop.set()
        with suppress(Exception):
            await asyncio.wait_for(asyncio.shield(conn.holder), timeout=_STOP_BOUND_S)
        return self._death(conn.process, conn.failure, death)

    def _death(self, process: Any, failure: BaseException | None, death: str) -> str:
        """How the server died: its exit code or signal, else the error; and its stderr."""
        returncode = None if process is None else process.returncode
        if returncode is not None and returncode < 0:
            why = f"was killed by {_signal_name(-returncode)}"
        elif returncode is not None:
            why = f"exited with code {returncode}"
        elif failure is not None:
            why = f"failed: {self._why(failure)}"
        else:
            why = f"failed: {death}"
        return f"the MCP server {self._label} {why}{self._stderr_tail()}"

    async def _shutdown(self) -> None:
        """Stop the current connection and every call still in flight on the loop."""
        if self._conn is not None:
            self._conn.stop.set()
            with suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._conn.holder), timeout=_STOP_BOUND_S)
        current = asyncio.current_task()
        others = [task for task in asyncio.all_tasks() if task is not current]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    def _allowed(self, conn: _Connection) -> dict[str, McpTool]:
        """The allowed tools of ``conn``; ``McpUnavailable`` naming any allowed one it lacks."""
        if self._allow is None:
            return dict(conn.tools)
        missing = [name for name in self._allow if name not in conn.tools]
        if missing:
            raise McpUnavailable(
                f"the MCP server {self._label} does not offer the allowed tools {missing}; "
                f"it offers {sorted(conn.tools)}"
            )
        return {name: conn.tools[name] for name in self._allow}

    def _why(self, exc: BaseException) -> str:
        """One line for an error, unwrapping anyio's exception groups, plus the stderr tail."""
        while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
            exc = exc.exceptions[0]
        text = str(exc) or type(exc).__name__
        return f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text

    def _stderr_tail(self) -> str:
        if self._logdir is None:
            return ""
        if self._errlog is not None:
            self._errlog.flush()
        with suppress(OSError):
            text = (self._logdir / "stderr.log").read_text(encoding="utf-8", errors="replace")
            tail = text[-_STDERR_TAIL_CHARS:].strip()
            if tail:
                return f"; its stderr ends: {tail}"
        return ""


async def _list_tools(session: ClientSession) -> dict[str, McpTool]:
    """Every tool the server offers, following ``list_tools`` pages."""
    tools: dict[str, McpTool] = {}
    cursor: str | None = None
    while True:
        params = None if cursor is None else PaginatedRequestParams(cursor=cursor)
        page = await session.list_tools(params=params)
        for tool in page.tools:
            tools[tool.name] = McpTool(
                name=tool.name,
                description=tool.description or "",
                input_schema=dict(tool.input_schema),
            )
        cursor = page.next_cursor
        if cursor is None:
            return tools


def _text_of(name: str, result: CallToolResult) -> str:
    """The result's text parts joined with newlines, else its structured content as JSON."""
    texts = [part.text for part in result.content if isinstance(part, TextContent)]
    if texts:
        text = "\n".join(texts)
    elif result.structured_content is not None:
        text = json.dumps(result.structured_content, ensure_ascii=False)
    else:
        text = ""
    if result.is_error:
        raise McpToolError(text or f"tool {name!r} failed without a message")
    return text


def _process_of(transport: Any) -> Any:
    """The SDK's server process inside a live ``stdio_client`` context, or None.

    ``stdio_client`` keeps its process to itself, yet its exit code is what says why a
    server died ("exited with code 3", "killed by SIGKILL"), so it is read from the
    suspended generator's frame. Only messages and ``pid`` depend on it: an SDK that
    moves it gives None here and the reasons merely lose the code.
    """
    frame = getattr(getattr(transport, "gen", None), "ag_frame", None)
    process = None if frame is None else frame.f_locals.get("process")
    if hasattr(process, "returncode") and hasattr(process, "pid"):
        return process
    return None


def _signal_name(number: int) -> str:
    with suppress(ValueError):
        return signal.Signals(number).name
    return f"signal {number}"
