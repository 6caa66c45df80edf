"""The generating phase: the run's training inputs, persisted before the first step."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlmodel import col

from app.inputs.models import TaskInput
from workers.context import RunContext
from workers.pipeline.plan import PlannedInput


class InputsUnavailable(RuntimeError):
    pass


async def prepare_inputs(ctx: RunContext) -> int:
    """Make sure the run has train inputs; returns how many."""
    async with ctx.session() as session:
        n_train = await session.scalar(
            select(func.count()).where(
                col(TaskInput.run_id) == ctx.run_id, col(TaskInput.split) == "train"
            )
        )
    if not n_train:
        raise InputsUnavailable(
            "the run has no train inputs: generating them from task_description with an LLM "
            "is not available on this worker yet; pass inline 'inputs'"
        )
    return int(n_train)


async def load_inputs(ctx: RunContext, split: str = "train") -> list[PlannedInput]:
    async with ctx.runtime.session() as session:
        rows = (
            await session.execute(
                select(TaskInput)
                .where(col(TaskInput.run_id) == ctx.run_id, col(TaskInput.split) == split)
                .order_by(col(TaskInput.index))
            )
        ).scalars()
        return [
            PlannedInput(id=str(r.id), index=r.index, input_text=r.input_text, context=r.context)
            for r in rows
        ]
