"""The generated-ahead rollouts of an asynchronous run, on a plain asyncpg connection (the
worker's producer thread and the trainer's step boundaries write them, fenced on the
run's lease like every write of a worker)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import asyncpg
from sqlalchemy import delete
from sqlalchemy.ext.asyncio import AsyncSession

from app.rollouts.models import GeneratedRollouts
from app.runs.lifecycle.fence import Fence
from app.runs.lifecycle.state import LeaseLost

_FENCED = "SELECT 1 FROM runs WHERE id = $1 AND lease_owner = $2 AND attempt = $3"

# $4 step, $5 policy version, $6 how many rollouts, $7 the payload as JSON text. A step
# generated again (its row discarded or never committed) takes the one usable place.
_STORE = f"""
    INSERT INTO generated_rollouts (id, run_id, step, policy_version, rollouts, payload)
    SELECT gen_random_uuid(), $1, $4, $5, $6, ($7::text)::jsonb
     WHERE EXISTS ({_FENCED})
    ON CONFLICT (run_id, step) WHERE discarded IS NULL DO UPDATE
       SET policy_version = EXCLUDED.policy_version, rollouts = EXCLUDED.rollouts,
           payload = EXCLUDED.payload, created_at = now()
    RETURNING 1
"""

_USABLE = """
    SELECT id, step, policy_version, rollouts, payload::text AS payload
      FROM generated_rollouts
     WHERE run_id = $1 AND step > $2 AND discarded IS NULL
     ORDER BY step
"""

_DISCARD = f"""
    WITH fenced AS ({_FENCED})
    UPDATE generated_rollouts SET discarded = $5
     WHERE id = ANY($4::uuid[]) AND discarded IS NULL AND EXISTS (SELECT 1 FROM fenced)
"""


@dataclass(frozen=True)
class Generated:
    """A step's rollouts as stored: ``payload`` holds ``prompt_ids``, ``completion_ids``,
    ``logprobs`` and ``scored_ahead`` (reward and breakdown), one entry per rollout in the
    step's order; stored as jsonb takes it (a log-probability that was not finite is null)."""

    id: uuid.UUID
    step: int
    policy_version: int
    rollouts: int
    payload: dict[str, Any]


async def store(
    conn: asyncpg.Connection,
    run_id: uuid.UUID,
    fence: Fence,
    step: int,
    policy_version: int,
    rollouts: int,
    payload: str,
) -> None:
    """Keep step ``step``'s ``rollouts`` rollouts, ``payload`` as JSON text (made storable
    by ``json_param``: NUL characters, infinities); raises :class:`LeaseLost` when the
    worker no longer holds the run (nothing is written)."""
    stored = await conn.fetchval(
        _STORE, run_id, fence.owner, fence.attempt, step, policy_version, rollouts, payload
    )
    if stored is None:
        raise LeaseLost(run_id)


async def usable(conn: asyncpg.Connection, run_id: uuid.UUID, after: int) -> list[Generated]:
    """The run's stored, not discarded rollouts of the steps after ``after``, by step."""
    rows = await conn.fetch(_USABLE, run_id, after)
    return [
        Generated(r["id"], r["step"], r["policy_version"], r["rollouts"], json.loads(r["payload"]))
        for r in rows
    ]


async def discard(
    conn: asyncpg.Connection,
    run_id: uuid.UUID,
    fence: Fence,
    ids: list[uuid.UUID],
    reason: str,
) -> None:
    """Mark rows as not to be trained on, saying why (they stay, for the record)."""
    if ids:
        await conn.execute(_DISCARD, run_id, fence.owner, fence.attempt, ids, reason)


async def prune(session: AsyncSession, run_id: uuid.UUID, through: int) -> None:
    """Forget the trained rows of steps up to ``through``: a checkpoint there holds what
    they taught, and no resumed attempt goes back before it (their trajectories stay).
    Discarded rows stay, for the record of what a crash cost (at most ``max_staleness + 1``
    steps' each)."""
    rows = GeneratedRollouts
    await session.execute(
        delete(rows).where(
            rows.run_id == run_id,  # type: ignore[arg-type]
            rows.step <= through,  # type: ignore[arg-type]
            rows.discarded.is_(None),  # type: ignore[union-attr]
        )
    )
