"""Agent runs end to end: a run with an environment, created over HTTP, warmed up with SFT
on demonstrations and trained with GRPO by a real worker on the agent tiny model (CPU),
every turn of every episode stored and served."""

from __future__ import annotations

import statistics
from typing import Any

from app.training_data.library import get_training_trajectories_async
from tests.support.runs import events, series, status_walk, trajectory_keys, wait_for
from tests.support.workers import agent_run, letter_rows


async def test_sft_warm_up_then_grpo_calls_the_tool_and_raises_the_episode_reward(
    client, tenant, sessionmaker, own_database, start_worker, tool_model, worker_home
) -> None:
    start_worker(**worker_home)
    body = agent_run(tool_model)
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    assert run["environment"]["factory"] == "calculator", run
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=400
    )
    assert done.status == "completed", done.error

    # The warm-up is a phase of its own, before the first step, with its loss curve.
    walk = await status_walk(sessionmaker, run["id"])
    assert walk[:3] == ["generating", "warming_up", "collecting"], walk
    loss = [v for _, v in await series(sessionmaker, run["id"], "sft/loss")]
    assert len(loss) >= 10 and loss[-1] < loss[0] / 2, loss
    assert any(e.type == "sft" for e in await events(sessionmaker, run["id"]))

    # Every rollout of every step is stored once, each a whole episode.
    assert await trajectory_keys(sessionmaker, run["id"]) == letter_rows(100, groups=4)
    served = await _served(client, tenant, run["id"])
    assert len(served) == 100 * 4 * 8
    called = [t for t in served if t["metadata"]["tool_calls"] > 0]
    assert len(called) > len(served) / 2, "after SFT the model calls its tools"
    episode = called[0]["messages"]
    assert [m["role"] for m in episode[:2]] == ["system", "user"]
    call = next(m for m in episode if m.get("tool_calls"))
    result = next(m for m in episode if m["role"] == "tool")
    first_call = call["tool_calls"][0]
    assert first_call["function"]["name"] in {"add", "subtract", "multiply", "divide"}
    assert result["tool_call_id"] == first_call["id"]
    assert result["name"] == first_call["function"]["name"]
    assert result["duration_ms"] >= 0 and result["truncated"] is False
    counts = called[0]["metadata"]
    assert counts["turns"] == sum(m["role"] == "assistant" for m in episode[2:])
    assert counts["trained_tokens"] > 0 and counts["masked_tokens"] > 0

    # The library serves the same episodes, and selects them by their tool calls.
    found = await get_training_trajectories_async(
        own_database.url, run_ids=[run["id"]], min_tool_calls=1, limit=None
    )
    assert len(found) == len(await _served(client, tenant, run["id"], min_tool_calls=1))
    sample = found[0]
    assert sample.episode[0]["role"] == "assistant" and sample.episode[0]["tool_calls"]
    assert sample.completion == sample.episode[-1]["content"]

    # GRPO raises the episode reward (the note quotes these numbers).
    rewards = [v for _, v in await series(sessionmaker, run["id"], "reward_mean")]
    first, last = statistics.fmean(rewards[:10]), statistics.fmean(rewards[-10:])
    print(f"episode reward: first 10 steps {first:.3f}, last 10 steps {last:.3f}")
    assert last > first + 0.1, (first, last)


async def _served(client: Any, tenant: Any, run_id: str, **filters: Any) -> list[dict[str, Any]]:
    """Every trajectory of the run the API serves (under ``filters``), page by page."""
    items: list[dict[str, Any]] = []
    params: dict[str, Any] = {"limit": 100, **filters}
    while True:
        answer = await client.get(
            f"/runs/{run_id}/trajectories", params=params, headers=tenant.headers
        )
        assert answer.status_code == 200, answer.text
        page = answer.json()
        items += page["data"]
        if not page["has_more"]:
            return items
        params["after"] = page["next_cursor"]
