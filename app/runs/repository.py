"""Hand-written SQL for the two hottest run statements, on a plain asyncpg connection.

Creating a run is one statement: the run, its inline inputs, its first event and the
``pg_notify`` that wakes the reconciler, all atomic and all delivered only on commit. A run
that names a dataset has a sibling statement of the same shape that copies the dataset's
rows (``INSERT … SELECT``) instead of unpacking inline inputs.
"""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg

from app.core.errors import Problem
from app.runs.dispatch import DUE_CHANNEL
from app.runs.schemas import RunCreate, RunPublic

PUBLIC_COLUMNS = ", ".join(RunPublic.model_fields)

_CREATE = f"""
WITH run AS (
    INSERT INTO runs (
        id, project_id, status, model_name, trained_model_name, task_description,
        num_examples, rollouts_per_group, learning_rate, num_epochs, max_steps,
        system_prompt, learning_key, reward, grpo, config, generator,
        step, epoch, version, attempt, cancel_requested, pause_requested
    )
    VALUES (
        $1, $2, 'pending', $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $18,
        0, 0, 1, 0, false, false
    )
    RETURNING {PUBLIC_COLUMNS}
), inputs AS (
    INSERT INTO task_inputs (id, run_id, index, input_text, context, split)
    SELECT gen_random_uuid(), $1, i.index, i.input_text, i.context, i.split
    FROM jsonb_to_recordset($16::jsonb) AS i(index int, input_text text, context jsonb, split text)
), event AS (
    INSERT INTO run_events (run_id, type, level, message, data)
    VALUES ($1, 'created', 'info', 'run created', $17::jsonb)
)
SELECT run.*, pg_notify('{DUE_CHANNEL}', $1::text) AS notified FROM run
"""

# The dataset is looked up in the statement itself: another project's dataset, or an unknown
# one, makes ``ds`` empty, so nothing is inserted and no row comes back.
_CREATE_FROM_DATASET = f"""
WITH ds AS (
    SELECT id, num_rows, num_train_rows FROM datasets WHERE id = $15 AND project_id = $2
        AND num_train_rows > 0
), run AS (
    INSERT INTO runs (
        id, project_id, status, model_name, trained_model_name, task_description,
        num_examples, rollouts_per_group, learning_rate, num_epochs, max_steps,
        system_prompt, learning_key, reward, grpo, config, dataset_id,
        step, epoch, version, attempt, cancel_requested, pause_requested
    )
    SELECT
        $1, $2, 'pending', $3, $4, $5, ds.num_train_rows, $6, $7, $8, $9, $10, $11, $12, $13,
        $14, ds.id, 0, 0, 1, 0, false, false
    FROM ds
    RETURNING {PUBLIC_COLUMNS}
), inputs AS (
    INSERT INTO task_inputs (id, run_id, index, input_text, context, split)
    SELECT gen_random_uuid(), run.id, r.index, r.input_text, r.context, r.split
    FROM run JOIN dataset_rows r ON r.dataset_id = run.dataset_id
), event AS (
    INSERT INTO run_events (run_id, type, level, message, data)
    SELECT run.id, 'created', 'info', 'run created',
        jsonb_build_object('dataset_id', ds.id, 'dataset_inputs', ds.num_rows)
    FROM run CROSS JOIN ds
)
SELECT run.*, pg_notify('{DUE_CHANNEL}', $1::text) AS notified FROM run
"""

_DATASET_TRAIN_ROWS = "SELECT num_train_rows FROM datasets WHERE id = $1 AND project_id = $2"

_GET = f"SELECT {PUBLIC_COLUMNS} FROM runs WHERE id = $1 AND project_id = $2"


async def insert_run(
    conn: asyncpg.Connection, project_id: uuid.UUID, body: RunCreate
) -> dict[str, Any]:
    """Insert the run, its inputs and its "created" event; it is due once committed.

    With ``body.dataset_id`` the inputs are the dataset's rows; a dataset this project cannot
    see, or one without train rows, is a 422 naming ``body.dataset_id``.
    """
    run_id = uuid.uuid4()
    if body.dataset_id is not None:
        return await _insert_run_from_dataset(conn, project_id, run_id, body, body.dataset_id)
    inputs = [
        {"index": i, **item.model_dump(mode="json")} for i, item in enumerate(body.inputs or [])
    ]
    row = await conn.fetchrow(
        _CREATE,
        run_id,
        project_id,
        body.model_name,
        body.trained_model_name,
        body.task_description,
        sum(1 for i in inputs if i["split"] == "train") if inputs else body.num_examples,
        body.rollouts_per_group,
        body.learning_rate,
        body.num_epochs,
        body.max_steps,
        body.system_prompt,
        body.learning_key,
        body.reward.model_dump(mode="json"),
        body.grpo.model_dump(mode="json"),
        body.config,
        inputs,
        {"inline_inputs": len(inputs)},
        body.generator.model_dump(mode="json") if body.generator else None,
    )
    assert row is not None
    run = dict(row)
    del run["notified"]
    return run


async def _insert_run_from_dataset(
    conn: asyncpg.Connection,
    project_id: uuid.UUID,
    run_id: uuid.UUID,
    body: RunCreate,
    dataset_id: uuid.UUID,
) -> dict[str, Any]:
    row = await conn.fetchrow(
        _CREATE_FROM_DATASET,
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
        dataset_id,
    )
    if row is None:
        train_rows = await conn.fetchval(_DATASET_TRAIN_ROWS, dataset_id, project_id)
        detail = (
            f"Dataset {dataset_id} not found."
            if train_rows is None
            else f"Dataset {dataset_id} has no train rows to train on."
        )
        raise Problem(422, "Unusable dataset", detail, field="body.dataset_id")
    run = dict(row)
    del run["notified"]
    return run


async def fetch_run(
    conn: asyncpg.Connection, project_id: uuid.UUID, run_id: uuid.UUID
) -> dict[str, Any] | None:
    row = await conn.fetchrow(_GET, run_id, project_id)
    return dict(row) if row is not None else None
