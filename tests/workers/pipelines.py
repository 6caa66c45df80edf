"""A small real pipeline for testing leases, the reconciler and stop requests with real
Celery workers: it walks the real phases, persists each phase's output like the training
pipeline does (trajectories unique per step/group/rollout, one metric point per step) and
resumes from the last persisted phase. Selected with ``TRAINYARD_PIPELINE``."""

from __future__ import annotations

import os

from sqlalchemy import update
from sqlalchemy.dialects.postgresql import insert

from app.metrics.models import MetricPoint
from app.runs.status import RunStatus
from app.trajectories.models import Trajectory
from app.trajectories.service import upsert_rollouts
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
            async with ctx.session() as session:
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
                await upsert_rollouts(session, ctx.run_id, step, rollouts)
            status = S((await ctx.move(S.SCORING, expected=S.COLLECTING)).status)
        if status == S.SCORING:
            await _tick(ctx, tick)
            async with ctx.session() as session:
                await session.execute(
                    update(Trajectory)
                    .where(Trajectory.run_id == ctx.run_id, Trajectory.step == step)
                    .values(reward=Trajectory.rollout_index / 10)
                )
            status = S((await ctx.move(S.TRAINING, expected=S.SCORING)).status)
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
