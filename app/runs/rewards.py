"""How a run is rewarded: a tagged union on ``type`` (``ruler`` | ``rim`` | ``function``).

Validated when the run is created, so a mistake is a 422 naming the field, not a failure an
hour later on a GPU.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.core.errors import inconsistent
from app.core.storable import NUL_FREE, STORABLE_OBJECT

_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
BUILTIN_REWARDS = frozenset(
    {"exact_match", "regex", "json_valid", "length_target", "char_fraction"}
)
# A built-in, or 'package.module:function' (ASCII, so that every reader of the document's
# regular expression, JSON Schema's included, means the same names).
_FUNCTION_NAME = (
    f"^({'|'.join(sorted(BUILTIN_REWARDS))}"
    r"|[A-Za-z_][A-Za-z0-9_.]*[:.][A-Za-z_][A-Za-z0-9_]*)$"
)
_FUNCTION_NAME_RE = re.compile(_FUNCTION_NAME.removesuffix("$") + r"\Z")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JudgeEndpoint(Strict):
    """Any OpenAI-compatible chat endpoint (vLLM, Ollama, OpenAI …)."""

    base_url: Annotated[str, NUL_FREE] = Field(
        max_length=500, pattern=r"^https?://", description="e.g. http://host:8000/v1"
    )
    model: Annotated[str, NUL_FREE] = Field(min_length=1, max_length=300)
    api_key_env: str | None = Field(
        default=None,
        max_length=100,
        pattern=_ENV_NAME,
        description="Name of the environment variable (on the worker) holding the API key.",
    )
    timeout_s: float = Field(default=60.0, gt=0, le=3600)
    max_concurrency: int = Field(default=8, ge=1, le=256)
    max_retries: int = Field(default=2, ge=0, le=10)
    max_tokens: int = Field(default=1024, ge=16, le=131072)


class RulerReward(Strict):
    """Group-relative LLM judge: one call per group ranks its rollouts 0..1."""

    type: Literal["ruler"]
    judge: JudgeEndpoint | None = Field(
        default=None, description="Judge endpoint; unset: the workers' default judge."
    )
    rubric: Annotated[str, NUL_FREE] | None = Field(default=None, max_length=20_000)
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


class RewardFunction(Strict):
    name: str = Field(
        max_length=300,
        json_schema_extra={"pattern": _FUNCTION_NAME},
        description=f"A built-in ({', '.join(sorted(BUILTIN_REWARDS))}) or a dotted import "
        "path 'package.module:function' importable on the workers.",
    )
    weight: float = Field(default=1.0, ge=0, le=1000)
    args: Annotated[dict[str, Any], STORABLE_OBJECT] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known(self) -> RewardFunction:
        if not _FUNCTION_NAME_RE.match(self.name):
            raise ValueError(
                f"unknown reward function {self.name!r}: use a built-in "
                f"({', '.join(sorted(BUILTIN_REWARDS))}) or 'package.module:function'"
            )
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
