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
from app.runs.models import Run
from app.runs.state import transition
from app.runs.status import RunStatus
from workers.context import RunContext
from workers.environments import LoadedEnvironment
from workers.ml.vllm_engine import check_engine
from workers.pipeline import teacher
from workers.pipeline.inputs import count_inputs, generate, load_inputs, prepare_inputs
from workers.pipeline.plan import build_plan
from workers.pipeline.ranks import check_distributed, distributed_spec
from workers.rewards import Scorer, make_scorer

S = RunStatus


async def run_pipeline(ctx: RunContext) -> None:
    from workers.pipeline.training import check_model, check_trackers

    run = await ctx.load()
    scorer = make_scorer(run.reward)
    await asyncio.to_thread(scorer.check)  # judges are reached over the network
    teaching = await teacher.for_run(ctx, run, scorer)  # None: not a teacher run
    if teaching is not None:
        await asyncio.to_thread(teaching.check)  # the student, loaded or reached
    await asyncio.to_thread(
        check_model,
        run.model_name,
        tools=run.environment is not None,
        sft=run.sft is not None,
    )
    check_trackers(run.grpo.get("report_to") or [])
    await asyncio.to_thread(check_engine, run.grpo, run.model_name)  # servers: over HTTP
    check_distributed(distributed_spec(run.grpo))
    environment = None
    if run.environment is not None:
        from workers.environments import load_environment

        # Imports, constructors, tool schemas, an MCP server: all before the first step.
        environment = await asyncio.to_thread(load_environment, run.environment)
    try:
        await _stages(ctx, run, scorer, environment, teaching)
    finally:
        if environment is not None:
            await asyncio.to_thread(environment.close)


async def _stages(
    ctx: RunContext,
    run: Run,
    scorer: Scorer,
    environment: LoadedEnvironment | None,
    teaching: teacher.Teaching | None = None,
) -> None:
    from workers.pipeline.training import RunPaths, train

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
        if teaching is not None:
            await teaching.probe_inputs(ctx)  # the student's baselines and probes

    paths = RunPaths(ctx.settings.artifacts / str(run.id))
    start = None
    if run.parent_step is not None:  # a fork: from its parent's checkpoint
        from workers.pipeline.fork import parent_weights

        start = str(await parent_weights(ctx, run, paths.root))
        if run.step == 0:
            await ctx.event(
                "fork",
                f"starts from run {run.parent_run_id}'s checkpoint at step {run.parent_step}",
                data={
                    "parent_run_id": str(run.parent_run_id),
                    "step": run.parent_step,
                    "model": start,
                },
            )
    if run.sft is not None:
        start = str(await _warm_up(ctx, run, paths.root, environment))

    train_inputs = await load_inputs(ctx, "train")
    validation = await load_inputs(ctx, "validation")
    if teaching is not None:
        # The teacher trains on its prompts; its guidance is scored by the student's answers.
        train_inputs = await teaching.lessons(ctx, train_inputs)
        validation = await teaching.lessons(ctx, validation)
        teaching.use_guidance_length(run)
        scorer = teaching.scorer()
    grpo = run.grpo
    plan = build_plan(
        train_inputs,
        groups_per_step=grpo["groups_per_step"],
        num_epochs=run.num_epochs,
        max_steps=run.max_steps,
        seed=grpo["seed"],
    )
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

    if distributed_spec(grpo)["num_processes"] > 1:
        from workers.pipeline.ranks import train_on_ranks

        final = await train_on_ranks(ctx, run, plan, validation, paths, resume, start)
    else:
        final = await asyncio.to_thread(
            train, ctx, run, plan, validation, scorer, paths, resume, environment, start
        )

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


async def _warm_up(
    ctx: RunContext, run: Run, root: Path, environment: LoadedEnvironment | None
) -> Path:
    """The SFT warm-up's model: trained now (or resumed) while the run is ``warming_up``;
    found on disk when a later stage of the run is resumed."""
    from workers.pipeline import sft

    if await asyncio.to_thread(sft.done, root):
        return sft.model_dir(root)
    status = RunStatus((await ctx.load()).status)
    if status not in (S.GENERATING, S.WARMING_UP):
        raise sft.SftUnavailable(
            f"the run is {status.value} but its SFT warm-up model is gone from "
            f"{sft.model_dir(root)}: the artifacts folder must outlive the run's workers"
        )
    chats = await sft.examples(ctx, run)
    spec = run.sft or {}
    if status == S.GENERATING:
        await ctx.move(
            S.WARMING_UP,
            expected=S.GENERATING,
            message=f"SFT warm-up: {len(chats)} examples, {spec.get('epochs', 1)} epoch(s)",
            data={"examples": len(chats)},
        )
    factory = environment.factory if environment is not None else None
    model = await asyncio.to_thread(sft.warm_up, ctx, run, root, chats, factory)
    await ctx.event(
        "sft", f"SFT warm-up done; GRPO starts from {model}", data={"model": str(model)}
    )
    return model
