"""The run pipeline: generating → (collecting → scoring → training) × steps → completed.

This build persists the run's inputs (inline inputs are stored when the run is created) and
stops there: input generation by an LLM, rollouts, scoring and GRPO training arrive with the
training pipeline. A run that needs them fails at once with an error saying so, before any
compute is spent, instead of waiting forever in the queue.
"""

from __future__ import annotations

from sqlalchemy import func, select

from app.inputs.models import TaskInput
from app.runs.status import RunStatus
from workers.context import RunContext


class PipelineUnavailable(RuntimeError):
    pass


async def run_pipeline(ctx: RunContext) -> None:
    run = await ctx.load()
    status = RunStatus(run.status)
    if status == RunStatus.PENDING:
        await ctx.move(RunStatus.GENERATING, expected=RunStatus.PENDING)
        status = RunStatus.GENERATING
    ctx.check()
    if status == RunStatus.GENERATING:
        async with ctx.session() as session:
            count = await session.scalar(
                select(func.count()).select_from(TaskInput).where(TaskInput.run_id == ctx.run_id)
            )
        if not count:
            raise PipelineUnavailable(
                "this worker cannot generate inputs from task_description yet: pass inline "
                "'inputs' when creating the run"
            )
        await ctx.event("inputs", f"{count} training inputs ready", data={"count": count})
    raise PipelineUnavailable(
        "this worker build has no rollout/training engine yet (the training pipeline lands "
        "separately); the run's inputs are stored"
    )
