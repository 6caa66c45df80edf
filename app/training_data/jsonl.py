"""Trajectories to JSON Lines and back.

Export streams: PostgreSQL renders each line and batches go straight to the file, so memory
stays flat at any size. Import is all or nothing: every line is validated before anything is
written, then the runs and rows go in one transaction, so a bad line 9,999 leaves no trace of
lines 1–9,998. Messages are :class:`~app.trajectories.messages.TrajectoryMessage` (tool
calls and tool results included) and are stored with exactly the keys the file gives them,
so an export imported and exported again reads the same. Each run named in the file
(``run_id``) becomes a new ``completed`` run of the target project (its id is new: the file
may come from another installation); lines without a ``run_id`` share one run.
"""

from __future__ import annotations

import asyncio
import io
import json
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TextIO, Unpack

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from app.core.copy_format import NULL, copy_field
from app.core.storable import NulFreeStr, StorableObject
from app.events.service import insert_events
from app.runs.repository import insert_run_sql
from app.training_data import queries
from app.training_data.filters import Filters, TrainingDataError, check_limit, check_order
from app.training_data.library import Database, TrajectoryFilters, connect, run_sync, sync_database
from app.trajectories.messages import TrajectoryMessage, dump_messages

MAX_REPORTED_LINES = 10
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


# --- export -----------------------------------------------------------------------------


async def export_jsonl_async(
    db_url: Database,
    destination: str | Path | TextIO,
    *,
    include_messages: bool = True,
    include_metadata: bool = True,
    limit: int | None = None,
    order: str = "newest",
    batch_size: int = 2000,
    **filters: Unpack[TrajectoryFilters],
) -> int:
    """Write the matching trajectories to ``destination`` (a path or an open text file), one
    JSON object per line; returns how many were written."""
    f = Filters.build(**filters)
    checked_limit = check_limit("limit", limit)
    checked_order = check_order(order)
    size = check_limit("batch_size", batch_size, allow_none=False)
    assert size is not None
    if isinstance(destination, str | Path):
        out: TextIO = await asyncio.to_thread(Path(destination).open, "w", encoding="utf-8")
        owned = True
    else:
        out, owned = destination, False
    written = 0
    try:
        async with connect(db_url) as conn:
            async for chunk in queries.jsonl_chunks(
                conn,
                f,
                batch_size=size,
                include_messages=include_messages,
                include_metadata=include_metadata,
                order=checked_order,
                limit=checked_limit,
            ):
                await asyncio.to_thread(out.write, chunk)
                written += chunk.count("\n")
    finally:
        if owned:
            out.close()
    return written


def export_jsonl(
    db_url: str | None,
    destination: str | Path | TextIO,
    *,
    include_messages: bool = True,
    include_metadata: bool = True,
    limit: int | None = None,
    order: str = "newest",
    batch_size: int = 2000,
    **filters: Unpack[TrajectoryFilters],
) -> int:
    """Sync :func:`export_jsonl_async`."""
    db = sync_database(db_url)
    return run_sync(
        lambda: export_jsonl_async(
            db,
            destination,
            include_messages=include_messages,
            include_metadata=include_metadata,
            limit=limit,
            order=order,
            batch_size=batch_size,
            **filters,
        )
    )


# --- import -----------------------------------------------------------------------------


