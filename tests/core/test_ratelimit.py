"""The rate limiter's Redis side, on the real Redis: one bucket per key across processes,
one shared redis-py connection per process, a lost script loaded again, a dropped or stalled
connection replaced, and failing open when Redis cannot answer.

The API's side (429s, headers, fail-open through the app) is in tests/api/test_limits.py.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
import redis.asyncio

from app.core import ratelimit
from app.core.embedded import redis_py_url
from app.core.ratelimit import Decision, RateLimiter
from app.core.services import redis_url
from app.core.settings import get_settings


@pytest.fixture(autouse=True)
def patient_limiter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded test machine can stall a process past the limiter's quarter-second
    deadlines, which would let a request through unlimited: the tests that count on Redis
    answering wait longer (those about timeouts set their own)."""
    monkeypatch.setattr(ratelimit, "COMMAND_TIMEOUT", 5.0)
    monkeypatch.setattr(ratelimit, "CONNECT_TIMEOUT", 5.0)


def _limiter(**kw: Any) -> RateLimiter:
    settings = get_settings()
    kw.setdefault("rate", 10)
    kw.setdefault("burst", 4)
    return RateLimiter(kw.pop("url", redis_url(settings)), prefix=settings.broker_prefix, **kw)


def _real_redis(url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_py_url(url), socket_timeout=5)


async def _reader_done(limiter: RateLimiter) -> None:
    """Wait until the limiter's shared connection has seen that it is gone."""
    shared = limiter._shared
    assert shared is not None and shared._reader is not None
    await asyncio.wait_for(asyncio.shield(shared._reader), timeout=10)


async def test_processes_share_one_bucket(
    service_urls: tuple[str, str],
) -> None:
    """Two limiters (two API processes) on one key draw from one bucket in Redis."""
    a, b = _limiter(), _limiter()
    key = uuid.uuid4().hex
    try:
        decisions = [await (a if i % 2 else b).hit(key) for i in range(5)]
        assert all(d is not None for d in decisions)
        assert [d.allowed for d in decisions if d] == [True, True, True, True, False]
        assert [d.remaining for d in decisions if d][:4] == [3, 2, 1, 0]
        refused = decisions[-1]
        assert refused is not None and 0 < refused.retry_after <= 0.1
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_lost_script_is_loaded_again_and_the_request_counts_once(
    service_urls: tuple[str, str],
) -> None:
    """As after SCRIPT FLUSH or a Redis restart: EVALSHA answers NOSCRIPT, the script is
    loaded again, and the request is counted, once."""
    limiter = _limiter(rate=0.001, burst=10)  # no token comes back during the test
    key = uuid.uuid4().hex
    try:
        first = await limiter.hit(key)
        assert first is not None and first.remaining == 9
        limiter._script.sha = "0" * 40  # a script Redis does not have
        again = await limiter.hit(key)
        assert again is not None and again.allowed and again.remaining == 8
        assert limiter._script.sha != "0" * 40
        last = await limiter.hit(key)  # and from then on over the shared connection again
        assert last is not None and last.remaining == 7
    finally:
        await limiter.aclose()


async def test_a_connection_redis_drops_is_replaced(service_urls: tuple[str, str]) -> None:
    """Redis restarted, or closed an idle client: the next request connects again and is
    counted."""
    limiter = _limiter(rate=0.001, burst=10)
    key = uuid.uuid4().hex
    admin = _real_redis(service_urls[1])
    try:
        first = await limiter.hit(key)
        assert first is not None and first.remaining == 9
        assert limiter._shared is not None
        client_id = await limiter._shared.call("CLIENT", "ID")
        assert admin.client_kill_filter(_id=client_id) == 1
        await _reader_done(limiter)
        second = await limiter.hit(key)
        assert second is not None and second.allowed and second.remaining == 8
    finally:
        admin.close()
        await limiter.aclose()


def test_concurrent_requests_share_one_connection_under_uvloop(
    service_urls: tuple[str, str],
) -> None:
    """The server runs uvloop: there, fifty requests at once on one connection each get
    their own reply, in order, and every one is counted exactly once."""
    import uvloop

    async def scenario() -> list[Decision | None]:
        limiter = _limiter(rate=1, burst=1000)
        try:
            return await asyncio.gather(*[limiter.hit("uv-" + key) for _ in range(50)])
        finally:
            await limiter.aclose()

    key = uuid.uuid4().hex
    decisions = uvloop.run(scenario())
    assert all(d is not None and d.allowed for d in decisions)
    assert sorted(d.remaining for d in decisions if d) == list(range(950, 1000))


