"""GRPO training with TRL: TRL's ``GRPOTrainer`` does every update; Trainyard hooks in
through TRL's extension points only, so the run's status is true to what happens:

- ``collecting``: set when a step begins; TRL generates the rollouts;
- the reward function is Trainyard's :class:`StepBridge`: it stores every rollout and moves
  the run to ``scoring`` in one transaction, scores the groups, stores the rewards and moves
  the run to ``training`` in another, then hands TRL the rewards;
- ``training``: TRL computes the loss and steps the optimizer; :class:`RunCallback` stores
  the step's metrics, promotes checkpoints (staging folder → rename → record) and honours
  cancel and pause requests.

Runs in a worker thread; database work is handed to the runtime's event loop, fenced on
the run's lease. Step numbers start at 1 (the checkpoint after step N is checkpoint-N).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from app.runs import step_moves
from app.runs.grpo import GrpoSettings
from app.runs.models import Run
from app.runs.state import transition
from app.runs.status import RunStatus
from workers.context import RunContext
from workers.environments import LoadedEnvironment
from workers.pipeline import episodes
from workers.pipeline.disk import raise_if_disk_full
from workers.pipeline.plan import InputBatch, PlannedInput
from workers.pipeline.ranks import Ranks, distributed_spec
from workers.pipeline.writes import WriteBehind
from workers.rewards import Group, Rollout, Score, Scorer

log = logging.getLogger(__name__)
S = RunStatus


class ModelUnavailable(RuntimeError):
    pass


def check_model(model_name: str, *, tools: bool = False, sft: bool = False) -> None:
    """Fail before any step if the model or its tokenizer cannot be loaded here (with
    ``tools``: or if TRL cannot run tool calls with its chat template; with ``sft``: or if
    TRL cannot mark its assistant turns for the warm-up's loss)."""
    from transformers import AutoConfig, AutoTokenizer

    where = "folder" if os.path.isdir(model_name) else "hub id"
    if where == "hub id" and (model_name.startswith((".", "/", "~")) or model_name.count("/") > 1):
        # A path, not a hub id: say so now, not after the hub client's retries.
        raise ModelUnavailable(
            f"model_name {model_name!r} cannot be loaded: it is not a folder on this worker "
            f"(working directory {os.getcwd()}); give the absolute path of a folder every "
            "worker can read"
        )
    try:
        AutoConfig.from_pretrained(model_name)
        tokenizer = AutoTokenizer.from_pretrained(model_name)
    except Exception as exc:
        raise ModelUnavailable(
            f"model_name {model_name!r} ({where}) cannot be loaded on this worker: "
            f"{type(exc).__name__}: {str(exc)[:500]}"
        ) from exc
    if not getattr(tokenizer, "chat_template", None):
        raise ModelUnavailable(f"the tokenizer of {model_name!r} has no chat template")
    if tools:
        from trl.chat_template_utils import add_response_schema, supports_tool_calling

        if not supports_tool_calling(tokenizer):
            raise ModelUnavailable(
                f"the chat template of {model_name!r} cannot render tool calls and results, "
                "so it cannot run an environment"
            )
        if getattr(tokenizer, "response_template", None) is None:
            try:
                add_response_schema(tokenizer)
            except ValueError as exc:
                raise ModelUnavailable(
                    f"TRL cannot parse the tool calls of {model_name!r}: {exc}"
                ) from exc
    if sft:
        from trl.chat_template_utils import get_training_chat_template

        try:
            get_training_chat_template(tokenizer)
        except ValueError as exc:
            raise ModelUnavailable(
                f"the chat template of {model_name!r} cannot be trained with an SFT warm-up "
                f"(the loss is on assistant turns only): {exc}"
            ) from exc


class TrackerUnavailable(RuntimeError):
    pass


def check_trackers(report_to: list[str]) -> None:
    """Fail before any step if a tracker the run reports to cannot work on this worker: its
    package is missing, or W&B would need a login (a worker has no terminal to prompt on:
    give it WANDB_API_KEY, a netrc entry, or WANDB_MODE=offline)."""
    import importlib.util

    packages = {"tensorboard": "tensorboard", "wandb": "wandb"}
    for name in report_to:
        if importlib.util.find_spec(packages[name]) is None:
            raise TrackerUnavailable(
                f"report_to names {name!r} but the {packages[name]!r} package is not installed "
                "on this worker (pip install 'trainyard[worker]')"
            )
    if "wandb" in report_to and os.environ.get("WANDB_MODE") not in ("offline", "disabled"):
        import netrc
        from urllib.parse import urlparse

        host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
        try:
            stored = netrc.netrc().authenticators(host or "") is not None
        except (OSError, netrc.NetrcParseError):
            stored = False
        if not (os.environ.get("WANDB_API_KEY") or stored):
            raise TrackerUnavailable(
                f"report_to names 'wandb' but this worker has no W&B API key for {host} "
                "(WANDB_API_KEY or ~/.netrc) and WANDB_MODE is not offline: it would wait "
                "for a login no one can type"
            )


def tracker_name(run: Run) -> str:
    """The run's name in its trackers: what it trains, or its id."""
    return run.trained_model_name or f"run-{run.id}"


def tracker_callbacks(run: Run, root: Path, stage: str) -> list[Any]:
    """transformers' own tracker callbacks for one stage of the run (``grpo`` or ``sft``),
    given their folders, names and project explicitly.

    Not through ``report_to``: transformers 5.19 takes TensorBoard's folder, W&B's project
    and folder only from process-wide environment variables (racy in a threads worker) and
    never finishes the W&B run, so the next stage or run in this process would log into it.
    Folders: ``<run>/tensorboard/<stage>``; ``<run>/wandb`` (one W&B run per stage)."""
    report_to = (run.grpo or {}).get("report_to") or []
    name = tracker_name(run) + ("-sft" if stage == "sft" else "")
    callbacks: list[Any] = []
    if "tensorboard" in report_to:
        from torch.utils.tensorboard import SummaryWriter
        from transformers.integrations import TensorBoardCallback

        callbacks.append(TensorBoardCallback(SummaryWriter(str(root / "tensorboard" / stage))))
    if "wandb" in report_to:
        from transformers.integrations import WandbCallback

        project = (run.grpo or {}).get("tracker_project") or run.learning_key or "trainyard"
        project = re.sub(r"[^A-Za-z0-9_.-]+", "_", project)[:128]
        folder = root / "wandb"
        folder.mkdir(parents=True, exist_ok=True)

        class StageWandb(WandbCallback):  # type: ignore[misc]
            """transformers' W&B logging into a run opened with this stage's project, name
            and folder (the mode is the worker's WANDB_MODE), closed when training ends."""

            def setup(self, args: Any, state: Any, model: Any, **kwargs: Any) -> None:
                if state.is_world_process_zero:
                    if self._wandb.run is not None:  # left open by a stage that raised
                        self._wandb.finish()
                    self._wandb.init(
                        project=project,
                        name=name,
                        group=str(run.id),  # its stages and resumed attempts together
                        dir=str(folder),
                        config={"trainyard_run_id": str(run.id), "trainyard_stage": stage},
                    )
                super().setup(args, state, model, **kwargs)

            def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                super().on_train_end(args, state, control, **kwargs)
                if self._wandb.run is not None:
                    self._wandb.finish()

        callbacks.append(StageWandb())
    return callbacks


def prompt_messages(system_prompt: str | None, input_text: str) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*messages, {"role": "user", "content": input_text}]


