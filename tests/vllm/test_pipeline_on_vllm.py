"""A real run whose RULER judge is a real vLLM server: however bad the judge's answers, the
run completes, and the groups it could not score are counted in its metrics."""

from __future__ import annotations

from tests.support.runs import series, wait_for
from tests.support.workers import VLLM_PYTHON, agent_run, letters_run


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
        # The tiny judge may garble every group of a step: the run is about counting them,
        # so it is not failed for a few such steps in a row (grpo.max_dropped_steps).
        grpo={"save_steps": 100, "max_dropped_steps": 100},
    )
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=600
    )
    assert done.status == "completed", done.error
    dropped = [v for _, v in await series(sessionmaker, run["id"], "groups_dropped")]
    assert len(dropped) == 3 and all(0 <= d <= 2 for d in dropped)


async def test_vllm_colocate_engine_trains_with_synced_weights(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home
) -> None:
    """Rollouts from vLLM in-process (TRL colocate): the policy learns only if every
    optimizer step's weights reach vLLM."""
    start_worker(python=str(VLLM_PYTHON), **worker_home)
    body = letters_run(
        tiny_model,
        max_steps=60,
        grpo={
            "engine": "vllm-colocate",
            # On the CPU backend: the share of RAM vLLM reserves.
            "vllm_gpu_memory_utilization": 0.15,
            "vllm_max_model_len": 512,
        },
    )
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=600
    )
    assert done.status == "completed", done.error
    rewards = [v for _, v in await series(sessionmaker, run["id"], "reward_mean")]
    assert len(rewards) == 60
    assert sum(rewards[-10:]) / 10 - sum(rewards[:10]) / 10 >= 0.3, rewards
    page = (
        await client.get(
            f"/runs/{run['id']}/trajectories", params={"limit": 1}, headers=tenant.headers
        )
    ).json()
    assert page["data"][0]["metadata"]["engine"] == "vllm-colocate"
    # The same worker process takes the next colocated run: the first one's engine was
    # freed (vLLM sizes its KV cache from what its process holds, and would refuse).
    again = await client.post("/runs", json={**body, "max_steps": 2}, headers=tenant.headers)
    second = await wait_for(
        sessionmaker, again.json()["id"], lambda r: r.status in {"completed", "failed"}, within=300
    )
    assert second.status == "completed", second.error


async def test_an_agent_run_on_vllm_colocate_plays_its_episodes_through_vllm(
    client, tenant, sessionmaker, start_worker, tool_model, worker_home
) -> None:
    """TRL's multi-turn loop with vLLM generating each turn: after the SFT warm-up the
    model calls the calculator's tools, and every episode is stored whole."""
    start_worker(python=str(VLLM_PYTHON), **worker_home)
    body = agent_run(
        tool_model,
        max_steps=10,
        grpo={
            "engine": "vllm-colocate",
            "vllm_gpu_memory_utilization": 0.15,
            "vllm_max_model_len": 1024,
        },
    )
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=600
    )
    assert done.status == "completed", done.error
    page = (
        await client.get(
            f"/runs/{run['id']}/trajectories",
            params={"limit": 100, "min_tool_calls": 1},
            headers=tenant.headers,
        )
    ).json()
    assert page["data"], "after the warm-up the model calls its tools under vLLM too"
    episode = page["data"][0]
    assert episode["metadata"]["engine"] == "vllm-colocate"
    tool = next(m for m in episode["messages"] if m["role"] == "tool")
    assert tool["tool_call_id"] and tool["name"] in {"add", "subtract", "multiply", "divide"}
