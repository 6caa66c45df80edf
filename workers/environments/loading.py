"""A run's ``environment`` spec made into TRL's ``environment_factory``.

Each type becomes an :class:`~workers.environments.episode.Episode` subclass whose public
methods are the tools, every one guarded (deadline, output cap, errors as tool messages):

- ``tools``: stateless functions (built-in names or ``package.module:function``);
- ``python``: a class on TRL's contract (a built-in or ``package.module:Class``), one
  instance per rollout, wrapped so its methods are guarded and its ``get_reward`` (called
  as TRL calls it, plus ``completion`` / ``messages`` when it names them) is the
  ``environment`` reward function's;
- ``mcp``: the tools an MCP server offers (through the ``mcp`` SDK), their JSON schemas
  made into the methods' signatures.

Everything that can be checked is checked here, before the first step: imports, the
constructor, each tool's schema; a failure is :class:`EnvironmentUnavailable` saying why.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import keyword
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any

from pydantic import BaseModel

from app.runs.spec.environments import EnvironmentSpec
from workers.environments.episode import (
    Episode,
    accepted,
    environment_class,
    resolved_hints,
    tool_method,
)
from workers.environments.safety import (
    EpisodeFailed,
    Limits,
    ToolFailed,
    ToolTimeout,
    with_deadline,
)

log = logging.getLogger(__name__)


class EnvironmentUnavailable(ValueError):
    """The run's environment cannot be loaded on this worker; the message says why."""


@dataclass
class LoadedEnvironment:
    factory: type[Episode]  # TRL's environment_factory: one instance per rollout
    max_turns: int
    tool_names: list[str]
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for close in self.closers:
            close()


def load_environment(spec: EnvironmentSpec | dict[str, Any]) -> LoadedEnvironment:
    """The run's environment, loaded and checked: its imports, constructor, tool schemas and
    MCP server, before the first step."""
    if isinstance(spec, BaseModel):
        spec = spec.model_dump()
    limits = Limits.of(spec)
    closers: list[Callable[[], None]] = []
    kind = spec["type"]
    if kind == "tools":
        factory = _tools_environment(spec["tools"], limits)
    elif kind == "python":
        factory = _python_environment(spec["factory"], spec.get("args") or {}, limits)
    elif kind == "mcp":
        factory, close = _mcp_environment(spec, limits)
        closers.append(close)
    else:
        raise EnvironmentUnavailable(f"unknown environment type {kind!r}")
    try:
        names = _check_schemas(factory)
        factory()  # the constructor, now rather than inside TRL
    except EnvironmentUnavailable:
        for close in closers:
            close()
        raise
    except Exception as exc:
        for close in closers:
            close()
        raise EnvironmentUnavailable(
            f"the environment cannot be constructed: {type(exc).__name__}: {exc}"
        ) from exc
    return LoadedEnvironment(factory, int(spec["max_turns"]), names, closers)


