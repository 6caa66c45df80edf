"""The training loop's per-step moves, one statement each on a plain asyncpg connection.

A step's rows and the status move they allow travel together: the rollouts with the move
out of ``collecting``, the rewards with the move out of ``scoring``, the metrics with the
move back to ``collecting``. :func:`app.runs.state.transition` does the same with a locked
read, a compare-and-set and an event insert, through SQLAlchemy; on a tiny model that
costs the trainer a tenth of its step time (the worker's Python shares the GIL with the
training thread). Here each move is one data-modifying CTE: the ``UPDATE`` of the run is
fenced on the lease (owner and attempt) and on the source status, renews the lease, and
holds the run's row lock before the events are numbered (event readers rely on that), so
the statement is atomic and the data is written only if the move is. When it is not, a
second read says why: :class:`~app.runs.state.LeaseLost` or
:class:`~app.runs.state.TransitionConflict`.

Only the moves below are made here, each checked against the state machine's table. The
connection must decode JSONB as Python objects (``app.core.pg.init_connection``).
"""

from __future__ import annotations

import math
import uuid
from typing import Any

import asyncpg

from app.metrics.service import storable_values
from app.runs.state import Fence, LeaseLost, TransitionConflict, can_transition
from app.runs.status import RunStatus as S

MOVES = {(S.COLLECTING, S.SCORING), (S.SCORING, S.TRAINING), (S.TRAINING, S.COLLECTING)}
assert all(can_transition(src, dst) for src, dst in MOVES), "step moves must be legal moves"

# $1 run, $2 owner, $3 attempt, $4 source status, $5 destination status, $6 lease seconds,
# $7 events: [{message, data}] in order (each a status event unless data says otherwise).
_MOVE = """
moved AS (
    UPDATE runs
       SET status = $5, version = version + 1, updated_at = now(),
           lease_expires_at = now() + make_interval(secs => $6){extra_sets}
     WHERE id = $1 AND lease_owner = $2 AND attempt = $3 AND status = $4
    RETURNING id, project_id, learning_key
), events AS (
    INSERT INTO run_events (run_id, type, level, message, data)
    SELECT moved.id, e.item ->> 'type', 'info', e.item ->> 'message', e.item -> 'data'
      FROM moved, jsonb_array_elements($7::jsonb) WITH ORDINALITY AS e(item, n)
     ORDER BY e.n
)"""

_ROLLOUT_COLUMNS = """
    INSERT INTO trajectories (id, run_id, project_id, learning_key, step, group_index,
                              rollout_index, task_input_id, messages, reward, reward_breakdown,
                              metadata)
    SELECT gen_random_uuid(), moved.id, moved.project_id, moved.learning_key, $8, r.group_index,
           r.rollout_index, r.task_input_id, r.messages, r.reward,
           coalesce(r.breakdown, '{}'::jsonb), coalesce(r.metadata, '{}'::jsonb)
      FROM moved, jsonb_to_recordset($9::jsonb)
           AS r(group_index int, rollout_index int, task_input_id uuid, messages jsonb,
                metadata jsonb, reward float8, breakdown jsonb)
    ON CONFLICT (run_id, step, group_index, rollout_index) DO UPDATE
       SET task_input_id = EXCLUDED.task_input_id, messages = EXCLUDED.messages,
           metadata = EXCLUDED.metadata, reward = EXCLUDED.reward,
           reward_breakdown = EXCLUDED.reward_breakdown
"""

_STORE_ROLLOUTS = f"""
WITH {_MOVE.format(extra_sets="")}, stored AS ({_ROLLOUT_COLUMNS})
SELECT count(*) FROM moved
"""

_STORE_REWARDS = f"""
WITH {_MOVE.format(extra_sets="")}, scored AS (
    UPDATE trajectories AS t
       SET reward = v.reward, reward_breakdown = coalesce(v.breakdown, '{{}}'::jsonb)
      FROM moved, jsonb_to_recordset($8::jsonb)
           AS v(group_index int, rollout_index int, reward float8, breakdown jsonb)
     WHERE t.run_id = moved.id AND t.step = $9
       AND t.group_index = v.group_index AND t.rollout_index = v.rollout_index
)
SELECT count(*) FROM moved
"""

