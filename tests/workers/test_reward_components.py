"""Each reward part becomes a per-step metric (the dashboard's components chart)."""

from __future__ import annotations

import math

from workers.pipeline.steps import reward_components
from workers.rewards import Score


def test_functions_ruler_and_rim_judges_become_series() -> None:
    scores = [
        Score(0.5, {"functions": {"exact_match": 1.0, "length_target": 0.0}}),
        Score(0.7, {"functions": {"exact_match": 0.0, "length_target": 0.4}}),
        Score(0.8, {"ruler": {"score": 0.8, "explanation": "good"}}),
        Score(0.6, {"rim": {"score": 0.6, "adjusted": {"accuracy": 0.9, "process": 0.3}}}),
        Score(None, {"ruler": {"dropped": True, "error": "timed out"}}),  # not trained on
        Score(0.1, {"functions": {"odd": math.nan}}),  # not a number: left out
    ]
    assert reward_components(scores) == {
        "reward/exact_match": [1.0, 0.0],
        "reward/length_target": [0.0, 0.4],
        "reward/ruler": [0.8],
        "reward/rim/accuracy": [0.9],
        "reward/rim/process": [0.3],
    }
