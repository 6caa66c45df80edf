"""A small real pipeline for testing leases, the reconciler and stop requests with real
Celery workers: it walks the real phases, persists each phase's output like the training
pipeline does (trajectories unique per step/group/rollout, one metric point per step) and
resumes from the last persisted phase. Selected with ``TRAINYARD_PIPELINE``
(``tests.support.pipelines:ticking``).

The run's ``config`` steers it: ``tick`` is how long each phase lasts (seconds);
``stall_in`` names a phase that lasts an hour instead, so that only a stop request (which the
heartbeat delivers) can end it in a test's lifetime; ``die_at_start`` and ``die_in_training``
make the worker process die.

``dies_mid_checkpoint`` is the real training pipeline with one fault injected.
"""

from __future__ import annotations

import asyncio
import importlib
import os
from typing import Any

from sqlalchemy.dialects.postgresql import insert

from app.metrics.models import MetricPoint
from app.runs.lifecycle import step_moves
from app.runs.lifecycle.status import RunStatus
from workers.context import RunContext

S = RunStatus
STALL_SECONDS = 3600.0


async def _tick(ctx: RunContext, seconds: float) -> None:
    await ctx.wait_for_stop(seconds)
    ctx.check(pause_ok=False)


async def ticking(ctx: RunContext) -> None:
    run = await ctx.load()
    if run.attempt <= int(run.config.get("die_at_start", 0)):
        os._exit(17)  # the worker dies right after its claim, before its first heartbeat
    base_tick = float(run.config.get("tick", 0.2))
    stall = run.config.get("stall_in")

    def tick(phase: RunStatus) -> float:
        return STALL_SECONDS if phase.value == stall else base_tick

    ttl = ctx.settings.lease_ttl_seconds
    steps = run.max_steps or 3
    groups = run.grpo.get("groups_per_step", 2)
    status = S(run.status)
    if status == S.PENDING:
        run = await ctx.move(S.GENERATING if run.step == 0 else S.COLLECTING)
        status = S(run.status)
    if status == S.GENERATING:
        await _tick(ctx, tick(S.GENERATING))
        status = S((await ctx.move(S.COLLECTING, expected=S.GENERATING)).status)
    step = run.step
    while True:
        if status == S.COLLECTING:
            await _tick(ctx, tick(S.COLLECTING))
            rollouts = [
                {
                    "group_index": g,
                    "rollout_index": r,
                    "messages": [
                        {"role": "user", "content": f"s{step}g{g}"},
                        {"role": "assistant", "content": "a" * r},
                    ],
                }
                for g in range(groups)
                for r in range(run.rollouts_per_group)
            ]
            async with ctx.runtime.pg() as conn:
                await step_moves.rollouts_collected(
                    conn, ctx.run_id, ctx.fence, step, rollouts, ttl_seconds=ttl
                )
            status = S.SCORING
        if status == S.SCORING:
            await _tick(ctx, tick(S.SCORING))
            rewards = [
                {"group_index": g, "rollout_index": r, "reward": r / 10}
                for g in range(groups)
                for r in range(run.rollouts_per_group)
            ]
            async with ctx.runtime.pg() as conn:
                await step_moves.rewards_scored(
                    conn, ctx.run_id, ctx.fence, step, rewards, ttl_seconds=ttl
                )
            status = S.TRAINING
        if status == S.TRAINING:
            if run.config.get("die_in_training"):
                os._exit(17)  # a poison run: the worker process dies on every attempt
            await _tick(ctx, tick(S.TRAINING))
            async with ctx.session() as session:
                await session.execute(
                    insert(MetricPoint)
                    .values(run_id=ctx.run_id, step=step, name="reward_mean", value=step / steps)
                    .on_conflict_do_nothing()
                )
            step += 1
            done = step >= steps
            moved = await ctx.move(
                S.COMPLETED if done else S.COLLECTING, expected=S.TRAINING, values={"step": step}
            )
            if done:
                return
            status = S(moved.status)
            ctx.check()  # a step boundary: the safe point for a pause


async def dies_mid_checkpoint(ctx: RunContext) -> None:
    """The real training pipeline, but on the run's first attempt the worker process dies
    while writing the checkpoint at ``config.die_at_checkpoint``: after the model weights,
    before the optimizer state."""
    # Imported off the event loop: a multi-second import there would starve the heartbeat.
    transformers = await asyncio.to_thread(importlib.import_module, "transformers")
    pipeline = await asyncio.to_thread(importlib.import_module, "workers.pipeline")
    Trainer = transformers.Trainer

    run = await ctx.load()
    at = run.config.get("die_at_checkpoint")
    original = Trainer._save_optimizer_and_scheduler

    def save(self: Any, output_dir: str) -> None:
        if ctx.fence.attempt == 1 and self.state.global_step == at:
            os._exit(17)
        original(self, output_dir)

    Trainer._save_optimizer_and_scheduler = save  # type: ignore[method-assign]
    try:
        await pipeline.run_pipeline(ctx)
    finally:
        Trainer._save_optimizer_and_scheduler = original  # type: ignore[method-assign]
