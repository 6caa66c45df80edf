"""Hand-written SQL for the two hottest run statements, on a plain asyncpg connection.

Creating a run is one statement: the run, its inline inputs and its first event, all
atomic; the caller wakes the reconciler once it committed (``DueBell`` in
app/runs/lifecycle/dispatch.py: a NOTIFY in the statement would make creates commit one at
a time). A run that names a dataset has a sibling statement of the same shape that copies
the dataset's rows (``INSERT … SELECT``) instead of unpacking inline inputs.

With a cap on a project's active runs, the create runs in a transaction that first takes the
project's advisory lock and then counts its active runs: creates in one project queue on the
lock, and each count (a statement of its own, so its snapshot is taken after the lock is
held) sees every run committed before it, so concurrent creates cannot overshoot the cap.
"""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg

from app.core.domain import Conflict, InvalidInput, LimitReached, NotFound
from app.core.errors import UNKNOWN_REFERENCE
from app.events.service import insert_events
from app.runs.lifecycle.status import TERMINAL, RunStatus
from app.runs.schemas import RunPublic
from app.runs.spec.body import RunCreate

PUBLIC_COLUMNS = ", ".join(RunPublic.model_fields)

# Every column a new run is given, with what it holds unless the statement says otherwise
# (None: the statement must say). The one column list of the API's two creates and of the
# training-data import.
_NEW_RUN: dict[str, str | None] = {
    "id": None,
    "project_id": None,
    "status": "'pending'",
    "model_name": None,
    "trained_model_name": "NULL",
    "task_description": None,
    "num_examples": None,
    "rollouts_per_group": None,
    "learning_rate": None,
    "num_epochs": None,
    "max_steps": "NULL",
    "system_prompt": "NULL",
    "learning_key": "NULL",
    "reward": None,
    "grpo": None,
    "config": None,
    "generator": "NULL",
    "environment": "NULL",
    "sft": "NULL",
    "dataset_id": "NULL",
    "parent_run_id": "NULL",
    "parent_step": "NULL",
    "teacher": "NULL",
    "step": "0",
    "epoch": "0",
    "version": "1",
    "attempt": "0",
    "cancel_requested": "false",
    "pause_requested": "false",
    "dispatched_at": "NULL",
    "completed_at": "NULL",
}


def insert_run_sql(values: dict[str, str], *, select_from: str | None = None) -> str:
    """``INSERT INTO runs`` of one new run. ``values`` maps columns to their SQL (``"$3"``,
    ``"now()"``); the rest take :data:`_NEW_RUN`'s. With ``select_from`` the row is
    ``SELECT``-ed from that source (a CTE) instead of given as ``VALUES``."""
    unknown = values.keys() - _NEW_RUN.keys()
    exprs = {**_NEW_RUN, **values}
    missing = [column for column, sql in exprs.items() if sql is None]
    if unknown or missing:
        raise ValueError(f"run insert: unknown columns {unknown}, missing {missing}")
    columns = ", ".join(exprs)
    row = ", ".join(str(sql) for sql in exprs.values())
    if select_from is not None:
        return f"INSERT INTO runs ({columns}) SELECT {row} FROM {select_from}"
    return f"INSERT INTO runs ({columns}) VALUES ({row})"


_CREATE_VALUES = {
    "id": "$1",
    "project_id": "$2",
    "model_name": "$3",
    "trained_model_name": "$4",
    "task_description": "$5",
    "rollouts_per_group": "$6",
    "learning_rate": "$7",
    "num_epochs": "$8",
    "max_steps": "$9",
    "system_prompt": "$10",
    "learning_key": "$11",
    "reward": "$12",
    "grpo": "$13",
    "config": "$14",
    "environment": "$15",
    "sft": "$16",
    "parent_run_id": "$17",
    "parent_step": "$18",
    "teacher": "$19",
}
_INSERT_INLINE = insert_run_sql({**_CREATE_VALUES, "num_examples": "$20", "generator": "$21"})
_INSERT_FROM_DATASET = insert_run_sql(
    {**_CREATE_VALUES, "num_examples": "ds.num_train_rows", "dataset_id": "ds.id"},
    select_from="ds",
)

# A create's first event. The statement inserts the run itself, so no other transaction can
# see the row, let alone append to its log, before this one commits: the row lock the event
# writer requires (app/events/service.py) is held by construction.
_CREATED_EVENT = insert_events("VALUES ($1, 'created', 'info', 'run created', $23::jsonb)")
_CREATED_FROM_DATASET_EVENT = insert_events(
    """SELECT run.id, 'created', 'info', 'run created',
        jsonb_build_object('dataset_id', ds.id, 'dataset_inputs', ds.num_rows)
    FROM run CROSS JOIN ds"""
)

