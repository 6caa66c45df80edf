"""How a run is rewarded: a tagged union on ``type`` (``ruler`` | ``rim`` | ``function``).

Validated when the run is created, so a mistake is a 422 naming the field, not a failure an
hour later on a GPU.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol

from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from app.catalog.models import ENTRY_NAME
from app.core.errors import inconsistent
from app.core.storable import HttpUrlStr, NulFreeStr, RequestModel, StorableObject

# The name of an environment variable (a judge's api_key_env, an MCP server's env).
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
# What names a user's code on the workers: 'package.module:function' (or a dotted path).
# ASCII, so that every reader of the document's regular expression, JSON Schema's included,
# means the same names. Reward functions, tools and environments are all named by it.
IMPORT_PATH = r"[A-Za-z_][A-Za-z0-9_.]*[:.][A-Za-z_][A-Za-z0-9_]*"


class Strict(RequestModel):
    """A part of the reward spec: unknown fields and non-finite numbers are a 422."""


# --- built-in reward functions ------------------------------------------------------------
# The one list of them: their names, what each does, and its arguments with their defaults
# and rules. The API validates a run's args against it (422 naming the field); the workers'
# implementations (workers.rewards.functions) attach to it by name and are called with the
# args it validated, defaults filled in.


class ExactMatchArgs(Strict):
    key: NulFreeStr = Field(default="answer", min_length=1, max_length=200)
    case_sensitive: bool = False


class RegexArgs(Strict):
    pattern: NulFreeStr = Field(
        min_length=1, max_length=2000, json_schema_extra={"format": "regex"}
    )
    full_match: bool = False

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a regular expression Python can compile: {exc}") from exc
        return value


class JsonValidArgs(Strict):
    required_keys: list[NulFreeStr] | None = Field(default=None, max_length=100)


class LengthTargetArgs(Strict):
    target: int = Field(default=100, ge=1, le=1_000_000)


class CharFractionArgs(Strict):
    char: NulFreeStr = Field(default="a", min_length=1, max_length=1)


class EnvironmentArgs(Strict):
    """None: the environment's get_reward takes what its episode left it."""


@dataclass(frozen=True)
class BuiltinReward:
    name: str
    summary: str
    args: type[Strict]


BUILTIN_REWARDS: dict[str, BuiltinReward] = {
    b.name: b
    for b in (
        BuiltinReward(
            "exact_match",
            "1 when the completion equals context[key] (whitespace-trimmed)",
            ExactMatchArgs,
        ),
        BuiltinReward(
            "regex",
            "1 when pattern matches the completion (anywhere, or whole with full_match)",
            RegexArgs,
        ),
        BuiltinReward(
            "json_valid",
            "1 when the completion is JSON (an object holding required_keys, if given)",
            JsonValidArgs,
        ),
        BuiltinReward(
            "length_target",
            "1 at exactly target characters, falling linearly to 0 at 0 or 2x target",
            LengthTargetArgs,
        ),
        BuiltinReward(
            "char_fraction",
            "The fraction of the completion's characters that are char",
            CharFractionArgs,
        ),
        BuiltinReward(
            "environment",
            "The environment's own reward: a python environment's get_reward, a gateway harness's "
            "reward",
            EnvironmentArgs,
        ),
    )
}


def _arg_doc(model: type[Strict]) -> list[str]:
    return [
        name if field.is_required() else f"{name}={field.default!r}"
        for name, field in model.model_fields.items()
    ]


