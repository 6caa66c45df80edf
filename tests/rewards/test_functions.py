"""Programmatic rewards: the built-ins, user functions by import path, weighting."""

from __future__ import annotations

from functools import partial

import pytest

from app.runs.spec.rewards import BUILTIN_REWARDS
from workers.rewards import make_scorer
from workers.rewards.base import Group, Rollout
from workers.rewards.functions import _IMPLEMENTATIONS, resolve


def double_length(completion: str, **_: object) -> float:
    """A user reward function, imported by path in the tests below."""
    return min(1.0, len(completion) / 10)


def reward(name: str, completion: str, context: dict | None = None, **args: object) -> float:
    """A built-in as the scorer calls it: args validated by the registry, defaults filled."""
    return resolve(name, args)(completion, prompt=[], context=context)


def test_builtins() -> None:
    assert reward("exact_match", " 42 ", context={"answer": 42}) == 1.0
    assert reward("exact_match", "Paris", context={"answer": "paris"}) == 1.0
    assert reward("exact_match", "Paris", {"answer": "paris"}, case_sensitive=True) == 0.0
    assert reward("exact_match", "x", context=None) == 0.0
    assert reward("exact_match", "7", {"answer": "8", "n": 7}, key="n") == 1.0
    assert reward("regex", "the answer is 7", pattern=r"\d") == 1.0
    assert reward("regex", "the answer is 7", pattern=r"\d", full_match=True) == 0.0
    assert reward("json_valid", '{"a": 1}', required_keys=["a"]) == 1.0
    assert reward("json_valid", '{"a": 1}', required_keys=["b"]) == 0.0
    assert reward("json_valid", "{nope") == 0.0
    assert reward("length_target", "x" * 50, target=100) == 0.5
    assert reward("length_target", "x" * 100) == 1.0  # target defaults to 100
    assert reward("length_target", "x" * 300, target=100) == 0.0
    assert reward("char_fraction", "aab", char="a") == pytest.approx(2 / 3)
    assert reward("char_fraction", "aab") == pytest.approx(2 / 3)  # char defaults to 'a'
    assert reward("char_fraction", "") == 0.0


def test_one_registry_of_builtins_for_the_api_and_the_workers() -> None:
    """The API validates against BUILTIN_REWARDS; every entry has an implementation, and
    the implementations get exactly the args the registry validated (defaults included)."""
    assert set(BUILTIN_REWARDS) == set(_IMPLEMENTATIONS)
    for name, builtin in BUILTIN_REWARDS.items():
        assert _IMPLEMENTATIONS[name].__name__ == name and builtin.summary
    bound = resolve("exact_match", {})
    assert isinstance(bound, partial)
    assert bound.keywords == {"key": "answer", "case_sensitive": False}


@pytest.mark.parametrize(
    ("name", "args", "why"),
    [
        ("regex", {}, "pattern"),
        ("regex", {"pattern": "("}, "pattern"),
        ("char_fraction", {"chr": "a"}, "chr"),
        ("length_target", {"target": 0}, "target"),
    ],
)
def test_bad_builtin_args_fail_on_the_worker_too(name: str, args: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        resolve(name, args)


def test_user_function_by_path_and_weights() -> None:
    scorer = make_scorer(
        {
            "type": "function",
            "functions": [
                {"name": "char_fraction", "weight": 3, "args": {"char": "a"}},
                {"name": "tests.rewards.test_functions:double_length", "weight": 1},
            ],
        }
    )
    group = Group(0, "q", None, [Rollout([], "aaaaa"), Rollout([], "bb")])
    [[first, second]] = scorer.score([group])
    assert first.reward == pytest.approx((3 * 1.0 + 1 * 0.5) / 4)
    assert first.breakdown == {
        "functions": {"char_fraction": 1.0, "tests.rewards.test_functions:double_length": 0.5}
    }
    assert second.reward == pytest.approx((0 + 0.2) / 4)


def test_same_function_twice_keeps_both_in_the_breakdown() -> None:
    scorer = make_scorer(
        {
            "type": "function",
            "functions": [
                {"name": "char_fraction", "args": {"char": "a"}},
                {"name": "char_fraction", "args": {"char": "b"}},
            ],
        }
    )
    [[score]] = scorer.score([Group(0, "q", None, [Rollout([], "ab")])])
    assert score.breakdown["functions"] == {"char_fraction[0]": 0.5, "char_fraction[1]": 0.5}


def test_unimportable_function_fails_before_training() -> None:
    with pytest.raises(ValueError, match="cannot be imported"):
        resolve("no_such_package.module:fn")
    with pytest.raises(ValueError, match="cannot be imported"):
        make_scorer({"type": "function", "functions": [{"name": "tests.rewards:missing"}]})
