from __future__ import annotations

import uuid
from datetime import datetime

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from app.core.pagination import Page
from app.core.storable import StoredObject
from app.trajectories.messages import ServedMessages


class TrajectoryPublic(BaseModel):
    """One rollout: the messages (system prompt, input, completion; an agent's episode adds
    its tool calls and their results), its reward with the breakdown and judges'
    explanations, and where it came from. ``messages`` is null when asked for without
    (``include_messages=false``); ``reward_breakdown`` and ``metadata`` with
    ``include_metadata=false``."""

    model_config = ConfigDict(from_attributes=True, populate_by_name=True)

    id: uuid.UUID
    run_id: uuid.UUID
    project_id: uuid.UUID
    learning_key: str | None
    step: int
    group_index: int
    rollout_index: int
    task_input_id: uuid.UUID | None
    messages: ServedMessages
    reward: float | None
    reward_breakdown: StoredObject | None
    metadata: StoredObject | None = Field(validation_alias=AliasChoices("meta", "metadata"))
    created_at: datetime


class TrajectoriesPage(Page[TrajectoryPublic]):
    """A page of TrajectoryPublic; pass ``next_cursor`` as ``after`` for the next."""
