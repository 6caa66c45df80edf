"""Trainyard's subclasses of transformers' and TRL's extension points: a W&B callback per
training stage, a stopping criterion that ends a generation when the run is cancelled, the
SFT warm-up's callback, and the GRPO trainer of agent runs.

transformers and TRL are imported here at the top, so this module is imported only inside
the functions that train (the worker's API-side code, and the API, never load it).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TrainerCallback
from transformers.integrations import WandbCallback
from trl import GRPOTrainer

from app.events import service as events
from app.metrics import service as metrics
from workers.context import RunContext

log = logging.getLogger(__name__)


class StageWandb(WandbCallback):  # type: ignore[misc]
    """transformers' W&B logging into a run opened with this stage's project, name and folder
    (the mode is the worker's WANDB_MODE), grouped by the Trainyard run, and finished when
    training ends: transformers would leave it open for the next stage to log into."""

    def __init__(self, *, project: str, name: str, run_id: str, stage: str, folder: Path) -> None:
        super().__init__()
        self.project, self.name, self.run_id = project, name, run_id
        self.stage, self.folder = stage, folder

    def setup(self, args: Any, state: Any, model: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            if self._wandb.run is not None:  # left open by a stage that raised
                self._wandb.finish()
            self._wandb.init(
                project=self.project,
                name=self.name,
                group=self.run_id,  # its stages and resumed attempts together
                dir=str(self.folder),
                config={"trainyard_run_id": self.run_id, "trainyard_stage": self.stage},
            )
        super().setup(args, state, model, **kwargs)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        super().on_train_end(args, state, control, **kwargs)
        if self._wandb.run is not None:
            self._wandb.finish()


class StopWhenCancelled(StoppingCriteria):  # type: ignore[misc]
    """Ends every sequence of a generation at the next token once the run is cancelled or its
    lease lost (the heartbeat sets the flag this reads)."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.said = False

    def __call__(self, input_ids: Any, scores: Any, **_: Any) -> Any:
        stop = self.ctx.cancelled
        if stop and not self.said:
            self.said = True
            log.info("run %s: cancelled mid-generation; generation stops", self.ctx.run_id)
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


def stop_generating_when_cancelled(model: Any, ctx: RunContext) -> None:
    """End a generation in progress at the next token once the run is cancelled (or its
    lease lost): a long generation would otherwise hold a cancel for as long as it lasts.
    The criterion is handed to every ``generate`` call of this model. (vLLM generates a
    step's batch at once; a cancel waits for it.)"""
    generate = model.generate
    criterion = StopWhenCancelled(ctx)

    def generate_until_cancelled(*args: Any, **kwargs: Any) -> Any:
        criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
        criteria.append(criterion)
        return generate(*args, stopping_criteria=criteria, **kwargs)

    model.generate = generate_until_cancelled


class SftCallback(TrainerCallback):  # type: ignore[misc]
    """The SFT warm-up's callback: stores the loss curve; honours cancel, and pause after a
    checkpoint."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.pausing = False

    def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self.ctx.check(pause_ok=False)

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self.ctx.stops_at_step_end and state.global_step < state.max_steps:
            self.pausing = True
            control.should_save = True

    def on_save(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self.pausing:
            self.ctx.stop_at_step_end()

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
        if not logs or "loss" not in logs:
            return
        values = {
            f"sft/{name}": float(value)
            for name, value in logs.items()
            if isinstance(value, int | float) and name != "epoch"
        }
        self.ctx.runtime.run(_record_sft_step(self.ctx, state.global_step, values))


async def _record_sft_step(ctx: RunContext, step: int, values: dict[str, float]) -> None:
    """The warm-up's loss at ``step``, with the event every metrics write comes with."""
    async with ctx.session() as session:  # the lease renewal locks the run's row
        await metrics.record(session, ctx.run_id, step, values)
        loss = values.get("sft/loss")
        await events.append(
            session,
            ctx.run_id,
            "sft_step",
            f"warm-up step {step}" + ("" if loss is None else f": loss {loss:.4f}"),
            data={"step": step, **values},
        )


class AgentTrainer(GRPOTrainer):  # type: ignore[misc]
    """TRL's GRPOTrainer, unchanged, keeping the tool mask of its last generation so each
    stored episode can say how many of its tokens were trained on and how many (the tool
    results) were masked out of the loss."""

    last_tool_mask: list[list[int]] | None = None

    def _generate(self, prompts: list[Any]) -> Any:
        out = super()._generate(prompts)
        self.last_tool_mask = out[2]  # (prompt_ids, completion_ids, tool_mask, ...)
        return out


class GatewayTrainer(GRPOTrainer):  # type: ignore[misc]
    """TRL's GRPOTrainer, keeping the rows of the batch it generates for (a gateway run's
    rollout function makes an episode of each, and TRL hands it the prompts only:
    workers/gateway/rollouts.py), and training a split episode's earlier chains of calls
    (app/gateway/samples.py) as rows of their own with the episode's advantage.

    TRL's batch holds one row per rollout, and its rewards and advantages are computed per
    rollout, so the earlier chains join the batch right after generation: TRL pads them,
    scores them under the policy and the reference, corrects for the engine's sampling and
    counts their tokens in the loss's normaliser like any row's; only their advantages are
    added here, each its episode's. A training batch is split into ``steps_per_generation``
    equal micro-batches, so rows with nothing to train (every token masked, advantage 0)
    fill it up to a multiple: they add nothing to the ``dapo`` and ``bnpo`` losses, and
    count as rows in the per-row means of ``grpo`` and ``dr_grpo``. Evaluations train
    nothing and take the last chains only."""

    gateway_inputs: list[dict[str, Any]] = []
    _owners: list[int] = []  # for each row added, its episode's row; -1 for a filler

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> Any:
        self.gateway_inputs = inputs
        self._owners = []
        output = super()._generate_and_score_completions(inputs)
        if self._owners:
            advantages = output["advantages"]
            owners = torch.tensor(self._owners, device=advantages.device)
            added = torch.where(owners >= 0, advantages[owners.clamp(min=0)], 0.0)
            output["advantages"] = torch.cat([advantages, added])
        return output

    def _generate(self, prompts: list[Any]) -> Any:
        out = list(super()._generate(prompts))
        prompt_ids, completion_ids, env_mask, _, logprobs, extra_fields = out[:6]
        earlier = extra_fields.pop("earlier_chains", None) or []
        if not self.model.training:
            return tuple(out)
        for row, chains in enumerate(earlier):
            for chain in chains:
                self._owners.append(row)
                prompt_ids.append(chain.prompt_ids)
                completion_ids.append(chain.completion_ids)
                env_mask.append(chain.env_mask)
                logprobs.append(chain.logprobs)
        if self._owners:
            eos, pad = self.eos_token_ids[0], self._tokenizer.pad_token_id
            while len(self._owners) % self.args.steps_per_generation:
                self._owners.append(-1)
                prompt_ids.append([pad])
                completion_ids.append([eos])
                env_mask.append([0])
                logprobs.append([0.0])
        return tuple(out)

    def _calculate_rewards(
        self, inputs: list[Any], prompts: list[Any], completions: list[Any], ids: list[Any]
    ) -> Any:
        # One reward per rollout: the rows added after them share their episode's.
        return super()._calculate_rewards(inputs, prompts, completions, ids[: len(prompts)])


class _AdaptersLoadedByRollouts:
    """What TRL syncs its vLLM weights through, for a run whose rollout function loads each
    policy version's adapter into the servers itself: nothing to do here."""

    def sync_weights(self) -> None:
        pass


class ServerTrainer(GRPOTrainer):  # type: ignore[misc]
    """TRL's GRPOTrainer for an asynchronous LoRA run on vLLM servers, with TRL's vLLM
    importance-sampling correction turned on for its rollout function's rollouts.

    TRL corrects for the sampler (``vllm_importance_sampling_*``: the ratio of the trainer's
    log-probabilities to the sampled ones, truncated or masked) only when it generates with
    vLLM itself (``use_vllm``); the rollouts of workers/pipeline/ahead.py come from plain
    ``vllm serve`` servers through ``rollout_func``, sampled by an adapter up to
    ``max_staleness`` versions old, with their log-probabilities. With the correction on,
    ``use_vllm`` is set after TRL's set-up (whose vLLM client would look for a
    ``trl vllm-serve`` server): with a rollout function it means only that TRL computes
    the ratio, logs its statistics (``sampling/importance_sampling_ratio/*``) and weighs the
    loss by it; its weight sync is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.args.vllm_importance_sampling_correction:
            self.use_vllm = True
            self.vllm_mode = "server"
            self.vllm_generation = _AdaptersLoadedByRollouts()
            self._last_loaded_step = -1


class GatewayServerTrainer(GatewayTrainer, ServerTrainer):
    """A gateway run's trainer on an asynchronous run (workers/gateway/rollouts.py serves the
    steps ahead): GatewayTrainer's rows, with TRL's importance-sampling correction of
    ServerTrainer over the episodes' recorded log-probabilities (the harness's turns masked
    out of it by the rollouts' ``env_mask``, as out of the loss)."""
