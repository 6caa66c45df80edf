"""The workers' metrics at their hooks: the runs and queue gauges the maintenance loop
refreshes, tool calls by outcome, judge calls and failures, lease renewals that failed."""

from __future__ import annotations

import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from app.observability import prometheus
from app.runs.lifecycle.fence import Fence
from app.runs.lifecycle.status import RunStatus
from tests.support.database import OwnDatabase, own_database, sessionmaker  # noqa: F401
from tests.support.llm import Reply, ScriptedLLM, llm, llm_server  # noqa: F401
from tests.support.prometheus import value
from tests.support.runs import create_run
from workers.celery_app import QUEUES, make_celery
from workers.context import RunContext
from workers.environments.safety import Limits, ToolFailed, ToolTimeout, call_tool, with_deadline
from workers.rewards import Group, Rollout
from workers.rewards.ruler import RulerScorer
from workers.runtime import Runtime


def scrape() -> str:
    return prometheus.exposition().decode()


async def test_runs_by_status_counts_every_status_and_drops_to_zero(
    sessionmaker: Any,  # noqa: F811
    make_tenant: Any,
) -> None:
    tenant = await make_tenant()
    pending = [
        await create_run(sessionmaker, project_id=tenant.project_id, status=RunStatus.PENDING)
        for _ in range(2)
    ]
    await create_run(sessionmaker, project_id=tenant.project_id, status=RunStatus.COMPLETED)
    async with sessionmaker() as session:
        counts = await prometheus.refresh_run_gauges(session)
    assert counts == {s.value: 0 for s in RunStatus} | {"pending": 2, "completed": 1}
    text = scrape()
    assert value(text, "trainyard_runs", status="pending") == 2
    assert value(text, "trainyard_runs", status="training") == 0  # present, at zero

    for run in pending:
        async with sessionmaker() as session:
            row = await session.get(type(run), run.id)
            row.status = RunStatus.FAILED.value
            await session.commit()
    async with sessionmaker() as session:
        await prometheus.refresh_run_gauges(session)
    text = scrape()
    assert value(text, "trainyard_runs", status="pending") == 0
    assert value(text, "trainyard_runs", status="failed") == 2


def test_queue_depth_counts_waiting_tasks_under_the_broker_prefix(
    own_database: OwnDatabase,  # noqa: F811
) -> None:
    celery = make_celery(own_database.broker_url, own_database.broker_prefix)
    for _ in range(3):  # nobody consumes this prefix's queues
        celery.send_task("runs.reconcile", queue="control")
    assert prometheus.refresh_queue_depth(celery, QUEUES) == {"control": 3, "gpu": 0}
    assert value(scrape(), "trainyard_queue_depth", queue="control") == 3


def test_tool_calls_are_timed_by_outcome() -> None:
    limits = Limits(timeout=0.05, max_output_chars=100)
    release = threading.Event()
    name = "trainyard_tool_call_duration_seconds_count"
    before = {o: value(scrape(), name, outcome=o) for o in ("ok", "error", "timeout")}

    def hangs() -> str:
        release.wait(10)
        return "late"

    def explodes() -> str:
        raise ValueError("no")

    try:
        assert call_tool([], "ok", lambda: "fine", limits) == "fine"
        with pytest.raises(ToolFailed):
            call_tool([], "bad", explodes, limits)
        with pytest.raises(ToolTimeout):
            call_tool([], "slow", lambda: with_deadline(hangs, {}, limits.timeout), limits)
    finally:
        release.set()
    after = {o: value(scrape(), name, outcome=o) for o in ("ok", "error", "timeout")}
    assert {o: after[o] - before[o] for o in after} == {"ok": 1, "error": 1, "timeout": 1}


def test_judge_calls_and_failures(llm: ScriptedLLM) -> None:  # noqa: F811
    llm.handle(lambda body: Reply(status=500))
    spec = {"type": "ruler", "judge": llm.endpoint(max_retries=0), "temperature": 0.25}
    groups = [
        Group(index=i, input_text="q", context=None, rollouts=[Rollout([], "a"), Rollout([], "b")])
        for i in range(2)
    ]
    before = scrape()
    rows = RulerScorer(spec, backoff_s=0).score(groups)
    assert all(s.reward is None for row in rows for s in row)  # dropped, not raised
    after = scrape()
    calls = "trainyard_judge_call_duration_seconds_count"
    failures = "trainyard_judge_failures_total"
    assert value(after, calls, judge="ruler") - value(before, calls, judge="ruler") == 2
    assert value(after, failures, judge="ruler") - value(before, failures, judge="ruler") == 2


@pytest.fixture
async def runtime(own_database: OwnDatabase) -> AsyncIterator[Runtime]:  # noqa: F811
    runtime = Runtime(own_database.settings)
    try:
        yield runtime
    finally:
        await runtime.engine.dispose()
        runtime.loop.call_soon_threadsafe(runtime.loop.stop)


async def test_a_lost_lease_counts_a_failed_renewal(
    runtime: Runtime,
    sessionmaker: Any,  # noqa: F811
    make_tenant: Any,
) -> None:
    tenant = await make_tenant()
    run = await create_run(sessionmaker, project_id=tenant.project_id, status=RunStatus.TRAINING)
    name = "trainyard_lease_renewals_failed_total"
    before = value(scrape(), name, reason="lost")
    ctx = RunContext(runtime, run.id, Fence(owner=f"gone-{uuid.uuid4().hex[:6]}", attempt=1))
    await ctx.heartbeat_once()  # nobody holds this run: the renewal finds no lease
    assert ctx.lost
    assert value(scrape(), name, reason="lost") - before == 1
