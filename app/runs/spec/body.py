"""The body of ``POST /runs``: what a run is, validated when it is created.

Inputs forbid unknown fields, so ``status``, ``project``, ``attempt``, ``version`` and the
like are a 422 when a request tries to set them; they exist only on the table. Each part
(``grpo``, ``reward``, ``environment``, ``sft``, ``teacher``) has a module of its own here;
the workers read a stored run back into the same models (:mod:`app.runs.spec.parsed`).
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from app.core.columns import INT32_MAX
from app.core.errors import inconsistent
from app.core.limits import MAX_DATASET_ROWS, MAX_INPUT_CHARS, MAX_JSON_DEPTH
from app.core.storable import NulFreeStr, RequestModel, StorableObject
from app.runs.spec.environments import EnvironmentSpec, GatewayEnvironment, PythonEnvironment
from app.runs.spec.grpo import GrpoSettings
from app.runs.spec.rewards import FunctionReward, JudgeEndpoint, RewardSpec, RulerReward
from app.runs.spec.sft import SftSettings
from app.runs.spec.teacher import TeacherSettings

MAX_INLINE_INPUTS = 10_000


class InputItem(RequestModel):
    input_text: NulFreeStr = Field(min_length=1, max_length=MAX_INPUT_CHARS)
    context: StorableObject | None = Field(
        default=None,
        description="Task context, e.g. {'answer': '42'} for exact-match rewards (nested at "
        f"most {MAX_JSON_DEPTH} levels).",
    )
    # An enum in the document; checked by its pattern (what a bad JSONL line's 422 says).
    split: str = Field(
        default="train",
        pattern=r"^(train|validation)$",
        json_schema_extra={"enum": ["train", "validation"]},
    )


class FromCheckpoint(RequestModel):
    """A checkpoint of another run of this project to start from."""

    run_id: uuid.UUID
    step: int = Field(ge=0, le=INT32_MAX, description="The checkpoint's step.")


class RunCreate(RequestModel):
    """A training run to start. The reference's TrainingRun fields plus inputs and settings."""

    model_name: NulFreeStr = Field(
        min_length=1, max_length=500, description="Base model: a folder on the workers or hub id."
    )
    task_description: NulFreeStr = Field(
        min_length=1,
        max_length=20_000,
        description="What the model is trained to do; the generator writes inputs from it "
        "and the judges read it.",
    )
    trained_model_name: NulFreeStr | None = Field(
        default=None, min_length=1, max_length=500, description="A name for the trained model."
    )
    system_prompt: NulFreeStr | None = Field(
        default=None,
        max_length=20_000,
        description="The system message of every rollout; unset with generated inputs: the "
        "generator writes one.",
    )
    num_examples: int = Field(
        default=100,
        ge=1,
        le=MAX_DATASET_ROWS,
        description="How many inputs to generate from task_description when the run has "
        "neither inputs nor dataset_id; otherwise the number of train inputs given.",
    )
    rollouts_per_group: int = Field(
        default=4, ge=2, le=256, description="Completions per input (GRPO num_generations)."
    )
    learning_rate: float = Field(default=1e-5, gt=0, lt=1, description="AdamW learning rate.")
    num_epochs: int = Field(
        default=1,
        ge=1,
        le=10_000,
        description="Passes over the train inputs; max_steps, when given, overrides it.",
    )
    max_steps: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description="The number of GRPO steps. As in TRL it overrides num_epochs when given: "
        "the inputs are gone through again as often as needed.",
    )
    learning_key: NulFreeStr | None = Field(
        default=None,
        max_length=200,
        description="Groups runs of one task so their trajectories can be pulled together.",
    )
    inputs: list[InputItem] | None = Field(
        default=None,
        max_length=MAX_INLINE_INPUTS,
        description="Inline training inputs. Omitted, and no dataset_id: generated from "
        "task_description.",
    )
    dataset_id: uuid.UUID | None = Field(
        default=None,
        description="An uploaded dataset (POST /datasets) of this project whose rows become "
        "the run's inputs; num_examples is then its train row count. Not with inputs.",
    )
    generator: JudgeEndpoint | None = Field(
        default=None,
        description="The LLM that writes num_examples inputs (and a system prompt, if none is "
        "given) from task_description when the run has neither inputs nor dataset_id. "
        "Unset: the workers' default judge endpoint.",
    )
    # Before reward, which is checked against it.
    environment: EnvironmentSpec | None = Field(
        default=None,
        description="Where the agent acts: tools it may call over several turns (built-in or "
        "user functions, a python environment, an MCP server), or your own agent through the "
        "gateway. Unset: one completion per "
        "rollout, no tools.",
    )
    reward: RewardSpec = Field(
        default_factory=lambda: RulerReward(type="ruler"),
        description="How rollouts are scored: RULER (default), RIM or reward functions (the "
        "function 'environment': a python environment's own reward, or the reward a gateway "
        "run's harness gives; the default of a gateway run).",
    )
    grpo: GrpoSettings = Field(
        default_factory=GrpoSettings, description="GRPO settings (the reference recipe's)."
    )
    sft: SftSettings | None = Field(
        default=None,
        description="A supervised warm-up on example conversations before the GRPO steps.",
    )
    teacher: TeacherSettings | None = Field(
        default=None,
        description="A teacher run: the policy trained is a teacher whose completions are "
        "guidance for a student model, rewarded by how much they improve its answers "
        "(docs/teacher.md). Unset: plain GRPO.",
    )
    config: StorableObject = Field(
        default_factory=dict,
        description=f"Free-form extra settings (nested at most {MAX_JSON_DEPTH} levels).",
    )
    from_checkpoint: FromCheckpoint | None = Field(
        default=None,
        description="Start from this checkpoint's weights (a full model, or a LoRA adapter "
        "merged into its base) instead of model_name's; model_name must be the parent run's. "
        "The new run's steps start at 0 with a fresh optimizer.",
    )

    @field_validator("dataset_id")
    @classmethod
    def _inputs_or_dataset(cls, value: uuid.UUID | None, info: ValidationInfo) -> uuid.UUID | None:
        # A field validator, so the problem names body.dataset_id (inputs is validated first).
        if value is not None and info.data.get("inputs") is not None:
            raise inconsistent("give either inputs or dataset_id, not both")
        return value

    @field_validator("reward")
    @classmethod
    def _environment_reward(cls, value: Any, info: ValidationInfo) -> Any:
        # A field validator, so the problem names body.reward (environment comes first).
        if "environment" not in info.data:
            return value  # the environment was invalid: that is the error to report
        wants = isinstance(value, FunctionReward) and any(
            f.name == "environment" for f in value.functions
        )
        if wants and not isinstance(
            info.data["environment"], PythonEnvironment | GatewayEnvironment
        ):
            raise inconsistent(
                "the reward function 'environment' is a python environment's get_reward or "
                "a gateway harness's reward: it needs an environment of type 'python' or "
                "'gateway'"
            )
        return value

    @field_validator("grpo")
    @classmethod
    def _ranks(cls, value: GrpoSettings, info: ValidationInfo) -> GrpoSettings:
        # A field validator, so the problem names body.grpo (environment comes first).
        environment = info.data.get("environment")
        if value.async_rollouts is not None and not (
            environment is None or isinstance(environment, GatewayEnvironment)
        ):
            raise inconsistent(
                "async_rollouts is for single-turn and gateway runs: a tool, python or MCP "
                "environment's episodes are played by TRL's tool loop in the training process, "
                "step by step; unset environment or async_rollouts"
            )
        ranks = value.distributed.num_processes
        if not value.distributed.in_ranks:
            return value
        if info.data.get("environment") is not None:
            raise inconsistent(
                "an agent run (environment) trains in the worker's process: its episodes' "
                "tool state lives in the rank that ran them, and rank 0 scores every group; "
                "set grpo.distributed.num_processes to 1 (launcher local)"
            )
        rollouts = value.groups_per_step * info.data.get("rollouts_per_group", 1)
        split = ranks * value.gradient_accumulation_steps
        if rollouts % split:
            raise inconsistent(
                f"a step's {rollouts} rollouts (groups_per_step x rollouts_per_group) must "
                f"split evenly over distributed.num_processes x gradient_accumulation_steps "
                f"= {split} micro-batches"
            )
        return value

    @model_validator(mode="after")
    def _inputs(self) -> RunCreate:
        if self.inputs is not None and not any(i.split == "train" for i in self.inputs):
            raise inconsistent("inputs must contain at least one item with split 'train'")
        return self

    @model_validator(mode="after")
    def _gateway_reward(self) -> RunCreate:
        if isinstance(self.environment, GatewayEnvironment) and "reward" not in (
            self.model_fields_set
        ):  # the harness's reward, unless told otherwise
            self.reward = FunctionReward.model_validate(
                {"type": "function", "functions": [{"name": "environment"}]}
            )
        return self

    @model_validator(mode="after")
    def _servers_hold_model_name(self) -> RunCreate:
        if self.grpo.engine != "vllm-server" or self.grpo.lora is None:
            return self
        start = "from_checkpoint" if self.from_checkpoint else "sft" if self.sft else None
        if start is not None:
            raise inconsistent(
                f"a LoRA run on vLLM servers loads its adapter onto the servers' model_name; "
                f"with {start} the adapter would be trained on other weights: use engine "
                "'transformers' or 'vllm-colocate'"
            )
        return self

    @field_validator("teacher")
    @classmethod
    def _teacher_in_one_process(cls, value: Any, info: ValidationInfo) -> Any:
        # A field validator, so the problem names body.teacher (grpo comes first).
        if value is not None and isinstance(info.data.get("environment"), GatewayEnvironment):
            raise inconsistent("a gateway run's policy is the user's agent: it cannot be a teacher")
        grpo = info.data.get("grpo")
        if value is not None and grpo is not None and grpo.async_rollouts is not None:
            raise inconsistent(
                "a teacher run's prompts are rewritten from its student's answers step by "
                "step: it cannot generate ahead (unset grpo.async_rollouts)"
            )
        if value is not None and grpo is not None and grpo.distributed.in_ranks:
            raise inconsistent(
                "a teacher run trains in the worker's process (its student is asked from the "
                "process that scores): set grpo.distributed.num_processes to 1 (launcher local)"
            )
        return value

    @field_validator("from_checkpoint")
    @classmethod
    def _fork_without_warm_up(cls, value: Any, info: ValidationInfo) -> Any:
        # A field validator, so the problem names body.from_checkpoint (sft comes first).
        if value is not None and info.data.get("sft") is not None:
            raise inconsistent(
                "a fork starts from its parent's trained weights; an SFT warm-up would start "
                "from model_name's: give one or the other"
            )
        return value
