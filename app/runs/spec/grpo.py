"""GRPO settings of a run, with the reference recipe's defaults.

Mapped onto TRL's ``GRPOConfig`` by the training stage. The run's top-level
``learning_rate``, ``num_epochs``, ``max_steps`` and ``rollouts_per_group``
(= ``num_generations``) are not repeated here.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, WithJsonSchema, field_validator, model_validator

from app.catalog.models import ENTRY_NAME
from app.core.errors import inconsistent
from app.core.storable import HTTP_URL_PATTERN, NulFreeStr, RequestModel
from app.runs.spec.environments import _no_repeats
from app.runs.spec.rewards import EvalMetric


class LoraSettings(RequestModel):
    r: int = Field(default=16, ge=1, le=1024, description="LoRA rank.")
    alpha: int = Field(
        default=32,
        ge=1,
        le=4096,
        description="LoRA scaling (lora_alpha); the update is scaled by alpha / r.",
    )
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout on the LoRA layers.")
    target_modules: (
        Annotated[
            list[Annotated[NulFreeStr, Field(json_schema_extra={"not": {"const": "lm_head"}})]],
            Field(min_length=1),
        ]
        | Literal["all-linear"]
    ) = Field(default="all-linear", description="Modules to adapt; TRL refuses lm_head.")

    @model_validator(mode="after")
    def _no_lm_head(self) -> LoraSettings:
        if isinstance(self.target_modules, list) and "lm_head" in self.target_modules:
            raise ValueError("lm_head cannot be a LoRA target module (TRL refuses it)")
        return self


class EarlyStopping(RequestModel):
    """transformers' ``EarlyStoppingCallback(early_stopping_patience,
    early_stopping_threshold)``, on the evaluation metric that picks the best checkpoint."""

    patience: int = Field(
        ge=1,
        le=10_000,
        description="Stop after this many evaluations in a row in which metric_for_best_model "
        "did not improve on the best so far by more than threshold.",
    )
    threshold: float = Field(
        default=0.0,
        ge=0,
        description="The least improvement over the best evaluation so far that counts as one.",
    )


_MAX_SERVERS = 64
_ONE_URL = {"type": "string", "pattern": HTTP_URL_PATTERN, "maxLength": 500}
_SERVER_URLS_SCHEMA = {
    "anyOf": [
        _ONE_URL,
        {"type": "array", "items": _ONE_URL, "minItems": 1, "maxItems": _MAX_SERVERS},
        {"type": "null"},
    ]
}


class DistributedSettings(RequestModel):
    num_processes: int = Field(
        default=1,
        ge=1,
        le=512,
        description="Training processes (ranks), one per GPU: above 1 they run under "
        "`accelerate launch` (on a machine without GPUs: that many CPU processes on gloo). "
        "Each rank generates and trains on its share of the step's rollouts; rank 0 scores "
        "them all and writes to the database. At most 64 on one machine.",
    )
    launcher: Literal["local", "ray"] = Field(
        default="local",
        description="Where the ranks run: `local`, on the machine of the worker that holds "
        "the run; `ray`, on the operator's Ray cluster (the worker's TRAINYARD_RAY_ADDRESS), "
        "spread over `num_nodes` nodes, one `accelerate launch` per node (docs/scaling.md).",
    )
    num_nodes: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Ray only: the nodes the ranks are spread over, one node each (Ray's "
        "STRICT_SPREAD), num_processes / num_nodes ranks on each.",
    )
    gpus_per_process: int | None = Field(
        default=None,
        ge=0,
        le=8,
        description="Ray only: the GPUs each rank reserves; unset: 1 where the cluster has "
        "GPUs, none where it has not.",
    )
    cpus_per_process: int = Field(
        default=1,
        ge=1,
        le=256,
        description="Ray only: the CPUs each rank reserves.",
    )
    accelerate_config: Literal["ddp", "zero2", "zero3", "zero3-offload"] = Field(
        default="ddp",
        description="The accelerate config the ranks are launched with, one of "
        "configs/accelerate/: DDP, DeepSpeed ZeRO-2, ZeRO-3, or ZeRO-3 with the optimizer "
        "and parameters offloaded to CPU memory (DeepSpeed: the `gpu` extra, on GPUs).",
    )

    @property
    def in_ranks(self) -> bool:
        """Trained by rank processes the worker starts, not in the worker itself: several,
        or any number on a Ray cluster."""
        return self.num_processes > 1 or self.launcher == "ray"

    @property
    def processes_per_node(self) -> int:
        return self.num_processes // self.num_nodes

    @model_validator(mode="after")
    def _placement(self) -> DistributedSettings:
        if self.launcher == "local":
            # Not left at their defaults (a client may send back what it was served).
            changed = {
                "num_nodes": self.num_nodes != 1,
                "gpus_per_process": self.gpus_per_process is not None,
                "cpus_per_process": self.cpus_per_process != 1,
            }
            if named := [name for name, differs in changed.items() if differs]:
                raise inconsistent(
                    f"{', '.join(named)}: Ray only; the local launcher runs every rank on the "
                    "worker's machine, one per GPU (set launcher: ray)"
                )
            if self.num_processes > 64:
                raise inconsistent(
                    "num_processes: at most 64 on one machine; more need launcher: ray"
                )
        elif self.num_processes % self.num_nodes:
            raise inconsistent(
                f"num_processes ({self.num_processes}) must split evenly over num_nodes "
                f"({self.num_nodes}): the same number of ranks on every node"
            )
        return self


_IS_MODES = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


class AsyncRollouts(RequestModel):
    """Rollouts for the next steps generated while the current step trains (docs/async.md)."""

    max_staleness: int = Field(
        default=1,
        ge=0,
        le=8,
        description="How many policy versions behind the trainer a rollout may be when a step "
        "trains on it: step t trains on rollouts sampled by the adapter of step t-1-k, k at "
        "most this. The next steps' generation starts only within the bound (0: as a "
        "synchronous run, nothing generated ahead).",
    )
    importance_sampling: _IS_MODES | None = Field(
        default="token_truncate",
        description="TRL's importance-sampling correction of rollouts sampled by an older "
        "adapter, or by vLLM's numerics (vllm_importance_sampling_mode): the ratio of the "
        "trainer's log-probabilities to the recorded ones, per token or per sequence, truncated "
        "to or masked outside the clip bounds; null: no correction. The default truncates per "
        "token: TRL's own default, sequence_mask, drops the stale rollouts the policy has "
        "moved towards since (their ratio passes the bound), which slowed learning "
        "(docs/benchmarks.md).",
    )
    importance_sampling_clip_max: float | None = Field(
        default=3.0, gt=0, description="Upper bound of the importance-sampling ratio."
    )
    importance_sampling_clip_min: float | None = Field(
        default=None, ge=0, description="Lower bound of the importance-sampling ratio."
    )


class GrpoSettings(RequestModel):
    # Algorithm
    beta: float = Field(
        default=0.04,
        ge=0,
        le=10,
        description="KL coefficient against the reference model; 0 loads no reference model.",
    )
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo"] = Field(
        default="dapo",
        description="How the per-token loss is normalised (TRL's loss_type): grpo per "
        "sequence, dapo over the batch's tokens, dr_grpo by a constant, bnpo over the "
        "local batch's tokens.",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        default="group",
        description="Divide advantages by the reward std of the group, of the batch, or not.",
    )
    groups_per_step: int = Field(
        default=2, ge=1, le=1024, description="Inputs (groups) per GRPO step."
    )
    # Sampling
    temperature: float = Field(
        default=0.9, gt=0, le=2, description="Sampling temperature of the rollouts."
    )
    top_p: float = Field(
        default=1.0, gt=0, le=1, description="Nucleus sampling: keep the tokens of this mass."
    )
    top_k: int | None = Field(
        default=None, ge=1, description="Sample among the k likeliest tokens; unset: all."
    )
    min_p: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Drop tokens less likely than min_p times the likeliest; unset: off.",
    )
    repetition_penalty: float = Field(
        default=1.0, gt=0, le=10, description="Above 1 discourages repeated tokens; 1: off."
    )
    max_completion_length: int = Field(
        default=256, ge=1, le=131072, description="Most tokens a rollout may generate."
    )
    # Optimisation
    warmup_ratio: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="Share of the steps over which the learning rate warms up from 0.",
    )
    weight_decay: float = Field(default=0.01, ge=0, le=1, description="AdamW weight decay.")
    max_grad_norm: float = Field(
        default=1.0, gt=0, description="Gradients are clipped to this norm."
    )
    gradient_accumulation_steps: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Micro-batches per optimizer step; groups_per_step must be a multiple.",
    )
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute activations in the backward pass to save memory."
    )
    bf16: bool = Field(default=False, description="Train in bfloat16 (on a GPU; ignored on CPU).")
    fp16: bool = Field(default=False, description="Train in float16 (on a GPU; ignored on CPU).")
    seed: int = Field(
        default=42,
        ge=0,
        description="Seeds training, sampling, the input order and the validation hold-out.",
    )
    lora: LoraSettings | None = Field(
        default=None, description="Set to train a LoRA adapter; unset: full fine-tuning."
    )
    distributed: DistributedSettings = Field(
        default_factory=DistributedSettings,
        description="How many processes train the run; unset: one, in the worker itself.",
    )
    # Checkpoints and evaluation (metrics are stored for every step)
    save_steps: int = Field(default=500, ge=1, description="Write a checkpoint every N steps.")
    max_dropped_steps: int = Field(
        default=3,
        ge=1,
        le=10_000,
        description="Fail the run after this many steps in a row whose every group was dropped "
        "(its judge failed for the whole step, its environment was gone): it would train on "
        "nothing.",
    )
    save_total_limit: int | None = Field(
        default=3,
        ge=1,
        description="Checkpoints kept (the best one too, with load_best_model_at_end); unset: all.",
    )
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
        description="Share of the train inputs held out for evaluation (seeded, rounded down) "
        "when none are marked split='validation'.",
    )
    load_best_model_at_end: bool = Field(
        default=True,
        description="The final model is the best evaluated checkpoint, not the last step "
        "(needs validation inputs; without any, the last step).",
    )
    metric_for_best_model: str = Field(
        default="eval_reward",
        pattern=r"^[A-Za-z0-9_/.-]+$",
        max_length=100,
        description="The evaluation metric that picks the best checkpoint.",
    )
    greater_is_better: bool = Field(
        default=True, description="Whether a higher metric_for_best_model is better."
    )
    eval_metrics: list[EvalMetric] = Field(
        default_factory=list,  # a default [] is deep-copied for every run body
        max_length=16,
        description="Extra evaluation metrics: functions called as reward functions are, on "
        "every validation rollout, averaged at each evaluation and recorded as "
        "eval_metric/<label> (charted beside the eval reward). metric_for_best_model may name "
        "one (eval_metric/<label>). They reward nothing.",
    )
    early_stopping: EarlyStopping | None = Field(
        default=None,
        description="Stop on a plateau of metric_for_best_model: the run completes at that "
        "step, saying why in its events and summary (metrics.stopped_early); with "
        "load_best_model_at_end its final model is the best checkpoint. Needs validation "
        "inputs (without any it is off, and an event says so).",
    )
    # Experiment trackers (docs/trackers.md)
    report_to: list[Literal["wandb", "tensorboard"]] = Field(
        default_factory=list,  # a default [] is deep-copied for every run body
        max_length=2,
        json_schema_extra={"uniqueItems": True},
        description="Also log the training metrics to these trackers: 'tensorboard' (event "
        "files under the run's artifacts, <run>/tensorboard) and 'wandb' (Weights & Biases; "
        "its run directory under <run>/wandb; the worker's WANDB_MODE=offline keeps it "
        "local). The run's id is in the tracker's config; its name is trained_model_name or "
        "run-<id> (the SFT warm-up: <name>-sft).",
    )
    # A str, not a NulFreeStr (whose pattern is the one pydantic would document): the
    # pattern refuses NUL too.
    tracker_project: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="The W&B project the run is logged to; unset: the run's learning_key, "
        "or 'trainyard'.",
    )
    # Inference engine for rollouts
    engine: Literal["transformers", "vllm-colocate", "vllm-server"] = Field(
        default="transformers",
        description="What generates rollouts: transformers' generate, vLLM in the training "
        "process, or a vLLM server (vllm_server_url).",
    )
    vllm_gpu_memory_utilization: float = Field(
        default=0.9, gt=0, le=1, description="Share of GPU memory vLLM may take (colocate)."
    )
    vllm_dtype: NulFreeStr = Field(
        default="auto",
        max_length=20,
        description="Not passed on yet: TRL 1.16 has no vLLM dtype option, so "
        "vLLM runs at the dtype TRL gives it. Accepted so that bodies setting it stay valid.",
    )
    vllm_max_model_len: int | None = Field(
        default=None,
        ge=1,
        description="vLLM's context length (colocate); unset: the model's own.",
    )
    vllm_server_url: Annotated[
        str | list[str] | None, WithJsonSchema(_SERVER_URLS_SCHEMA, mode="validation")
    ] = Field(
        default=None,
        description="For engine 'vllm-server': the vLLM server's base URL (http://host:8000), "
        "or several to spread the rollouts over. A LoRA run uses plain `vllm serve` OpenAI "
        "servers started with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, each "
        "step's adapter loaded into them (they must read the run's artifacts folder); a full "
        "fine-tune uses one `trl vllm-serve` server, its weights synced over NCCL (GPUs).",
    )
    vllm_servers: str | None = Field(
        default=None,
        max_length=100,
        pattern=ENTRY_NAME,
        description="For engine 'vllm-server': vLLM servers of the operator's catalog (GET "
        "/catalog), by name; the only kind the catalog code policy allows. Not with "
        "vllm_server_url.",
    )
    num_vllm_servers: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="For vllm_servers that Ray places (GET /catalog: placed_by_ray): how many "
        "servers of the run's model it starts for the run (unset: 1), at most the fleet's "
        "servers. They start before the first step and stop when the attempt ends.",
    )
    vllm_server_timeout_s: float = Field(
        default=120,
        gt=0,
        le=3600,
        description="Longest wait for one answer of a vLLM server (a group's completions, an "
        "adapter load), and for a `trl vllm-serve` server to come up.",
    )
    vllm_server_max_retries: int = Field(
        default=3,
        ge=0,
        le=20,
        description="Retries of a failed vLLM server call; past them the attempt ends with the "
        "reason and the run resumes from its last checkpoint later.",
    )
    async_rollouts: AsyncRollouts | None = Field(
        default=None,
        description="Generate the next steps' rollouts while the current step trains, at most "
        "max_staleness adapter versions behind (docs/async.md). For LoRA runs on vLLM servers "
        "(engine 'vllm-server' with lora), single-turn or gateway, in one process; unset: "
        "each step generates, then trains.",
    )

    @field_validator("vllm_server_url", mode="before")
    @classmethod
    def _server_urls(cls, value: Any) -> Any:
        # By hand, before the union: its errors name the field, not a member type.
        if value is None:
            return value
        if isinstance(value, list) and not 1 <= len(value) <= _MAX_SERVERS:
            raise ValueError(f"give 1 to {_MAX_SERVERS} server URLs")
        for url in value if isinstance(value, list) else [value]:
            if not (isinstance(url, str) and re.match(HTTP_URL_PATTERN, url) and len(url) <= 500):
                raise ValueError(
                    "must be an http(s) URL of at most 500 characters, or a list of them"
                )
        return value

    @field_validator("report_to")
    @classmethod
    def _once_each(cls, value: list[str]) -> list[str]:
        _no_repeats(value, "report_to")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> GrpoSettings:
        if self.bf16 and self.fp16:
            raise inconsistent("bf16 and fp16 are exclusive: choose one")
        if self.engine == "vllm-server" and not (self.vllm_server_url or self.vllm_servers):
            raise inconsistent("engine 'vllm-server' needs vllm_servers or vllm_server_url")
        if self.vllm_server_url and self.vllm_servers:
            raise inconsistent("give vllm_servers (the catalog's) or vllm_server_url, not both")
        if self.num_vllm_servers is not None and self.vllm_servers is None:
            raise inconsistent(
                "num_vllm_servers is for vLLM servers Ray places for the run: name such a "
                "fleet of the catalog in vllm_servers"
            )
        if (
            self.engine == "vllm-server"
            and self.lora is None
            and isinstance(self.vllm_server_url, list)
            and len(self.vllm_server_url) > 1
        ):
            raise inconsistent(
                "a full fine-tune syncs its weights into one `trl vllm-serve` server (give it "
                "--data-parallel-size to spread the rollouts): give one vllm_server_url, or "
                "train a LoRA adapter to use several servers"
            )
        if self.async_rollouts is not None:
            if self.engine != "vllm-server" or self.lora is None:
                raise inconsistent(
                    "async_rollouts needs engine 'vllm-server' with lora: transformers and "
                    "vllm-colocate generate in the training process itself, so there is "
                    "nothing to overlap, and a full fine-tune's weights reach `trl vllm-serve` "
                    "only between steps (NCCL); train a LoRA adapter on vLLM servers"
                )
            if self.distributed.in_ranks:
                raise inconsistent(
                    "async_rollouts trains in one process for now: set "
                    "distributed.num_processes to 1 (launcher local)"
                )
        if self.eval_steps and self.load_best_model_at_end and self.save_steps % self.eval_steps:
            raise inconsistent(
                "save_steps must be a multiple of eval_steps when load_best_model_at_end is "
                "set (the best model is chosen among evaluated checkpoints)"
            )
        labels = [m.label for m in self.eval_metrics]
        if len(set(labels)) != len(labels):
            raise inconsistent(
                "eval_metrics labels must differ (give `label` to a function used twice)"
            )
        if self.groups_per_step % self.gradient_accumulation_steps:
            raise inconsistent(
                "groups_per_step must be a multiple of gradient_accumulation_steps (each "
                "micro-batch holds whole groups)"
            )
        return self

    # -- what the workers read ---------------------------------------------------------------

    @property
    def server_urls(self) -> list[str]:
        """The vLLM servers' root URLs, without the OpenAI API's ``/v1`` (TRL's client and
        the adapter routes want the root); empty unless the engine is ``vllm-server`` (a
        catalog's ``vllm_servers`` is resolved into ``vllm_server_url`` by the worker)."""
        value = self.vllm_server_url or []
        urls = [value] if isinstance(value, str) else value
        return [url.rstrip("/").removesuffix("/v1") for url in urls]

    def trl_arguments(
        self,
        *,
        output_dir: str,
        num_generations: int,
        learning_rate: float,
        max_steps: int,
        run_name: str,
        cuda: bool,
        evaluate: bool,
        max_turns: int | None = None,
    ) -> dict[str, Any]:
        """These settings as the keyword arguments of TRL's ``GRPOConfig``: the one mapping
        (the worker builds the config from it; ``app`` imports no TRL). The rest is the
        run's: ``num_generations`` (rollouts_per_group), ``learning_rate``, ``max_steps``
        (the plan's length), ``max_turns`` (an agent run's environment.max_turns, TRL's
        max_tool_calling_iterations), and where it runs (``cuda``: bf16/fp16 apply only
        there; on CPU TRL's bf16 default must be turned off)."""
        per_step = self.groups_per_step * num_generations
        ranks = self.distributed.num_processes
        accumulation = self.gradient_accumulation_steps
        engine: dict[str, Any] = {}
        if self.engine == "vllm-colocate":
            engine = {
                "use_vllm": True,
                "vllm_mode": "colocate",
                "vllm_gpu_memory_utilization": self.vllm_gpu_memory_utilization,
                "vllm_max_model_length": self.vllm_max_model_len,
            }
        elif self.engine == "vllm-server" and self.lora is None:
            # TRL's server mode: all the weights broadcast to `trl vllm-serve` over NCCL. A
            # LoRA run's rollouts come from Trainyard's rollout_func instead.
            engine = {
                "use_vllm": True,
                "vllm_mode": "server",
                "vllm_server_base_url": self.server_urls[0],
                "vllm_server_timeout": self.vllm_server_timeout_s,
            }
        if self.async_rollouts is not None:
            # Read by TRL's loss once the server trainer turns its vLLM correction on
            # (workers/pipeline/hooks.py: ServerTrainer).
            ahead = self.async_rollouts
            engine |= {
                "vllm_importance_sampling_correction": ahead.importance_sampling is not None,
                "vllm_importance_sampling_mode": ahead.importance_sampling or "token_truncate",
                "vllm_importance_sampling_clip_max": ahead.importance_sampling_clip_max,
                "vllm_importance_sampling_clip_min": ahead.importance_sampling_clip_min,
            }
        if max_turns is not None:
            engine["max_tool_calling_iterations"] = max_turns
        if evaluate:
            engine |= {
                "eval_strategy": "steps",
                "eval_steps": self.eval_steps or self.save_steps,
                "per_device_eval_batch_size": per_step // ranks,
                "load_best_model_at_end": self.load_best_model_at_end,
                "metric_for_best_model": self.metric_for_best_model,
                "greater_is_better": self.greater_is_better,
                # A resumed attempt goes on counting evaluations without improvement.
                "restore_callback_states_from_checkpoint": self.early_stopping is not None,
            }
        return {
            "output_dir": output_dir,
            "learning_rate": learning_rate,
            "max_steps": max_steps,
            "num_train_epochs": 1,
            "num_generations": num_generations,
            # One generation of groups_per_step groups per optimizer step, split over the
            # ranks and into micro-batches when gradients are accumulated (checked to split).
            "per_device_train_batch_size": per_step // (accumulation * ranks),
            "gradient_accumulation_steps": accumulation,
            "steps_per_generation": accumulation,
            "shuffle_dataset": False,  # the dataset is already in the plan's order
            "seed": self.seed,
            "beta": self.beta,
            "loss_type": self.loss_type,
            "scale_rewards": self.scale_rewards,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k or 0,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "max_completion_length": self.max_completion_length,
            "warmup_steps": self.warmup_ratio,  # a float below 1 is a ratio in transformers 5
            "weight_decay": self.weight_decay,
            "max_grad_norm": self.max_grad_norm,
            "gradient_checkpointing": self.gradient_checkpointing,
            "bf16": self.bf16 and cuda,
            "fp16": self.fp16 and cuda,
            "use_cpu": not cuda,
            "logging_steps": 1,
            "save_strategy": "steps",
            "save_steps": self.save_steps,
            "save_total_limit": None,  # Trainyard prunes its own checkpoint folder
            "report_to": [],  # trackers are attached as callbacks (workers/pipeline)
            "run_name": run_name,
            "disable_tqdm": True,
            **engine,
        }
