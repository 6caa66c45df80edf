"""Uploaded datasets of training inputs and their rows.

A dataset never changes once stored: runs that name one copy its rows into their own
``task_inputs`` when they are created, so later runs and earlier ones never share rows.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, CheckConstraint, Column, ForeignKey, Index, String, Text, Uuid
from sqlmodel import Field, SQLModel

from app.core.columns import jsonb, timestamp


class Dataset(SQLModel, table=True):
    __tablename__ = "datasets"
    # GET /datasets: newest first within a project.
    __table_args__ = (Index("ix_datasets_project_created", "project_id", "created_at", "id"),)

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    project_id: uuid.UUID = Field(
        sa_column=Column(Uuid, ForeignKey("projects.id", ondelete="CASCADE"), nullable=False)
    )
    name: str | None = Field(default=None, max_length=200)
    num_rows: int
    num_train_rows: int
    num_validation_rows: int
    size_bytes: int = Field(sa_column=Column(BigInteger, nullable=False))  # of the file
    sha256: str = Field(max_length=64, description="Hex SHA-256 of the uploaded file.")
    created_at: datetime | None = Field(default=None, sa_column=timestamp())


class DatasetRow(SQLModel, table=True):
    """One non-blank line of the uploaded file; ``index`` counts from 0 in file order."""

    __tablename__ = "dataset_rows"
    __table_args__ = (
        CheckConstraint("split IN ('train', 'validation')", name="ck_dataset_rows_split"),
        # GET /datasets/{id}/rows?split=: a sparse split pages without scanning the other.
        Index("ix_dataset_rows_split", "dataset_id", "split", "index"),
    )

    dataset_id: uuid.UUID = Field(
        sa_column=Column(
            Uuid, ForeignKey("datasets.id", ondelete="CASCADE"), primary_key=True, nullable=False
        )
    )
    index: int = Field(primary_key=True)
    input_text: str = Field(sa_column=Column(Text, nullable=False))
    context: dict[str, Any] | None = Field(
        default=None, sa_column=jsonb(nullable=True, default=None)
    )
    split: str = Field(default="train", sa_column=Column(String(16), nullable=False))
