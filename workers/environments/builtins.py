"""The built-in tools and environments, so that a run needs no code of its own.

Their names and summaries are listed once, in :mod:`app.runs.spec.environments`
(``BUILTIN_TOOLS``, ``BUILTIN_ENVIRONMENTS``), which the API validates run bodies against;
the implementations here attach to those lists by name. The environments are plain classes
on TRL's ``environment_factory`` contract (``reset``, tool methods, ``get_reward``) and are
loaded exactly like a user's ``package.module:Class``. Their ``get_reward`` names
``completion``, Trainyard's opt-in: they reward the final answer, which a ``get_reward()``
as TRL calls it cannot see (under plain TRL it would always score 0).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from app.runs.spec.environments import BUILTIN_ENVIRONMENTS, BUILTIN_TOOLS


def _plain(x: float) -> float | int:
    """7.0 → 7: what a person (and a small model's demonstrations) would write."""
    x = float(x)
    return int(x) if math.isfinite(x) and x.is_integer() and abs(x) < 2**53 else x


def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return _plain(a + b)


def subtract(a: float, b: float) -> float:
    """Subtract the second number from the first.

    Args:
        a: The number to subtract from.
        b: The number to subtract.
    """
    return _plain(a - b)


def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return _plain(a * b)


def divide(a: float, b: float) -> float:
    """Divide the first number by the second.

    Args:
        a: The dividend.
        b: The divisor (not zero).
    """
    if b == 0:
        raise ZeroDivisionError("cannot divide by zero")
    return _plain(a / b)


TOOLS: dict[str, Callable[..., Any]] = {f.__name__: f for f in (add, subtract, multiply, divide)}

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def same_answer(completion: str | None, answer: Any) -> bool:
    """Whether the final answer is ``answer``: numbers compared as numbers (the last one in
    the text), anything else as trimmed, case-folded text."""
    if answer is None or completion is None:
        return False
    text = completion.strip()
    try:
        expected = float(answer)
    except (TypeError, ValueError):
        return text.casefold() == str(answer).strip().casefold()
    found = _NUMBER.findall(text)
    return bool(found) and math.isclose(float(found[-1]), expected, rel_tol=1e-9, abs_tol=1e-9)


class Calculator:
    """Arithmetic tools; the reward is 1 when the final answer is the input's
    ``context.answer``, else 0."""

    def __init__(self) -> None:
        self.answer: Any = None

    def reset(self, context: dict[str, Any] | None = None, **_: Any) -> None:
        self.answer = (context or {}).get("answer")

    add = staticmethod(add)
    subtract = staticmethod(subtract)
    multiply = staticmethod(multiply)
    divide = staticmethod(divide)

    def get_reward(self, completion: str | None = None) -> float:
        return float(same_answer(completion, self.answer))


class Lookup:
    """A small key-value store the agent must query. The store is the input's
    ``context.store`` or, without one, the environment's ``args.store``; the reward is 1 when
    the final answer is ``context.answer``, else 0."""

    def __init__(self, store: dict[str, Any] | None = None) -> None:
        self._default = dict(store or {})
        self._store: dict[str, Any] = dict(self._default)
        self._answer: Any = None

    def reset(self, context: dict[str, Any] | None = None, **_: Any) -> None:
        context = context or {}
        self._store = dict(context.get("store") or self._default)
        self._answer = context.get("answer")

    def lookup(self, key: str) -> str:
        """Look a key up in the store.

        Args:
            key: The key to look up.
        """
        if key not in self._store:
            raise KeyError(f"no such key: {key!r}")
        return str(self._store[key])

    def list_keys(self) -> list[str]:
        """List the keys in the store."""
        return sorted(self._store)

    def get_reward(self, completion: str | None = None) -> float:
        return float(same_answer(completion, self._answer))


ENVIRONMENTS: dict[str, type] = {"calculator": Calculator, "lookup": Lookup}

for _have, _listed, _what in (
    (TOOLS, BUILTIN_TOOLS, "tools"),
    (ENVIRONMENTS, BUILTIN_ENVIRONMENTS, "environments"),
):
    if _have.keys() != _listed.keys():  # not an assert: python -O keeps it
        raise RuntimeError(
            f"built-in {_what} listed in app.runs.spec.environments and implemented here differ: "
            + ", ".join(sorted(_have.keys() ^ _listed.keys()))
        )