@dataclass
class RunPaths:
    root: Path

    @property
    def staging(self) -> Path:
        """TRL's output_dir: checkpoints appear here first, possibly half-written."""
        return self.root / "staging"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def final(self, name: str) -> Path:
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"
        return self.root / "final" / safe


class EveryGroupDropped(RuntimeError):
    def __init__(self, steps: int, reason: str) -> None:
        super().__init__(
            f"every group of the last {steps} steps was dropped, so nothing was trained on "
            f"(grpo.max_dropped_steps); the last reason: {reason}"
        )


def _drop_reason(score: Score) -> str:
    """What a dropped rollout's breakdown says went wrong: its judge's or its episode's error."""
    for value in score.breakdown.values():
        if isinstance(value, dict) and value.get("error"):
            return str(value["error"])
        if isinstance(value, str) and value:
            return value
    return "no reward (the scorer gave none)"


def reward_components(scores: Iterable[Score]) -> dict[str, list[float]]:
    """Each reward part's values over the step's scored rollouts, by metric name:
    ``reward/<function>``, ``reward/ruler``, ``reward/rim/<judge>`` (the judge's adjusted
    score). Dropped rollouts (no reward) are left out, as they are of the reward itself."""
    parts: dict[str, list[float]] = {}
    for score in scores:
        if score.reward is None:
            continue
        found: dict[str, Any] = {}
        breakdown = score.breakdown
        for name, value in (breakdown.get("functions") or {}).items():
            found[f"reward/{name}"] = value
        ruler = breakdown.get("ruler")
        if isinstance(ruler, dict) and "score" in ruler:
            found["reward/ruler"] = ruler["score"]
        rim = breakdown.get("rim")
        if isinstance(rim, dict):
            for judge, value in (rim.get("adjusted") or {}).items():
                found[f"reward/rim/{judge}"] = value
        for name, value in found.items():
            if isinstance(value, int | float) and math.isfinite(value):
                parts.setdefault(name, []).append(float(value))
    return parts


