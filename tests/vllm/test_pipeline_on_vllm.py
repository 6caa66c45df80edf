"""A real run whose RULER judge is a real vLLM server: however bad the judge's answers, the
run completes, and the groups it could not score are counted in its metrics."""

from __future__ import annotations

import uuid

from sqlalchemy import select

from app.metrics.models import MetricPoint
from tests.workers.test_leases import wait_for
from tests.workers.test_pipeline import letters_run


async def test_run_with_a_vllm_judge_completes_and_counts_dropped_groups(
    client,
    tenant,
    sessionmaker,
    start_worker,
    tiny_model,
    worker_home,
    vllm_server,
) -> None:
    start_worker(**worker_home)
    body = letters_run(
        tiny_model,
        max_steps=3,
        reward={"type": "ruler", "judge": vllm_server},
        grpo={"save_steps": 100},
    )
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=600
    )
    assert done.status == "completed", done.error
    async with sessionmaker() as s:
        dropped = (
            (
                await s.execute(
                    select(MetricPoint.value).where(
                        MetricPoint.run_id == uuid.UUID(run["id"]),
                        MetricPoint.name == "groups_dropped",
                    )
                )
            )
            .scalars()
            .all()
        )
    assert len(dropped) == 3 and all(0 <= d <= 2 for d in dropped)
