"""What the training-data library returns: plain frozen dataclasses, cheap to build by the
million (no validation per row; the database already holds checked data)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True, slots=True)
class TrainingTrajectory:
    """One stored rollout (the reference's session trace): for an agent, one episode.

    ``messages`` is ``None`` when loaded with ``include_messages=False``; ``reward_breakdown``
    and ``metadata`` are ``None`` with ``include_metadata=False``. The group statistics are
    set when asked for (``include_group_stats=True``): over every scored rollout of the
    group, whatever the filters kept.
    """

    id: uuid.UUID
    run_id: uuid.UUID
    project_id: uuid.UUID
    learning_key: str | None
    step: int
    group_index: int
    rollout_index: int
    task_input_id: uuid.UUID | None
    reward: float | None
    created_at: datetime
    messages: list[dict[str, Any]] | None = None
    reward_breakdown: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    group_reward_mean: float | None = None
    group_reward_std: float | None = None
    group_size: int | None = None

    @property
    def group_key(self) -> tuple[uuid.UUID, int, int]:
        """The GRPO group this rollout was sampled in: (run, step, group)."""
        return (self.run_id, self.step, self.group_index)

    @property
    def prompt(self) -> list[dict[str, Any]]:
        """The messages before the policy's first turn: system prompt and input."""
        messages = self._messages()
        return messages[: _first_assistant(messages)]

    @property
    def episode(self) -> list[dict[str, Any]]:
        """Everything the policy's turns produced, from its first message on: for an agent,
        its tool calls, their results and its final answer; for a single turn, the answer."""
        messages = self._messages()
        return messages[_first_assistant(messages) :]

    @property
    def completion(self) -> str | None:
        """The policy's answer: the content of the final assistant message (None when the
        episode did not end with one, as one cut short by an error)."""
        messages = self._messages()
        if messages and messages[-1].get("role") == "assistant":
            content = messages[-1].get("content")
            return content if isinstance(content, str) else None
        return None

    def _messages(self) -> list[dict[str, Any]]:
        if self.messages is None:
            raise ValueError("messages were not loaded (include_messages=False)")
        return self.messages


def _first_assistant(messages: list[dict[str, Any]]) -> int:
    return next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))


@dataclass(frozen=True, slots=True)
class TrainingRun:
    """A run as the training-data library sees it: what it trained and how it ended."""

    id: uuid.UUID
    project_id: uuid.UUID
    learning_key: str | None
    status: str
    model_name: str
    trained_model_name: str | None
    task_description: str
    step: int
    metrics: dict[str, Any] | None
    error: str | None
    created_at: datetime
    completed_at: datetime | None
