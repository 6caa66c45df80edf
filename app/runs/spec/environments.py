"""Where an agent acts: a run's ``environment``, a tagged union on ``type``.

- ``tools``: plain functions the model may call (built-ins or ``package.module:function``);
- ``python``: an environment object with tools, state per episode and its own reward (a
  built-in, or ``package.module:Class``), made from ``args`` and each input's context;
- ``mcp``: the tools of an MCP server, started over stdio (``command``), reached over
  streamable HTTP (``url``), or one of the operator's catalog (``server``);
- ``gateway``: the user's own agent, a harness outside Trainyard that plays each episode
  through the run's OpenAI-compatible gateway (docs/gateway.md) and gives its reward.

Every kind bounds an episode the same way: ``max_turns`` tool-calling rounds (TRL's
``max_tool_calling_iterations``), a timeout per call and a cap on each result's length; and
shows a tool's exception to the model the same way (``tool_errors``: TRL's text by default).

Validated when the run is created, so a typo in a tool's name is a 422 naming the field,
not a failure an hour later on a GPU. :data:`BUILTIN_TOOLS` and
:data:`BUILTIN_ENVIRONMENTS` are the one list of built-ins: the workers attach their
implementations to these names, as they do for :data:`~app.runs.spec.rewards.BUILTIN_REWARDS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from app.catalog.models import ENTRY_NAME
from app.core.errors import inconsistent
from app.core.storable import HttpUrlStr, NulFreeStr, StorableObject
from app.runs.spec.rewards import (
    ENV_NAME,
    Strict,
    builtin_or_import_path,
    check_builtin_args,
    describe_builtin_args,
)

# --- built-ins -----------------------------------------------------------------------------


@dataclass(frozen=True)
class BuiltinTool:
    name: str
    summary: str


BUILTIN_TOOLS: dict[str, BuiltinTool] = {
    t.name: t
    for t in (
        BuiltinTool("add", "add(a, b): a + b"),
        BuiltinTool("subtract", "subtract(a, b): a - b"),
        BuiltinTool("multiply", "multiply(a, b): a * b"),
        BuiltinTool("divide", "divide(a, b): a / b (dividing by zero is a tool error)"),
    )
}


class CalculatorArgs(Strict):
    """The calculator takes no arguments."""


class LookupArgs(Strict):
    # A plain object here: args as a whole is a StorableObject, checked before these.
    store: dict[str, Any] | None = Field(
        default=None,
        description="The key-value store of every episode; unset: each input's context.store.",
    )


@dataclass(frozen=True)
class BuiltinEnvironment:
    name: str
    summary: str
    args: type[Strict]


BUILTIN_ENVIRONMENTS: dict[str, BuiltinEnvironment] = {
    e.name: e
    for e in (
        BuiltinEnvironment(
            "calculator",
            "arithmetic tools add/subtract/multiply/divide; rewards the right final answer "
            "(context.answer)",
            CalculatorArgs,
        ),
        BuiltinEnvironment(
            "lookup",
            "a small key-value store the agent must query with lookup(key) and list_keys(), "
            "from args.store or the input's context.store; rewards the right final answer "
            "(context.answer)",
            LookupArgs,
        ),
    )
}

_TOOL_NAME, _TOOL_NAME_RE = builtin_or_import_path(BUILTIN_TOOLS)
_FACTORY, _FACTORY_RE = builtin_or_import_path(BUILTIN_ENVIRONMENTS)


def _no_repeats(values: list[str] | None, what: str) -> list[str] | None:
    if values is not None:
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise ValueError(f"{what} named more than once: {', '.join(repeated)}")
    return values


# --- the environments ----------------------------------------------------------------------


class _Episode(Strict):
    """How far an episode may go, and what its model is shown of a failed call, whatever the
    environment."""

    max_turns: int = Field(
        default=4,
        ge=1,
        le=50,
        description="The most tool-calling rounds in an episode: TRL's "
        "max_tool_calling_iterations; the model answers after at most this many.",
    )
    tool_timeout_seconds: float = Field(
        default=10,
        gt=0,
        le=600,
        description="How long one tool call may take; a call that runs over is a tool "
        "error the model sees.",
    )
    max_tool_output_chars: int = Field(
        default=4000,
        ge=100,
        le=1_000_000,
        description="The longest tool result the model is shown; longer results are cut and "
        "marked.",
    )
    tool_errors: Literal["trl", "typed"] = Field(
        default="trl",
        description="What the model is shown when a tool raises: 'trl', what TRL shows, "
        "{'error': 'cannot divide by zero'} (str of the exception); 'typed', the exception's "
        "type first, {'error': 'ZeroDivisionError: cannot divide by zero'}. A timeout, a cut "
        "result and an MCP server's error text have messages of their own either way.",
    )


ToolName = Annotated[
    str,
    Field(
        max_length=300,
        json_schema_extra={"pattern": _TOOL_NAME},
        description="A built-in tool ("
        + "; ".join(f"{t.name}: {t.summary}" for t in BUILTIN_TOOLS.values())
        + ") or a dotted import path 'package.module:function' importable on the workers.",
    ),
]


class ToolsEnvironment(_Episode):
    """Plain functions the model may call; the run's reward scores the episode."""

    type: Literal["tools"]
    tools: list[ToolName] = Field(
        min_length=1,
        max_length=32,
        json_schema_extra={"uniqueItems": True},
        description="The tools, each named once; the model sees their signatures and docstrings.",
    )

    @field_validator("tools")
    @classmethod
    def _known(cls, value: list[str]) -> list[str]:
        for name in value:
            if not _TOOL_NAME_RE.match(name):
                raise ValueError(
                    f"unknown tool {name!r}: use a built-in ({', '.join(sorted(BUILTIN_TOOLS))})"
                    " or 'package.module:function'"
                )
        _no_repeats(value, "tools")
        return value


