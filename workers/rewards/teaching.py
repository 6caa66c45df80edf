"""The teaching reward of a teacher run (the reference's ``compute_teaching_reward``).

One pure function, so the formula lives in one place: the teacher scorer
(workers/pipeline/teacher.py) calls it per guidance, and tests/rewards/test_teaching.py
checks it against a table of hand-computed cases. With the default weights it is the
reference's documented formula::

    reward = (enhanced − baseline) + max(0, 1 − guidance_tokens / 200)
             − 2.0 if enhanced < baseline

e.g. baseline 0.6, enhanced 0.8, 120 tokens: 0.2 + 0.4 = 0.6.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TeachingReward:
    """The reward and its parts (stored in the trajectory's breakdown)."""

    reward: float
    improvement: float
    efficiency: float
    penalty: float

    def as_dict(self) -> dict[str, float]:
        return {
            "reward": self.reward,
            "improvement": self.improvement,
            "efficiency": self.efficiency,
            "penalty": self.penalty,
        }


def _score(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be in [0.0, 1.0], got {value!r}")
    return float(value)


def teaching_reward(
    baseline_score: float,
    enhanced_score: float,
    teaching_length: int,
    *,
    improvement_weight: float = 1.0,
    efficiency_weight: float = 1.0,
    efficiency_tokens: int = 200,
    safety_penalty: float = 2.0,
) -> TeachingReward:
    """The reward for guidance of ``teaching_length`` tokens that took the student from
    ``baseline_score`` (without it) to ``enhanced_score`` (with it), both in [0, 1].

    Raises ValueError for a score outside [0, 1] or a negative length, TypeError for
    anything that is not a number (the reference's rules)."""
    baseline = _score("baseline_score", baseline_score)
    enhanced = _score("enhanced_score", enhanced_score)
    if isinstance(teaching_length, bool) or not isinstance(teaching_length, int):
        raise TypeError(f"teaching_length must be an int, not {type(teaching_length).__name__}")
    if teaching_length < 0:
        raise ValueError(f"teaching_length must not be negative, got {teaching_length}")
    if efficiency_tokens < 1:
        raise ValueError(f"efficiency_tokens must be at least 1, got {efficiency_tokens}")
    improvement = improvement_weight * (enhanced - baseline)
    efficiency = efficiency_weight * max(0.0, 1.0 - teaching_length / efficiency_tokens)
    penalty = safety_penalty if enhanced < baseline else 0.0
    return TeachingReward(improvement + efficiency - penalty, improvement, efficiency, penalty)
