"""User code for agent runs, imported by path the way a run names it
(``tests.support.agent_tools:NAME``): tools for a ``tools`` environment, environment classes
for a ``python`` one, reward functions, and the broken ones that must fail to load.

Each misbehaving tool does one thing a worker must survive: block past its deadline, raise,
call ``sys.exit``, flood its caller. The blocking one waits on :data:`RELEASE` (a test sets
it when done), so no thread outlives the test that started it by more than a moment.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from pydantic import TypeAdapter

from app.runs.spec.environments import EnvironmentSpec

RELEASE = threading.Event()  # set by a test to let ``block``'s threads finish


def environment_spec(**body: Any) -> dict[str, Any]:
    """A run's ``environment`` as the worker gets it: validated by the API's own model, its
    defaults filled in (limits included)."""
    return TypeAdapter(EnvironmentSpec).validate_python(body).model_dump()


def greet(name: str, excited: bool = False) -> str:
    """Greet someone by name.

    Args:
        name: Who to greet.
        excited: Whether to end with an exclamation mark.
    """
    return f"Hello, {name}{'!' if excited else '.'}"


def block(seconds: float) -> str:
    """Wait, as a tool stuck on a slow service would.

    Args:
        seconds: The longest wait; the tool answers after :data:`RELEASE` is set.
    """
    RELEASE.wait(seconds)
    return "released"


def explode(reason: str) -> str:
    """Fail with the reason given.

    Args:
        reason: The error's message.
    """
    raise ValueError(reason)


def leave(code: int) -> str:
    """Ask the interpreter to exit, as a careless script would.

    Args:
        code: The exit status.
    """
    sys.exit(code)


def flood(megabytes: int) -> str:
    """Answer with far more text than anyone should read.

    Args:
        megabytes: How many megabytes of text.
    """
    return "x" * (megabytes * 1_000_000)


def weather(city: str) -> dict[str, Any]:
    """The weather in a city, as a structured answer.

    Args:
        city: The city.
    """
    return {"city": city, "celsius": 21.5, "sunny": True, "note": "ça va"}


def undocumented(a: int) -> int:
    return a


def unhinted(a):  # type: ignore[no-untyped-def]  # on purpose: no schema can be derived
    """Return a.

    Args:
        a: Anything.
    """
    return a


class Counter:
    """A user environment on TRL's contract: state per episode, tools, its own reward.

    The reward is 1 when the final answer states how many times ``bump`` was called.
    """

    def __init__(self, start: int = 0) -> None:
        self.start = start
        self.count = start
        self.seen: dict[str, Any] = {}

    def reset(self, **kwargs: Any) -> str:
        self.seen = kwargs
        self.count = self.start
        return f"The counter starts at {self.start}."

    def bump(self, by: int = 1) -> int:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.count += by
        return self.count

    def read(self) -> str:
        """Say what the counter is at."""
        return f"count={self.count}"

    def get_reward(self, completion: str) -> float:
        return float(completion.strip() == str(self.count))


class KwargsReward(Counter):
    """``get_reward(**kwargs)`` is called as TRL calls it: with nothing."""

    def get_reward(self, **kwargs: Any) -> float:  # type: ignore[override]
        self.given = kwargs
        return 0.5


class AsyncMessagesReward(Counter):
    """An async ``get_reward`` that names ``messages``, Trainyard's opt-in: awaited, given
    the conversation."""

    async def get_reward(self, messages: list[dict[str, Any]]) -> float:  # type: ignore[override]
        return float(len(messages))


class RewardNeedsAnswer(Counter):
    """A ``get_reward`` that needs what nobody gives it."""

    def get_reward(self, answer: str) -> float:  # type: ignore[override]
        return 1.0


class SmallCalculator:
    """TRL's environment contract and nothing more, so that the same class runs under plain
    TRL (``GRPOTrainer(environment_factory=SmallCalculator)``) and in Trainyard
    (``factory: tests.support.agent_tools:SmallCalculator``): ``reset(**row)``, its public
    methods the tools, ``get_reward()`` with no arguments.

    Its tools refuse numbers above 4, so the calculator agent's model, warmed up on the
    preset's demonstrations (many of them with a 5), often sees a tool fail. The reward is 1
    when a tool's result was the input's answer (``context.answer``), else 0.
    """

    def __init__(self) -> None:
        self.answer: Any = None
        self.results: list[float] = []

    def reset(self, **row: Any) -> None:
        self.answer = (row.get("context") or {}).get("answer")
        self.results = []

    def add(self, a: float, b: float) -> float:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return self._result(self._small(a) + self._small(b))

    def multiply(self, a: float, b: float) -> float:
        """Multiply two numbers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        return self._result(self._small(a) * self._small(b))

    def get_reward(self) -> float:
        return float(self.answer is not None and self.answer in self.results)

    def _small(self, x: float) -> float:
        if x > 4:
            raise ValueError(f"{x} is too large: this calculator takes numbers up to 4")
        return x

    def _result(self, x: float) -> float:
        self.results.append(x)
        return x


class NoReset:
    """Not an environment: TRL needs reset."""

    def tool(self, x: int) -> int:
        """Echo.

        Args:
            x: A number.
        """
        return x


class BadTool:
    """An environment whose one tool cannot be described to the model."""

    def reset(self, **kwargs: Any) -> None:
        return None

    def poke(self, x):  # type: ignore[no-untyped-def]  # on purpose: no type hints
        return x


class Unbuildable:
    """An environment whose constructor fails (a missing service, a bad argument)."""

    def __init__(self, url: str = "") -> None:
        raise ConnectionError(f"cannot reach {url or 'the service'}")

    def reset(self, **kwargs: Any) -> None:
        return None

    def ping(self) -> str:
        """Ping the service."""
        return "pong"


def saw_episode(
    completion: str,
    *,
    prompt: list[dict[str, Any]],
    context: dict[str, Any] | None,
    messages: list[dict[str, Any]] | None = None,
    environment: Any = None,
    **_: Any,
) -> float:
    """A reward that reports what it was given: the number of messages (0 without
    ``messages``), plus 0.5 when it got an environment."""
    SEEN.append({"completion": completion, "messages": messages, "environment": environment})
    return (len(messages) if messages is not None else 0) + (0.5 if environment is not None else 0)


def single_turn(completion: str, *, prompt: list[dict[str, Any]], context: Any) -> float:
    """A reward written before agents existed: it takes no extra keywords."""
    return float(len(completion))


SEEN: list[dict[str, Any]] = []  # what ``saw_episode`` was called with, in order


# --- for the worker-process fault tests (tests/workers/test_agent_faults.py) ---------------


def slow_add(a: float, b: float) -> float:
    """Add two numbers, slowly.

    Args:
        a: The first number.
        b: The second number.
    """
    time.sleep(30)
    return a + b


def broken_add(a: float, b: float) -> float:
    """Add two numbers, except that it always fails.

    Args:
        a: The first number.
        b: The second number.
    """
    raise RuntimeError("the adder is broken")


def flood_add(a: float, b: float) -> str:
    """Add two numbers, and say far too much about it.

    Args:
        a: The first number.
        b: The second number.
    """
    return f"{a + b} " + "banana " * (10 * 1024 * 1024 // 7)


def patient_add(a: float, b: float) -> float:
    """Add two numbers, taking a moment.

    Args:
        a: The first number.
        b: The second number.
    """
    time.sleep(0.3)
    return a + b
