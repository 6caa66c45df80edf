"""A supervised warm-up before GRPO: a run's optional ``sft``.

A policy that never calls a tool gets no reward from tool use to learn from, so an agent run
can first fine-tune on example conversations: given inline (``examples``) or pulled from the
project's training data (``query``: earlier runs' best episodes). The loss is on assistant
turns only, so every example needs one.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import Field, field_serializer, field_validator, model_validator

from app.core.errors import inconsistent
from app.core.storable import FiniteFloat, NulFreeStr
from app.runs.spec.rewards import Strict
from app.trajectories.messages import TrajectoryMessage, dump_messages

MAX_EXAMPLES = 10_000


class SftExample(Strict):
    messages: list[TrajectoryMessage] = Field(
        min_length=1,
        max_length=10_000,
        description="One conversation, tool calls and results included; the loss is on "
        "its assistant messages.",
    )

    @field_validator("messages")
    @classmethod
    def _assistant(cls, value: list[TrajectoryMessage]) -> list[TrajectoryMessage]:
        if not any(m.role == "assistant" for m in value):
            raise inconsistent("an example needs an assistant message (the loss is on them)")
        return value

    @field_serializer("messages")
    def _as_given(self, value: list[TrajectoryMessage]) -> list[dict[str, Any]]:
        return dump_messages(value)


class SftQuery(Strict):
    """Trajectories of this project to train on, best first; narrowed by learning key or
    runs so that a run never trains on a whole project by accident."""

    learning_key: NulFreeStr | None = Field(
        default=None, min_length=1, max_length=200, description="Runs of this learning key."
    )
    run_ids: list[uuid.UUID] | None = Field(
        default=None, min_length=1, max_length=100, description="These runs' trajectories."
    )
    min_reward: FiniteFloat | None = Field(
        default=None, description="Only trajectories scored at least this (inclusive)."
    )
    limit: int = Field(
        default=1000, ge=1, le=100_000, description="At most this many, highest reward first."
    )

    @model_validator(mode="after")
    def _narrowed(self) -> SftQuery:
        if self.learning_key is None and self.run_ids is None:
            raise inconsistent("a query needs learning_key or run_ids (or both)")
        return self


class SftSettings(Strict):
    """Supervised fine-tuning (TRL's SFTTrainer) before the GRPO steps."""

    examples: list[SftExample] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_EXAMPLES,
        description="Conversations to imitate. Not with query.",
    )
    query: SftQuery | None = Field(
        default=None, description="Trajectories of this project to imitate. Not with examples."
    )
    epochs: int = Field(default=1, ge=1, le=100, description="Passes over the examples.")
    learning_rate: float = Field(default=2e-5, gt=0, lt=1, description="AdamW learning rate.")
    max_seq_length: int = Field(
        default=1024, ge=16, le=131072, description="Longer conversations are cut (tokens)."
    )
    packing: bool = Field(default=False, description="Pack several examples per sequence.")
    batch_size: int = Field(default=4, ge=1, le=1024, description="Examples per device step.")

    @model_validator(mode="after")
    def _one_source(self) -> SftSettings:
        if (self.examples is None) == (self.query is None):
            raise inconsistent("give exactly one of examples and query")
        return self
