"""Storing and reading datasets. Nothing here commits except :func:`insert_dataset`, which
owns its transaction on a plain asyncpg connection (COPY has no ORM path)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import asyncpg
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlmodel import col

from app.core.domain import NotFound
from app.datasets.models import Dataset, DatasetRow
from app.datasets.upload import JsonlReader

_COPY_CHUNK = 1024 * 1024
_ROW_COLUMNS = ["dataset_id", "index", "input_text", "context", "split"]

_INSERT = """
INSERT INTO datasets (
    id, project_id, name, num_rows, num_train_rows, num_validation_rows, size_bytes, sha256
)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
RETURNING id, project_id, name, num_rows, num_train_rows, num_validation_rows, size_bytes,
    sha256, created_at
"""


async def _chunks(data: bytearray) -> AsyncIterator[bytes]:
    view = memoryview(data)
    try:
        for start in range(0, len(view), _COPY_CHUNK):
            yield bytes(view[start : start + _COPY_CHUNK])
    finally:
        view.release()


async def insert_dataset(
    conn: asyncpg.Connection,
    project_id: uuid.UUID,
    dataset_id: uuid.UUID,
    name: str | None,
    reader: JsonlReader,
) -> dict[str, Any]:
    """The dataset and all its rows (one COPY), committed together or not at all."""
    async with conn.transaction():
        row = await conn.fetchrow(
            _INSERT,
            dataset_id,
            project_id,
            name,
            reader.num_rows,
            reader.num_train_rows,
            reader.num_validation_rows,
            reader.size,
            reader.sha256,
        )
        await conn.copy_to_table(
            "dataset_rows", source=_chunks(reader.copy), columns=_ROW_COLUMNS, format="text"
        )
    assert row is not None
    return dict(row)


async def get_dataset(
    session: AsyncSession, project_id: uuid.UUID, dataset_id: uuid.UUID
) -> Dataset:
    """The dataset, if it belongs to the project; another project's is simply not found."""
    dataset = (
        await session.execute(
            select(Dataset).where(
                col(Dataset.id) == dataset_id, col(Dataset.project_id) == project_id
            )
        )
    ).scalar_one_or_none()
    if dataset is None:
        raise NotFound("Dataset")
    return dataset


async def ensure_dataset_visible(
    session: AsyncSession, project_id: uuid.UUID, dataset_id: uuid.UUID
) -> None:
    found = await session.scalar(
        select(col(Dataset.id)).where(
            col(Dataset.id) == dataset_id, col(Dataset.project_id) == project_id
        )
    )
    if found is None:
        raise NotFound("Dataset")


async def list_datasets(
    session: AsyncSession,
    project_id: uuid.UUID,
    *,
    limit: int,
    after: tuple[datetime, uuid.UUID] | None,
) -> list[Dataset]:
    """Newest first, keyset on (created_at, id); returns up to ``limit + 1`` rows."""
    query = select(Dataset).where(col(Dataset.project_id) == project_id)
    if after is not None:
        query = query.where(func.row(Dataset.created_at, Dataset.id) < func.row(*after))
    query = query.order_by(col(Dataset.created_at).desc(), col(Dataset.id).desc()).limit(limit + 1)
    return list((await session.execute(query)).scalars())


async def list_rows(
    session: AsyncSession,
    dataset_id: uuid.UUID,
    *,
    split: str | None,
    limit: int,
    after: int | None,
) -> list[DatasetRow]:
    """By index; returns up to ``limit + 1`` rows."""
    query = select(DatasetRow).where(col(DatasetRow.dataset_id) == dataset_id)
    if split is not None:
        query = query.where(col(DatasetRow.split) == split)
    if after is not None:
        query = query.where(col(DatasetRow.index) > after)
    query = query.order_by(col(DatasetRow.index)).limit(limit + 1)
    return list((await session.execute(query)).scalars())
