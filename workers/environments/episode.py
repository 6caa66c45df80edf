"""One rollout's environment, on TRL's ``environment_factory`` contract.

``GRPOTrainer`` makes one instance per rollout (pooled, ``reset`` between episodes), exposes
every public method of its class as a tool (the signature and docstring are the tool's
schema) and hands the instances to the reward functions. Every environment type of a run
(``tools``, ``python``, ``mcp``) becomes a subclass of :class:`Episode` whose tool methods
go through :func:`~workers.environments.safety.call_tool`, so each instance knows, for its
own episode, every call's duration, error and truncation, and whether the episode failed.

Helpers are private (underscored): a public method would be offered to the model as a tool
(TRL lists the class's functions; the properties the pipeline reads are not offered).
``get_reward`` is deliberately not defined: TRL would add it as a reward of its own, outside
the run's weighted reward spec; the ``environment`` reward function calls
:meth:`Episode._reward` instead.
"""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Callable
from typing import Any, ClassVar

from workers.environments.safety import CallRecord, EpisodeFailed, Limits, call_tool


class Episode:
    limits: ClassVar[Limits]

    def __init__(self) -> None:
        self._calls: list[CallRecord] = []
        self._failed: str | None = None

    def reset(self, **row: Any) -> str | None:
        """TRL's reset, with the dataset row (prompt, input_id, context as JSON text)."""
        self._calls = []
        self._failed = None
        context = row.get("context")
        if isinstance(context, str):
            context = json.loads(context) if context else None
        prompt = row.get("prompt") or []
        user = [m for m in prompt if m.get("role") == "user"]
        return self._begin(
            prompt=prompt,
            input_text=user[-1]["content"] if user else "",
            context=context or {},
            input_id=row.get("input_id"),
        )

    # --- for subclasses -------------------------------------------------------------------

    def _begin(self, **episode: Any) -> str | None:
        """Start an episode; a string returned is appended to the user's message."""
        return None

    def _reward(self, completion: str, messages: list[dict[str, Any]]) -> float | None:
        """The environment's own reward for the episode just played, if it has one."""
        raise NotImplementedError(f"{type(self).__name__} has no reward of its own")

    def _invoke(self, name: str, invoke: Callable[[], Any]) -> str:
        try:
            return call_tool(self._calls, name, invoke, self.limits)
        except EpisodeFailed as exc:
            self._failed = self._failed or str(exc)
            raise

    # --- for the pipeline -----------------------------------------------------------------

    # Properties, not methods: TRL offers an environment's public *functions* as tools.
    @property
    def records(self) -> list[CallRecord]:
        """Every tool call of the episode so far: name, duration, error, truncation."""
        return self._calls

    @property
    def failure(self) -> str | None:
        """Why the episode failed (a tool that broke it), or None."""
        return self._failed


def tool_method(
    name: str,
    signature: inspect.Signature,
    doc: str,
    annotations: dict[str, Any],
    body: Callable[[Episode, dict[str, Any]], str],
    like: Callable[..., Any] | None = None,
) -> Callable[..., str]:
    """A method named ``name`` whose schema (as transformers' ``get_json_schema`` reads it:
    signature, type hints, Google-style docstring) is the tool's, and whose call is
    ``body(self, kwargs)``. ``like``: the user's function it stands for, whose module and
    qualified name it takes, so that Python's own messages about a call TRL makes with
    arguments that are not an object name that function, as under plain TRL."""

    def method(self: Episode, **kwargs: Any) -> str:
        return body(self, kwargs)

    params = list(signature.parameters.values())
    if not params or params[0].name != "self":
        params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *params]
    method.__name__ = method.__qualname__ = name
    if like is not None:
        method.__module__ = like.__module__
        method.__qualname__ = getattr(like, "__qualname__", name)
    method.__doc__ = doc
    method.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    method.__annotations__ = {k: v for k, v in annotations.items() if k != "self"}
    return method


def resolved_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """``fn``'s annotations as objects (a string annotation of the tool's module would not
    resolve from the generated method's globals)."""
    try:
        return typing.get_type_hints(fn)
    except Exception:
        return dict(getattr(fn, "__annotations__", {}))


def accepted(fn: Callable[..., Any], offered: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``offered`` that ``fn`` takes (all of them with **kwargs)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return offered
    return {k: v for k, v in offered.items() if k in params}


def environment_class(
    name: str, base: type[Episode], methods: dict[str, Callable[..., str]], **attrs: Any
) -> type[Episode]:
    return type(name, (base,), {**methods, **attrs, "__module__": __name__})
