"""Scoring: turning a step's rollouts into rewards with their breakdown.

A scorer takes the step's groups (one input, its rollouts) and returns one
:class:`~workers.rewards.base.Score` per rollout, or drops a whole group (reward None) when
a judge could not score it. Built from the run's ``reward`` spec by :func:`make_scorer`.
"""

from __future__ import annotations

from typing import Any

from workers.rewards.base import Group, Rollout, Score, Scorer


def make_scorer(spec: dict[str, Any]) -> Scorer:
    kind = spec.get("type")
    if kind == "function":
        from workers.rewards.functions import FunctionScorer

        return FunctionScorer(spec)
    raise ValueError(
        f"reward type {kind!r} is not available on this worker yet (function rewards are)"
    )


__all__ = ["Group", "Rollout", "Score", "Scorer", "make_scorer"]
