"""Tools are untrusted code: every call has a deadline and an output cap, and whatever goes
wrong becomes a tool error the model sees, recorded with the call, instead of an exception
that would end the episode, the step or the worker.

TRL's tool loop calls each tool synchronously from the training thread and turns an
exception ``e`` into the tool message ``{'error': str(e)}``; a call here therefore ends
either with its (capped) text or with :class:`ToolFailed` whose text is what the model is
shown (:func:`shown`): by default exactly TRL's, so a run shows its model what the same
environment shows it under plain TRL; with ``tool_errors: typed``, the exception's type
first. A timeout, a result cut at the cap, an MCP server's error have messages of their
own (TRL has no deadline or cap).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from app.observability import prometheus

TRUNCATED = "\n[... output truncated: {cut} of {total} characters not shown]"


@dataclass(frozen=True, slots=True)
class Limits:
    """How every call of the run is guarded: its ``environment.tool_timeout_seconds``,
    ``max_tool_output_chars`` and ``tool_errors``."""

    timeout: float
    max_output_chars: int
    tool_errors: str = "trl"

    @classmethod
    def of(cls, spec: dict[str, Any]) -> Limits:
        return cls(
            float(spec["tool_timeout_seconds"]),
            int(spec["max_tool_output_chars"]),
            str(spec.get("tool_errors") or "trl"),
        )


@dataclass(slots=True)
class CallRecord:
    """What the stored tool message says beyond its content."""

    name: str
    duration_ms: float
    error: str | None = None
    truncated: bool = False


class ToolFailed(Exception):
    """A tool call that produced no result; its message is what the model is shown."""


class ToolTimeout(ToolFailed):
    pass


class EpisodeFailed(ToolFailed):
    """The episode cannot go on (its MCP server is gone): it is recorded as failed."""


def as_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    if isinstance(result, dict | list | tuple | int | float | bool) or result is None:
        try:
            return json.dumps(result, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            pass
    return str(result)


def cap(text: str, limit: int) -> tuple[str, bool]:
    """``text`` cut to ``limit`` characters, the cut marked so the model knows."""
    if len(text) <= limit:
        return text, False
    return text[:limit] + TRUNCATED.format(cut=len(text) - limit, total=len(text)), True


class _Runner:
    """A daemon thread that runs tool calls one at a time, kept between calls: handing a
    call to a waiting thread costs one wake-up, where starting a thread per call cost
    two hand-overs (``Thread.start`` waits for the new thread) and the thread's creation,
    which on a busy machine came to ~0.2 ms a call (``bench/tool_calls.py``).

    A runner takes itself back to the idle ones after each call, however late it ends, so
    a call that hangs keeps only its own runner: the calls after it get another one (made
    when none is idle) and are never queued behind it.
    """

    _idle: ClassVar[list[_Runner]] = []
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="tool-runner", daemon=True)
        self._thread.start()

    @classmethod
    def take(cls) -> _Runner:
        with cls._lock:
            if cls._idle:
                return cls._idle.pop()
        return cls()

    def run(self, call: _Call) -> None:
        self._calls.put(call)

    def _serve(self) -> None:
        me = threading.current_thread()
        while True:
            call = self._calls.get()
            me.name = f"tool-{call.name}"  # what a hung call's thread is called meanwhile
            call.run()
            me.name = "tool-runner"
            with self._lock:
                self._idle.append(self)  # before the caller wakes: its next call reuses it
            call.done.set()


class _Call:
    __slots__ = ("done", "fn", "kwargs", "name", "outcome")

    def __init__(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        self.fn, self.kwargs = fn, kwargs
        self.name = getattr(fn, "__name__", "call")
        self.done = threading.Event()
        self.outcome: tuple[bool, Any] = (False, None)

    def run(self) -> None:
        try:
            self.outcome = (True, self.fn(**self.kwargs))
        except BaseException as exc:  # the tool's failure, whatever it is, is the model's news
            self.outcome = (False, exc)


def with_deadline(fn: Callable[..., Any], kwargs: dict[str, Any], timeout: float) -> Any:
    """``fn(**kwargs)`` on a thread of its own (a :class:`_Runner`), waited on for
    ``timeout`` seconds.

    A Python call cannot be interrupted from outside: one that never returns keeps its
    (daemon) thread, and the episode goes on without it.
    """
    call = _Call(fn, kwargs)
    _Runner.take().run(call)
    if not call.done.wait(timeout):
        raise ToolTimeout(f"the tool did not answer within {timeout:g} s")
    ok, value = call.outcome
    if ok:
        return value
    if isinstance(value, Exception):
        raise value
    # SystemExit or KeyboardInterrupt raised by the tool is the tool's failure, not a
    # request to stop this worker.
    raise ToolFailed(describe(value))


def describe(exc: BaseException) -> str:
    """The exception's type and text: ``ZeroDivisionError: cannot divide by zero``."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def shown(exc: BaseException, tool_errors: str) -> str:
    """What the model is shown for a call that raised ``exc`` (inside TRL's ``{'error':
    ...}``): a message of ours (:class:`ToolFailed`: a timeout, an MCP tool's error) as it
    is; else with ``trl``, TRL's own ``str(e)``; with ``typed``, :func:`describe`'s type
    and text. A ``SystemExit`` or ``KeyboardInterrupt`` raised by a tool, which would end
    a plain TRL script, reaches here as a ToolFailed already typed by the guard."""
    if isinstance(exc, ToolFailed):
        return str(exc)
    return str(exc) if tool_errors == "trl" else describe(exc)


def call_tool(
    records: list[CallRecord],
    name: str,
    invoke: Callable[[], Any],
    limits: Limits,
) -> str:
    """Run ``invoke`` (which applies its own deadline), record the call, and return its
    capped text or raise :class:`ToolFailed` with a capped message."""
    started = time.perf_counter()
    record = CallRecord(name, 0.0)
    outcome = "ok"
    try:
        text, record.truncated = cap(as_text(invoke()), limits.max_output_chars)
        return text
    except BaseException as exc:
        if not isinstance(exc, Exception):
            raise  # KeyboardInterrupt, SystemExit: the worker's own, not the tool's
        outcome = "timeout" if isinstance(exc, ToolTimeout) else "error"
        message, _ = cap(shown(exc, limits.tool_errors), min(limits.max_output_chars, 2000))
        record.error = message
        raise (type(exc) if isinstance(exc, ToolFailed) else ToolFailed)(message) from None
    finally:
        record.duration_ms = (time.perf_counter() - started) * 1000
        records.append(record)
        prometheus.TOOL_SECONDS.labels(outcome).observe(record.duration_ms / 1000)
