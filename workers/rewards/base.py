from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Rollout:
    """One completion: the conversation so far plus the model's answer."""

    prompt: list[dict[str, str]]
    completion: str


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
