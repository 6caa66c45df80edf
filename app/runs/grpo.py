"""GRPO settings of a run, with the reference recipe's defaults.

Mapped onto TRL's ``GRPOConfig`` by the training stage. The run's top-level
``learning_rate``, ``num_epochs``, ``max_steps`` and ``rollouts_per_group``
(= ``num_generations``) are not repeated here.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.core.errors import inconsistent
from app.core.storable import NUL_FREE


class LoraSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    r: int = Field(default=16, ge=1, le=1024, description="LoRA rank.")
    alpha: int = Field(default=32, ge=1, le=4096)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    target_modules: (
        Annotated[
            list[Annotated[str, NUL_FREE, Field(json_schema_extra={"not": {"const": "lm_head"}})]],
            Field(min_length=1),
        ]
        | Literal["all-linear"]
    ) = Field(default="all-linear", description="Modules to adapt; TRL refuses lm_head.")

    @model_validator(mode="after")
    def _no_lm_head(self) -> LoraSettings:
        if isinstance(self.target_modules, list) and "lm_head" in self.target_modules:
            raise ValueError("lm_head cannot be a LoRA target module (TRL refuses it)")
        return self


class GrpoSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Algorithm
    beta: float = Field(default=0.04, ge=0, le=10, description="KL coefficient.")
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo"] = "dapo"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    groups_per_step: int = Field(
        default=2, ge=1, le=1024, description="Inputs (groups) per GRPO step."
    )
    # Sampling
    temperature: float = Field(default=0.9, gt=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0, le=10)
    max_completion_length: int = Field(default=256, ge=1, le=131072)
    # Optimisation
    warmup_ratio: float = Field(default=0.1, ge=0, le=1)
    weight_decay: float = Field(default=0.01, ge=0, le=1)
    max_grad_norm: float = Field(default=1.0, gt=0)
    gradient_accumulation_steps: int = Field(default=1, ge=1, le=1024)
    gradient_checkpointing: bool = False
    bf16: bool = False
    fp16: bool = False
    seed: int = Field(default=42, ge=0)
    lora: LoraSettings | None = Field(default=None, description="Set to train a LoRA adapter.")
    # Checkpoints and evaluation (metrics are stored for every step)
    save_steps: int = Field(default=500, ge=1)
    save_total_limit: int | None = Field(default=3, ge=1)
    eval_steps: int | None = Field(
        default=None,
        ge=1,
        description="Evaluate on the validation inputs every N steps; unset: at every "
        "checkpoint (save_steps).",
    )
    validation_fraction: float = Field(
        default=0.1,
        ge=0,
        lt=1,
        description="Share of the inputs held out for evaluation (seeded) when none are "
        "marked split='validation'.",
    )
    load_best_model_at_end: bool = Field(
        default=True,
        description="The final model is the best evaluated checkpoint, not the last step.",
    )
    metric_for_best_model: str = Field(
        default="eval_reward", pattern=r"^[A-Za-z0-9_/.-]+$", max_length=100
    )
    greater_is_better: bool = True
    # Inference engine for rollouts
    engine: Literal["transformers", "vllm-colocate", "vllm-server"] = "transformers"
    vllm_gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    vllm_dtype: Annotated[str, NUL_FREE] = Field(default="auto", max_length=20)
    vllm_max_model_len: int | None = Field(default=None, ge=1)
    vllm_server_url: Annotated[str, NUL_FREE] | None = Field(
        default=None, max_length=500, pattern=r"^https?://"
    )

    @model_validator(mode="after")
    def _consistent(self) -> GrpoSettings:
        if self.bf16 and self.fp16:
            raise inconsistent("bf16 and fp16 are exclusive: choose one")
        if self.engine == "vllm-server" and not self.vllm_server_url:
            raise inconsistent("engine 'vllm-server' needs vllm_server_url")
        if self.eval_steps and self.load_best_model_at_end and self.save_steps % self.eval_steps:
            raise inconsistent(
                "save_steps must be a multiple of eval_steps when load_best_model_at_end is "
                "set (the best model is chosen among evaluated checkpoints)"
            )
        if self.groups_per_step % self.gradient_accumulation_steps:
            raise inconsistent(
                "groups_per_step must be a multiple of gradient_accumulation_steps (each "
                "micro-batch holds whole groups)"
            )
        return self
