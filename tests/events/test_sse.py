"""The Server-Sent Events wire format (app/events/sse.py): every message the API sends,
pinned byte for byte; the API's stream made of exactly those messages; and the Python
clients' parser reading what the HTML standard says, as httpx-sse reads it, however the
bytes are cut."""

from __future__ import annotations

import json
from itertools import pairwise
from typing import Any

import httpx
from httpx_sse import EventSource

from app.events import sse
from app.events.sse import Message, Parser
from tests.support import ROOT
from tests.support.events import new_run

STEP = '{"id" : 41, "type" : "step", "data" : {"step" : 3, "reward_mean" : 0.5}}'


def test_every_message_the_api_sends_byte_for_byte() -> None:
    assert sse.RETRY_MS == 1000
    assert sse.RETRY == b"retry: 1000\n\n"
    assert sse.KEEP_ALIVE == b": keep-alive\n\n"
    assert sse.TOO_FAR_BEHIND == b"retry: 1000\n: too far behind; reconnect to resume\n\n"
    assert sse.event(41, "step", STEP) == f"id: 41\nevent: step\ndata: {STEP}\n\n"
    assert sse.end("cancelled") == b'event: end\ndata: {"status": "cancelled"}\n\n'
    assert sse.end(None) == b'event: end\ndata: {"status": null}\n\n'
    # Data of several lines (never an event as PostgreSQL renders it): one `data:` per line.
    assert sse.event(7, "log", "a\nb\r\nc\rd\n") == (
        "id: 7\nevent: log\ndata: a\ndata: b\ndata: c\ndata: d\ndata: \n\n"
    )


async def test_the_api_stream_is_those_messages(client: Any, tenant: Any) -> None:
    run_id = await new_run(client, tenant)
    await client.post(f"/runs/{run_id}/cancel", headers=tenant.headers)
    page = (await client.get(f"/runs/{run_id}/events", headers=tenant.headers)).json()["data"]
    answer = await client.get(f"/runs/{run_id}/events/stream", headers=tenant.headers)
    assert answer.status_code == 200, answer.text
    messages = Parser().feed(answer.content)
    events = [m for m in messages if m.id is not None]
    assert [int(m.id or 0) for m in events] == [e["id"] for e in page]
    assert [m.event for m in events] == [e["type"] for e in page]
    assert [json.loads(m.data or "") for m in events] == page
    framed = "".join(sse.event(int(m.id or 0), m.event, m.data or "") for m in events)
    assert answer.content == sse.RETRY + framed.encode() + sse.end("cancelled")


# A stream as the API sends it: the retry hint, two events, a keep-alive, the end.
STREAM = (
    sse.RETRY
    + sse.event(41, "step", STEP).encode()
    + sse.event(42, "status", '{"to" : "completed"}').encode()
    + sse.KEEP_ALIVE
    + sse.end("completed")
)
READ = [
    Message(None, "", None, 1000, None),
    Message("41", "step", STEP, None, None),
    Message("42", "status", '{"to" : "completed"}', None, None),
    Message(None, "", None, None, "keep-alive"),
    Message(None, "end", '{"status": "completed"}', None, None),
]


def _read(stream: bytes, cuts: list[int] | None = None) -> list[Message]:
    """``stream`` fed to one parser in the pieces ``cuts`` makes of it."""
    parser = Parser()
    bounds = [0, *(cuts or []), len(stream)]
    return [m for a, b in pairwise(bounds) for m in parser.feed(stream[a:b])]


def test_the_parser_reads_what_the_api_sends_however_it_is_cut() -> None:
    assert _read(STREAM) == READ
    assert _read(sse.TOO_FAR_BEHIND) == [
        Message(None, "", None, 1000, "too far behind; reconnect to resume")
    ]
    for cut in range(1, len(STREAM)):
        assert _read(STREAM, [cut]) == READ, cut
    assert _read(STREAM, list(range(1, len(STREAM)))) == READ  # a byte at a time


# The standard's corners, each with what the parser makes of it.
CORNERS: list[tuple[bytes, list[Message]]] = [
    # Lines end in \r\n or \r as well as \n, also when a \r\n is cut between two reads.
    (b"id: 1\r\ndata: a\r\n\r\nid: 2\rdata: b\r\r", [
        Message("1", "", "a", None, None), Message("2", "", "b", None, None),
    ]),
    # One optional space after the colon; no colon: the field, empty; an unknown field and
    # a retry not of digits ignored; an id holding NUL ignored; data lines joined by \n.
    (b"data:x\ndata:  y\ndata\nretry: 12a\nfoo: bar\nid: 3\x00\n\n", [
        Message(None, "", "x\n y\n", None, None),
    ]),
    # Comments, blank lines between messages; U+2028 and NEL are not line ends.
    (b":a\n: b\n\n\n\ndata: one\xe2\x80\xa8two\xc2\x85three\n\n", [
        Message(None, "", None, None, "a\nb"),
        Message(None, "", "one\u2028two\x85three", None, None),
    ]),
    # A message the end of the stream cut short is never dispatched.
    (b"data: whole\n\ndata: cut short\n", [Message(None, "", "whole", None, None)]),
]  # fmt: skip


def test_the_parser_follows_the_standard_in_its_corners() -> None:
    for stream, read in CORNERS:
        assert _read(stream) == read, stream
        assert _read(stream, list(range(1, len(stream)))) == read, stream
    # A byte order mark at the start is dropped, also when it comes a byte at a time.
    bom = b"\xef\xbb\xbf" + STREAM
    assert _read(bom) == READ and _read(bom, [1, 2, 3, 4]) == READ


def _as_httpx_sse_reads(stream: bytes) -> tuple[list[tuple[str, str, str]], list[int]]:
    response = httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream)
    read = list(EventSource(response).iter_sse())
    return [(e.id, e.event, e.data) for e in read if e.data], [
        e.retry for e in read if e.retry is not None
    ]


def _as_we_read(stream: bytes) -> tuple[list[tuple[str, str, str]], list[int]]:
    events, retries, last_id = [], [], ""
    for m in _read(stream):
        last_id = last_id if m.id is None else m.id  # EventSource's lastEventId
        if m.data:
            events.append((last_id, m.event or "message", m.data))
        if m.retry is not None:
            retries.append(m.retry)
    return events, retries


def test_the_parser_reads_as_httpx_sse_reads() -> None:
    """httpx-sse is the reference: the same events (id, type, data) and retry hints. (It
    does not drop a byte order mark, so that corner is left out.)"""
    for stream in [STREAM, sse.TOO_FAR_BEHIND, *(s for s, _ in CORNERS)]:
        assert _as_we_read(stream) == _as_httpx_sse_reads(stream), stream


def test_the_dashboard_and_the_docs_say_the_same_retry() -> None:
    js = (ROOT / "app/ui/static/js/sse.js").read_text()
    assert f"this.retryMs = {sse.RETRY_MS};" in js
    dashboard = (ROOT / "docs/dashboard.md").read_text()
    assert f"`retry` ({sse.RETRY_MS // 1000} s," in " ".join(dashboard.split())
