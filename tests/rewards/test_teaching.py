"""The teaching reward (workers/rewards/teaching.py) against hand-computed values, and the
parsing of a student's diagnostic probe (workers/pipeline/teacher.py)."""

from __future__ import annotations

from typing import Any

import pytest

from app.runs.spec.teacher import guidance_form
from workers.pipeline.teacher import parse_probe
from workers.rewards.teaching import teaching_reward

# (baseline, enhanced, tokens, weights, reward, improvement, efficiency, penalty): each
# computed by hand from reward = w_i (e − b) + w_e max(0, 1 − tokens / L) − 2.0 [e < b].
CASES: list[tuple[str, float, float, int, dict[str, Any], float, float, float, float]] = [
    # The reference's own example: 0.2 + 0.4.
    ("reference example", 0.6, 0.8, 120, {}, 0.6, 0.2, 0.4, 0.0),
    ("improvement, no words", 0.0, 1.0, 0, {}, 2.0, 1.0, 1.0, 0.0),
    ("no change", 0.5, 0.5, 50, {}, 0.75, 0.0, 0.75, 0.0),
    ("no change, long guidance", 0.5, 0.5, 200, {}, 0.0, 0.0, 0.0, 0.0),
    ("long guidance earns no bonus", 0.2, 0.7, 450, {}, 0.5, 0.5, 0.0, 0.0),
    ("degradation", 0.9, 0.4, 100, {}, -2.0, -0.5, 0.5, 2.0),
    ("degradation, long guidance", 1.0, 0.0, 300, {}, -3.0, -1.0, 0.0, 2.0),
    (
        "weights",
        0.25,
        0.75,
        40,
        {"improvement_weight": 0.5, "efficiency_weight": 0.25, "efficiency_tokens": 80},
        0.375,
        0.25,
        0.125,
        0.0,
    ),
    ("own penalty", 0.5, 0.25, 200, {"safety_penalty": 0.5}, -0.75, -0.25, 0.0, 0.5),
]


@pytest.mark.parametrize(
    ("baseline", "enhanced", "tokens", "weights", "reward", "improvement", "efficiency", "penalty"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_teaching_reward_matches_the_hand_computed_table(
    baseline: float,
    enhanced: float,
    tokens: int,
    weights: dict[str, Any],
    reward: float,
    improvement: float,
    efficiency: float,
    penalty: float,
) -> None:
    got = teaching_reward(baseline, enhanced, tokens, **weights)
    assert got.reward == pytest.approx(reward)
    assert got.improvement == pytest.approx(improvement)
    assert got.efficiency == pytest.approx(efficiency)
    assert got.penalty == pytest.approx(penalty)
    assert got.as_dict()["reward"] == got.reward


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((1.5, 0.5, 10), ValueError, "baseline_score"),
        ((0.5, -0.1, 10), ValueError, "enhanced_score"),
        ((0.5, float("nan"), 10), ValueError, "enhanced_score"),
        ((0.5, 0.5, -1), ValueError, "teaching_length"),
        (("0.5", 0.5, 10), TypeError, "baseline_score"),
        ((0.5, True, 10), TypeError, "enhanced_score"),
        ((0.5, 0.5, 1.5), TypeError, "teaching_length"),
    ],
)
def test_bad_inputs_are_refused_saying_which(
    args: tuple[Any, Any, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        teaching_reward(*args)


@pytest.mark.parametrize(
    ("level", "form"),
    [
        (0.0, "walkthrough"),
        (0.29, "walkthrough"),
        (0.3, "hints"),
        (0.69, "hints"),
        (0.7, "verification"),
        (1.0, "verification"),
    ],
)
def test_the_guidance_form_follows_the_capability_level(level: float, form: str) -> None:
    assert guidance_form(level) == form


def test_a_probe_that_says_its_levels_is_read() -> None:
    answer = "A linear equation.\nCAPABILITY: 0.8\nConfidence: 65%\nGAPS: fractions, signs"
    probe = parse_probe(answer, fallback=0.1)
    assert probe == {
        "capability_level": 0.8,
        "confidence_score": 0.65,
        "identified_gaps": ["fractions", "signs"],
        "self_assessed": True,
    }


def test_a_probe_that_cannot_say_falls_back_to_the_baseline_score() -> None:
    probe = parse_probe("aaaa aaa", fallback=0.25)
    assert probe == {
        "capability_level": 0.25,
        "confidence_score": 0.0,
        "identified_gaps": [],
        "self_assessed": False,
    }
    # Out of range or none: clipped into [0, 1], "none" is no gap.
    assert parse_probe("CAPABILITY: 7\nGAPS: none", fallback=0.5)["capability_level"] == 1.0
    assert parse_probe("GAPS: none", fallback=0.5)["identified_gaps"] == []
