"""The trainer callback of a run: what happens at TRL's step boundaries.

Imported by :func:`workers.pipeline.training.train` only (it needs transformers). At each
boundary it checks for stop requests, stores the step's metrics and summary with the move to
the next step's ``collecting`` (one fenced statement,
:mod:`app.runs.lifecycle.step_moves`), promotes checkpoints (staging folder → rename →
record), records evaluations, and turns a pause request into a checkpoint followed by a stop.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from app.checkpoints import service as checkpoints
from app.events import service as events
from app.metrics import service as metrics
from app.observability import prometheus
from app.rollouts import service as generated
from app.runs.lifecycle import step_moves
from app.runs.lifecycle.status import RunStatus
from app.runs.models import Run
from app.runs.spec.parsed import RunSpec
from workers.context import RunContext
from workers.pipeline.paths import RunPaths
from workers.pipeline.plan import InputBatch
from workers.pipeline.steps import StepBridge, StepStats

S = RunStatus


class RunCallback(TrainerCallback):  # type: ignore[misc]
    """Statuses at step boundaries, per-step metrics, checkpoints, stop requests."""

    def __init__(
        self,
        ctx: RunContext,
        spec: RunSpec,
        bridge: StepBridge,
        paths: RunPaths,
        plan: list[InputBatch],
    ) -> None:
        self.ctx = ctx
        self.spec = spec
        self.bridge = bridge
        self.ranks = bridge.ranks  # rank 0 alone writes; stops are its decision
        self.paths = paths
        self.plan = plan
        # How many resumable checkpoints to keep (None: all of them).
        self.keep: int | None = spec.grpo.save_total_limit
        self.pausing = False
        self.logged: set[int] = set()
        previous = ctx.runtime.run(_summary(ctx))  # what earlier attempts recorded
        self.first_reward: float | None = previous.get("reward_first")
        # Evaluation on the validation inputs: base model (step 0), then every eval_steps.
        self.evaluation: dict[str, Any] = {
            k: previous[k] for k in previous if k.startswith("eval_")
        }

    def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        # Cancel stops here; a pause only at a step's end, after its checkpoint (on_step_end):
        # a pause seen first here would stop with no checkpoint of the steps since the last.
        self.ranks.check(self.ctx, pause_ok=False)
        self.bridge.writes.check()
        self.bridge.stats = StepStats(started=time.monotonic())

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self.ranks.stops_at_step_end(self.ctx) and state.global_step < state.max_steps:
            # Pause (or hand over) at this step boundary: checkpoint first, stop in on_save.
            self.pausing = True
            control.should_save = True

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
        if not self.ranks.writer:
            return  # the logs are every rank's, reduced; rank 0 records them
        step = state.global_step
        if logs and "eval_reward" in logs:
            self._evaluated(step, logs)
            return
        if not logs or "loss" not in logs or step in self.logged or step == 0:
            return
        self.logged.add(step)
        stats = self.bridge.stats
        seconds = max(time.monotonic() - stats.started, 1e-9)
        values: dict[str, float] = {
            name: float(value)
            for name, value in logs.items()
            if isinstance(value, int | float) and name != "epoch"
        }
        if stats.rewards:
            values.update(
                reward_mean=statistics.fmean(stats.rewards),
                reward_std=statistics.pstdev(stats.rewards),
                reward_min=min(stats.rewards),
                reward_max=max(stats.rewards),
            )
        values.update({n: statistics.fmean(v) for n, v in stats.components.items() if v})
        values.update(
            groups_dropped=float(stats.dropped_groups),
            step_seconds=seconds,
            tokens_per_second=stats.completion_tokens / seconds,
        )
        if self.first_reward is None and "reward_mean" in values:
            self.first_reward = values["reward_mean"]
        batch = self.plan[step - 1]
        rollouts = len(batch.items) * self.spec.rollouts_per_group
        prometheus.observe_step(seconds, rollouts, stats.completion_tokens)
        summary = {
            "step": step,
            "epoch": batch.epoch,
            "total_trajectories": step * rollouts,
            "avg_reward": values.get("reward_mean"),
            "min_reward": values.get("reward_min"),
            "max_reward": values.get("reward_max"),
            "training_loss": values.get("loss"),
            "reward_first": self.first_reward,
            **self.evaluation,
        }
        self.bridge.writes.submit(lambda: self._finish_step(step, batch.epoch, values, summary))

    async def _finish_step(
        self, step: int, epoch: int, values: dict[str, float], summary: dict[str, Any]
    ) -> None:
        """The step's metrics, summary and event; the run moves on to the next step's
        collecting in the same transaction (or stays in training after the last)."""
        reward = values.get("reward_mean")
        async with self.ctx.runtime.pg() as conn:
            await step_moves.step_finished(
                conn,
                self.ctx.run_id,
                self.ctx.fence,
                step,
                epoch,
                metrics=values,
                summary=summary,
                last=step >= len(self.plan),
                event=f"step {step}/{len(self.plan)} done"
                + (f": reward {reward:.3f}" if reward is not None else ""),
                ttl_seconds=self.ctx.settings.lease_ttl_seconds,
            )

    def _evaluated(self, step: int, logs: dict[str, Any]) -> None:
        values = {
            name: float(value)
            for name, value in logs.items()
            if name.startswith("eval_") and isinstance(value, int | float)
        }
        reward = values["eval_reward"]
        base = self.evaluation.setdefault("eval_reward_base", reward)
        best = self.evaluation.get("eval_reward_best")
        if best is None or reward > best:
            self.evaluation.update(eval_reward_best=reward, eval_best_step=step)
        self.evaluation.update(eval_reward=reward, eval_step=step, eval_improvement=reward - base)
        summary = dict(self.evaluation)
        self.bridge.writes.submit(
            lambda: self._record_evaluation(step, values, summary, reward, reward - base)
        )

    async def _record_evaluation(
        self,
        step: int,
        values: dict[str, float],
        summary: dict[str, Any],
        reward: float,
        gain: float,
    ) -> None:
        async with self.ctx.session() as session:
            await metrics.record(session, self.ctx.run_id, step, values)
            row = await session.get(Run, self.ctx.run_id, populate_existing=True)
            assert row is not None
            row.metrics = {**(row.metrics or {}), **summary}
            label = "base model" if step == 0 else f"step {step}"
            await events.append(
                session,
                self.ctx.run_id,
                "eval",
                f"evaluation of the {label}: reward {reward:.3f} ({gain:+.3f} vs base)",
                data={"step": step, "eval_reward": reward, "improvement": gain},
            )

    def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        # Pause, cancel and failures leave by an exception; max_steps ends with the step
        # count reached. What is left is transformers' EarlyStoppingCallback.
        stopping = self.spec.grpo.early_stopping
        if (
            stopping is None
            or not control.should_training_stop
            or state.global_step >= state.max_steps
            or not self.ranks.writer
        ):
            return
        step, metric = state.global_step, args.metric_for_best_model
        stopped = {
            "step": step,
            "metric": metric,
            "patience": stopping.patience,
            "threshold": stopping.threshold,
            "best_metric": state.best_metric,
            "best_step": state.best_global_step,
        }
        better = "rose" if args.greater_is_better else "fell"
        message = (
            f"stopped early at step {step} of {state.max_steps}: {metric} {better} by no more "
            f"than {stopping.threshold:g} over its best in {stopping.patience} evaluation(s) "
            f"in a row (best {state.best_metric:.3f} at step {state.best_global_step})"
        )
        self.bridge.writes.submit(lambda: self._record_early_stop(stopped, message))

    async def _record_early_stop(self, stopped: dict[str, Any], message: str) -> None:
        async with self.ctx.session() as session:
            row = await session.get(Run, self.ctx.run_id, populate_existing=True)
            assert row is not None
            row.metrics = {**(row.metrics or {}), "stopped_early": stopped}
            await events.append(session, self.ctx.run_id, "early_stop", message, data=stopped)

    def on_save(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        step = state.global_step
        self.ranks.wait()  # every rank's part of the checkpoint is written (its RNG state)
        staged = self.paths.staging / f"checkpoint-{step}"
        target = self.paths.checkpoints / f"checkpoint-{step}"
        # The trainer remembers where the best checkpoint is (for load_best_model_at_end,
        # also inside the checkpoint's trainer_state.json, read back on resume): point
        # both at the promoted folder.
        if (
            state.best_model_checkpoint
            and Path(state.best_model_checkpoint).parent == self.paths.staging
        ):
            state.best_model_checkpoint = str(
                self.paths.checkpoints / Path(state.best_model_checkpoint).name
            )
        if self.ranks.writer and staged.is_dir():
            self._promote(staged, target)
            best = state.best_global_step if state.best_model_checkpoint else None
            self.bridge.writes.submit(lambda: self._record_checkpoint(step, target, best))
        if self.pausing:
            self.bridge.writes.flush()  # the checkpoint is recorded before the run stops
            self.ranks.stop_at_step_end(self.ctx)

    def _promote(self, staged: Path, target: Path) -> None:
        """staging/checkpoint-N → checkpoints/checkpoint-N, whole (a rename)."""
        self.paths.checkpoints.mkdir(parents=True, exist_ok=True)
        if target.exists():  # left by an attempt that died before recording it
            shutil.rmtree(target)
        os.rename(staged, target)
        saved_state = target / "trainer_state.json"
        if saved_state.is_file():
            text = saved_state.read_text()
            saved_state.write_text(
                text.replace(str(self.paths.staging), str(self.paths.checkpoints))
            )

    async def _record_checkpoint(self, step: int, target: Path, best: int | None) -> None:
        async with self.ctx.session() as session:
            await checkpoints.record(
                session,
                self.ctx.run_id,
                step,
                str(target),
                metrics=(await session.get(Run, self.ctx.run_id, populate_existing=True)).metrics
                or {},  # type: ignore[union-attr]
            )
            await events.append(
                session,
                self.ctx.run_id,
                "checkpoint",
                f"checkpoint at step {step}",
                data={"step": step, "path": str(target)},
            )
            if self.spec.grpo.async_rollouts is not None:
                await generated.prune(session, self.ctx.run_id, step)
            protect = {best} if best else set()
            doomed = (
                await checkpoints.prune(session, self.ctx.run_id, keep=self.keep, protect=protect)
                if self.keep
                else []
            )
        # Folders go only after the commit that forgot them.
        for folder in doomed:
            await asyncio.to_thread(shutil.rmtree, folder, True)


async def _summary(ctx: RunContext) -> dict[str, Any]:
    """The run's summary as stored now (its metrics column)."""
    async with ctx.runtime.session() as session:
        row = await session.get(Run, ctx.run_id)
        return dict(row.metrics or {}) if row is not None else {}
