"""The generating phase: the run's training inputs, persisted before the first step."""

from __future__ import annotations

import random

from sqlalchemy import select, update
from sqlmodel import col

from app.inputs.models import TaskInput
from workers.context import RunContext
from workers.pipeline.plan import PlannedInput


class InputsUnavailable(RuntimeError):
    pass


async def prepare_inputs(
    ctx: RunContext, *, validation_fraction: float, seed: int
) -> dict[str, int]:
    """Make sure the run has train inputs, and hold a seeded share out for evaluation when
    the user marked none as validation. Returns the count per split."""
    async with ctx.session() as session:
        rows = (
            await session.execute(
                select(col(TaskInput.index), col(TaskInput.split)).where(
                    col(TaskInput.run_id) == ctx.run_id
                )
            )
        ).all()
        train = sorted(r.index for r in rows if r.split == "train")
        n_validation = sum(1 for r in rows if r.split == "validation")
        if not train:
            raise InputsUnavailable(
                "the run has no train inputs: generating them from task_description with an "
                "LLM is not available on this worker yet; pass 'inputs' or a 'dataset_id'"
            )
        held_out = int(len(train) * validation_fraction) if not n_validation else 0
        if held_out:
            chosen = random.Random(f"{seed}:validation").sample(train, held_out)
            await session.execute(
                update(TaskInput)
                .where(col(TaskInput.run_id) == ctx.run_id, col(TaskInput.index).in_(chosen))
                .values(split="validation")
            )
    return {"train": len(train) - held_out, "validation": n_validation + held_out}


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
