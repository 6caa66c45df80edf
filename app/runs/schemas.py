"""Request and response shapes for runs.

Inputs forbid unknown fields, so ``status``, ``project``, ``attempt``, ``version`` and the
like are a 422 when a request tries to set them; they exist only on the table.
"""

from __future__ import annotations

import math
import uuid
from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from app.core.errors import inconsistent
from app.core.pagination import Page
from app.core.storable import NUL_FREE, STORABLE_OBJECT
from app.runs.grpo import GrpoSettings
from app.runs.rewards import JudgeEndpoint, RewardSpec, RulerReward
from app.runs.status import RunStatus

MAX_INLINE_INPUTS = 10_000


class InputItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_text: Annotated[str, NUL_FREE] = Field(min_length=1, max_length=32_000)
    context: Annotated[dict[str, Any], STORABLE_OBJECT] | None = Field(
        default=None, description="Task context, e.g. {'answer': '42'} for exact-match rewards."
    )
    split: str = Field(default="train", pattern=r"^(train|validation)$")

    @field_validator("input_text")
    @classmethod
    def _text_is_storable(cls, value: str) -> str:
        if "\x00" in value:
            raise ValueError(_NUL)
        return value

    @field_validator("context")
    @classmethod
    def _context_is_storable(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # PostgreSQL's jsonb stores neither \u0000 (in keys or strings) nor NaN/Infinity,
        # which the JSON parser lets through; refuse them here rather than fail the insert.
        reason = _unstorable_json(value)
        if reason:
            raise ValueError(reason)
        return value


_NUL = "must not contain NUL (\\u0000) characters"
_NAN = "must not contain NaN or Infinity"


def _unstorable_json(value: Any) -> str | None:
    """Why PostgreSQL's jsonb would refuse ``value``, or None. Iterative: it runs for every
    line of a 100,000-line dataset."""
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is str:
            if "\x00" in item:
                return _NUL
        elif kind is float:
            if not math.isfinite(item):
                return _NAN
        elif kind is dict:
            for key, v in item.items():
                if "\x00" in key:
                    return _NUL
                t = type(v)
                if t is str:
                    if "\x00" in v:
                        return _NUL
                elif t is dict or t is list or t is float:
                    stack.append(v)
        elif kind is list:
            stack.extend(item)
    return None


class RunCreate(BaseModel):
    """A training run to start. The reference's TrainingRun fields plus inputs and settings."""

    model_config = ConfigDict(extra="forbid")

    model_name: Annotated[str, NUL_FREE] = Field(
        min_length=1, max_length=500, description="Base model: a folder on the workers or hub id."
    )
    task_description: Annotated[str, NUL_FREE] = Field(min_length=1, max_length=20_000)
    trained_model_name: Annotated[str, NUL_FREE] | None = Field(
        default=None, min_length=1, max_length=500
    )
    system_prompt: Annotated[str, NUL_FREE] | None = Field(default=None, max_length=20_000)
    num_examples: int = Field(
        default=100,
        ge=1,
        le=100_000,
        description="How many inputs to generate from task_description when the run has "
        "neither inputs nor dataset_id; otherwise the number of train inputs given.",
    )
    rollouts_per_group: int = Field(
        default=4, ge=2, le=256, description="Completions per input (GRPO num_generations)."
    )
    learning_rate: float = Field(default=1e-5, gt=0, lt=1)
    num_epochs: int = Field(default=1, ge=1, le=10_000)
    max_steps: int | None = Field(default=None, ge=1, le=10_000_000)
    learning_key: Annotated[str, NUL_FREE] | None = Field(
        default=None,
        max_length=200,
        description="Groups runs of one task so their trajectories can be pulled together.",
    )
    inputs: list[InputItem] | None = Field(
        default=None,
        max_length=MAX_INLINE_INPUTS,
        description="Inline training inputs. Omitted, and no dataset_id: generated from "
        "task_description.",
    )
    dataset_id: uuid.UUID | None = Field(
        default=None,
        description="An uploaded dataset (POST /datasets) of this project whose rows become "
        "the run's inputs; num_examples is then its train row count. Not with inputs.",
    )
    generator: JudgeEndpoint | None = Field(
        default=None,
        description="The LLM that writes num_examples inputs (and a system prompt, if none is "
        "given) from task_description when the run has neither inputs nor dataset_id. "
        "Unset: the workers' default judge endpoint.",
    )
    reward: RewardSpec = Field(default_factory=lambda: RulerReward(type="ruler"))
    grpo: GrpoSettings = Field(default_factory=GrpoSettings)
    config: Annotated[dict[str, Any], STORABLE_OBJECT] = Field(
        default_factory=dict, description="Free-form extra settings."
    )

    @field_validator(
        "model_name",
        "task_description",
        "trained_model_name",
        "system_prompt",
        "learning_key",
        "config",
        "reward",
        "grpo",
        "generator",
    )
    @classmethod
    def _storable(cls, value: Any) -> Any:
        reason = _unstorable_json(value.model_dump() if isinstance(value, BaseModel) else value)
        if reason:
            raise ValueError(reason)
        return value

    @field_validator("dataset_id")
    @classmethod
    def _inputs_or_dataset(cls, value: uuid.UUID | None, info: ValidationInfo) -> uuid.UUID | None:
        # A field validator, so the problem names body.dataset_id (inputs is validated first).
        if value is not None and info.data.get("inputs") is not None:
            raise inconsistent("give either inputs or dataset_id, not both")
        return value

    @model_validator(mode="after")
    def _inputs(self) -> RunCreate:
        if self.inputs is not None and not any(i.split == "train" for i in self.inputs):
            raise inconsistent("inputs must contain at least one item with split 'train'")
        return self


class TrainingMetrics(BaseModel):
    """Summary of a run's progress (the reference's TrainingMetrics), extended freely."""

    model_config = ConfigDict(extra="allow")

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
    reward: dict[str, Any]
    grpo: dict[str, Any]
    config: dict[str, Any]
    generator: dict[str, Any] | None
    dataset_id: uuid.UUID | None
    metrics: TrainingMetrics | None
    error: str | None
    step: int
    epoch: int
    attempt: int
    cancel_requested: bool
    pause_requested: bool
    version: int
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    completed_at: datetime | None


class RunsPage(Page[RunPublic]):
    """A page of RunPublic; pass ``next_cursor`` as ``after`` for the next."""
