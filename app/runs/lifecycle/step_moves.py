"""The training loop's per-step moves: a step's rows and the status move they allow, as one
:class:`~app.runs.lifecycle.state.Move` each, applied on a plain asyncpg connection.

The rollouts travel with the move out of ``collecting``, the rewards with the move out of
``scoring``, the metrics with the move back to ``collecting``. Each is one statement (the
trainer waits on none of them but shares the GIL with this thread: docs/benchmarks.md,
service vs script), fenced on the lease, renewing it, and checked against the state
machine's table by :func:`app.runs.lifecycle.state.apply` like every other move.
"""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg

from app.metrics.service import storable_values
from app.runs.lifecycle.fence import Fence
from app.runs.lifecycle.state import Hop, Move, Rows, apply, json_param
from app.runs.lifecycle.status import RunStatus as S

# The step's rollouts: $1 step, $2 the rows as JSON. A step redone after a crash
# overwrites its rows (unique on run, step, group, rollout).
_ROLLOUTS = """
    INSERT INTO trajectories (id, run_id, project_id, learning_key, step, group_index,
                              rollout_index, task_input_id, messages, reward, reward_breakdown,
                              metadata)
    SELECT gen_random_uuid(), moved.id, moved.project_id, moved.learning_key, $1, r.group_index,
           r.rollout_index, r.task_input_id, r.messages, r.reward,
           coalesce(r.breakdown, '{}'::jsonb), coalesce(r.metadata, '{}'::jsonb)
      FROM moved, jsonb_to_recordset(($2::text)::jsonb)
           AS r(group_index int, rollout_index int, task_input_id uuid, messages jsonb,
                metadata jsonb, reward float8, breakdown jsonb)
    ON CONFLICT (run_id, step, group_index, rollout_index) DO UPDATE
       SET task_input_id = EXCLUDED.task_input_id, messages = EXCLUDED.messages,
           metadata = EXCLUDED.metadata, reward = EXCLUDED.reward,
           reward_breakdown = EXCLUDED.reward_breakdown
"""

# The step's rewards, by group and rollout: $1 step, $2 the rewards as JSON.
_REWARDS = """
    UPDATE trajectories AS t
       SET reward = v.reward, reward_breakdown = coalesce(v.breakdown, '{}'::jsonb)
      FROM moved, jsonb_to_recordset(($2::text)::jsonb)
           AS v(group_index int, rollout_index int, reward float8, breakdown jsonb)
     WHERE t.run_id = moved.id AND t.step = $1
       AND t.group_index = v.group_index AND t.rollout_index = v.rollout_index
"""

# The step's metric values: $1 step, $2 {name: value} as JSON.
_METRICS = """
    INSERT INTO metric_points (run_id, step, name, value)
    SELECT moved.id, $1, m.key, m.value::float8
      FROM moved, jsonb_each(($2::text)::jsonb) AS m(key, value)
    ON CONFLICT (run_id, name, step) DO UPDATE SET value = EXCLUDED.value
"""


def _rows(sql: str, step: int, payload: Any) -> Rows:
    return Rows(sql, (step, json_param(payload)))


async def rollouts_collected(
    conn: asyncpg.Connection,
    run_id: uuid.UUID,
    fence: Fence,
    step: int,
    rollouts: list[dict[str, Any]],
    *,
    ttl_seconds: float,
    scored: bool = False,
) -> None:
    """Store the step's rollouts (``group_index``, ``rollout_index``, ``messages``,
    ``task_input_id``, ``metadata``; ``reward`` and ``breakdown`` when ``scored``) and move
    ``collecting`` → ``scoring``, or on through ``scoring`` to ``training`` when they come
    scored (both moves are logged)."""
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
    stored = f"step {step}: {len(rollouts)} rollouts stored; scoring"
    trained = f"step {step}: rewards stored; training"
    await apply(
        conn,
        Move(
            run_id,
            S.TRAINING if scored else S.SCORING,
            expected=S.COLLECTING,
            fence=fence,
            renew_lease=ttl_seconds,
            via=(Hop(S.SCORING, stored),) if scored else (),
            message=trained if scored else stored,
            rows=(_rows(_ROLLOUTS, step, rows),),
        ),
    )


async def rewards_scored(
    conn: asyncpg.Connection,
    run_id: uuid.UUID,
    fence: Fence,
    step: int,
    rewards: list[dict[str, Any]],
    *,
    ttl_seconds: float,
) -> None:
    """Attach ``reward`` and ``breakdown`` to the step's rows (by group and rollout) and move
    ``scoring`` → ``training``."""
    await apply(
        conn,
        Move(
            run_id,
            S.TRAINING,
            expected=S.SCORING,
            fence=fence,
            renew_lease=ttl_seconds,
            message=f"step {step}: rewards stored; training",
            rows=(_rows(_REWARDS, step, rewards),),
        ),
    )


async def step_finished(
    conn: asyncpg.Connection,
    run_id: uuid.UUID,
    fence: Fence,
    step: int,
    epoch: int,
    *,
    metrics: dict[str, float],
    summary: dict[str, Any],
    last: bool,
    event: str,
    ttl_seconds: float,
) -> None:
    """Record the step's metric values and the run's progress (``step``, ``epoch``, the
    summary); move ``training`` → ``collecting`` for the next step, or stay in ``training``
    after the last one (what comes next is the final model, then ``completed``)."""
    step_event = {
        "type": "step",
        "message": event,
        "data": {
            "step": step,
            "reward_mean": metrics.get("reward_mean"),
            "loss": metrics.get("loss"),
        },
    }
    await apply(
        conn,
        Move(
            run_id,
            S.TRAINING if last else S.COLLECTING,
            expected=S.TRAINING,
            stay=last,
            fence=fence,
            renew_lease=ttl_seconds,
            message=None if last else f"step {step + 1}: collecting rollouts",
            data=None if last else {"step": step + 1},
            values={"step": step, "epoch": epoch, "metrics": summary},
            events=(step_event,),
            rows=(_rows(_METRICS, step, storable_values(metrics)),),
        ),
    )