class StallingProxy:
    """A TCP proxy in front of the real Redis that can stop the answers on the connections
    open now, as a half-dead connection or a partition does; new connections get through."""

    def __init__(self, upstream_url: str) -> None:
        self._upstream = redis.asyncio.connection.parse_url(redis_py_url(upstream_url))
        self._gates: list[asyncio.Event] = []
        self._server: asyncio.Server | None = None
        self.holding = asyncio.Event()  # set once an answer is being held back

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}/{self._upstream.get('db', 0)}"

    def stall(self) -> None:
        for gate in self._gates:
            gate.clear()

    def release(self) -> None:
        for gate in self._gates:
            gate.set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up = self._upstream
        if up.get("path"):
            up_reader, up_writer = await asyncio.open_unix_connection(up["path"])
        else:
            up_reader, up_writer = await asyncio.open_connection(
                up.get("host", "localhost"), int(up.get("port", 6379))
            )
        gate = asyncio.Event()
        gate.set()
        self._gates.append(gate)
        await asyncio.gather(
            self._pump(reader, up_writer, None),
            self._pump(up_reader, writer, gate),
            return_exceptions=True,
        )

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, gate: asyncio.Event | None
    ) -> None:
        try:
            while data := await src.read(65536):
                if gate is not None and not gate.is_set():
                    self.holding.set()
                    await gate.wait()
                dst.write(data)
                await dst.drain()
        finally:
            dst.close()

    async def aclose(self) -> None:
        self.release()
        if self._server is not None:
            self._server.close()


@pytest.fixture
async def proxy(service_urls: tuple[str, str]) -> AsyncIterator[StallingProxy]:
    if service_urls[1].startswith("rediss://"):
        pytest.skip("the proxy cannot stand in front of TLS")
    p = StallingProxy(service_urls[1])
    yield p
    await p.aclose()


async def test_a_stalled_connection_costs_one_timeout_then_nothing_and_is_replaced(
    proxy: StallingProxy, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger="app.core.ratelimit")
    limiter = _limiter(url=await proxy.start(), rate=0.001, burst=10)
    key = uuid.uuid4().hex
    loop = asyncio.get_running_loop()
    try:
        first = await limiter.hit(key)
        assert first is not None and first.remaining == 9

        monkeypatch.setattr(ratelimit, "COMMAND_TIMEOUT", 0.2)
        proxy.stall()  # Redis counts the next request, and its answer never comes back
        started = loop.time()
        assert await limiter.hit(key) is None
        assert loop.time() - started < 0.2 + 0.5
        started = loop.time()
        assert await limiter.hit(key) is None  # skipped: Redis is not asked again yet
        assert loop.time() - started < 0.05

        limiter._skip_until = 0.0  # as a second later
        last = await limiter.hit(key)
        # On a new connection, with its own answer: the stalled request was counted by
        # Redis (9 → 8), and this one too (→ 7).
        assert last is not None and last.allowed and last.remaining == 7
    finally:
        await limiter.aclose()
    assert len([r for r in caplog.records if r.name == "app.core.ratelimit"]) == 1


async def test_a_late_reply_goes_to_the_request_that_gave_up_not_the_next_one(
    proxy: StallingProxy,
) -> None:
    limiter = _limiter(url=await proxy.start(), rate=0.001, burst=10)
    key = uuid.uuid4().hex
    try:
        first = await limiter.hit(key)
        assert first is not None and first.remaining == 9
        proxy.stall()
        gave_up = asyncio.create_task(limiter.hit(key))
        await proxy.holding.wait()  # Redis has counted it (9 → 8); the answer is held
        gave_up.cancel()  # as when its client hangs up
        with pytest.raises(asyncio.CancelledError):
            await gave_up
        proxy.release()  # the late answer (8) arrives, and the next request follows it
        last = await limiter.hit(key)
        assert last is not None and last.remaining == 7
    finally:
        await limiter.aclose()


async def test_a_redis_that_never_answers_the_handshake_fails_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The URL's credentials go out in redis-py's handshake; an unanswered one is a
    connect timeout, and the request passes."""
    monkeypatch.setattr(ratelimit, "CONNECT_TIMEOUT", 0.2)
    received = bytearray()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.extend(await reader.read(1024))
        await reader.read()  # silent until the limiter gives up and hangs up

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    limiter = _limiter(url=f"redis://u:s3cret@127.0.0.1:{port}/3")
    loop = asyncio.get_running_loop()
    try:
        started = loop.time()
        assert await limiter.hit("k") is None
        assert loop.time() - started < 0.2 + 0.5
    finally:
        await limiter.aclose()
        server.close()
    assert b"AUTH" in received and b"u" in received and b"s3cret" in received


async def test_a_reply_that_is_not_a_decision_fails_open() -> None:
    async def ok_to_everything(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        while data := await reader.read(4096):
            writer.write(b"+OK\r\n" * data.count(b"*"))  # one reply per command (arrays)

    server = await asyncio.start_server(ok_to_everything, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    limiter = _limiter(url=f"redis://127.0.0.1:{port}/0")
    try:
        assert await limiter.hit("k") is None
    finally:
        await limiter.aclose()
        server.close()


def test_a_malformed_url_fails_at_startup() -> None:
    with pytest.raises(ValueError, match="redis://"):
        RateLimiter("http://cache:6379", rate=1, burst=1)
