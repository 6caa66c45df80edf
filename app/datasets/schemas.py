"""Response shapes for datasets. A dataset's lines are validated as the runs' inline
inputs are (:class:`app.runs.spec.body.InputItem`): one rule for both."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.core.pagination import Page


class DatasetPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: uuid.UUID
    project_id: uuid.UUID
    name: str | None = Field(description="The `name` given, else the uploaded file's name.")
    num_rows: int
    num_train_rows: int = Field(description="What num_examples is for a run of this dataset.")
    num_validation_rows: int
    size_bytes: int = Field(description="Bytes of the uploaded file.")
    sha256: str = Field(description="Hex SHA-256 of the uploaded file, to spot duplicates.")
    created_at: datetime


class DatasetsPage(Page[DatasetPublic]):
    """A page of DatasetPublic; pass ``next_cursor`` as ``after`` for the next."""


class DatasetRowPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    index: int = Field(description="0-based position among the file's non-blank lines.")
    input_text: str
    context: dict[str, Any] | None
    split: Literal["train", "validation"]


class DatasetRowsPage(Page[DatasetRowPublic]):
    """A page of DatasetRowPublic; pass ``next_cursor`` as ``after`` for the next."""
