"""The run pipeline: generating → (collecting → scoring → training) × steps → completed.

Everything a run needs is checked before its first step (reward spec, model, tokenizer),
so a run that cannot work fails at once with the reason. Each phase persists its output
before the run leaves it; a run whose worker died resumes from its last complete
checkpoint (optimizer, scheduler, RNG, step and position in the plan).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from app.checkpoints import service as checkpoints
from app.runs.state import transition
from app.runs.status import RunStatus
from workers.context import RunContext
from workers.ml.vllm_engine import check_vllm
from workers.pipeline.inputs import count_inputs, generate, load_inputs, prepare_inputs
from workers.pipeline.plan import build_plan
from workers.rewards import make_scorer

S = RunStatus


async def run_pipeline(ctx: RunContext) -> None:
    from workers.pipeline.training import RunPaths, check_model, train

    run = await ctx.load()
    scorer = make_scorer(run.reward)
    await asyncio.to_thread(scorer.check)  # judges are reached over the network
    await asyncio.to_thread(check_model, run.model_name)
    check_vllm(run.grpo.get("engine", "transformers"))

    status = RunStatus(run.status)
    if status == S.PENDING and run.step == 0:
        await ctx.move(S.GENERATING, expected=S.PENDING, message="preparing inputs")
        status = S.GENERATING
    if status == S.GENERATING:
        if not await count_inputs(ctx):
            await generate(ctx, run)
            run = await ctx.load()  # with its generated system prompt
        counts = await prepare_inputs(
            ctx, validation_fraction=run.grpo["validation_fraction"], seed=run.grpo["seed"]
        )
        await ctx.event(
            "inputs",
            f"{counts['train']} training inputs, {counts['validation']} for evaluation",
            data=counts,
        )

    grpo = run.grpo
    plan = build_plan(
        await load_inputs(ctx, "train"),
        groups_per_step=grpo["groups_per_step"],
        num_epochs=run.num_epochs,
        max_steps=run.max_steps,
        seed=grpo["seed"],
    )
    validation = await load_inputs(ctx, "validation")
    paths = RunPaths(ctx.settings.artifacts / str(run.id))
    async with ctx.runtime.session() as session:
        latest = await checkpoints.latest(session, ctx.run_id)
    resume = None
    if latest is not None and await asyncio.to_thread(Path(latest.path).is_dir):
        resume = Path(latest.path)
        await ctx.event(
            "resume",
            f"resuming from the checkpoint at step {latest.step}",
            data={"path": latest.path, "step": latest.step},
        )

    final = await asyncio.to_thread(train, ctx, run, plan, validation, scorer, paths, resume)

    run = await ctx.load()
    async with ctx.session() as session:
        await checkpoints.record(
            session, ctx.run_id, len(plan), str(final), metrics=run.metrics or {}, is_final=True
        )
        await transition(
            session,
            ctx.run_id,
            S.COMPLETED,
            expected=S.TRAINING,
            fence=ctx.fence,
            message=f"completed {len(plan)} steps; final model at {final}",
            data={"final_model": str(final)},
        )
