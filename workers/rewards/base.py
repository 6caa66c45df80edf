from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Rollout:
    """One completion: the conversation so far plus the model's answer.

    An agent's rollout is an episode: ``episode`` holds every message from the model's first
    turn on (tool calls, tool results, the final answer, which ``completion`` repeats), and
    ``environment`` the instance it played in (for the ``environment`` reward)."""

    prompt: list[dict[str, Any]]
    completion: str
    episode: list[dict[str, Any]] | None = None
    environment: Any = None

    @property
    def response(self) -> list[dict[str, Any]]:
        """What the model produced, as messages: the episode, or the one answer."""
        if self.episode is not None:
            return self.episode
        return [{"role": "assistant", "content": self.completion}]


@dataclass(frozen=True)
class Group:
    """The rollouts of one input in one step."""

    index: int
    input_text: str
    context: dict[str, Any] | None
    rollouts: list[Rollout]


@dataclass(frozen=True)
class Score:
    reward: float | None  # None: the group was dropped (a judge failed); not trained on
    breakdown: dict[str, Any] = field(default_factory=dict)


class Scorer(Protocol):
    def check(self) -> None:
        """Fail at once, before any step is spent, if this scorer cannot work here."""

    def score(self, groups: list[Group]) -> list[list[Score]]: ...
