"""Per-key rate limits and the per-project cap on active runs, over the real app, PostgreSQL
and Redis.

The session's app runs with the default limits; each test here builds an app of its own with
small ones (and its lifespan), as the ``api`` fixture does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select, update

from app.core import ratelimit
from app.core.ratelimit import (
    Decision,
    Pipe,
    RateLimiter,
    ReplyError,
    Target,
    bulks,
    command,
    parse_reply,
)
from app.core.services import redis_url
from app.core.settings import get_settings
from app.main import create_app
from app.runs.models import Run
from app.runs.status import RunStatus
from tests.conftest import run_body
from tests.factories import create_run

PROBLEM = "application/problem+json"
CLOSED_PORT_REDIS = "redis://127.0.0.1:1/0"  # nothing listens on port 1

LimitedClient = Callable[..., AbstractAsyncContextManager[httpx.AsyncClient]]


@pytest.fixture(autouse=True)
def patient_limiter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded test machine can stall a process past the limiter's quarter-second
    deadlines, which would let a request through unlimited: the tests that count on Redis
    answering wait longer (those about timeouts set their own)."""
    monkeypatch.setattr(ratelimit, "COMMAND_TIMEOUT", 5.0)
    monkeypatch.setattr(ratelimit, "CONNECT_TIMEOUT", 5.0)