_CREATE = f"""
WITH run AS (
    {_INSERT_INLINE}
    RETURNING {PUBLIC_COLUMNS}
), inputs AS (
    INSERT INTO task_inputs (id, run_id, index, input_text, context, split)
    SELECT gen_random_uuid(), $1, i.index, i.input_text, i.context, i.split
    FROM jsonb_to_recordset($22::jsonb) AS i(index int, input_text text, context jsonb, split text)
), event AS (
    {_CREATED_EVENT}
)
SELECT * FROM run
"""

# The dataset is looked up in the statement itself: another project's dataset, or an unknown
# one, makes ``ds`` empty, so nothing is inserted and no row comes back.
_CREATE_FROM_DATASET = f"""
WITH ds AS (
    SELECT id, num_rows, num_train_rows FROM datasets WHERE id = $20 AND project_id = $2
        AND num_train_rows > 0
), run AS (
    {_INSERT_FROM_DATASET}
    RETURNING {PUBLIC_COLUMNS}
), inputs AS (
    INSERT INTO task_inputs (id, run_id, index, input_text, context, split)
    SELECT gen_random_uuid(), run.id, r.index, r.input_text, r.context, r.split
    FROM run JOIN dataset_rows r ON r.dataset_id = run.dataset_id
), event AS (
    {_CREATED_FROM_DATASET_EVENT}
)
SELECT * FROM run
"""

_DATASET_TRAIN_ROWS = "SELECT num_train_rows FROM datasets WHERE id = $1 AND project_id = $2"

_GET = f"SELECT {PUBLIC_COLUMNS} FROM runs WHERE id = $1 AND project_id = $2"

# Advisory locks are keyed (class, object): this class is "a project's run creation", the
# object the project id's first four bytes. A collision only makes two projects' creates
# queue on one lock.
_CREATE_LOCK_CLASS = 0x74790001
_LOCK_PROJECT = "SELECT pg_advisory_xact_lock($1::int4, $2::int4)"
_ACTIVE_STATUSES = [s.value for s in RunStatus if s not in TERMINAL]
# A run whose cancel was requested is on its way out (within a heartbeat): it frees its slot
# at once, so "cancel one" works as the 429 says. The LIMIT bounds the count at the cap,
# whatever the project's history (ix_runs_project_status_created serves it).
_COUNT_ACTIVE = """
SELECT count(*) FROM (
    SELECT 1 FROM runs
    WHERE project_id = $1 AND status = ANY($2::text[]) AND NOT cancel_requested
    LIMIT $3
) active
"""


class ActiveRunLimit(LimitReached):
    code = "active-run-limit"
    title = "Too many active runs"

    def __init__(self, active: int, limit: int) -> None:
        super().__init__(
            f"This project has {active} active runs and the limit is {limit}; cancel one "
            "or wait for one to finish.",
            active_runs=active,
            limit=limit,
        )


class UnusableDataset(InvalidInput):
    title = "Unusable dataset"

    def __init__(self, detail: str, *, unknown: bool = False) -> None:
        super().__init__(
            detail, field="body.dataset_id", error_type=UNKNOWN_REFERENCE if unknown else None
        )


class CheckpointGone(Conflict):
    code = "checkpoint-gone"
    title = "No such checkpoint"

    def __init__(self, run_id: uuid.UUID, step: int, steps: list[int]) -> None:
        have = ", ".join(map(str, steps)) if steps else "none"
        super().__init__(
            f"Run {run_id} has no checkpoint at step {step} (pruned, or never written); its "
            f"checkpoints: {have}."
        )
        self.steps = steps

    def details(self) -> dict[str, Any]:
        return {"field": "body.from_checkpoint.step", "checkpoint_steps": self.steps}


# The parent run (this project's) and the steps of its checkpoints, resumable and final.
_PARENT = """
SELECT p.model_name,
       coalesce(array_agg(DISTINCT c.step ORDER BY c.step)
                FILTER (WHERE c.step IS NOT NULL), '{}') AS steps
  FROM runs AS p LEFT JOIN checkpoints AS c ON c.run_id = p.id
 WHERE p.id = $1 AND p.project_id = $2
 GROUP BY p.id
"""


async def check_parent(conn: asyncpg.Connection, project_id: uuid.UUID, body: RunCreate) -> None:
    """A fork's checkpoint must be this project's and exist: another project's run is a 404,
    a missing step a 409 naming the steps there are, another base model a 422."""
    parent = body.from_checkpoint
    if parent is None:
        return
    row = await conn.fetchrow(_PARENT, parent.run_id, project_id)
    if row is None:
        raise NotFound("Run", f"Run {parent.run_id} (body.from_checkpoint.run_id) not found.")
    if parent.step not in row["steps"]:
        raise CheckpointGone(parent.run_id, parent.step, list(row["steps"]))
    if row["model_name"] != body.model_name:
        raise InvalidInput(
            f"The checkpoint is of a run of {row['model_name']!r}: a fork trains that model, "
            "so model_name must name it too.",
            field="body.model_name",
        )


