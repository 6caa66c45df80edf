"""Writing trajectories and their rewards: the pipeline's own write path, batched.

Rows are unique on (run, step, group, rollout); a step redone after a crash overwrites its
rows, so a resumed run has neither duplicates nor holes.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession


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


_UPSERT_ROLLOUTS = text(
    """
    INSERT INTO trajectories (id, run_id, project_id, learning_key, step, group_index,
                              rollout_index, task_input_id, messages, reward, reward_breakdown,
                              metadata)
    SELECT gen_random_uuid(), run.id, run.project_id, run.learning_key, :step, r.group_index,
           r.rollout_index, r.task_input_id, r.messages, r.reward,
           coalesce(r.breakdown, '{}'::jsonb), coalesce(r.metadata, '{}'::jsonb)
      FROM runs AS run,
           jsonb_to_recordset(CAST(:rows AS jsonb))
           AS r(group_index int, rollout_index int, task_input_id uuid, messages jsonb,
                metadata jsonb, reward float8, breakdown jsonb)
     WHERE run.id = :run_id
    ON CONFLICT (run_id, step, group_index, rollout_index) DO UPDATE
       SET task_input_id = EXCLUDED.task_input_id, messages = EXCLUDED.messages,
           metadata = EXCLUDED.metadata, reward = EXCLUDED.reward,
           reward_breakdown = EXCLUDED.reward_breakdown
    """
)


async def upsert_rollouts(
    session: AsyncSession, run_id: uuid.UUID, step: int, rollouts: list[dict[str, Any]]
) -> None:
    """Store one step's rollouts (``group_index``, ``rollout_index``, ``messages``,
    ``task_input_id``, ``metadata``, and ``reward`` and ``breakdown`` when already scored),
    replacing any earlier attempt at the same step.

    One statement with the rows as a single JSON parameter: a step's worth of rows costs one
    bind, not one per value (the training loop calls this every step). The run's project and
    learning key are copied onto each row in the same statement."""
    if rollouts:
        rows = [
            {
                "group_index": r["group_index"],
                "rollout_index": r["rollout_index"],
                "task_input_id": str(r["task_input_id"]) if r.get("task_input_id") else None,
                "messages": r["messages"],
                "metadata": r.get("metadata", {}),
                "reward": r.get("reward"),
                "breakdown": r.get("breakdown", {}),
            }
            for r in rollouts
        ]
        await session.execute(
            _UPSERT_ROLLOUTS,
            {"rows": json.dumps(storable(rows)), "run_id": run_id, "step": step},
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
    if rewards:
        await session.execute(
            _SET_REWARDS,
            {"rows": json.dumps(storable(rewards)), "run_id": run_id, "step": step},
        )
