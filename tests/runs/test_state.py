"""The state machine: every from × to pair, and races on one run."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from sqlalchemy import func, select

from app.events.models import RunEvent
from app.runs.lifecycle.state import (
    TRANSITIONS,
    Fence,
    InvalidTransition,
    LeaseLost,
    TransitionConflict,
    can_transition,
    transition,
)
from app.runs.lifecycle.status import TERMINAL, RunStatus
from app.runs.models import Run
from tests.support.runs import create_run

PAIRS = list(itertools.product(RunStatus, RunStatus))


def test_table_covers_every_status() -> None:
    assert set(TRANSITIONS) == set(RunStatus)
    for terminal in TERMINAL:
        assert TRANSITIONS[terminal] == frozenset()
    for status in set(RunStatus) - TERMINAL:
        # Any non-terminal status may fail or be cancelled.
        assert {RunStatus.FAILED, RunStatus.CANCELLED} <= TRANSITIONS[status]


@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=[f"{a.value}->{b.value}" for a, b in PAIRS])
async def test_every_pair(sessionmaker, tenant, src: RunStatus, dst: RunStatus) -> None:
    run = await create_run(sessionmaker, project_id=tenant.project_id, status=src)
    async with sessionmaker() as s:
        if can_transition(src, dst):
            updated = await transition(s, run.id, dst)
            await s.commit()
            assert updated.status == dst
            assert updated.version == run.version + 1
        else:
            with pytest.raises(InvalidTransition) as info:
                await transition(s, run.id, dst)
            assert info.value.current == src
            await s.rollback()
    async with sessionmaker() as s:
        stored = await s.get(Run, run.id)
        events = (
            (
                await s.execute(
                    select(RunEvent).where(RunEvent.run_id == run.id, RunEvent.type == "status")
                )
            )
            .scalars()
            .all()
        )
    if can_transition(src, dst):
        assert stored.status == dst
        assert [(e.data["from"], e.data["to"]) for e in events] == [(src.value, dst.value)]
        if dst in TERMINAL:
            assert stored.completed_at is not None and stored.lease_owner is None
    else:
        assert stored.status == src and stored.version == run.version
        assert events == []


async def test_expected_status_mismatch_is_a_conflict(sessionmaker, tenant) -> None:
    run = await create_run(sessionmaker, project_id=tenant.project_id, status=RunStatus.SCORING)
    async with sessionmaker() as s:
        with pytest.raises(TransitionConflict) as info:
            await transition(s, run.id, RunStatus.FAILED, expected=RunStatus.COLLECTING)
    assert info.value.current == RunStatus.SCORING


async def test_fenced_transition_needs_the_lease(sessionmaker, tenant) -> None:
    run = await create_run(
        sessionmaker,
        project_id=tenant.project_id,
        status=RunStatus.COLLECTING,
        lease_owner="w1",
        attempt=2,
    )
    async with sessionmaker() as s:
        with pytest.raises(LeaseLost):
            await transition(s, run.id, RunStatus.SCORING, fence=Fence("w1", 1))
        await s.rollback()
        moved = await transition(s, run.id, RunStatus.SCORING, fence=Fence("w1", 2))
        await s.commit()
    assert moved.status == RunStatus.SCORING


async def test_fifty_concurrent_terminal_transitions_one_wins(sessionmaker, tenant) -> None:
    run = await create_run(sessionmaker, project_id=tenant.project_id, status=RunStatus.TRAINING)
    targets = [
        (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED)[i % 3] for i in range(50)
    ]
    start = asyncio.Barrier(len(targets))  # all fifty waiting before any moves

    async def attempt(dst: RunStatus) -> RunStatus | None:
        async with sessionmaker() as s:
            await start.wait()
            try:
                await transition(s, run.id, dst)
                await s.commit()
                return dst
            except TransitionConflict:
                await s.rollback()
                return None

    results = await asyncio.gather(*(attempt(t) for t in targets))
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    async with sessionmaker() as s:
        stored = await s.get(Run, run.id)
        n_events = await s.scalar(
            select(func.count()).where(RunEvent.run_id == run.id, RunEvent.type == "status")
        )
    assert stored.status == winners[0]
    assert stored.version == run.version + 1
    assert n_events == 1

    # Terminal statuses never change afterwards.
    async with sessionmaker() as s:
        for dst in RunStatus:
            with pytest.raises(TransitionConflict):
                await transition(s, run.id, dst)


async def test_fifty_concurrent_step_transitions_one_wins(sessionmaker, tenant) -> None:
    """Two workers racing the same non-terminal move: the loser gets a conflict."""
    run = await create_run(sessionmaker, project_id=tenant.project_id, status=RunStatus.COLLECTING)
    start = asyncio.Barrier(50)  # all fifty waiting before any moves

    async def attempt() -> bool:
        async with sessionmaker() as s:
            await start.wait()
            try:
                await transition(s, run.id, RunStatus.SCORING)
                await s.commit()
                return True
            except TransitionConflict:
                return False

    assert sum(await asyncio.gather(*(attempt() for _ in range(50)))) == 1
