"""What every move shares: the table checked by construction, and a version PostgreSQL keeps."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from app.runs.lifecycle import leases
from app.runs.lifecycle.fence import Fence
from app.runs.lifecycle.state import Hop, Move, compile_move, sources, transition
from app.runs.lifecycle.status import RunStatus as S
from app.runs.models import Run
from tests.support.runs import create_run


def test_a_move_starts_only_from_what_the_table_allows() -> None:
    move = Move(uuid.uuid4(), S.SCORING)
    _, args = compile_move(move)
    assert set(args[2]) == {s.value for s in sources(S.SCORING)} == {"collecting"}
    # What the caller expects narrows the table; it never widens it.
    narrowed = Move(uuid.uuid4(), S.FAILED, expected=frozenset({S.TRAINING, S.COMPLETED}))
    assert narrowed.allowed_sources() == {S.TRAINING}


def test_an_illegal_path_or_column_is_refused_before_any_sql() -> None:
    with pytest.raises(ValueError, match="cannot go on"):
        Move(uuid.uuid4(), S.COMPLETED, via=(Hop(S.SCORING, "scored"),))
    with pytest.raises(ValueError, match="not columns"):
        Move(uuid.uuid4(), S.FAILED, values={"status": "completed"})
    with pytest.raises(ValueError, match="passes through"):
        Move(uuid.uuid4(), S.TRAINING, stay=True, via=(Hop(S.SCORING, "x"),))


async def test_version_counts_visible_changes_only(sessionmaker, tenant) -> None:
    fence = Fence("w:1", 1)
    run = await create_run(
        sessionmaker,
        project_id=tenant.project_id,
        status=S.COLLECTING,
        lease_owner=fence.owner,
        attempt=fence.attempt,
        lease_expires_at=datetime.now(UTC) + timedelta(seconds=30),
    )
    async with sessionmaker() as s:
        # A heartbeat changes nothing a client sees: same version, same ETag.
        await leases.renew(s, run.id, fence, ttl_seconds=30)
        await s.commit()
        assert (await s.get(Run, run.id, populate_existing=True)).version == run.version
        moved = await transition(s, run.id, S.SCORING, fence=fence)
        await s.commit()
    assert moved.version == run.version + 1
    async with sessionmaker() as s:
        # Releasing the lease is bookkeeping too.
        await leases.release(s, run.id, fence)
        await s.commit()
        assert (await s.get(Run, run.id, populate_existing=True)).version == moved.version
