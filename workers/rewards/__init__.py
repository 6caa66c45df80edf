"""Scoring: turning a step's rollouts into rewards with their breakdown.

A scorer takes the step's groups (one input, its rollouts) and returns one
:class:`~workers.rewards.base.Score` per rollout, or drops a whole group (reward None) when
a judge could not score it. Built from the run's ``reward`` spec by :func:`make_scorer`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from app.runs.spec.rewards import RewardSpec
from workers.rewards.base import Group, Rollout, Score, Scorer


def make_scorer(spec: RewardSpec | dict[str, Any]) -> Scorer:
    """The scorer for a run's ``reward`` spec (app.runs.spec.rewards' union, or its model_dump).

    Imports lazily, so a worker only loads what its runs use.
    """
    if isinstance(spec, BaseModel):
        spec = spec.model_dump()
    kind = spec.get("type")
    if kind == "function":
        from workers.rewards.functions import FunctionScorer

        return FunctionScorer(spec)
    if kind == "ruler":
        from workers.rewards.ruler import RulerScorer

        return RulerScorer(spec)
    if kind == "rim":
        from workers.rewards.rim import RimScorer

        return RimScorer(spec)
    raise ValueError(f"unknown reward type {kind!r} (expected ruler, rim or function)")


__all__ = ["Group", "Rollout", "Score", "Scorer", "make_scorer"]
