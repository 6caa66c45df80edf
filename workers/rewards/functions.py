"""Programmatic rewards: built-ins and user functions, combined by weight.

Every function is called as ``fn(completion, *, prompt, context, **args) -> float``; in a
run with an environment also with ``messages`` (the whole episode) and ``environment`` (the
rollout's environment instance), ``completion`` being the final answer. User
functions are named by import path (``package.module:function``) and must be importable on
the workers. The built-ins are listed, with what each does and its arguments, in
:data:`app.runs.spec.rewards.BUILTIN_REWARDS`; their implementations here attach to that list.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from functools import partial
from importlib import import_module
from typing import Any

from pydantic import ValidationError

from app.runs.spec.rewards import BUILTIN_REWARDS, builtin_args
from workers.environments.episode import accepted
from workers.rewards.base import Group, Rollout, Score

RewardFn = Callable[..., float]


_IMPLEMENTATIONS: dict[str, RewardFn] = {}


def _builtin(fn: RewardFn) -> RewardFn:
    """Attach ``fn`` to the built-in of its name in :data:`BUILTIN_REWARDS`, which holds its
    arguments' defaults and rules: it is called with args validated there."""
    name = fn.__name__
    if name not in BUILTIN_REWARDS:
        raise RuntimeError(f"{name!r} is not in app.runs.spec.rewards.BUILTIN_REWARDS")
    _IMPLEMENTATIONS[name] = fn
    return fn


@_builtin
def exact_match(
    completion: str, *, context: dict[str, Any] | None, key: str, case_sensitive: bool, **_: Any
) -> float:
    if not context or key not in context:
        return 0.0
    a, b = completion.strip(), str(context[key]).strip()
    return float(a == b if case_sensitive else a.lower() == b.lower())


@_builtin
def regex(completion: str, *, pattern: str, full_match: bool, **_: Any) -> float:
    matcher = re.fullmatch if full_match else re.search
    return float(matcher(pattern, completion, flags=re.DOTALL) is not None)


@_builtin
def json_valid(completion: str, *, required_keys: list[str] | None, **_: Any) -> float:
    try:
        value = json.loads(completion)
    except ValueError:
        return 0.0
    if required_keys:
        return float(isinstance(value, dict) and all(k in value for k in required_keys))
    return 1.0


@_builtin
def length_target(completion: str, *, target: int, **_: Any) -> float:
    return max(0.0, 1.0 - abs(len(completion) - target) / max(target, 1))


@_builtin
def char_fraction(completion: str, *, char: str, **_: Any) -> float:
    return completion.count(char) / len(completion) if completion else 0.0


@_builtin
def environment(
    completion: str, *, environment: Any = None, messages: Any = None, **_: Any
) -> float:
    if environment is None:
        raise ValueError("the 'environment' reward function needs a run with a python environment")
    value = environment._reward(completion, messages or [])
    return 0.0 if value is None else float(value)


if _IMPLEMENTATIONS.keys() != BUILTIN_REWARDS.keys():  # not an assert: python -O keeps it
    raise RuntimeError(
        "built-in rewards without an implementation: "
        + ", ".join(sorted(BUILTIN_REWARDS.keys() - _IMPLEMENTATIONS.keys()))
    )


def resolve(name: str, args: dict[str, Any] | None = None) -> RewardFn:
    """The function ``name`` with its ``args`` bound: a built-in's validated against
    :data:`BUILTIN_REWARDS` (defaults filled in), a user function's as given. Raises
    ValueError for a function this worker cannot import or arguments that do not fit."""
    if name in BUILTIN_REWARDS:
        try:
            bound = builtin_args(name, dict(args or {}))
        except ValidationError as exc:
            raise ValueError(f"reward function {name!r}: bad args: {exc}") from exc
        return partial(_IMPLEMENTATIONS[name], **bound)
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
    return partial(fn, **(args or {}))


def _episode(rollout: Rollout) -> dict[str, Any]:
    """What an agent's reward functions may get beyond a single-turn one's: the whole
    conversation and the environment instance (single-turn calls stay as they were)."""
    if rollout.episode is None:
        return {}
    return {"messages": [*rollout.prompt, *rollout.episode], "environment": rollout.environment}


_EPISODE_KEYWORDS = {"messages": None, "environment": None}


def _call(
    fn: RewardFn, takes: set[str], rollout: Rollout, group: Group, extra: dict[str, Any]
) -> float:
    """``fn`` on one rollout, as every reward function is called; a non-finite value is 0."""
    value = float(
        fn(
            rollout.completion,
            prompt=rollout.prompt,
            context=group.context,
            **{k: v for k, v in extra.items() if k in takes},
        )
    )
    return value if math.isfinite(value) else 0.0


class FunctionScorer:
    # Scores in microseconds: the training loop stores rollouts and rewards together.
    instant = True

    def __init__(self, spec: dict[str, Any]) -> None:
        names = [f["name"] for f in spec["functions"]]
        self.functions = [
            (
                # The breakdown is keyed by name; a function used twice gets its position.
                name if names.count(name) == 1 else f"{name}[{i}]",
                resolve(name, f.get("args")),
                float(f.get("weight", 1.0)),
            )
            for i, (name, f) in enumerate(zip(names, spec["functions"], strict=True))
        ]
        self.total_weight = sum(w for _, _, w in self.functions)
        # Which of an episode's extra keywords each function takes, read from its signature
        # once here rather than for every rollout.
        self.takes = {name: set(accepted(fn, _EPISODE_KEYWORDS)) for name, fn, _ in self.functions}

    def check(self) -> None:
        """Resolving the functions in __init__ already proved they import."""

    def score(self, groups: list[Group]) -> list[list[Score]]:
        scored = []
        for group in groups:
            row = []
            for rollout in group.rollouts:
                parts: dict[str, float] = {}
                extra = _episode(rollout)
                for name, fn, _ in self.functions:
                    parts[name] = _call(fn, self.takes[name], rollout, group, extra)
                total = sum(parts[n] * w for n, _, w in self.functions) / self.total_weight
                row.append(Score(total, {"functions": parts}))
            scored.append(row)
        return scored


class EvalMetrics:
    """A run's extra evaluation metrics (``grpo.eval_metrics``): functions called as reward
    functions are, on each validation rollout, averaged over the rollouts evaluated."""

    def __init__(self, metrics: list[dict[str, Any]]) -> None:
        self.metrics = [(m["label"], resolve(m["name"], m.get("args"))) for m in metrics]
        self.takes = {label: set(accepted(fn, _EPISODE_KEYWORDS)) for label, fn in self.metrics}

    def averages(self, groups: list[Group]) -> dict[str, float]:
        """{label: the mean over every rollout of ``groups``}."""
        totals = {label: 0.0 for label, _ in self.metrics}
        count = 0
        for group in groups:
            for rollout in group.rollouts:
                extra = _episode(rollout)
                for label, fn in self.metrics:
                    totals[label] += _call(fn, self.takes[label], rollout, group, extra)
                count += 1
        return {label: total / max(count, 1) for label, total in totals.items()}
