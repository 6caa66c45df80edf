"""A small real pipeline for testing leases, the reconciler and stop requests with real
Celery workers: it walks the real phases, persists each phase's output like the training
pipeline does (trajectories unique per step/group/rollout, one metric point per step) and
resumes from the last persisted phase. Selected with ``TRAINYARD_PIPELINE``."""

from __future__ import annotations

import os

from sqlalchemy.dialects.postgresql import insert

from app.metrics.models import MetricPoint
from app.runs import step_moves
from app.runs.status import RunStatus
from workers.context import RunContext

S = RunStatus


async def _tick(ctx: RunContext, seconds: float) -> None:
    await ctx.wait_for_stop(seconds)
    ctx.check(pause_ok=False)


async def ticking(ctx: RunContext) -> None:
    run = await ctx.load()
    if run.attempt <= int(run.config.get("die_at_start", 0)):
        os._exit(17)  # the worker dies right after its claim, before its first heartbeat
    tick = float(run.config.get("tick", 0.2))
    ttl = ctx.settings.lease_ttl_seconds
    steps = run.max_steps or 3
    groups = run.grpo.get("groups_per_step", 2)
    status = S(run.status)
    if status == S.PENDING:
        run = await ctx.move(S.GENERATING if run.step == 0 else S.COLLECTING)
        status = S(run.status)
    if status == S.GENERATING:
        await _tick(ctx, tick)
        status = S((await ctx.move(S.COLLECTING, expected=S.GENERATING)).status)
    step = run.step
    while True:
        if status == S.COLLECTING:
            await _tick(ctx, tick)
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
            await _tick(ctx, tick)
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
            await _tick(ctx, tick)
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
