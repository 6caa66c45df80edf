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
from app.runs.lifecycle.state import transition
from app.runs.lifecycle.status import RunStatus
from app.runs.models import Run
from app.runs.spec.parsed import RunSpec
from workers.context import RunContext
from workers.environments import LoadedEnvironment
from workers.ml.vllm_engine import check_engine
from workers.pipeline import teacher
from workers.pipeline.inputs import count_inputs, generate, load_inputs, prepare_inputs
from workers.pipeline.paths import RunPaths
from workers.pipeline.plan import build_plan
from workers.pipeline.ranks import check_distributed
from workers.pipeline.ray_servers import placed_servers
from workers.rewards import Scorer, make_scorer

S = RunStatus


async def run_pipeline(ctx: RunContext) -> None:
    from workers.pipeline.trackers import check_trackers
    from workers.pipeline.training import check_model

    run = await ctx.load()
    spec = RunSpec.of(run)  # the run's settings, typed, from here on
    scorer = make_scorer(spec.reward)
    await asyncio.to_thread(scorer.check)  # judges are reached over the network
    teaching = await teacher.for_run(ctx, spec, scorer)  # None: not a teacher run
    if teaching is not None:
        await asyncio.to_thread(teaching.check)  # the student, loaded or reached
    await asyncio.to_thread(
        check_model,
        spec.model_name,
        tools=spec.environment is not None and spec.environment.type != "gateway",
        sft=spec.sft is not None,
    )
    check_trackers(spec.grpo.report_to)
    await asyncio.to_thread(check_engine, spec.grpo, spec.model_name)  # servers: over HTTP
    await asyncio.to_thread(check_distributed, spec.grpo.distributed, ctx.settings)
    environment = None
    if spec.environment is not None and spec.environment.type != "gateway":
        from workers.environments import load_environment

        # Imports, constructors, tool schemas, an MCP server: all before the first step.
        environment = await asyncio.to_thread(load_environment, spec.environment)
    try:
        root = ctx.settings.artifacts / str(spec.id)
        async with placed_servers(ctx, spec, root) as placed:
            if placed:  # the fleet's name is their URLs from here on: check them as any
                run = await ctx.load()
                spec = RunSpec.of(run)
                await asyncio.to_thread(check_engine, spec.grpo, spec.model_name)
            await _stages(ctx, run, spec, scorer, environment, teaching)
    finally:
        if environment is not None:
            await asyncio.to_thread(environment.close)


async def _stages(
    ctx: RunContext,
    run: Run,
    spec: RunSpec,
    scorer: Scorer,
    environment: LoadedEnvironment | None,
    teaching: teacher.Teaching | None = None,
) -> None:
    from workers.pipeline.training import train

    status = RunStatus(run.status)
    if status == S.PENDING and run.step == 0:
        await ctx.move(S.GENERATING, expected=S.PENDING, message="preparing inputs")
        status = S.GENERATING
    if status == S.GENERATING:
        if not await count_inputs(ctx):
            await generate(ctx, spec)
            spec = RunSpec.of(await ctx.load())  # with its generated system prompt
        counts = await prepare_inputs(
            ctx,
            validation_fraction=spec.grpo.validation_fraction,
            seed=spec.grpo.seed,
            load_best_model_at_end=spec.grpo.load_best_model_at_end,
        )
        await ctx.event(
            "inputs",
            f"{counts['train']} training inputs, {counts['validation']} for evaluation",
            data=counts,
        )
        if teaching is not None:
            await teaching.probe_inputs(ctx)  # the student's baselines and probes

    paths = RunPaths(ctx.settings.artifacts / str(spec.id))
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
    if spec.sft is not None:
        start = str(await _warm_up(ctx, spec, paths.root, environment))

    train_inputs = await load_inputs(ctx, "train")
    validation = await load_inputs(ctx, "validation")
    if teaching is not None:
        # The teacher trains on its prompts; its guidance is scored by the student's answers.
        train_inputs = await teaching.lessons(ctx, train_inputs)
        validation = await teaching.lessons(ctx, validation)
        spec = teaching.with_guidance_length(spec)
        scorer = teaching.scorer()
    plan = build_plan(
        train_inputs,
        groups_per_step=spec.grpo.groups_per_step,
        num_epochs=spec.num_epochs,
        max_steps=spec.max_steps,
        seed=spec.grpo.seed,
    )
    stopped = (run.metrics or {}).get("stopped_early")
    if stopped:
        # An attempt stopped early and died before it completed: the plan ends where it
        # stopped, so the resumed trainer only loads the best checkpoint and saves it.
        plan = plan[: int(stopped["step"])]
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

    if spec.grpo.distributed.in_ranks:
        from workers.pipeline.ranks import train_on_ranks

        final = await train_on_ranks(ctx, spec, plan, validation, paths, resume, start)
    else:
        final = await asyncio.to_thread(
            train, ctx, spec, plan, validation, scorer, paths, resume, environment, start
        )

    run = await ctx.load()
    summary = run.metrics or {}
    stopped = summary.get("stopped_early")
    steps = int(stopped["step"]) if stopped else len(plan)
    ended = f"stopped early after {steps} of {len(plan)} steps" if stopped else f"{steps} steps"
    async with ctx.session() as session:
        await checkpoints.record(
            session, ctx.run_id, steps, str(final), metrics=summary, is_final=True
        )
        await transition(
            session,
            ctx.run_id,
            S.COMPLETED,
            # Stopped early, the run had moved on to the next step's collecting.
            expected=S.COLLECTING if stopped else S.TRAINING,
            fence=ctx.fence,
            message=f"completed: {ended}; final model at {final}",
            data={"final_model": str(final), "steps": steps},
        )


async def _warm_up(
    ctx: RunContext, spec: RunSpec, root: Path, environment: LoadedEnvironment | None
) -> Path:
    """The SFT warm-up's model: trained now (or resumed) while the run is ``warming_up``;
    found on disk when a later stage of the run is resumed."""
    from workers.pipeline import sft

    assert spec.sft is not None
    if await asyncio.to_thread(sft.done, root):
        return sft.model_dir(root)
    status = RunStatus((await ctx.load()).status)
    if status not in (S.GENERATING, S.WARMING_UP):
        raise sft.SftUnavailable(
            f"the run is {status.value} but its SFT warm-up model is gone from "
            f"{sft.model_dir(root)}: the artifacts folder must outlive the run's workers"
        )
    chats = await sft.examples(ctx, spec)
    if status == S.GENERATING:
        await ctx.move(
            S.WARMING_UP,
            expected=S.GENERATING,
            message=f"SFT warm-up: {len(chats)} examples, {spec.sft.epochs} epoch(s)",
            data={"examples": len(chats)},
        )
    factory = environment.factory if environment is not None else None
    model = await asyncio.to_thread(sft.warm_up, ctx, spec, root, chats, factory)
    await ctx.event(
        "sft", f"SFT warm-up done; GRPO starts from {model}", data={"model": str(model)}
    )
    return model
