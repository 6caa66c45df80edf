"""Writing trajectories and their rewards: the pipeline's own write path, batched.

Rows are unique on (run, step, group, rollout); a step redone after a crash overwrites its
rows, so a resumed run has neither duplicates nor holes.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from app.trajectories.models import Trajectory


def storable(value: Any) -> Any:
    """``value`` with NUL characters replaced: PostgreSQL's JSONB and text refuse them, and a
    young policy emits them happily."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, list):
        return [storable(v) for v in value]
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    return value


async def upsert_rollouts(
    session: AsyncSession, run_id: uuid.UUID, step: int, rollouts: list[dict[str, Any]]
) -> None:
    """Store one step's rollouts (``group_index``, ``rollout_index``, ``messages``,
    ``task_input_id``, ``metadata``), replacing any earlier attempt at the same step."""
    if not rollouts:
        return
    rows = [
        {
            "run_id": run_id,
            "step": step,
            "group_index": r["group_index"],
            "rollout_index": r["rollout_index"],
            "task_input_id": r.get("task_input_id"),
            "messages": storable(r["messages"]),
            "meta": storable(r.get("metadata", {})),
            "reward": None,
            "reward_breakdown": {},
        }
        for r in rollouts
    ]
    stmt = insert(Trajectory).values(rows)
    await session.execute(
        stmt.on_conflict_do_update(
            index_elements=["run_id", "step", "group_index", "rollout_index"],
            set_={
                "task_input_id": stmt.excluded.task_input_id,
                "messages": stmt.excluded.messages,
                "metadata": stmt.excluded.metadata,
                "reward": None,
                "reward_breakdown": {},
            },
        )
    )


_SET_REWARDS = text(
    """
    UPDATE trajectories AS t
       SET reward = v.reward, reward_breakdown = coalesce(v.breakdown, '{}'::jsonb)
      FROM jsonb_to_recordset(CAST(:rows AS jsonb))
           AS v(group_index int, rollout_index int, reward float8, breakdown jsonb)
     WHERE t.run_id = :run_id AND t.step = :step
       AND t.group_index = v.group_index AND t.rollout_index = v.rollout_index
    """
)


async def set_rewards(
    session: AsyncSession, run_id: uuid.UUID, step: int, rewards: list[dict[str, Any]]
) -> None:
    """Attach ``reward`` and ``breakdown`` to the step's rows (by group and rollout)."""
    import json

    if rewards:
        await session.execute(
            _SET_REWARDS,
            {"rows": json.dumps(storable(rewards)), "run_id": run_id, "step": step},
        )