def builtin_args(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """A built-in's ``args`` validated, with its defaults filled in (ValidationError if they
    do not fit)."""
    return BUILTIN_REWARDS[name].args.model_validate(args).model_dump()


def builtin_or_import_path(builtins: Iterable[str]) -> tuple[str, re.Pattern[str]]:
    """The regular expression of a name that is one of ``builtins`` or an import path: as
    the document writes it, and compiled as the validators match it (``\\Z``: a trailing
    newline is no match)."""
    pattern = f"^({'|'.join(sorted(builtins))}|{IMPORT_PATH})$"
    return pattern, re.compile(pattern.removesuffix("$") + r"\Z")


_FUNCTION_NAME, _FUNCTION_NAME_RE = builtin_or_import_path(BUILTIN_REWARDS)


class Builtin(Protocol):
    """A built-in a run names: a reward function, an environment."""

    @property
    def name(self) -> str: ...

    @property
    def args(self) -> type[Strict]: ...


def describe_builtin_args(
    key: str, builtins: Iterable[Builtin]
) -> Callable[[dict[str, Any]], None]:
    """A ``json_schema_extra`` saying in the document which args each built-in named by
    ``key`` takes (one branch per built-in, and one for import paths, whose args are
    free-form), so that a client, or a fuzzer, that follows it sends args the validators
    accept. Shared by reward functions and built-in environments."""

    def describe(schema: dict[str, Any]) -> None:
        branches: list[dict[str, Any]] = []
        for builtin in builtins:
            args = builtin.args.model_json_schema()
            args.pop("title", None)
            branch: dict[str, Any] = {"properties": {key: {"const": builtin.name}, "args": args}}
            if args.get("required"):
                branch["required"] = ["args"]
            branches.append(branch)
        branches.append({"properties": {key: {"pattern": f"^{IMPORT_PATH}$"}}})
        schema["anyOf"] = branches

    return describe


def check_builtin_args(name: str, model: type[Strict], args: dict[str, Any]) -> None:
    """``args`` of the built-in ``name`` checked against its ``model``: a ValueError naming
    the first argument that does not fit (the field validator's message)."""
    try:
        model.model_validate(args)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise ValueError(f"{name} {where or 'args'}: {message}") from None


class JudgeEndpoint(Strict):
    """Any OpenAI-compatible chat endpoint (vLLM, Ollama, OpenAI …): one of the operator's
    catalog by name (``{endpoint: big-judge}``), or a ``base_url`` and ``model`` of the run's
    own, which only the ``open`` code policy allows (docs/security.md)."""

    endpoint: str | None = Field(
        default=None,
        max_length=100,
        pattern=ENTRY_NAME,
        description="An endpoint of the operator's catalog (GET /catalog), by name: its base "
        "URL, model and key come from there. Not with base_url.",
    )
    base_url: HttpUrlStr | None = Field(
        default=None,
        max_length=500,
        description="e.g. http://host:8000/v1 (the open code policy only). Not with endpoint.",
    )
    model: NulFreeStr | None = Field(
        default=None,
        min_length=1,
        max_length=300,
        validate_default=True,  # so that neither endpoint nor base_url is a 422 naming it
        description="The model the base_url serves (an endpoint of the catalog has its own).",
    )
    api_key_env: str | None = Field(
        default=None,
        max_length=100,
        pattern=ENV_NAME,
        description="Name of the environment variable (on the worker) holding the API key of "
        "the base_url (an endpoint of the catalog names its own).",
    )
    timeout_s: float = Field(default=60.0, gt=0, le=3600)
    max_concurrency: int = Field(default=8, ge=1, le=256)
    max_retries: int = Field(default=2, ge=0, le=10)
    max_tokens: int = Field(default=1024, ge=16, le=131072)

    @field_validator("model")
    @classmethod
    def _endpoint_or_base_url(cls, value: str | None, info: ValidationInfo) -> str | None:
        if "endpoint" not in info.data or "base_url" not in info.data:
            return value  # one of them was invalid: that is the error to report
        named, base_url = info.data["endpoint"], info.data["base_url"]
        if (named is None) == (base_url is None):
            raise inconsistent("give an endpoint of the catalog, or a base_url and its model")
        if base_url is not None and value is None:
            raise inconsistent("a base_url needs the model it serves")
        if named is not None and value is not None:
            raise inconsistent("an endpoint of the catalog serves its own model: leave model out")
        return value

    @field_validator("api_key_env")
    @classmethod
    def _own_key(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("endpoint") is not None:
            raise inconsistent("an endpoint of the catalog names its own key's variable")
        return value


class RulerReward(Strict):
    """Group-relative LLM judge: one call per group ranks its rollouts 0..1."""

    type: Literal["ruler"]
    judge: JudgeEndpoint | None = Field(
        default=None, description="Judge endpoint; unset: the workers' default judge."
    )
    rubric: NulFreeStr | None = Field(default=None, max_length=20_000)
    temperature: float = Field(default=0.0, ge=0, le=2)


class RimJudges(Strict):
    accuracy: bool = True
    helpfulness: bool = True
    process: bool = True
    diagnostic: bool = True

    @model_validator(mode="after")
    def _one_active(self) -> RimJudges:
        if not any(self.model_dump().values()):
            raise inconsistent("at least one RIM judge must be active")
        return self


class ConsistencyRules(Strict):
    alignment_completeness_bound: float = Field(default=0.1, ge=0, le=1)
    completeness_helpfulness_threshold: float = Field(default=0.5, ge=0, le=1)
    understanding_helpfulness_bound: float = Field(default=0.1, ge=0, le=1)
    contradiction_penalty: float = Field(default=0.2, ge=0, le=1)
    safety_violation_penalty: float = Field(default=0.2, ge=0, le=1)


class AntiGaming(Strict):
    enabled: bool = True
    cap_score: float = Field(default=0.3, ge=0, le=1)


class RimReward(Strict):
    """Judge ensemble sampled at several temperatures, escalating to a large model on doubt."""

    type: Literal["rim"]
    small_model: JudgeEndpoint
    large_model: JudgeEndpoint | None = None
    temperatures: list[Annotated[float, Field(ge=0, le=2)]] = Field(
        default=[0.2, 0.5, 0.8], min_length=1, max_length=8
    )
    variance_threshold: float = Field(default=0.15, ge=0, le=1)
    uncertainty_threshold: float = Field(default=0.3, ge=0, le=1)
    active_judges: RimJudges = Field(default_factory=RimJudges)
    consistency_rules: ConsistencyRules = Field(default_factory=ConsistencyRules)
    anti_gaming: AntiGaming = Field(default_factory=AntiGaming)


class FunctionCall(Strict):
    """A built-in or a user's function, with its arguments: the reward functions' and the
    evaluation metrics' (``grpo.eval_metrics``) common part."""

    model_config = ConfigDict(
        json_schema_extra=describe_builtin_args("name", BUILTIN_REWARDS.values())
    )

    name: str = Field(
        max_length=300,
        json_schema_extra={"pattern": _FUNCTION_NAME},
        description="A built-in ("
        + "; ".join(f"{b.name}: {b.summary}" for b in BUILTIN_REWARDS.values())
        + ") or a dotted import path 'package.module:function' importable on the workers.",
    )
    args: StorableObject = Field(
        default_factory=dict,
        validate_default=True,  # a built-in's required args are required when args is omitted
        description="Keyword arguments of the function. A built-in's are checked here: "
        + "; ".join(f"{b.name}({', '.join(_arg_doc(b.args))})" for b in BUILTIN_REWARDS.values())
        + ".",
    )

    @field_validator("name")
    @classmethod
    def _known(cls, value: str) -> str:
        if not _FUNCTION_NAME_RE.match(value):
            raise ValueError(
                f"unknown reward function {value!r}: use a built-in "
                f"({', '.join(sorted(BUILTIN_REWARDS))}) or 'package.module:function'"
            )
        return value

    @field_validator("args")
    @classmethod
    def _builtin_args(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        name = info.data.get("name")
        if name in BUILTIN_REWARDS:  # a user function's args are the user's to check
            check_builtin_args(name, BUILTIN_REWARDS[name].args, value)
        return value


class RewardFunction(FunctionCall):
    weight: float = Field(default=1.0, ge=0, le=1000)


METRIC_LABEL = r"^[A-Za-z0-9_.-]{1,64}$"


class EvalMetric(FunctionCall):
    """An extra evaluation metric: a function called as a reward function is, on every
    validation rollout, averaged; recorded as ``eval_metric/<label>``. It rewards nothing."""

    label: str | None = Field(
        default=None,
        pattern=METRIC_LABEL,
        description="The metric's name (eval_metric/<label>); default: the function's own "
        "name (a built-in's, or the part after ':' of an import path). Filled in when the "
        "run is created.",
    )

    @model_validator(mode="after")
    def _labelled(self) -> EvalMetric:
        if self.label is None:
            self.label = re.split(r"[:.]", self.name)[-1][:64]
        return self


class FunctionReward(Strict):
    """Programmatic rewards combined by their weights."""

    type: Literal["function"]
    functions: list[RewardFunction] = Field(min_length=1, max_length=32)

    @model_validator(mode="after")
    def _weights(self) -> FunctionReward:
        if sum(f.weight for f in self.functions) <= 0:
            raise inconsistent("reward function weights must not all be zero")
        return self


RewardSpec = Annotated[RulerReward | RimReward | FunctionReward, Field(discriminator="type")]
