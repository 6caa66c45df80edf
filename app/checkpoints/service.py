from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession
from sqlmodel import col

from app.checkpoints.models import Checkpoint


async def record(
    session: AsyncSession,
    run_id: uuid.UUID,
    step: int,
    path: str,
    *,
    metrics: dict[str, Any] | None = None,
    is_final: bool = False,
) -> None:
    """Record a checkpoint whose folder is complete on disk (renamed into place)."""
    stmt = insert(Checkpoint).values(
        run_id=run_id, step=step, path=path, metrics=metrics or {}, is_final=is_final
    )
    await session.execute(
        stmt.on_conflict_do_update(
            index_elements=["run_id", "step", "is_final"],
            set_={
                "path": stmt.excluded.path,
                "metrics": stmt.excluded.metrics,
                "is_final": stmt.excluded.is_final,
            },
        )
    )


async def latest(session: AsyncSession, run_id: uuid.UUID) -> Checkpoint | None:
    """The newest resumable (non-final) checkpoint of the run."""
    return (
        await session.execute(
            select(Checkpoint)
            .where(col(Checkpoint.run_id) == run_id, col(Checkpoint.is_final).is_(False))
            .order_by(col(Checkpoint.step).desc())
            .limit(1)
        )
    ).scalar_one_or_none()


async def at_step(session: AsyncSession, run_id: uuid.UUID, step: int) -> Checkpoint | None:
    """The run's checkpoint at ``step``: the resumable one, else the final model."""
    return (
        await session.execute(
            select(Checkpoint)
            .where(col(Checkpoint.run_id) == run_id, col(Checkpoint.step) == step)
            .order_by(col(Checkpoint.is_final))
            .limit(1)
        )
    ).scalar_one_or_none()


async def prune(
    session: AsyncSession, run_id: uuid.UUID, *, keep: int, protect: set[int] | None = None
) -> list[str]:
    """Forget all but the newest ``keep`` resumable checkpoints (and any step in
    ``protect``); returns the folders the caller should delete from disk."""
    rows = (
        await session.execute(
            select(col(Checkpoint.step), col(Checkpoint.path))
            .where(col(Checkpoint.run_id) == run_id, col(Checkpoint.is_final).is_(False))
            .order_by(col(Checkpoint.step).desc())
        )
    ).all()
    doomed = [r for r in rows[keep:] if r.step not in (protect or set())]
    if doomed:
        await session.execute(
            delete(Checkpoint).where(
                col(Checkpoint.run_id) == run_id,
                col(Checkpoint.step).in_([r.step for r in doomed]),
                col(Checkpoint.is_final).is_(False),
            )
        )
    return [r.path for r in doomed]


async def list_after(
    session: AsyncSession, run_id: uuid.UUID, *, after_step: int | None, limit: int
) -> list[Checkpoint]:
    """The run's checkpoints by step, after ``after_step`` (a page of ``limit`` rows)."""
    query = select(Checkpoint).where(col(Checkpoint.run_id) == run_id)
    if after_step is not None:
        query = query.where(col(Checkpoint.step) > after_step)
    query = query.order_by(col(Checkpoint.step)).limit(limit)
    return list((await session.execute(query)).scalars())
