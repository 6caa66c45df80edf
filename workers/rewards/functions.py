"""Programmatic rewards: built-ins and user functions, combined by weight.

Every function is called as ``fn(completion, *, prompt, context, **args) -> float``; user
functions are named by import path (``package.module:function``) and must be importable on
the workers.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from importlib import import_module
from typing import Any

from workers.rewards.base import Group, Score

RewardFn = Callable[..., float]


def exact_match(
    completion: str,
    *,
    context: dict[str, Any] | None,
    key: str = "answer",
    case_sensitive: bool = False,
    **_: Any,
) -> float:
    """1 when the completion equals ``context[key]`` (whitespace-trimmed)."""
    if not context or key not in context:
        return 0.0
    a, b = completion.strip(), str(context[key]).strip()
    return float(a == b if case_sensitive else a.lower() == b.lower())


def regex(completion: str, *, pattern: str, full_match: bool = False, **_: Any) -> float:
    """1 when ``pattern`` matches the completion (anywhere, or whole with full_match)."""
    matcher = re.fullmatch if full_match else re.search
    return float(matcher(pattern, completion, flags=re.DOTALL) is not None)


def json_valid(completion: str, *, required_keys: list[str] | None = None, **_: Any) -> float:
    """1 when the completion is JSON (an object holding ``required_keys``, if given)."""
    try:
        value = json.loads(completion)
    except ValueError:
        return 0.0
    if required_keys:
        return float(isinstance(value, dict) and all(k in value for k in required_keys))
    return 1.0


def length_target(completion: str, *, target: int = 100, **_: Any) -> float:
    """1 at exactly ``target`` characters, falling linearly to 0 at 0 or 2x target."""
    return max(0.0, 1.0 - abs(len(completion) - target) / max(target, 1))


def char_fraction(completion: str, *, char: str = "a", **_: Any) -> float:
    """The fraction of the completion's characters that are ``char``."""
    return completion.count(char) / len(completion) if completion else 0.0


BUILTINS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "regex": regex,
    "json_valid": json_valid,
    "length_target": length_target,
    "char_fraction": char_fraction,
}


def resolve(name: str) -> RewardFn:
    if name in BUILTINS:
        return BUILTINS[name]
    module, sep, attr = name.partition(":")
    if not sep:
        module, _, attr = name.rpartition(".")
    try:
        fn = getattr(import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"reward function {name!r} cannot be imported on this worker: {exc}"
        ) from exc
    if not callable(fn):
        raise ValueError(f"reward function {name!r} is not callable")
    return fn  # type: ignore[no-any-return]


class FunctionScorer:
    # Scores in microseconds: the training loop stores rollouts and rewards together.
    instant = True

    def __init__(self, spec: dict[str, Any]) -> None:
        names = [f["name"] for f in spec["functions"]]
        self.functions = [
            (
                # The breakdown is keyed by name; a function used twice gets its position.
                name if names.count(name) == 1 else f"{name}[{i}]",
                resolve(name),
                float(f.get("weight", 1.0)),
                dict(f.get("args", {})),
            )
            for i, (name, f) in enumerate(zip(names, spec["functions"], strict=True))
        ]
        self.total_weight = sum(w for _, _, w, _ in self.functions)

    def check(self) -> None:
        """Resolving the functions in __init__ already proved they import."""

    def score(self, groups: list[Group]) -> list[list[Score]]:
        scored = []
        for group in groups:
            row = []
            for rollout in group.rollouts:
                parts: dict[str, float] = {}
                for name, fn, _, args in self.functions:
                    value = float(
                        fn(rollout.completion, prompt=rollout.prompt, context=group.context, **args)
                    )
                    parts[name] = value if math.isfinite(value) else 0.0
                total = sum(parts[n] * w for n, _, w, _ in self.functions) / self.total_weight
                row.append(Score(total, {"functions": parts}))
            scored.append(row)
        return scored
