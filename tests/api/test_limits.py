"""Per-key rate limits and the per-project cap on active runs, over the real app, PostgreSQL
and Redis. The limiter's own Redis side (shared buckets, NOSCRIPT, dropped and stalled
connections) is tested in tests/core/test_ratelimit.py.

The session's app runs with the default limits; each test here builds an app of its own with
small ones (and its lifespan), as the ``api`` fixture does.
"""

from __future__ import annotations

import asyncio
import json
import logging
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
from app.core.ratelimit import Decision
from app.core.settings import get_settings
from app.main import create_app
from app.runs.lifecycle.status import RunStatus
from app.runs.models import Run
from tests.support.runs import create_run, run_body

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