async def _check_active_runs(conn: asyncpg.Connection, project_id: uuid.UUID, limit: int) -> None:
    """Hold the project's create lock until the transaction ends; 429 if at the cap."""
    object_id = int.from_bytes(project_id.bytes[:4], "big", signed=True)
    await conn.execute(_LOCK_PROJECT, _CREATE_LOCK_CLASS, object_id)
    active = await conn.fetchval(_COUNT_ACTIVE, project_id, _ACTIVE_STATUSES, limit)
    if active >= limit:
        raise ActiveRunLimit(active, limit)


async def insert_run(
    conn: asyncpg.Connection,
    project_id: uuid.UUID,
    body: RunCreate,
    *,
    max_active: int = 0,
) -> dict[str, Any]:
    """Insert the run, its inputs and its "created" event; it is due once committed.

    With ``body.dataset_id`` the inputs are the dataset's rows; a dataset this project cannot
    see, or one without train rows, is a 422 naming ``body.dataset_id``. With ``max_active``
    (0: no cap) a project that already has that many active runs gets
    :class:`ActiveRunLimit` (429) and nothing is inserted.
    """
    if max_active > 0:
        # The count must be read committed: a snapshot older than the lock would miss runs
        # committed while this request waited for it.
        if conn.is_in_transaction():
            await _check_active_runs(conn, project_id, max_active)
            return await _insert_run(conn, project_id, body)
        async with conn.transaction(isolation="read_committed"):
            await _check_active_runs(conn, project_id, max_active)
            return await _insert_run(conn, project_id, body)
    return await _insert_run(conn, project_id, body)


def _run_values(run_id: uuid.UUID, project_id: uuid.UUID, body: RunCreate) -> tuple[Any, ...]:
    """Parameters $1..$19 of both creates (:data:`_CREATE_VALUES`)."""
    return (
        run_id,
        project_id,
        body.model_name,
        body.trained_model_name,
        body.task_description,
        body.rollouts_per_group,
        body.learning_rate,
        body.num_epochs,
        body.max_steps,
        body.system_prompt,
        body.learning_key,
        body.reward.model_dump(mode="json"),
        body.grpo.model_dump(mode="json"),
        body.config,
        body.environment.model_dump(mode="json") if body.environment else None,
        body.sft.model_dump(mode="json") if body.sft else None,
        body.from_checkpoint.run_id if body.from_checkpoint else None,
        body.from_checkpoint.step if body.from_checkpoint else None,
        body.teacher.model_dump(mode="json") if body.teacher else None,
    )


async def _insert_run(
    conn: asyncpg.Connection, project_id: uuid.UUID, body: RunCreate
) -> dict[str, Any]:
    await check_parent(conn, project_id, body)
    run_id = uuid.uuid4()
    if body.dataset_id is not None:
        return await _insert_run_from_dataset(conn, project_id, run_id, body, body.dataset_id)
    inputs = [
        {"index": i, **item.model_dump(mode="json")} for i, item in enumerate(body.inputs or [])
    ]
    row = await conn.fetchrow(
        _CREATE,
        *_run_values(run_id, project_id, body),
        sum(1 for i in inputs if i["split"] == "train") if inputs else body.num_examples,
        body.generator.model_dump(mode="json") if body.generator else None,
        inputs,
        {"inline_inputs": len(inputs)},
    )
    assert row is not None
    return dict(row)


async def _insert_run_from_dataset(
    conn: asyncpg.Connection,
    project_id: uuid.UUID,
    run_id: uuid.UUID,
    body: RunCreate,
    dataset_id: uuid.UUID,
) -> dict[str, Any]:
    row = await conn.fetchrow(
        _CREATE_FROM_DATASET, *_run_values(run_id, project_id, body), dataset_id
    )
    if row is None:
        train_rows = await conn.fetchval(_DATASET_TRAIN_ROWS, dataset_id, project_id)
        if train_rows is None:
            raise UnusableDataset(f"Dataset {dataset_id} not found.", unknown=True)
        raise UnusableDataset(f"Dataset {dataset_id} has no train rows to train on.")
    return dict(row)


async def fetch_run(
    conn: asyncpg.Connection, project_id: uuid.UUID, run_id: uuid.UUID
) -> dict[str, Any] | None:
    row = await conn.fetchrow(_GET, run_id, project_id)
    return dict(row) if row is not None else None
