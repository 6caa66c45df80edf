"""The generating phase's split of train and validation inputs (workers.pipeline.inputs)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from app.core.db import session_scope
from app.core.settings import get_settings
from app.runs.lifecycle import leases
from tests.support.runs import run_body
from workers.context import RunContext
from workers.pipeline.inputs import VALIDATION_WARNING, no_validation_warning, prepare_inputs


class _Runtime:
    """The part of workers.runtime.Runtime a RunContext uses, on the test's own loop."""

    def __init__(self, maker: Any) -> None:
        self.settings = get_settings()
        self.maker = maker

    @asynccontextmanager
    async def session(self) -> AsyncIterator[Any]:
        async with session_scope(self.maker) as session:
            yield session


async def _claimed(client: Any, tenant: Any, sessionmaker: Any, n_inputs: int, **grpo: Any):
    body = run_body(inputs=[{"input_text": f"say {i}"} for i in range(n_inputs)], grpo=grpo)
    r = await client.post("/runs", json=body, headers=tenant.headers)
    assert r.status_code == 202, r.text
    run_id = uuid.UUID(r.json()["id"])
    async with session_scope(sessionmaker) as session:
        claimed = await leases.claim(
            session, run_id, owner="test-inputs", ttl_seconds=30, max_attempts=3
        )
    assert claimed is not None
    return RunContext(_Runtime(sessionmaker), run_id, claimed[1])  # type: ignore[arg-type]


async def test_a_fraction_that_holds_out_none_says_so(client, tenant, sessionmaker) -> None:
    """0.1 of 6 inputs is 0.6, rounded down to none: with load_best_model_at_end on, the
    run's events and its summary say that nothing will be evaluated."""
    ctx = await _claimed(client, tenant, sessionmaker, 6, validation_fraction=0.1)
    counts = await prepare_inputs(ctx, validation_fraction=0.1, seed=42)
    assert counts == {"train": 6, "validation": 0}
    expected = no_validation_warning(6, 0.1, load_best_model_at_end=True)
    assert "load_best_model_at_end" in expected and "10 inputs" in expected

    run = (await client.get(f"/runs/{ctx.run_id}", headers=tenant.headers)).json()
    assert run["metrics"][VALIDATION_WARNING] == expected
    events = (await client.get(f"/runs/{ctx.run_id}/events", headers=tenant.headers)).json()
    [warning] = [e for e in events["data"] if e["level"] == "warning"]
    assert warning["message"] == expected and warning["type"] == "inputs"


async def test_a_fraction_that_holds_out_some_is_silent(client, tenant, sessionmaker) -> None:
    ctx = await _claimed(client, tenant, sessionmaker, 10, validation_fraction=0.1)
    assert await prepare_inputs(ctx, validation_fraction=0.1, seed=42) == {
        "train": 9,
        "validation": 1,
    }
    run = (await client.get(f"/runs/{ctx.run_id}", headers=tenant.headers)).json()
    assert VALIDATION_WARNING not in (run["metrics"] or {})
    events = (await client.get(f"/runs/{ctx.run_id}/events", headers=tenant.headers)).json()
    assert not [e for e in events["data"] if e["level"] == "warning"]


async def test_no_fraction_asked_for_is_silent_too(client, tenant, sessionmaker) -> None:
    ctx = await _claimed(client, tenant, sessionmaker, 6, validation_fraction=0)
    assert await prepare_inputs(ctx, validation_fraction=0, seed=42) == {
        "train": 6,
        "validation": 0,
    }
    run = (await client.get(f"/runs/{ctx.run_id}", headers=tenant.headers)).json()
    assert run["metrics"] is None


def test_the_warning_without_load_best_model_at_end() -> None:
    text = no_validation_warning(3, 0.25, load_best_model_at_end=False)
    assert "load_best_model_at_end" not in text
    assert text.startswith("validation_fraction 0.25 of 3 train inputs holds out none")