@pytest.fixture
def limited_client(service_urls: tuple[str, str]) -> LimitedClient:
    """``async with limited_client(rate_limit_burst=3, …) as client``: a client of an app
    created from the session's settings with these overrides, its lifespan running."""

    @asynccontextmanager
    async def _client(**overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
        overrides.setdefault("db_pool_size", 4)
        app = create_app(get_settings().model_copy(update=overrides))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                yield c

    return _client


async def _a_run(client: httpx.AsyncClient, tenant: Any) -> str:
    r = await client.post("/runs", json=run_body(), headers=tenant.headers)
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


async def count_runs(sessionmaker: Any, project_id: uuid.UUID) -> int:
    async with sessionmaker() as s:
        return int(await s.scalar(select(func.count()).where(Run.project_id == project_id)))


# ------------------------------------------------------------------------- rate limit


async def test_an_exhausted_burst_is_429_with_retry_after_and_recovers(
    limited_client, make_tenant
) -> None:
    # A token every 2 s, three at once: the fourth request comes long before the next token.
    async with limited_client(rate_limit_per_second=0.5, rate_limit_burst=3) as client:
        t = await make_tenant()
        run_id = await _a_run(client, t)  # 1st
        remaining = []
        for _ in range(2):  # 2nd, 3rd
            r = await client.get(f"/runs/{run_id}", headers=t.headers)
            assert r.status_code == 200
            assert r.headers["ratelimit-limit"] == "3"
            remaining.append(int(r.headers["ratelimit-remaining"]))
        assert remaining == [1, 0]

        r = await client.get(f"/runs/{run_id}", headers=t.headers)
        assert r.status_code == 429, r.text
        assert r.headers["content-type"] == PROBLEM
        problem = r.json()
        assert problem["status"] == 429
        assert problem["type"].endswith("/rate-limited")
        assert "0.5 requests per second" in problem["detail"]
        assert "bursts of up to 3" in problem["detail"]
        retry_after = int(r.headers["retry-after"])
        assert 1 <= retry_after <= 2
        assert r.headers["ratelimit-remaining"] == "0"
        # Refused requests cost nothing: asking again at once is refused the same way.
        assert (await client.get("/runs", headers=t.headers)).status_code == 429

        # Another key is not affected.
        other = await make_tenant()
        assert (await client.get("/runs", headers=other.headers)).status_code == 200

        await asyncio.sleep(retry_after)
        r = await client.get(f"/runs/{run_id}", headers=t.headers)
        assert r.status_code == 200, r.text


async def test_unauthenticated_routes_and_bad_keys_are_not_limited(limited_client) -> None:
    async with limited_client(rate_limit_per_second=0.5, rate_limit_burst=1) as client:
        for _ in range(3):
            assert (await client.get("/healthz")).status_code == 200
            r = await client.get("/runs", headers={"Authorization": "Bearer ty_unknown"})
            assert r.status_code == 401


async def test_the_limit_off_adds_no_headers(limited_client, make_tenant) -> None:
    async with limited_client(rate_limit_per_second=0) as client:
        t = await make_tenant()
        for _ in range(3):
            r = await client.get("/runs", headers=t.headers)
            assert r.status_code == 200
            assert "ratelimit-limit" not in r.headers


async def test_redis_down_fails_open_and_warns_once(limited_client, make_tenant, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="app.core.ratelimit")
    async with limited_client(
        rate_limit_per_second=0.5, rate_limit_burst=1, redis_url=CLOSED_PORT_REDIS
    ) as client:
        t = await make_tenant()
        run_id = await _a_run(client, t)
        for _ in range(5):
            r = await client.get(f"/runs/{run_id}", headers=t.headers)
            assert r.status_code == 200, r.text
            assert "ratelimit-limit" not in r.headers
    warnings = [r for r in caplog.records if r.name == "app.core.ratelimit"]
    assert len(warnings) == 1, warnings
    assert "not rate-limited" in warnings[0].getMessage()


def _limiter(**kw: Any) -> RateLimiter:
    settings = get_settings()
    kw.setdefault("rate", 10)
    kw.setdefault("burst", 4)
    return RateLimiter(kw.pop("url", redis_url(settings)), prefix=settings.broker_prefix, **kw)


async def test_processes_share_one_bucket_and_a_lost_script_is_loaded_again(
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
        # As after SCRIPT FLUSH or a Redis restart: EVALSHA answers NOSCRIPT, and the
        # request is sent again as EVAL (which loads the script again) and still counts.
        b._evalsha = (bulks(b"EVALSHA", b"0" * 40, 1), b._evalsha[1])
        await asyncio.sleep(0.25)  # two tokens back
        again = await b.hit(key)
        assert again is not None and again.allowed
        # The connection dropped (a Redis restart, an idle timeout): the next request
        # connects again, and is counted.
        assert a._pipe is not None and a._pipe.transport is not None
        a._pipe.transport.close()
        await asyncio.sleep(0)
        last = await a.hit(key)
        assert last is not None and last.allowed and last.remaining == 0
    finally:
        await a.aclose()
        await b.aclose()


def test_concurrent_requests_share_one_connection_under_uvloop(
    service_urls: tuple[str, str],
) -> None:
    """The server runs uvloop: there, fifty requests at once on one connection each get
    their own reply, in order, and every one is counted exactly once."""
    import uvloop

    async def scenario() -> list[Decision | None]:
        limiter = _limiter(rate=1, burst=1000)
        try:
            return await asyncio.gather(*[limiter.hit("uv-" + KEY) for _ in range(50)])
        finally:
            await limiter.aclose()

    KEY = uuid.uuid4().hex
    decisions = uvloop.run(scenario())
    assert all(d is not None and d.allowed for d in decisions)
    assert sorted(d.remaining for d in decisions if d) == list(range(950, 1000))


async def test_a_redis_that_never_answers_costs_one_timeout_then_nothing(
    caplog, monkeypatch
) -> None:
    caplog.set_level(logging.WARNING, logger="app.core.ratelimit")
    monkeypatch.setattr(ratelimit, "COMMAND_TIMEOUT", 0.2)
    monkeypatch.setattr(ratelimit, "CONNECT_TIMEOUT", 0.2)
    received = bytearray()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.extend(await reader.read(1024))
        await reader.read()  # silent until the limiter gives up and hangs up

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    limiter = _limiter(url=f"redis://u:s3cret@127.0.0.1:{port}/3")
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await limiter.hit("k") is None
        assert loop.time() - started < 0.2 + 0.2 + 0.5
        started = loop.time()
        assert await limiter.hit("k") is None  # skipped: Redis is not asked again yet
        assert loop.time() - started < 0.05
    finally:
        await limiter.aclose()
        server.close()
    assert bytes(received) == command("AUTH", "u", "s3cret")  # then SELECT 3, after +OK
    assert len([r for r in caplog.records if r.name == "app.core.ratelimit"]) == 1


async def test_handshake_then_a_reply_that_is_not_a_decision_fails_open() -> None:
    received = bytearray()

    async def ok_to_everything(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        while data := await reader.read(4096):
            received.extend(data)
            writer.write(b"+OK\r\n" * data.count(b"*"))  # one reply per command (arrays)

    server = await asyncio.start_server(ok_to_everything, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    limiter = _limiter(url=f"redis://:pw@127.0.0.1:{port}/3")
    try:
        assert await limiter.hit("k") is None
    finally:
        await limiter.aclose()
        server.close()
    assert bytes(received).startswith(command("AUTH", "pw") + command("SELECT", 3))
    assert b"EVALSHA" in received


def test_replies_split_anywhere_resolve_their_requests_in_order() -> None:
    async def scenario() -> list[Any]:
        pipe = Pipe()

        class Transport:
            def write(self, data: bytes) -> None:
                pass

            def close(self) -> None:
                pass

        pipe.connection_made(Transport())  # type: ignore[arg-type]
        waiters = [pipe.request(b"") for _ in range(4)]
        stream = b"*4\r\n:1\r\n:199\r\n:0\r\n:10000\r\n-NOSCRIPT No matching script\r\n"
        stream += b"$3\r\nabc\r\n+OK\r\n"
        for i in range(len(stream)):
            pipe.data_received(stream[i : i + 1])
        return [await w for w in waiters]

    replies = asyncio.run(scenario())
    assert replies[0] == [1, 199, 0, 10000]
    assert isinstance(replies[1], ReplyError) and str(replies[1]).startswith("NOSCRIPT")
    assert replies[2:] == [b"abc", b"OK"]
    assert parse_reply(b"*2\r\n:1\r\n") is None
    assert parse_reply(b"$-1\r\n") == (None, 5)


def test_urls_the_broker_takes_work_for_the_limiter_too() -> None:
    embedded = Target.from_url("redis+socket:///tmp/ty/redis.sock")
    assert embedded.path == "/tmp/ty/redis.sock" and embedded.handshake == ()
    unix = Target.from_url("unix:///run/redis.sock?db=2")
    assert unix.path == "/run/redis.sock" and unix.handshake == (command("SELECT", 2),)
    tcp = Target.from_url("redis://user:p%40ss@cache:6380/1")
    assert (tcp.host, tcp.port, tcp.tls) == ("cache", 6380, None)
    assert tcp.handshake == (command("AUTH", "user", "p@ss"), command("SELECT", 1))
    tls = Target.from_url("rediss://cache?ssl_cert_reqs=none")
    assert tls.tls is not None and tls.tls.verify_mode == ssl.CERT_NONE
    verified = Target.from_url("rediss://cache")
    assert verified.tls is not None and verified.tls.verify_mode == ssl.CERT_REQUIRED
    assert verified.tls.check_hostname


# ---------------------------------------------------------------- active-run cap


async def test_the_cap_refuses_the_next_run_until_one_is_cancelled(
    limited_client, make_tenant, sessionmaker
) -> None:
    async with limited_client(max_active_runs_per_project=3) as client:
        t = await make_tenant()
        ids = [await _a_run(client, t) for _ in range(3)]
        r = await client.post("/runs", json=run_body(), headers=t.headers)
        assert r.status_code == 429, r.text
        assert r.headers["content-type"] == PROBLEM
        problem = r.json()
        assert problem["type"].endswith("/active-run-limit")
        assert problem["detail"] == (
            "This project has 3 active runs and the limit is 3; cancel one or wait for one "
            "to finish."
        )
        assert problem["active_runs"] == 3 and problem["limit"] == 3
        assert "retry-after" not in r.headers
        assert await count_runs(sessionmaker, t.project_id) == 3

        # Another project has slots of its own.
        other = await make_tenant()
        await _a_run(client, other)

        # A paused run still counts; a cancelled one frees its slot.
        r = await client.post(f"/runs/{ids[0]}/pause", headers=t.headers)
        assert r.json()["status"] == "paused"
        assert (await client.post("/runs", json=run_body(), headers=t.headers)).status_code == 429
        r = await client.post(f"/runs/{ids[1]}/cancel", headers=t.headers)
        assert r.json()["status"] == "cancelled"
        await _a_run(client, t)
        assert (await client.post("/runs", json=run_body(), headers=t.headers)).status_code == 429


async def test_a_run_whose_cancel_is_requested_frees_its_slot(
    limited_client, make_tenant, sessionmaker
) -> None:
    """A worker holding the run stops within a heartbeat; the slot is free at once."""
    async with limited_client(max_active_runs_per_project=1) as client:
        t = await make_tenant()
        run = await create_run(sessionmaker, project_id=t.project_id, status=RunStatus.TRAINING)
        assert (await client.post("/runs", json=run_body(), headers=t.headers)).status_code == 429
        async with sessionmaker() as s:  # what POST /cancel does while a worker holds it
            await s.execute(update(Run).where(Run.id == run.id).values(cancel_requested=True))
            await s.commit()
        await _a_run(client, t)


async def test_concurrent_creates_never_overshoot_the_cap(
    limited_client, make_tenant, sessionmaker
) -> None:
    async with limited_client(max_active_runs_per_project=5, db_pool_size=10) as client:
        t = await make_tenant()
        answers = await asyncio.gather(
            *[client.post("/runs", json=run_body(), headers=t.headers) for _ in range(20)]
        )
        assert Counter(r.status_code for r in answers) == {202: 5, 429: 15}
        assert await count_runs(sessionmaker, t.project_id) == 5
        # With Idempotency-Keys (the transaction the key shares) it holds the same way.
        u = await make_tenant()
        answers = await asyncio.gather(
            *[
                client.post(
                    "/runs",
                    json=run_body(),
                    headers={**u.headers, "Idempotency-Key": f"k{i}"},
                )
                for i in range(20)
            ]
        )
        assert Counter(r.status_code for r in answers) == {202: 5, 429: 15}
        assert await count_runs(sessionmaker, u.project_id) == 5


async def test_idempotent_replays_still_replay_at_the_cap(
    limited_client, make_tenant, sessionmaker
) -> None:
    async with limited_client(max_active_runs_per_project=2) as client:
        t = await make_tenant()
        first = await client.post(
            "/runs", json=run_body(), headers={**t.headers, "Idempotency-Key": "first"}
        )
        assert first.status_code == 202
        await _a_run(client, t)  # now at the cap
        replay = await client.post(
            "/runs", json=run_body(), headers={**t.headers, "Idempotency-Key": "first"}
        )
        assert replay.status_code == 202, replay.text
        assert replay.headers["idempotent-replayed"] == "true"
        assert replay.json()["id"] == first.json()["id"]
        # The same key with another body is still the 422 it always was.
        other = await client.post(
            "/runs",
            json=run_body(model_name="other"),
            headers={**t.headers, "Idempotency-Key": "first"},
        )
        assert other.status_code == 422
        # A new key is refused.
        fresh = await client.post(
            "/runs", json=run_body(), headers={**t.headers, "Idempotency-Key": "fresh"}
        )
        assert fresh.status_code == 429
        assert await count_runs(sessionmaker, t.project_id) == 2

        # One slot left and twenty concurrent tries with one key: one run, every answer its.
        u = await make_tenant()
        await _a_run(client, u)
        answers = await asyncio.gather(
            *[
                client.post(
                    "/runs", json=run_body(), headers={**u.headers, "Idempotency-Key": "same"}
                )
                for _ in range(20)
            ]
        )
        assert {r.status_code for r in answers} == {202}
        assert len({r.json()["id"] for r in answers}) == 1
        assert await count_runs(sessionmaker, u.project_id) == 2


async def test_runs_from_a_dataset_are_capped_too(
    limited_client, make_tenant, sessionmaker
) -> None:
    async with limited_client(max_active_runs_per_project=1) as client:
        t = await make_tenant()
        content = b"".join(
            json.dumps({"input_text": f"row {i}"}).encode() + b"\n" for i in range(3)
        )
        r = await client.post(
            "/datasets",
            files={"file": ("inputs.jsonl", content, "application/jsonl")},
            data={"name": "d"},
            headers=t.headers,
        )
        assert r.status_code == 201, r.text
        body = run_body(inputs=None, dataset_id=r.json()["id"])
        body.pop("inputs")
        r = await client.post("/runs", json=body, headers=t.headers)
        assert r.status_code == 202, r.text
        r = await client.post("/runs", json=body, headers=t.headers)
        assert r.status_code == 429
        assert "the limit is 1" in r.json()["detail"]
        # An unusable dataset is still the 422 naming the field, before or at the cap.
        bad = {**body, "dataset_id": str(uuid.uuid4())}
        r = await client.post("/runs", json=bad, headers=(await make_tenant()).headers)
        assert r.status_code == 422
        assert r.json()["errors"][0]["field"] == "body.dataset_id"
        assert await count_runs(sessionmaker, t.project_id) == 1


def test_retry_after_is_whole_seconds_and_at_least_one() -> None:
    from app.auth.deps import _rate_limited

    limiter = SimpleNamespace(rate=100, burst=200)
    for wait, expected in ((0.0004, "1"), (1.0, "1"), (1.2, "2")):
        problem = _rate_limited(limiter, Decision(False, 200, 0, wait, wait))  # type: ignore[arg-type]
        assert problem.headers is not None
        assert problem.headers["Retry-After"] == expected