class TrajectoryLine(BaseModel):
    """One line of a trajectory JSONL file, as :func:`export_jsonl` writes them. ``id``,
    ``project_id`` and ``task_input_id`` are accepted and not kept: imported rows get new
    ids in the target project."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    id: uuid.UUID | None = None
    project_id: uuid.UUID | None = None
    task_input_id: uuid.UUID | None = None
    run_id: uuid.UUID | None = None
    learning_key: NulFreeStr | None = Field(default=None, min_length=1, max_length=200)
    step: int = Field(default=0, ge=0, le=10_000_000)
    group_index: int = Field(default=0, ge=0, le=100_000)
    rollout_index: int = Field(default=0, ge=0, le=100_000)
    messages: list[TrajectoryMessage] = Field(min_length=1, max_length=10_000)
    reward: float | None = None
    reward_breakdown: StorableObject = Field(default_factory=dict)
    metadata: StorableObject = Field(default_factory=dict)
    created_at: datetime | None = None

    @field_validator("created_at")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("created_at needs a time zone (e.g. 2026-11-30T09:00:00Z)")
        return value


@dataclass(frozen=True, slots=True)
class ImportResult:
    project_id: uuid.UUID
    run_ids: dict[str, uuid.UUID]  # source run id ("" for lines without one) → new run
    trajectories: int


class JsonlImportError(TrainingDataError):
    """A file that cannot be imported; ``lines`` are (line number, what is wrong)."""

    def __init__(self, lines: list[tuple[int, str]]) -> None:
        shown = "; ".join(f"line {n}: {msg}" for n, msg in lines)
        super().__init__("file", f"{len(lines)} bad line(s) (nothing imported): {shown}")
        self.lines = lines


def _read_lines(source: str | Path | TextIO | Iterable[str]) -> Iterable[str]:
    if isinstance(source, str | Path):
        with open(source, encoding="utf-8") as handle:
            yield from handle
    else:
        yield from source


def parse_lines(source: str | Path | TextIO | Iterable[str]) -> list[tuple[int, TrajectoryLine]]:
    """Every non-blank line, validated; raises :class:`JsonlImportError` naming the first bad
    lines (up to ten) after reading them all, so one pass shows what to fix."""
    parsed: list[tuple[int, TrajectoryLine]] = []
    bad: list[tuple[int, str]] = []
    seen: dict[tuple[uuid.UUID | None, int, int, int], int] = {}
    for number, raw in enumerate(_read_lines(source), start=1):
        if not raw.strip():
            continue
        try:
            line = TrajectoryLine.model_validate_json(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "line"
            bad.append((number, f"{where}: {first['msg']}"))
            continue
        key = (line.run_id, line.step, line.group_index, line.rollout_index)
        if key in seen:
            bad.append((number, f"repeats run/step/group/rollout of line {seen[key]}"))
            continue
        seen[key] = number
        parsed.append((number, line))
    if bad:
        raise JsonlImportError(bad[:MAX_REPORTED_LINES])
    if not parsed:
        raise TrainingDataError("file", "has no trajectories")
    return parsed


_INSERT_RUN = insert_run_sql(
    {
        "id": "$1",
        "project_id": "$2",
        "status": "'completed'",
        "model_name": "$3",
        "task_description": "$4",
        "num_examples": "0",
        "rollouts_per_group": "$5",
        "learning_rate": "0",
        "num_epochs": "1",
        "learning_key": "$6",
        "reward": "'{}'",
        "grpo": "'{}'",
        "config": "$7",
        "step": "$8",
        "dispatched_at": "now()",
        "completed_at": "now()",
    }
)
# The imported run and its one event, in one statement: inserting the run in it holds the
# row lock the event writer requires (app/events/service.py), since no other transaction
# can see the run before this one commits.
_IMPORT_RUN = f"""
WITH run AS (
    {_INSERT_RUN}
)
{insert_events("VALUES ($1, 'imported', 'info', $9, $10)")}
"""
# The columns an import (and the training-data benchmark's load) COPYs, in this order.
COPY_COLUMNS = (
    "id",
    "run_id",
    "project_id",
    "learning_key",
    "step",
    "group_index",
    "rollout_index",
    "messages",
    "reward",
    "reward_breakdown",
    "metadata",
    "created_at",
)


async def import_jsonl_async(
    db_url: Database,
    source: str | Path | TextIO | Iterable[str],
    *,
    project: str | uuid.UUID,
    learning_key: str | None = None,
    model_name: str = "imported",
) -> ImportResult:
    """Import a trajectory JSONL file into ``project`` (name or id). ``learning_key`` sets
    the key of every imported run, overriding the file's."""
    lines = parse_lines(source)
    f = Filters.build(projects=[str(project)], learning_key=learning_key)
    runs: dict[str, list[TrajectoryLine]] = {}
    for _, line in lines:
        runs.setdefault(str(line.run_id or ""), []).append(line)
    async with connect(db_url) as conn:
        (project_id,) = await queries.resolve_projects(conn, f) or ()
        new_ids = {source_id: uuid.uuid4() for source_id in runs}
        async with conn.transaction():
            for source_id, rows in runs.items():
                run_id = new_ids[source_id]
                key = learning_key or next((r.learning_key for r in rows if r.learning_key), None)
                await conn.execute(
                    _IMPORT_RUN,
                    run_id,
                    project_id,
                    model_name,
                    f"Imported trajectories (source run {source_id or 'unnamed'})",
                    max(r.rollout_index for r in rows) + 1,
                    key,
                    {"imported_from": source_id or None},
                    max(r.step for r in rows),
                    f"imported {len(rows)} trajectories",
                    {"source_run_id": source_id or None, "trajectories": len(rows)},
                )
                await conn.copy_to_table(
                    "trajectories",
                    source=_copy_stream(rows, run_id, project_id, key),
                    columns=COPY_COLUMNS,
                    format="text",
                )
    return ImportResult(project_id, new_ids, len(lines))


async def _copy_stream(
    rows: list[TrajectoryLine], run_id: uuid.UUID, project_id: uuid.UUID, key: str | None
) -> AsyncIterator[bytes]:
    buffer = io.StringIO()
    for row in rows:
        fields = (
            str(uuid.uuid4()),
            str(run_id),
            str(project_id),
            copy_field(key) if key is not None else NULL,
            str(row.step),
            str(row.group_index),
            str(row.rollout_index),
            copy_field(_JSON.encode(dump_messages(row.messages))),
            repr(row.reward) if row.reward is not None else NULL,
            copy_field(_JSON.encode(row.reward_breakdown)),
            copy_field(_JSON.encode(row.metadata)),
            row.created_at.isoformat() if row.created_at is not None else "now",
        )
        buffer.write("\t".join(fields) + "\n")
        if buffer.tell() > 1 << 20:
            yield buffer.getvalue().encode()
            buffer = io.StringIO()
    yield buffer.getvalue().encode()


def import_jsonl(
    db_url: str | None,
    source: str | Path | TextIO | Iterable[str],
    *,
    project: str | uuid.UUID,
    learning_key: str | None = None,
    model_name: str = "imported",
) -> ImportResult:
    """Sync :func:`import_jsonl_async`."""
    db = sync_database(db_url)
    return run_sync(
        lambda: import_jsonl_async(
            db, source, project=project, learning_key=learning_key, model_name=model_name
        )
    )
