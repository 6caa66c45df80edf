#!/usr/bin/env python3
"""What each of a training step's database writes costs the worker, measured alone.

A diagnostic of bench/service_vs_script.py (--profile). It clones a completed run into a
scratch run that this process holds the lease on, then replays a step's writes with the
worker's own code — ``StepBridge._store_rollouts``, ``StepBridge._store_rewards``,
``RunCallback._finish_step`` (and ``RunCallback._begin_step`` where the code has it) — run
on a ``workers.runtime.Runtime`` loop thread as the worker runs them, with the rows
the source run stored at one of its steps (its rollouts, rewards, metrics and summary).
Each call is timed from the calling thread until it committed. Also timed: an empty
fenced transaction (``RunContext.session()``: a lease renewal and a commit). The scratch
run is deleted afterwards.

    TRAINYARD_DATABASE_URL=postgresql+asyncpg://… .venv/bin/python bench/step_writes.py \\
        --run-id RUN --steps 50

Prints one JSON object: the median milliseconds of each call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

OWNER = "bench-step-writes"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-id", required=True, help="a completed run to take the rows from")
    p.add_argument("--steps", type=int, default=50, help="steps to replay")
    p.add_argument("--source-step", type=int, help="the step whose rows are replayed (middle)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # The source run was the benchmark's own, naming a local model folder: RunContext.load
    # checks it again, which only the open code policy lets through.
    os.environ.setdefault("TRAINYARD_CODE_POLICY", "open")
    from sqlalchemy import text

    from app.core.settings import Settings
    from app.runs.lifecycle.state import Fence
    from app.runs.spec.parsed import RunSpec
    from workers.context import RunContext
    from workers.pipeline.callback import RunCallback
    from workers.pipeline.paths import RunPaths
    from workers.pipeline.steps import StepBridge
    from workers.rewards import make_scorer
    from workers.runtime import Runtime

    if not os.environ.get("TRAINYARD_DATABASE_URL"):
        print("TRAINYARD_DATABASE_URL must name the bench database", file=sys.stderr)
        return 2
    runtime = Runtime(Settings())
    source = uuid.UUID(args.run_id)
    scratch = uuid.uuid4()

    async def setup() -> dict[str, Any]:
        async with runtime.session() as session:
            step = args.source_step or int(
                (
                    await session.execute(
                        text("SELECT step FROM runs WHERE id = :id"), {"id": source}
                    )
                ).scalar_one()
                // 2
                or 1
            )
            await session.execute(
                text(
                    "INSERT INTO runs SELECT (jsonb_populate_record(NULL::runs, to_jsonb(r) ||"
                    " jsonb_build_object('id', CAST(:new AS text), 'status', 'collecting',"
                    " 'lease_owner', CAST(:owner AS text), 'lease_expires_at',"
                    " now() + interval '1 hour', 'attempt', 1, 'dispatched_at', now(),"
                    " 'completed_at', NULL, 'trained_model_name', 'bench-step-writes'))).*"
                    " FROM runs r WHERE r.id = :source"
                ),
                {"new": str(scratch), "owner": OWNER, "source": source},
            )
            rows = (
                await session.execute(
                    text(
                        "SELECT group_index, rollout_index, task_input_id, messages, metadata,"
                        " reward, reward_breakdown FROM trajectories"
                        " WHERE run_id = :id AND step = :step ORDER BY group_index, rollout_index"
                    ),
                    {"id": source, "step": step},
                )
            ).all()
            values = dict(
                (
                    await session.execute(
                        text(
                            "SELECT name, value FROM metric_points"
                            " WHERE run_id = :id AND step = :step"
                        ),
                        {"id": source, "step": step},
                    )
                ).all()
            )
        return {"step": step, "rows": rows, "values": values}

    async def teardown() -> None:
        async with runtime.session() as session:
            await session.execute(text("DELETE FROM runs WHERE id = :id"), {"id": scratch})

    data = runtime.run(setup())
    try:
        ctx = RunContext(runtime, scratch, Fence(owner=OWNER, attempt=1))
        run = runtime.run(ctx.load())
        spec = RunSpec.of(run)
        bridge = StepBridge(ctx, spec, make_scorer(spec.reward))
        # Only the plan's length matters to these writes (is there a next step?).
        plan: list[Any] = [None] * (args.steps + 2)
        callback = RunCallback(ctx, spec, bridge, RunPaths(Path("/nonexistent")), plan)
        rollouts = [
            {
                "group_index": r.group_index,
                "rollout_index": r.rollout_index,
                "task_input_id": r.task_input_id,
                "messages": r.messages,
                "metadata": r._mapping["metadata"],
            }
            for r in data["rows"]
        ]
        rewards = [
            {
                "group_index": r.group_index,
                "rollout_index": r.rollout_index,
                "reward": r.reward,
                "breakdown": r.reward_breakdown,
            }
            for r in data["rows"]
        ]
        values: dict[str, float] = data["values"]
        summary = dict(run.metrics or {})

        async def empty_fenced() -> None:
            async with ctx.session():
                pass

        # The worker's per-step writes, in step order; older code also had a _begin_step
        # transaction (status → collecting) that newer code folds into _finish_step.
        calls: dict[str, Any] = {}
        if hasattr(callback, "_begin_step"):
            calls["_begin_step"] = lambda s: callback._begin_step(s)
        calls |= {
            "_store_rollouts": lambda s: bridge._store_rollouts(s, rollouts),
            "_store_rewards": lambda s: bridge._store_rewards(s, rewards),
            "_finish_step": lambda s: callback._finish_step(s, 0, values, {**summary, "step": s}),
            "empty fenced transaction": lambda s: empty_fenced(),
        }
        times: dict[str, list[float]] = {k: [] for k in calls}
        for step in range(1, args.steps + 1):
            for name, make in calls.items():
                t = time.perf_counter()
                runtime.run(make(step))
                times[name].append(time.perf_counter() - t)
    finally:
        runtime.run(teardown())
        runtime.run(runtime.engine.dispose())
        runtime.loop.call_soon_threadsafe(runtime.loop.stop)
    # The first step warms SQLAlchemy's statement caches and the pool: leave it out.
    result = {
        "source_step": data["step"],
        "rollouts": len(rollouts),
        "metric_values": len(values),
        "steps": args.steps,
        "median_ms": {k: statistics.median(v[1:] or v) * 1e3 for k, v in times.items()},
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
