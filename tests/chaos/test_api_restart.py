"""The API process killed and restarted under load: clients that retry with their
Idempotency-Key lose no accepted request and create nothing twice; an SSE client that
reconnects with Last-Event-ID sees every event of the run once, in order."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from app.events.models import RunEvent
from app.runs.models import Run
from tests.support.api_process import ApiProcess
from tests.support.database import OwnDatabase
from tests.support.runs import get_run, run_body, wait_for

pytestmark = pytest.mark.chaos

CLIENTS = 6
# Requests accepted per client (on average) before the API is killed, and by each client
# after its restart: the load ends on those events, not after a number of seconds.
BEFORE, AFTER = 2, 2


@pytest.fixture
def api_server(own_database: OwnDatabase, tmp_path: Path) -> Iterator[ApiProcess]:
    env = {
        **own_database.env(),
        # Hundreds of pending runs (no worker keeps up) and six clients flat out: this test
        # is about restarts, not the project's quota or the per-key rate limit.
        "TRAINYARD_MAX_ACTIVE_RUNS_PER_PROJECT": "0",
        "TRAINYARD_RATE_LIMIT_PER_SECOND": "0",
    }
    server = ApiProcess(tmp_path / "api.log", env)
    server.start()
    try:
        yield server
    finally:
        server.kill()


async def _create_until_accepted(
    http: httpx.AsyncClient, headers: dict[str, str], key: str, body: dict[str, Any]
) -> str:
    """POST with one Idempotency-Key until the API answers, as a careful client does."""
    deadline = time.monotonic() + 60
    while True:
        try:
            r = await http.post("/runs", json=body, headers={**headers, "Idempotency-Key": key})
            if r.status_code in (200, 201, 202):
                return str(r.json()["id"])
            assert r.status_code >= 500 or r.status_code == 409, r.text  # retry on these
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"request {key} never accepted"
        await asyncio.sleep(0.05)


async def _follow(http: httpx.AsyncClient, headers: dict[str, str], run_id: str) -> list[int]:
    """Event ids of the run's stream, reconnecting with Last-Event-ID until it ends."""
    seen: list[int] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        resume = {"Last-Event-ID": str(seen[-1])} if seen else {}
        try:
            async with http.stream(
                "GET", f"/runs/{run_id}/events/stream", headers={**headers, **resume}
            ) as r:
                if r.status_code != 200:
                    await asyncio.sleep(0.1)
                    continue
                async for line in r.aiter_lines():
                    if line.startswith("id:"):
                        seen.append(int(line[3:].strip()))
                return seen  # the server ended the stream: the run is over
        except httpx.TransportError:
            await asyncio.sleep(0.1)
    raise AssertionError("stream never ended")


async def test_api_killed_under_load_loses_and_doubles_nothing(
    api_server: ApiProcess, tenant, sessionmaker, start_worker
) -> None:
    start_worker()
    base = api_server.url
    async with httpx.AsyncClient(base_url=base, timeout=10) as http:
        traced = await _create_until_accepted(
            http, tenant.headers, str(uuid.uuid4()), run_body(max_steps=20, config={"tick": 0.3})
        )
        follower = asyncio.create_task(_follow(http, tenant.headers, traced))
        accepted: dict[str, str] = {}
        warmed = asyncio.Event()
        restarted = asyncio.Event()

        async def client() -> None:
            """Flat out (some requests are in flight when the API dies) until AFTER of its
            requests were accepted after the restart."""
            done_after = 0
            while done_after < AFTER:
                key = str(uuid.uuid4())
                accepted[key] = await _create_until_accepted(
                    http, tenant.headers, key, run_body(config={"client_key": key})
                )
                if restarted.is_set():
                    done_after += 1
                elif len(accepted) >= CLIENTS * BEFORE:
                    warmed.set()

        load = [asyncio.create_task(client()) for _ in range(CLIENTS)]
        await warmed.wait()
        # The traced run's stream must span the restart for the resume to be tested.
        assert (await get_run(sessionmaker, traced)).completed_at is None
        await asyncio.to_thread(api_server.kill)  # mid-request for some of the clients
        await asyncio.to_thread(api_server.start)
        restarted.set()
        await asyncio.gather(*load)
        seen = await follower

    assert len(accepted) >= CLIENTS * (BEFORE + AFTER)
    async with sessionmaker() as s:
        stored = (
            await s.execute(
                select(Run.id, Run.config["client_key"].astext).where(
                    Run.project_id == tenant.project_id, Run.id != uuid.UUID(traced)
                )
            )
        ).all()
        events = list(
            (
                await s.execute(
                    select(RunEvent.id)
                    .where(RunEvent.run_id == uuid.UUID(traced))
                    .order_by(RunEvent.id)
                )
            ).scalars()
        )
        in_flight = await s.scalar(
            select(func.count()).select_from(Run).where(Run.project_id == tenant.project_id)
        )
    by_key = {key: str(run_id) for run_id, key in stored}
    # Every accepted request is stored, as the run the client was told; nothing twice.
    assert len(stored) == len(by_key) == len(accepted)
    assert by_key == accepted
    assert in_flight == len(accepted) + 1
    # The stream across the restart: every event once, in order, none missing.
    assert seen == events
    await wait_for(sessionmaker, traced, lambda r: r.status == "completed", within=120)
