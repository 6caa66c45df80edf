"""What the API answers about runs: a run (``RunPublic``), its summary, a page of them.

The request body is the run spec's (:mod:`app.runs.spec.body`).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.core.openapi import DocumentedAs
from app.core.pagination import Page
from app.core.storable import StoredObject, servable
from app.runs.lifecycle.status import RunStatus
from app.runs.spec.environments import EnvironmentSpec
from app.runs.spec.grpo import GrpoSettings
from app.runs.spec.rewards import JudgeEndpoint, RewardSpec
from app.runs.spec.sft import SftSettings
from app.runs.spec.teacher import TeacherSettings


class TrainingMetrics(BaseModel):
    """Summary of a run's progress (the reference's TrainingMetrics), extended freely."""

    # Served with every field: documented so (in `required`).
    model_config = ConfigDict(extra="allow", json_schema_serialization_defaults_required=True)

    total_trajectories: int = 0
    avg_reward: float | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    training_loss: float | None = None
    epoch: int = 0
    step: int = 0


class RunPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: uuid.UUID
    project_id: uuid.UUID
    status: RunStatus
    model_name: str
    trained_model_name: str | None
    task_description: str
    num_examples: int
    rollouts_per_group: int
    learning_rate: float
    num_epochs: int
    max_steps: int | None
    system_prompt: str | None
    learning_key: str | None
    # Served as stored: a request model wrote each (model_dump, every field), so each is
    # documented as that model's answer-side schema, and not validated again.
    reward: Annotated[dict[str, Any], DocumentedAs(RewardSpec)]
    grpo: Annotated[dict[str, Any], DocumentedAs(GrpoSettings)]
    config: StoredObject
    generator: Annotated[dict[str, Any], DocumentedAs(JudgeEndpoint)] | None
    environment: Annotated[dict[str, Any], DocumentedAs(EnvironmentSpec)] | None = Field(
        description="The run's environment as validated (defaults filled in); null: no tools."
    )
    sft: Annotated[dict[str, Any], DocumentedAs(SftSettings)] | None = Field(
        description="The supervised warm-up as validated; null: none."
    )
    teacher: Annotated[dict[str, Any], DocumentedAs(TeacherSettings)] | None = Field(
        description="The teacher run's settings as validated; null: plain GRPO."
    )
    dataset_id: uuid.UUID | None
    parent_run_id: uuid.UUID | None = Field(
        description="The run whose checkpoint this one started from; null: none (or deleted)."
    )
    parent_step: int | None = Field(description="That checkpoint's step.")
    metrics: TrainingMetrics | None
    error: str | None
    step: int
    epoch: int
    attempt: int = Field(description="Claims of the run by a worker so far (pauses included).")
    failures: int = Field(
        description="Attempts that ended with the worker gone (its lease ran out); the run "
        "is failed when they reach the workers' max_attempts."
    )
    cancel_requested: bool
    pause_requested: bool
    version: int
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    completed_at: datetime | None

    @model_validator(mode="before")
    @classmethod
    def _servable(cls, data: Any) -> Any:
        # Any row must render, whatever it holds: one stored before the depth limit (or
        # written around the API) would otherwise fail every page it is on. One validator
        # for the three columns, not three: GET /runs/{id} is the hottest route.
        get = data.get if isinstance(data, dict) else lambda name: getattr(data, name, None)
        clipped = {}
        for name in _FREE_FORM:
            value = get(name)
            shown = servable(value)
            if shown is not value:
                clipped[name] = shown
        if not clipped:
            return data
        if isinstance(data, dict):
            return {**data, **clipped}
        return {name: getattr(data, name) for name in cls.model_fields} | clipped


# The jsonb columns of a run that can nest without bound: config and a reward function's
# args are the user's, metrics the workers'. grpo and generator are only ever written from
# GrpoSettings and JudgeEndpoint, whose depth is fixed, so they are not walked; nor are
# environment and sft, which exist only since the depth limit and are only written from
# their request models (their free-form parts checked at most MAX_JSON_DEPTH deep, well
# within what an answer serves): walking a 10,000-example sft on every GET would cost more
# than the route.
_FREE_FORM = ("reward", "config", "metrics")


class RunsPage(Page[RunPublic]):
    """A page of RunPublic; pass ``next_cursor`` as ``after`` for the next."""