class Batch(NamedTuple):
    """The rollouts the reward function is handed, one list entry each."""

    prompts: list[list[dict[str, str]]]
    texts: list[str]
    tokens: list[int]  # completion tokens
    input_id: list[str]
    context: list[str]


@dataclass
class StepStats:
    rewards: list[float] = field(default_factory=list)
    components: dict[str, list[float]] = field(default_factory=dict)
    dropped_groups: int = 0
    completion_tokens: int = 0
    started: float = 0.0


class StepBridge:
    """TRL's reward function: persists, scores and moves the run through its statuses."""

    __name__ = "trainyard"  # TRL names reward functions in its logs

    def __init__(
        self, ctx: RunContext, run: Run, scorer: Scorer, engine: str, ranks: Ranks | None = None
    ) -> None:
        self.ctx = ctx
        self.run = run
        self.scorer = scorer
        self.engine = engine
        self.ranks = ranks or Ranks()
        self.group_size = run.rollouts_per_group
        self.trainer: Any = None
        self.stats = StepStats()
        self.writes = WriteBehind(ctx.runtime)
        self.dropped_in_a_row = 0  # steps whose every group was dropped, up to this one
        default = GrpoSettings.model_fields["max_dropped_steps"].default
        self.max_dropped_steps = int(run.grpo.get("max_dropped_steps", default))

    def __call__(
        self,
        prompts: list[list[dict[str, str]]],
        completions: list[Any],
        completion_ids: list[list[int]],
        input_id: list[str],
        context: list[str],
        trainer_state: Any,
        environments: list[Any] | None = None,
        log_metric: Any = None,
        **_: Any,
    ) -> list[float | None]:
        # Cancelled while generating: the generation was cut short; store none of it.
        self.ranks.check(self.ctx, pause_ok=False)
        episodes = self._episodes(completions, environments)
        if episodes is None:
            texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
        else:
            texts = [e.final for e in episodes]
        local = len(texts)
        batch = Batch(prompts, texts, [len(ids) for ids in completion_ids], input_id, context)
        if self.ranks.world > 1:
            # Each rank holds its share of the step's rollouts, in the global batch's order;
            # a group may span ranks. Rank 0 scores them all and stores them, once.
            every = self.ranks.gather(list(zip(*batch, strict=True)))
            batch = Batch(*(list(column) for column in zip(*every, strict=True)))
        evaluating = self.trainer is not None and not self.trainer.model.training
        step = trainer_state.global_step + 1
        rewards: list[float | None] = self.ranks.on_rank_zero(
            lambda: self._score(batch, episodes, environments, step, evaluating, log_metric)
        )
        start = self.ranks.rank * local
        return rewards[start : start + local]

    def _score(
        self,
        batch: Batch,
        episodes: list[episodes.Episode] | None,
        environments: list[Any] | None,
        step: int,
        evaluating: bool,
        log_metric: Any,
    ) -> list[float | None]:
        """Score the step's groups and store them (rank 0: the whole batch); the rewards."""
        prompts, texts, tokens, input_id, context = batch
        g = self.group_size
        if len(texts) % g:
            raise RuntimeError(f"{len(texts)} completions do not split into groups of {g}")
        groups = []
        for gi in range(len(texts) // g):
            part = slice(gi * g, (gi + 1) * g)
            if len(set(input_id[part])) != 1:
                raise RuntimeError("a group mixes inputs: TRL's sampler order is not the plan's")
            first = gi * g
            groups.append(
                Group(
                    index=gi,
                    input_text=prompts[first][-1]["content"],
                    context=json.loads(context[first]),
                    rollouts=[
                        Rollout(prompts[i], texts[i])
                        if episodes is None
                        else Rollout(prompts[i], texts[i], episodes[i].messages, environments[i])
                        for i in range(first, first + g)
                    ],
                )
            )
        if hasattr(self.scorer, "completion_tokens"):
            # A scorer that prices the policy's tokens (a teacher run's) gets their counts,
            # in the groups' order: a decoded text does not always re-encode to as many.
            self.scorer.completion_tokens = list(tokens)
        if evaluating:
            # Evaluation: score only; nothing is stored as training data.
            evaluated = self.scorer.score(groups)
            self._log_scorer_metrics(log_metric)
            return [s.reward for row in evaluated for s in row]

        self.ctx.check(pause_ok=False)
        rollouts = [
            {
                "group_index": i // g,
                "rollout_index": i % g,
                "task_input_id": uuid.UUID(input_id[i]),
                "messages": [*prompts[i], *groups[i // g].rollouts[i % g].response],
                "metadata": {
                    "engine": self.engine,
                    "completion_tokens": tokens[i],
                    **(episodes[i].metadata if episodes is not None else {}),
                },
            }
            for i in range(len(texts))
        ]
        # A judge takes seconds: the rollouts are stored (and the run shows "scoring") while
        # it works. Reward functions take microseconds: one transaction stores both.
        instant = getattr(self.scorer, "instant", False)
        if not instant:
            self.writes.submit(lambda: self._store_rollouts(step, rollouts))

        scores = self.scorer.score(groups)
        self._log_scorer_metrics(log_metric)
        if episodes is not None:
            # An episode whose environment failed under it (its MCP server gone) is not the
            # policy's doing: it is recorded with the reason and not trained on.
            scores = [
                [
                    Score(None, {"episode_error": episodes[gi * g + ri].failure})
                    if episodes[gi * g + ri].failure
                    else s
                    for ri, s in enumerate(row)
                ]
                for gi, row in enumerate(scores)
            ]
        rewards = [s.reward for row in scores for s in row]
        self.stats.rewards = [r for r in rewards if r is not None]
        self.stats.components = reward_components(s for row in scores for s in row)
        self.stats.dropped_groups = sum(1 for row in scores if all(s.reward is None for s in row))
        self.stats.completion_tokens = sum(tokens)
        rows = [
            {"group_index": gi, "rollout_index": ri, "reward": s.reward, "breakdown": s.breakdown}
            for gi, row in enumerate(scores)
            for ri, s in enumerate(row)
        ]
        if instant:
            scored = [{**r, **row} for r, row in zip(rollouts, rows, strict=True)]
            self.writes.submit(lambda: self._store_scored_rollouts(step, scored))
        else:
            self.writes.submit(lambda: self._store_rewards(step, rows))
        self._count_dropped(scores)
        self.ctx.check(pause_ok=False)
        return rewards

    def _log_scorer_metrics(self, log_metric: Any) -> None:
        """A scorer's own metrics of the groups it just scored (a teacher run's
        ``teacher/...``), logged with the step's (TRL's ``log_metric``)."""
        if log_metric is not None:
            for name, value in getattr(self.scorer, "step_metrics", {}).items():
                log_metric(name, value)

    def _count_dropped(self, scores: list[list[Score]]) -> None:
        """Fail the run once every group of ``max_dropped_steps`` steps in a row was dropped,
        with the reason the last step's first group gave."""
        if self.stats.dropped_groups < len(scores):
            self.dropped_in_a_row = 0
            return
        self.dropped_in_a_row += 1
        if self.dropped_in_a_row >= self.max_dropped_steps:
            raise EveryGroupDropped(self.dropped_in_a_row, _drop_reason(scores[0][0]))

    def _episodes(
        self, completions: list[Any], environments: list[Any] | None
    ) -> list[episodes.Episode] | None:
        """Each rollout's episode when the run has an environment (TRL's tool loop ran)."""
        if environments is None:
            return None
        masks = getattr(self.trainer, "last_tool_mask", None) or [None] * len(completions)
        return [
            episodes.build(c, env._records, mask, env._failure)
            for c, env, mask in zip(completions, environments, masks, strict=True)
        ]

    # Each write commits its data with the phase change, fenced on the lease: one statement
    # each (app.runs.step_moves), since the trainer waits on none of them but shares the GIL.
    async def _store_rollouts(self, step: int, rollouts: list[dict[str, Any]]) -> None:
        async with self.ctx.runtime.pg() as conn:
            await step_moves.rollouts_collected(
                conn, self.ctx.run_id, self.ctx.fence, step, rollouts, ttl_seconds=self._ttl
            )

    async def _store_rewards(self, step: int, rows: list[dict[str, Any]]) -> None:
        async with self.ctx.runtime.pg() as conn:
            await step_moves.rewards_scored(
                conn, self.ctx.run_id, self.ctx.fence, step, rows, ttl_seconds=self._ttl
            )

    async def _store_scored_rollouts(self, step: int, scored: list[dict[str, Any]]) -> None:
        """Rollouts with their rewards, and both phase moves, in one statement."""
        async with self.ctx.runtime.pg() as conn:
            await step_moves.rollouts_collected(
                conn,
                self.ctx.run_id,
                self.ctx.fence,
                step,
                scored,
                ttl_seconds=self._ttl,
                scored=True,
            )

    @property
    def _ttl(self) -> float:
        return self.ctx.settings.lease_ttl_seconds


def grpo_config(
    run: Run, paths: RunPaths, n_steps: int, *, evaluate: bool, max_turns: int | None = None
) -> Any:
    """The run's settings mapped onto TRL's GRPOConfig (``max_turns``: an agent run's
    environment.max_turns, TRL's max_tool_calling_iterations)."""
    import torch
    from trl import GRPOConfig

    grpo = run.grpo
    g = run.rollouts_per_group
    per_step = grpo["groups_per_step"] * g
    accumulation = grpo.get("gradient_accumulation_steps", 1)
    ranks = distributed_spec(grpo)["num_processes"]
    cuda = torch.cuda.is_available()
    engine = grpo.get("engine", "transformers")
    kwargs: dict[str, Any] = {}
    if engine == "vllm-colocate":
        kwargs.update(
            use_vllm=True,
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=grpo["vllm_gpu_memory_utilization"],
            vllm_max_model_length=grpo.get("vllm_max_model_len"),
        )
    elif engine == "vllm-server" and not grpo.get("lora"):
        # TRL's server mode: all the weights broadcast to `trl vllm-serve` over NCCL. A LoRA
        # run's rollouts come from Trainyard's rollout_func instead (workers/ml/vllm_server).
        from workers.ml.vllm_server import server_urls

        kwargs.update(
            use_vllm=True,
            vllm_mode="server",
            vllm_server_base_url=server_urls(grpo)[0],
            vllm_server_timeout=grpo.get("vllm_server_timeout_s", 120),
        )
    if max_turns is not None:
        kwargs["max_tool_calling_iterations"] = max_turns
    if evaluate:
        kwargs.update(
            eval_strategy="steps",
            eval_steps=grpo.get("eval_steps") or grpo["save_steps"],
            per_device_eval_batch_size=per_step // ranks,
            load_best_model_at_end=grpo["load_best_model_at_end"],
            metric_for_best_model=grpo["metric_for_best_model"],
            greater_is_better=grpo["greater_is_better"],
        )
    return GRPOConfig(
        output_dir=str(paths.staging),
        learning_rate=run.learning_rate,
        max_steps=n_steps,
        num_train_epochs=1,
        num_generations=g,
        # One generation of groups_per_step groups per optimizer step, split over the ranks
        # and into micro-batches when gradients are accumulated (the API checked it splits).
        per_device_train_batch_size=per_step // (accumulation * ranks),
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        shuffle_dataset=False,  # the dataset is already in the plan's order
        seed=grpo["seed"],
        beta=grpo["beta"],
        loss_type=grpo["loss_type"],
        scale_rewards=grpo["scale_rewards"],
        temperature=grpo["temperature"],
        top_p=grpo["top_p"],
        top_k=grpo.get("top_k") or 0,
        min_p=grpo.get("min_p"),
        repetition_penalty=grpo["repetition_penalty"],
        max_completion_length=grpo["max_completion_length"],
        warmup_steps=grpo["warmup_ratio"],  # a float below 1 is a ratio in transformers 5
        weight_decay=grpo["weight_decay"],
        max_grad_norm=grpo["max_grad_norm"],
        gradient_checkpointing=grpo["gradient_checkpointing"],
        bf16=grpo["bf16"] and cuda,
        fp16=grpo["fp16"] and cuda,
        use_cpu=not cuda,
        logging_steps=1,
        save_strategy="steps",
        save_steps=grpo["save_steps"],
        save_total_limit=None,  # Trainyard prunes its own checkpoint folder
        report_to=[],  # trackers are attached as callbacks: tracker_callbacks
        run_name=tracker_name(run),
        disable_tqdm=True,
        **kwargs,
    )


def _rows(run: Run, items: list[PlannedInput]) -> list[dict[str, Any]]:
    return [
        {
            "prompt": prompt_messages(run.system_prompt, item.input_text),
            "input_id": item.id,
            "context": json.dumps(item.context),
        }
        for item in items
    ]


def train(
    ctx: RunContext,
    run: Run,
    plan: list[InputBatch],
    validation: list[PlannedInput],
    scorer: Scorer,
    paths: RunPaths,
    resume_from: Path | None,
    environment: LoadedEnvironment | None = None,
    model: str | None = None,
) -> Path:
    """Run TRL's GRPO over the plan (blocking); returns the final model's folder.

    With an ``environment``, every rollout is an episode in it: TRL's own multi-turn loop
    calls the tools and masks their results out of the loss. ``model``: where GRPO starts
    (an SFT warm-up's output); unset, the run's model_name."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from trl import GRPOTrainer

    from workers.pipeline.callback import RunCallback

    grpo = run.grpo
    ranks = Ranks()
    if ranks.world == 1:  # the ranks' worker cleared it before it launched them
        shutil.rmtree(paths.staging, ignore_errors=True)  # half-written checkpoints of a crash
    dataset = Dataset.from_list(_rows(run, [item for batch in plan for item in batch.items]))
    evaluate = bool(validation)
    eval_dataset = Dataset.from_list(_rows(run, validation)) if evaluate else None
    peft_config = None
    if grpo.get("lora"):
        from peft import LoraConfig

        lora = grpo["lora"]
        peft_config = LoraConfig(
            r=lora["r"],
            lora_alpha=lora["alpha"],
            lora_dropout=lora["dropout"],
            target_modules=lora["target_modules"],
            task_type="CAUSAL_LM",
        )
    engine = grpo.get("engine", "transformers")
    if engine == "vllm-colocate":
        from workers.ml.vllm_engine import prepare_colocate

        prepare_colocate()
    bridge = StepBridge(ctx, run, scorer, engine=engine, ranks=ranks)
    agent: dict[str, Any] = {}
    if environment is not None:
        agent["environment_factory"] = environment.factory
    rollouts = None
    if engine == "vllm-server" and grpo.get("lora"):
        from workers.ml.vllm_server import ServerRollouts

        rollouts = ServerRollouts(str(run.id), grpo, paths.root / "adapters", ranks)
        agent["rollout_func"] = rollouts
    trainer = (agent_trainer_class() if environment is not None else GRPOTrainer)(
        model=model or run.model_name,
        reward_funcs=bridge,
        args=grpo_config(
            run,
            paths,
            len(plan),
            evaluate=evaluate,
            max_turns=environment.max_turns if environment is not None else None,
        ),
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        peft_config=peft_config,
        callbacks=[
            RunCallback(ctx, run, bridge, paths, plan),
            *tracker_callbacks(run, paths.root, "grpo"),
        ],
        **agent,
    )
    bridge.trainer = trainer
    if engine == "transformers":
        stop_generating_when_cancelled(trainer.model, ctx)
    # Trainyard records every step itself; the console printers would only flood worker logs.
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    if evaluate and resume_from is None:
        trainer.evaluate()  # the base model: what every later evaluation is compared with
    if ranks.writer:
        ctx.runtime.run(_start_collecting(ctx))
    try:
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    except BaseException as exc:
        # Land what can land; the reason training stopped is what the driver must see.
        with contextlib.suppress(Exception):
            bridge.writes.flush()
        if isinstance(exc, Exception):
            raise_if_disk_full(paths.root, paths.staging, exc)
        raise
    finally:
        if rollouts is not None:
            rollouts.close()
        if engine == "vllm-colocate" and ranks.world == 1:  # ranks exit when they are done
            from workers.ml.vllm_engine import release_colocate

            release_colocate(trainer)
    bridge.writes.flush()

    final = paths.final(run.trained_model_name or f"run-{run.id}")
    # Every rank saves (ZeRO-3 gathers the weights from all of them); rank 0 writes.
    staging = final.with_name(f".{final.name}.tmp-{ranks.share(uuid.uuid4().hex[:8])}")
    trainer.save_model(str(staging))
    ranks.wait()
    if ranks.writer:
        if final.exists():
            shutil.rmtree(final)
        os.rename(staging, final)
        shutil.rmtree(paths.staging, ignore_errors=True)
    return final


def stop_generating_when_cancelled(model: Any, ctx: RunContext) -> None:
    """End a generation in progress at the next token once the run is cancelled (or its
    lease lost): a long generation would otherwise hold a cancel for as long as it lasts.
    The heartbeat sets the flag; a stopping criterion handed to every ``generate`` call of
    this model reads it. (vLLM generates a step's batch at once; a cancel waits for it.)"""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Cancelled(StoppingCriteria):  # type: ignore[misc]
        said = False

        def __call__(self, input_ids: Any, scores: Any, **_: Any) -> Any:
            stop = ctx.cancelled
            if stop and not Cancelled.said:
                Cancelled.said = True
                log.info("run %s: cancelled mid-generation; generation stops", ctx.run_id)
            return torch.full(
                (input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device
            )

    generate = model.generate

    def generate_until_cancelled(*args: Any, **kwargs: Any) -> Any:
        criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
        criteria.append(Cancelled())
        return generate(*args, stopping_criteria=criteria, **kwargs)

    model.generate = generate_until_cancelled


def agent_trainer_class() -> type:
    """TRL's GRPOTrainer, unchanged, keeping the tool mask of its last generation so each
    stored episode can say how many of its tokens were trained on and how many (the tool
    results) were masked out of the loss."""
    from trl import GRPOTrainer

    class AgentTrainer(GRPOTrainer):  # type: ignore[misc]
        last_tool_mask: list[list[int]] | None = None

        def _generate(self, prompts: list[Any]) -> Any:
            out = super()._generate(prompts)
            self.last_tool_mask = out[2]  # (prompt_ids, completion_ids, tool_mask, ...)
            return out

    return AgentTrainer


async def _start_collecting(ctx: RunContext) -> None:
    """Whatever phase a (resumed) run was left in, its next step starts in collecting."""
    async with ctx.session() as session:
        row = await session.get(Run, ctx.run_id, populate_existing=True)
        assert row is not None
        if RunStatus(row.status) != S.COLLECTING:
            await transition(
                session,
                ctx.run_id,
                S.COLLECTING,
                fence=ctx.fence,
                message=f"step {row.step + 1}: collecting rollouts",
                data={"step": row.step + 1},
            )