class PythonEnvironment(_Episode):
    """An environment object per episode: its methods are the tools, it keeps the episode's
    state, and its get_reward is what the ``environment`` reward function returns."""

    model_config = ConfigDict(
        json_schema_extra=describe_builtin_args("factory", BUILTIN_ENVIRONMENTS.values())
    )

    type: Literal["python"]
    factory: str = Field(
        max_length=300,
        json_schema_extra={"pattern": _FACTORY},
        description="A built-in environment ("
        + "; ".join(f"{e.name}: {e.summary}" for e in BUILTIN_ENVIRONMENTS.values())
        + ") or a dotted import path 'package.module:Class' importable on the workers.",
    )
    args: StorableObject = Field(
        default_factory=dict,
        description="Keyword arguments of the factory; a built-in's are checked here "
        "(lookup: store).",
    )

    @field_validator("factory")
    @classmethod
    def _known(cls, value: str) -> str:
        if not _FACTORY_RE.match(value):
            raise ValueError(
                f"unknown environment {value!r}: use a built-in "
                f"({', '.join(sorted(BUILTIN_ENVIRONMENTS))}) or 'package.module:Class'"
            )
        return value

    @field_validator("args")
    @classmethod
    def _builtin_args(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        builtin = BUILTIN_ENVIRONMENTS.get(info.data.get("factory", ""))
        if builtin is not None:  # a user factory's args are the user's to check
            check_builtin_args(builtin.name, builtin.args, value)
        return value


EnvName = Annotated[str, Field(max_length=200, pattern=ENV_NAME)]


def _every_key_a_name(schema: dict[str, Any]) -> None:
    # pydantic writes constrained keys as patternProperties, which leaves other keys
    # unconstrained in the document: say "every key" instead.
    value = schema.pop("patternProperties").popitem()[1]
    schema["propertyNames"] = {"pattern": ENV_NAME, "maxLength": 200}
    schema["additionalProperties"] = value


class McpEnvironment(_Episode):
    """The tools of an MCP server; the run's reward scores the episode."""

    type: Literal["mcp"]
    command: list[Annotated[NulFreeStr, Field(min_length=1, max_length=4000)]] | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        description="The argv of an MCP server the worker starts over stdio, e.g. "
        "['python', '-m', 'my_server']. Not with url.",
    )
    url: HttpUrlStr | None = Field(
        default=None,
        max_length=2000,
        description="An MCP server over streamable HTTP, e.g. http://host:8000/mcp. Not with "
        "command.",
    )
    server: str | None = Field(
        default=None,
        max_length=100,
        pattern=ENTRY_NAME,
        validate_default=True,  # so that none of command, url and server is a 422 naming it
        description="An MCP server of the operator's catalog (GET /catalog), by name; the only "
        "kind the catalog code policy allows. Not with command or url.",
    )
    tools: list[Annotated[NulFreeStr, Field(min_length=1, max_length=500)]] | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        json_schema_extra={"uniqueItems": True},
        description="The server's tools the model may call; unset: all it offers.",
    )
    env: dict[EnvName, Annotated[NulFreeStr, Field(max_length=10_000)]] = Field(
        default_factory=dict,
        max_length=50,
        json_schema_extra=_every_key_a_name,
        description="Extra environment variables of a stdio server.",
    )

    @field_validator("server")
    @classmethod
    def _one_server(cls, value: str | None, info: ValidationInfo) -> str | None:
        if "command" not in info.data or "url" not in info.data:
            return value  # command or url was invalid; that is the error to report
        given = [v for v in (info.data["command"], info.data["url"], value) if v is not None]
        if len(given) != 1:
            raise inconsistent(
                "give exactly one of command (a stdio server), url and server (one of the "
                "catalog's)"
            )
        return value

    @field_validator("env")
    @classmethod
    def _env_of_a_command(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        if value and info.data.get("server") is not None:
            raise inconsistent("a server of the catalog has its own env: leave env out")
        return value

    @field_validator("tools")
    @classmethod
    def _once_each(cls, value: list[str] | None) -> list[str] | None:
        return _no_repeats(value, "tools")


class GatewayEnvironment(Strict):
    """The user's own agent: each rollout is an episode a harness outside Trainyard plays
    through the run's OpenAI-compatible gateway, token for token on the run's policy; the
    harness's finish gives its reward (the ``environment`` reward function)."""

    type: Literal["gateway"]
    episode_timeout_seconds: float = Field(
        default=300,
        gt=0,
        le=86_400,
        description="How long a harness may hold an episode it claimed before it is taken "
        "back and handed out again (its token stops working).",
    )
    max_issues: int = Field(
        default=3,
        ge=1,
        le=20,
        description="How many times an episode is handed out; one that is still unfinished "
        "after that is dropped (no reward) and counted.",
    )
    max_calls: int = Field(
        default=32,
        ge=1,
        le=1_000,
        description="The most model calls one claim of an episode may make (an episode "
        "handed out again starts over); a call beyond it is refused (409).",
    )
    tools: list[StorableObject] | None = Field(
        default=None,
        max_length=128,
        description="The tools the harness offers the model, as OpenAI function tools "
        "({type: function, function: {name, description, parameters}}), for an SFT "
        "warm-up to render its demonstrations with, so warm-up and episodes see one prompt; "
        "a harness may read them from the run. Unset: demonstrations without tool schemas.",
    )
    harness: str | None = Field(
        default=None,
        max_length=100,
        pattern=ENTRY_NAME,
        description="Push mode: a harness of the operator's catalog (GET /catalog) the worker "
        "POSTs each episode to, taking the answer as its finish. Unset (and no harness_url): "
        "pull mode, harnesses claim episodes (POST /runs/{id}/episodes/claim).",
    )
    harness_url: HttpUrlStr | None = Field(
        default=None,
        max_length=2000,
        description="Push mode with a harness of the run's own (the open code policy only). "
        "Not with harness.",
    )

    @field_validator("harness_url")
    @classmethod
    def _one_harness(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("harness") is not None:
            raise inconsistent("give harness (one of the catalog's) or harness_url, not both")
        return value

    @property
    def push(self) -> bool:
        return self.harness is not None or self.harness_url is not None


EnvironmentSpec = Annotated[
    ToolsEnvironment | PythonEnvironment | McpEnvironment | GatewayEnvironment,
    Field(discriminator="type"),
]
