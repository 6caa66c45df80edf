"""The Server-Sent Events wire format of a run's stream, both ways: every message the API
sends is framed here, and :class:`Parser` is the one Python client of it (``trainyard runs
follow`` through app/cli/follow.py, and bench/watchers.py's thousand streams). The dashboard's
parser is the browser's own copy of these rules (app/ui/static/js/sse.js).

What a stream sends (the WHATWG HTML standard's ``text/event-stream``, lines ending in
``\\n``): :data:`RETRY` first; one :func:`event` per run event (``id:`` its id, ``event:``
its type, ``data:`` the event as JSON); :data:`KEEP_ALIVE` while the run is quiet; then
:func:`end` with the run's final status, or :data:`TOO_FAR_BEHIND` when the client read too
slowly to be kept (it reconnects with ``Last-Event-ID`` and reads the rest from the log).

The event hub renders each event once and hands the same encoded chunk to every subscriber
(app/events/fanout.py): framing is a string format per event, never per subscriber.

Only the standard library: the CLI and the benchmark's client processes import this module.
"""

from __future__ import annotations

import json
from typing import NamedTuple

#: How long a client waits before reconnecting after a stream closed, in milliseconds:
#: after a drop, and after :data:`TOO_FAR_BEHIND`. One second, because a client closed for
#: falling behind should be back before it falls further behind, and because ``trainyard
#: up`` restarts an API that died after about a second; a reconnect costs a key check and
#: one read of the log, and a longer fixed delay would not spread many clients' reconnects
#: (they still come together), only slow each one. app/ui/static/js/sse.js starts with it.
RETRY_MS = 1000

#: A stream's first message: the reconnection delay.
RETRY = f"retry: {RETRY_MS}\n\n".encode()

#: Sent on a stream with nothing to say for ``sse_keepalive_seconds``, so proxies keep it.
KEEP_ALIVE = b": keep-alive\n\n"

#: The comment of :data:`TOO_FAR_BEHIND`, as a client reads it.
TOO_FAR_BEHIND_NOTE = "too far behind; reconnect to resume"

#: The last message to a client that fell more than ``sse_buffer_events`` behind.
TOO_FAR_BEHIND = f"retry: {RETRY_MS}\n: {TOO_FAR_BEHIND_NOTE}\n\n".encode()


def event(event_id: int, type_: str, data: str) -> str:
    """One run event: ``id:``, ``event:`` and ``data:`` (one line per line of ``data``).
    Text, not bytes: a batch's events are joined and encoded once (service.stream_read)."""
    if "\n" in data or "\r" in data:  # never in JSON as PostgreSQL renders it
        data = data.replace("\r\n", "\n").replace("\r", "\n").replace("\n", "\ndata: ")
    return f"id: {event_id}\nevent: {type_}\ndata: {data}\n\n"


def end(status: str | None) -> bytes:
    """A stream's last message after its run's last event: the run's final status (None
    when the run is gone)."""
    return f"event: end\ndata: {json.dumps({'status': status})}\n\n".encode()


# --------------------------------------------------------------------------- the client


class Message(NamedTuple):
    """One message of a stream: what came before a blank line. A run event has ``data``;
    a keep-alive only a ``comment``; the first message only ``retry``."""

    id: str | None  # the `id:` line's value; None without one
    event: str  # the `event:` line's value; "" without one (EventSource's "message")
    data: str | None  # the `data:` lines joined by "\n"; None without one
    retry: int | None  # a reconnection delay in ms (a `retry:` of ASCII digits)
    comment: str | None  # the comment lines (after `:` and one space), joined by "\n"


class Parser:
    """Reads a ``text/event-stream`` body as it arrives: :meth:`feed` takes each chunk of
    bytes and returns the messages it completed.

    The standard's rules: lines end in ``\\n``, ``\\r\\n`` or ``\\r``; ``field: value``, one
    optional space after the colon, a line without one being a field with no value; unknown
    fields ignored; ``data`` lines joined by ``\\n``; an ``id`` with NUL ignored; ``retry``
    only of digits; a leading byte order mark dropped; a message cut off by the end of the
    stream never dispatched. Unlike EventSource it also returns messages without data (the
    keep-alive, the retry hint), so a client can tell a quiet stream from a dead one.

    A hand parser, not httpx-sse (tests/events/test_sse.py holds it to httpx-sse's reading),
    for two reasons. httpx-sse drops comments, and ``runs follow`` needs the keep-alives
    (the demo narrates a quiet warm-up on them). And it reads through httpx, which costs
    too much where a thousand streams share one core: bench/watchers.py's client, 1,000
    streams of 3 events every 60 ms on one uvloop loop, took per event 6.0 µs with the
    blocks split by hand (as it did before), 7.7 µs with this parser, 8.1 µs with
    httpx-sse's own decoders fed from the same sockets (a private module of it), and 15 µs
    with httpx and httpx-sse: 53-86% of a core where the hand split took 18-25% (medians
    of 5 to 9 runs of 8 s, 2026-12-02, on a 2 vCPU AMD EPYC shared with other work).
    """

    __slots__ = ("_after_cr", "_buffer", "_started")

    def __init__(self) -> None:
        self._buffer = b""  # the start of a message not complete yet, its lines ending in \n
        self._after_cr = False  # the last chunk ended in \r: a \n first in this one is its
        self._started = False  # past where a byte order mark may be

    def feed(self, chunk: bytes) -> list[Message]:
        if not chunk:
            return []
        if self._after_cr and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._after_cr = chunk[-1:] == b"\r"
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buffer = self._buffer + chunk
        if not self._started:
            if len(buffer) < 3 and b"\xef\xbb\xbf".startswith(buffer):
                self._buffer = buffer  # maybe the start of a byte order mark
                return []
            self._started = True
            buffer = buffer.removeprefix(b"\xef\xbb\xbf")
        *blocks, self._buffer = buffer.split(b"\n\n")
        return [m for m in map(_message, blocks) if m is not None]


def _message(block: bytes) -> Message | None:
    text = block.decode(errors="replace")
    if text.startswith("id: "):  # a run event as event() frames it: the loop's answer, sooner
        lines = text.split("\n")
        if (
            len(lines) == 3
            and lines[1].startswith("event: ")
            and lines[2].startswith("data: ")
            and "\0" not in lines[0]
        ):
            return Message(lines[0][4:], lines[1][7:], lines[2][6:], None, None)
    id_ = data = retry = comment = None
    event = ""
    for line in text.split("\n"):
        if not line:
            continue  # a blank line before this block's first: it dispatched nothing
        name, _, value = line.partition(":")
        if value[:1] == " ":
            value = value[1:]
        if name == "data":
            data = value if data is None else f"{data}\n{value}"
        elif name == "id":
            if "\0" not in value:
                id_ = value
        elif name == "event":
            event = value
        elif not name:
            comment = value if comment is None else f"{comment}\n{value}"
        elif name == "retry" and value.isascii() and value.isdigit():
            retry = int(value)
    if id_ is None and data is None and retry is None and comment is None and not event:
        return None
    return Message(id_, event, data, retry, comment)