def _import(path: str, what: str) -> Any:
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    try:
        return getattr(import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise EnvironmentUnavailable(
            f"{what} {path!r} cannot be imported on this worker: {exc}"
        ) from exc


def _check_schemas(factory: type[Episode]) -> list[str]:
    """Each tool's schema as the chat template will get it (transformers' get_json_schema),
    so a tool without a docstring or type hints fails the run now, naming it."""
    from transformers.utils import get_json_schema

    names = []
    for name, method in inspect.getmembers(factory, predicate=inspect.isfunction):
        if name.startswith("_") or name == "reset":
            continue
        try:
            get_json_schema(method)
        except Exception as exc:
            raise EnvironmentUnavailable(
                f"tool {name!r} has no usable schema (it needs type hints and a Google-style "
                f"docstring describing every argument): {exc}"
            ) from exc
        names.append(name)
    if not names:
        raise EnvironmentUnavailable("the environment offers no tools (no public methods)")
    return names


def _guarded(fn: Callable[..., Any], limits: Limits) -> Callable[[Episode, dict[str, Any]], str]:
    name = fn.__name__
    if inspect.iscoroutinefunction(fn):

        def call(**kwargs: Any) -> Any:
            return asyncio.run(fn(**kwargs))

        call.__name__ = name
    else:
        call = fn
    return lambda self, kwargs: self._invoke(
        name, lambda: with_deadline(call, kwargs, limits.timeout)
    )


def _function_tool(name: str, fn: Callable[..., Any], limits: Limits) -> Callable[..., str]:
    return tool_method(
        name,
        inspect.signature(fn),
        inspect.getdoc(fn) or "",
        resolved_hints(fn),
        _guarded(fn, limits),
        like=fn,
    )


# --- tools --------------------------------------------------------------------------------


def _tools_environment(names: list[str], limits: Limits) -> type[Episode]:
    from workers.environments.builtins import TOOLS

    methods = {}
    for name in names:
        fn = TOOLS.get(name) or _import(name, "tool")
        if not callable(fn):
            raise EnvironmentUnavailable(f"tool {name!r} is not callable")
        tool_name = getattr(fn, "__name__", name.rpartition(":")[2])
        if tool_name in methods:
            raise EnvironmentUnavailable(f"two tools are named {tool_name!r}")
        methods[tool_name] = _function_tool(tool_name, fn, limits)
    return environment_class("ToolsEnvironment", Episode, methods, limits=limits)


# --- python -------------------------------------------------------------------------------


# What Trainyard offers a get_reward beyond TRL's call with no arguments, to one that names
# them as parameters: the final answer's text, and the whole conversation.
REWARD_EXTRAS = ("completion", "messages")


class _Wrapped(Episode):
    """A user's (or built-in) environment instance behind guarded tool methods."""

    _cls: type
    _args: dict[str, Any]
    _reward_extras: tuple[str, ...]  # which of REWARD_EXTRAS its get_reward names

    def __init__(self) -> None:
        super().__init__()
        self._inner = self._cls(**self._args)

    def _begin(self, **episode: Any) -> str | None:
        observation = self._inner.reset(**accepted(self._inner.reset, episode))
        return (
            observation if isinstance(observation, str) or observation is None else str(observation)
        )

    def _reward(self, completion: str, messages: list[dict[str, Any]]) -> float | None:
        """``get_reward()`` as TRL calls it (no arguments; awaited when async), given only
        those of ``completion`` and ``messages`` it names as parameters."""
        get_reward = getattr(self._inner, "get_reward", None)
        if get_reward is None:
            raise ValueError(
                f"{self._cls.__name__} has no get_reward, so the 'environment' reward "
                "function cannot score its episodes"
            )
        offered = {"completion": completion, "messages": messages}
        value = get_reward(**{k: offered[k] for k in self._reward_extras})
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
        return None if value is None else float(value)


async def _awaited(value: Any) -> Any:
    return await value


def _reward_extras(cls: type, path: str) -> tuple[str, ...]:
    """Which of :data:`REWARD_EXTRAS` the class's ``get_reward`` names; any other parameter
    it needs fails the run now (TRL calls it with none)."""
    get_reward = getattr(cls, "get_reward", None)
    if get_reward is None:
        return ()
    params = list(inspect.signature(get_reward).parameters.values())[1:]  # after self
    named = tuple(
        p.name
        for p in params
        if p.name in REWARD_EXTRAS
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    )
    needed = [
        p.name
        for p in params
        if p.name not in named
        and p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if needed:
        raise EnvironmentUnavailable(
            f"environment {path!r}: get_reward needs {', '.join(needed)}, which nothing gives "
            "it: TRL calls get_reward() with no arguments, and Trainyard offers only "
            f"{' and '.join(REWARD_EXTRAS)} (to a get_reward that names them)"
        )
    return named


def _python_environment(path: str, args: dict[str, Any], limits: Limits) -> type[Episode]:
    from workers.environments.builtins import ENVIRONMENTS

    cls = ENVIRONMENTS.get(path) or _import(path, "environment factory")
    if not inspect.isclass(cls):
        raise EnvironmentUnavailable(f"environment factory {path!r} is not a class")
    if not callable(getattr(cls, "reset", None)):
        raise EnvironmentUnavailable(
            f"environment {path!r} has no reset method (TRL's environment contract)"
        )
    methods = {
        name: _bound_tool(name, fn, limits)
        for name, fn in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not name.startswith("_") and name not in ("reset", "get_reward")
    }
    return environment_class(
        f"{cls.__name__}Environment",
        _Wrapped,
        methods,
        limits=limits,
        _cls=cls,
        _args=args,
        _reward_extras=_reward_extras(cls, path),
    )


def _bound_tool(name: str, fn: Callable[..., Any], limits: Limits) -> Callable[..., str]:
    """A tool method of the wrapper calling the same method of the wrapped instance."""

    def body(self: Episode, kwargs: dict[str, Any]) -> str:
        target = getattr(self._inner, name)  # type: ignore[attr-defined]
        return _guarded(target, limits)(self, kwargs)

    return tool_method(
        name, inspect.signature(fn), inspect.getdoc(fn) or "", resolved_hints(fn), body, like=fn
    )


# --- mcp ----------------------------------------------------------------------------------

_JSON_TYPES: dict[str, type] = {
    "string": str,
    "integer": int,
    "number": float,
    "boolean": bool,
    "array": list,
    "object": dict,
}


def _schema_signature(tool: Any) -> tuple[inspect.Signature, dict[str, Any], str]:
    """An MCP tool's JSON schema as a Python signature, hints and Google-style docstring,
    which is how TRL (through transformers) writes tools into the prompt."""
    schema = tool.input_schema or {}
    properties: dict[str, Any] = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    params, hints, lines = [], {}, []
    for arg, prop in properties.items():
        if not arg.isidentifier() or keyword.iskeyword(arg):
            raise EnvironmentUnavailable(
                f"MCP tool {tool.name!r}: argument {arg!r} is not a Python identifier, which "
                "TRL's tool schema needs"
            )
        kind = prop.get("type")
        hint: Any = _JSON_TYPES.get(kind, str) if isinstance(kind, str) else str
        if arg not in required:
            hint = hint | None
        hints[arg] = hint
        params.append(
            inspect.Parameter(
                arg,
                inspect.Parameter.KEYWORD_ONLY,
                default=inspect.Parameter.empty if arg in required else None,
                annotation=hint,
            )
        )
        text = " ".join(str(prop.get(k) or "") for k in ("description",)).strip()
        text = text or str(prop.get("title") or f"The {arg}.")
        if isinstance(prop.get("enum"), list):
            text += f" (choices: {json.dumps(prop['enum'], ensure_ascii=False)})"
        lines.append(f"    {arg}: {' '.join(text.split())}")
    summary = " ".join((tool.description or tool.name).split())
    doc = summary + ("\n\nArgs:\n" + "\n".join(lines) if lines else "")
    return inspect.Signature(params), hints, doc


def _interpreter(command: list[str] | None) -> list[str] | None:
    """A server started as plain ``python`` (or ``python3``) runs on the worker's own
    interpreter, which has the ``mcp`` SDK: the child gets only the SDK's safe environment,
    and whatever ``python`` its PATH finds first may not. An explicit path is kept."""
    if command and command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    return command


def _mcp_environment(
    spec: dict[str, Any], limits: Limits
) -> tuple[type[Episode], Callable[[], None]]:
    from workers.environments.mcp import (
        McpServerGone,
        McpToolbox,
        McpToolError,
        McpUnavailable,
    )

    toolbox = McpToolbox(
        command=_interpreter(spec.get("command")),
        url=spec.get("url"),
        env=spec.get("env") or {},
        allow=spec.get("tools"),
    )
    try:
        tools = toolbox.start()
    except McpUnavailable as exc:
        toolbox.close()
        raise EnvironmentUnavailable(f"the MCP server cannot be used: {exc}") from exc

    def body_for(name: str) -> Callable[[Episode, dict[str, Any]], str]:
        def body(self: Episode, kwargs: dict[str, Any]) -> str:
            def invoke() -> str:
                arguments = {k: v for k, v in kwargs.items() if v is not None}
                try:
                    return toolbox.call(name, arguments, timeout=limits.timeout)
                except McpToolError as exc:
                    raise ToolFailed(str(exc)) from None
                except TimeoutError:
                    raise ToolTimeout(
                        f"the tool did not answer within {limits.timeout:g} s"
                    ) from None
                except McpServerGone as exc:
                    raise EpisodeFailed(f"the MCP server is gone: {exc}") from None

            return self._invoke(name, invoke)

        return body

    methods = {}
    try:
        for tool in tools:
            if tool.name.startswith("_") or tool.name in ("reset", "get_reward"):
                raise EnvironmentUnavailable(
                    f"MCP tool {tool.name!r}: the name is TRL's environment contract's own "
                    "(reset, get_reward, or private); leave it out with environment.tools"
                )
            signature, hints, doc = _schema_signature(tool)
            methods[tool.name] = tool_method(tool.name, signature, doc, hints, body_for(tool.name))
    except EnvironmentUnavailable:
        toolbox.close()
        raise
    return environment_class("McpEnvironment", Episode, methods, limits=limits), toolbox.close