_FINISH_STEP = f"""
WITH {_MOVE.format(extra_sets=", step = $8, epoch = $9, metrics = $10::jsonb")}, recorded AS (
    INSERT INTO metric_points (run_id, step, name, value)
    SELECT moved.id, $8, m.key, m.value::float8
      FROM moved, jsonb_each($11::jsonb) AS m(key, value)
    ON CONFLICT (run_id, name, step) DO UPDATE SET value = EXCLUDED.value
)
SELECT count(*) FROM moved
"""

_WHY = "SELECT status, lease_owner, attempt FROM runs WHERE id = $1"


def _status_event(src: S, dst: S, message: str, data: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "status",
        "message": message,
        "data": {"from": src.value, "to": dst.value, **data},
    }


def _jsonable(value: Any) -> Any:
    """``value`` as PostgreSQL's JSONB takes it (the connection's codec encodes it): NUL
    characters, which JSONB refuses and a young policy emits happily, become U+FFFD; NaN and
    infinities, which JSON lacks, become null."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {_jsonable(k): _jsonable(v) for k, v in value.items()}
    return value


async def _move(
    conn: asyncpg.Connection,
    sql: str,
    run_id: uuid.UUID,
    fence: Fence,
    src: S,
    dst: S,
    ttl_seconds: float,
    events: list[dict[str, Any]],
    *args: Any,
) -> None:
    moved = await conn.fetchval(
        sql,
        run_id,
        fence.owner,
        fence.attempt,
        src.value,
        dst.value,
        ttl_seconds,
        _jsonable(events),
        *args,
    )
    if moved:
        return
    row = await conn.fetchrow(_WHY, run_id)
    if row is None or (row["lease_owner"], row["attempt"]) != (fence.owner, fence.attempt):
        raise LeaseLost(run_id)
    current = S(row["status"])
    raise TransitionConflict(run_id, f"Run is {current.value}, not {src.value}.", current=current)


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
    ``collecting`` → ``scoring``, or on to ``training`` when they come scored (both moves
    are logged). A step redone after a crash overwrites its rows."""
    message = f"step {step}: {len(rollouts)} rollouts stored; scoring"
    events = [_status_event(S.COLLECTING, S.SCORING, message, {})]
    if scored:
        events.append(
            _status_event(S.SCORING, S.TRAINING, f"step {step}: rewards stored; training", {})
        )
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
    dst = S.TRAINING if scored else S.SCORING
    await _move(
        conn,
        _STORE_ROLLOUTS,
        run_id,
        fence,
        S.COLLECTING,
        dst,
        ttl_seconds,
        events,
        step,
        _jsonable(rows),
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
    events = [_status_event(S.SCORING, S.TRAINING, f"step {step}: rewards stored; training", {})]
    await _move(
        conn,
        _STORE_REWARDS,
        run_id,
        fence,
        S.SCORING,
        S.TRAINING,
        ttl_seconds,
        events,
        _jsonable(rewards),
        step,
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
    after the last one (what comes next is the checkpoint and the final model)."""
    events = []
    if not last:
        events.append(
            _status_event(
                S.TRAINING,
                S.COLLECTING,
                f"step {step + 1}: collecting rollouts",
                {"step": step + 1},
            )
        )
    reward = metrics.get("reward_mean")
    events.append(
        {
            "type": "step",
            "message": event,
            "data": {"step": step, "reward_mean": reward, "loss": metrics.get("loss")},
        }
    )
    values = storable_values(metrics)
    dst = S.TRAINING if last else S.COLLECTING
    await _move(
        conn,
        _FINISH_STEP,
        run_id,
        fence,
        S.TRAINING,
        dst,
        ttl_seconds,
        events,
        step,
        epoch,
        _jsonable(summary),
        _jsonable(values),
    )
