"""A gateway run end to end: a harness outside the worker (the Trainyard SDK, the ``openai``
SDK) plays every episode through a real API process, a real worker answers its calls with
the policy it trains, and what is trained is exactly what the engine sampled."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import openai
import pytest
import trainyard

from app.gateway.samples import StoredCall, stitch
from tests.support.api_process import api_process
from tests.support.runs import series, trajectory_keys
from tests.support.workers import letter_rows, letters_run


def gateway_run(model: Any, **overrides: Any) -> dict[str, Any]:
    body = letters_run(model, **{"max_steps": 3, "rollouts_per_group": 4, **overrides})
    body["environment"] = {"type": "gateway", "episode_timeout_seconds": 60}
    body.pop("reward")  # the harness's reward: the default of a gateway run
    return body


async def two_turns(episode: trainyard.Episode, seed: int | None = None) -> float:
    """The harness: the input, then "Again." after the model's answer (the second call
    streamed, the first with ``seed`` if given); the reward is the share of letters a in the
    last answer."""
    client = episode.openai_client()
    messages: list[Any] = episode.messages
    first = await client.chat.completions.create(
        model="policy", messages=messages, **({} if seed is None else {"seed": seed})
    )
    messages = [*messages, first.choices[0].message.model_dump(exclude_none=True)]
    messages.append({"role": "user", "content": "Again."})
    stream = await client.chat.completions.create(
        model="policy", messages=messages, stream=True, stream_options={"include_usage": True}
    )
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    assert usage is not None and usage.completion_tokens >= 1
    return text.count("a") / len(text) if text else 0.0


async def test_a_harness_plays_every_episode_and_the_trained_tokens_are_the_engines(
    tenant, sessionmaker, start_worker, tiny_model, worker_home, api_server
) -> None:
    start_worker(**worker_home)
    body = gateway_run(tiny_model, grpo={"eval_steps": 3, "save_steps": 3})
    body["inputs"].append({"input_text": "Whisper.", "split": "validation"})
    async with trainyard.Client(api_server.url, tenant.key) as ty:
        run = await ty.create_run(body)
        assert run.data["reward"]["functions"][0]["name"] == "environment"
        await asyncio.wait_for(run.play(two_turns, concurrency=8), 300)
        await run.refresh()
    assert run.status == "completed", run.data.get("error")

    # Every rollout stored once, each an episode the harness finished.
    assert await trajectory_keys(sessionmaker, run.id) == letter_rows(3, groups=2, rollouts=4)
    async with httpx.AsyncClient(base_url=api_server.url, headers=tenant.headers) as http:
        listed = (await http.get(f"/runs/{run.id}/episodes", params={"limit": 100})).json()
        episodes = [e for e in listed["data"] if e["phase"] == "train"]
        assert len(episodes) == 24 and {e["status"] for e in episodes} == {"finished"}
        detail = (
            await http.get(f"/episodes/{episodes[5]['id']}", params={"tokens": "true"})
        ).json()
    # The evaluations (of the base model, and after step 3) are episodes the harness played
    # too: the validation input's rollouts, their mean reward the run's eval reward.
    evaluations = [e for e in listed["data"] if e["phase"] == "eval"]
    assert {e["status"] for e in evaluations} == {"finished"}, evaluations
    assert sorted({e["step"] for e in evaluations}) == [0, 3]
    eval_reward = dict(await series(sessionmaker, run.id, "eval_reward"))
    assert sorted(eval_reward) == [0, 3]
    for step, value in eval_reward.items():
        rewards = [e["reward"] for e in evaluations if e["step"] == step]
        assert value == pytest.approx(sum(rewards) / len(rewards)), (step, rewards)

    # Two calls, the second continuing the first token for token: prompt ids extend the
    # first prompt and completion, so the episode trains as one sequence.
    first, second = detail["call_log"]
    assert (first["seq"], second["seq"]) == (1, 2)
    assert second["prompt_ids"][: len(first["prompt_ids"]) + len(first["completion_ids"])] == (
        first["prompt_ids"] + first["completion_ids"]
    )
    assert len(first["logprobs"]) == len(first["completion_ids"])
    assert all(lp <= 0 for lp in first["logprobs"] + second["logprobs"])
    (sample,) = stitch(
        [StoredCall(c["prompt_ids"], c["completion_ids"], c["logprobs"]) for c in (first, second)]
    )
    assert sample.prompt_ids == first["prompt_ids"]
    trained = [t for t, m in zip(sample.completion_ids, sample.env_mask, strict=True) if m]
    assert trained == first["completion_ids"] + second["completion_ids"]
    masked = len(sample.env_mask) - sum(sample.env_mask)
    assert masked == len(second["prompt_ids"]) - len(first["prompt_ids"]) - len(
        first["completion_ids"]
    )
    assert first["policy_version"] == detail["step"] - 1
    # Each call's time in the API splits into its wait for the engine, the generation that
    # answered it, and the gateway's own path (the rest, never negative).
    for call in (first, second):
        assert call["generation_ms"] > 0 and call["queued_ms"] >= 0
        assert call["queued_ms"] + call["generation_ms"] <= call["latency_ms"] + 1.0, call

    # Each step says how many calls each of its generations answered: the calls that queued
    # while the engine generated are answered together (at least one; 16 calls a step).
    per_generation = await series(sessionmaker, run.id, "gateway/calls_per_generation")
    assert [step for step, _ in per_generation] == [1, 2, 3]
    assert all(1 <= value <= 16 for _, value in per_generation), per_generation


async def summarised(episode: trainyard.Episode) -> float:
    """A harness that edits its history: after the first answer it asks again with the
    conversation rewritten as one user turn, so the second call does not continue the
    first."""
    client = episode.openai_client()
    first = await client.chat.completions.create(model="policy", messages=episode.messages)
    said = first.choices[0].message.content or ""
    rewritten = [{"role": "user", "content": f"Earlier you said {said!r}. Again."}]
    second = await client.chat.completions.create(model="policy", messages=rewritten)
    text = second.choices[0].message.content or ""
    return text.count("a") / len(text) if text else 0.0


async def test_an_edited_history_is_trained_as_one_sample_per_chain_and_says_so(
    tenant, sessionmaker, start_worker, tiny_model, worker_home, api_server
) -> None:
    start_worker(**worker_home)
    body = gateway_run(tiny_model, max_steps=1, grpo={"groups_per_step": 1})
    async with trainyard.Client(api_server.url, tenant.key) as ty:
        run = await ty.create_run(body)
        await run.play(summarised, concurrency=4)
        await run.refresh()
    assert run.status == "completed", run.data.get("error")
    async with httpx.AsyncClient(base_url=api_server.url, headers=tenant.headers) as http:
        trajectories = (await http.get(f"/runs/{run.id}/trajectories")).json()["data"]
        assert len(trajectories) == 4
        for trajectory in trajectories:
            meta = trajectory["metadata"]
            episode = (
                await http.get(f"/episodes/{meta['episode_id']}", params={"tokens": "true"})
            ).json()
            sampled = sum(len(c["completion_ids"]) for c in episode["call_log"])
            assert (meta["sequence"], meta["chains"], meta["calls"], meta["trained_calls"]) == (
                "split",
                2,
                2,
                2,
            )
            # Both calls' sampled tokens are trained, each chain a sample of its own.
            assert meta["trained_tokens"] == sampled
    assert await series(sessionmaker, run.id, "gateway/episodes_split") == [(1, 4.0)]


async def test_a_claim_makes_at_most_max_calls_and_each_is_numbered(
    tenant, start_worker, tiny_model, worker_home, api_server
) -> None:
    start_worker(**worker_home)
    body = gateway_run(tiny_model, max_steps=1, grpo={"groups_per_step": 1})
    body["environment"]["max_calls"] = 2
    refused: list[str] = []

    async def three_calls(episode: trainyard.Episode) -> float:
        client = episode.openai_client(max_retries=0)
        for _ in range(2):
            await client.chat.completions.create(model="policy", messages=episode.messages)
        with pytest.raises(openai.ConflictError) as third:
            await client.chat.completions.create(model="policy", messages=episode.messages)
        refused.append(third.value.message)
        return 0.5

    async with trainyard.Client(api_server.url, tenant.key) as ty:
        run = await ty.create_run(body)
        # More at once than one claim may take (64): the SDK asks in claims of at most that.
        await run.play(three_calls, concurrency=100)
        await run.refresh()
        assert run.status == "completed", run.data.get("error")
    assert len(refused) == 4 and all("max_calls" in m for m in refused), refused
    async with httpx.AsyncClient(base_url=api_server.url, headers=tenant.headers) as http:
        episodes = (await http.get(f"/runs/{run.id}/episodes")).json()["data"]
        assert [e["calls"] for e in episodes] == [2, 2, 2, 2]
        detail = (await http.get(f"/episodes/{episodes[0]['id']}")).json()
    assert [(c["issue"], c["seq"]) for c in detail["call_log"]] == [(1, 1), (1, 2)]


async def test_an_episode_token_opens_that_episode_only(
    tenant, start_worker, tiny_model, worker_home, api_server
) -> None:
    start_worker(**worker_home)
    async with trainyard.Client(api_server.url, tenant.key) as ty:
        run = await ty.create_run(gateway_run(tiny_model, max_steps=1))
        claimed = []
        async for episode in run.episodes(concurrency=2):
            claimed.append(episode)
            if len(claimed) == 2:
                break
        a, b = claimed
        async with httpx.AsyncClient(base_url=api_server.url) as http:
            # Another episode's routes, with a's token: not found.
            other = await http.post(
                f"/gateway/episodes/{b.id}/v1/chat/completions",
                json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": f"Bearer {a.token}"},
            )
            assert other.status_code == 404 and other.json()["error"]["type"] == "not_found_error"
            finish = await http.post(
                f"/episodes/{b.id}/finish",
                json={"reward": 1},
                headers={"Authorization": f"Bearer {a.token}"},
            )
            assert finish.status_code == 404
            # An API key is not an episode token; a run's routes take no episode token.
            assert (
                await http.post(
                    f"/episodes/{a.id}/finish", json={"reward": 1}, headers=tenant.headers
                )
            ).status_code == 401
            assert (
                await http.get(f"/runs/{run.id}", headers={"Authorization": f"Bearer {a.token}"})
            ).status_code == 401
            # A forged token for the right episode: its secret does not match.
            forged = f"tye_{uuid.UUID(a.id).hex}_not-the-secret"
            assert (
                await http.post(
                    f"/episodes/{a.id}/finish",
                    json={"reward": 1},
                    headers={"Authorization": f"Bearer {forged}"},
                )
            ).status_code == 409
            # Finished once; a second finish is a conflict.
            await a.finish(reward=0.5)
            again = await http.post(
                f"/episodes/{a.id}/finish",
                json={"reward": 1},
                headers={"Authorization": f"Bearer {a.token}"},
            )
            assert again.status_code == 409 and "ended" in again.json()["detail"]


async def test_a_claim_ended_through_another_api_process_takes_no_more_calls(
    tenant, start_worker, tiny_model, worker_home, api_server, own_database, tmp_path
) -> None:
    """An API process keeps the claims its calls opened; a claim ended through another
    process (behind one load balancer) is refused at its next call, which records nothing.
    Three episodes end that way while the fourth holds the step open."""
    start_worker(**worker_home)
    refused: list[str] = []
    three_refused = asyncio.Event()
    with api_process(tmp_path / "api-2.log", own_database.env()) as other:

        async def rollout(episode: trainyard.Episode) -> float | None:
            client = episode.openai_client(max_retries=0)
            await client.chat.completions.create(model="policy", messages=episode.messages)
            if episode.data["rollout_index"] == 3:
                await three_refused.wait()
                return 0.5
            async with httpx.AsyncClient(base_url=other.url) as http:
                finish = await http.post(
                    f"/episodes/{episode.id}/finish",
                    json={"reward": 0.5},
                    headers={"Authorization": f"Bearer {episode.token}"},
                )
                assert finish.status_code == 200, finish.text
            episode.ended = True
            with pytest.raises(openai.ConflictError) as late:
                await client.chat.completions.create(model="policy", messages=episode.messages)
            refused.append(late.value.message)
            if len(refused) == 3:
                three_refused.set()
            return None

        async with trainyard.Client(api_server.url, tenant.key) as ty:
            run = await ty.create_run(
                gateway_run(tiny_model, max_steps=1, grpo={"groups_per_step": 1})
            )
            await asyncio.wait_for(run.play(rollout, concurrency=4), 300)
            await run.refresh()
            assert run.status == "completed", run.data.get("error")
    assert len(refused) == 3 and all("ended" in m for m in refused), refused
    async with httpx.AsyncClient(base_url=api_server.url, headers=tenant.headers) as http:
        episodes = (await http.get(f"/runs/{run.id}/episodes")).json()["data"]
    assert [(e["status"], e["calls"]) for e in episodes] == [("finished", 1)] * 4


async def test_a_call_waiting_on_a_cancelled_run_is_refused_not_left_hanging(
    tenant, start_worker, tiny_model, worker_home, api_server
) -> None:
    """The run is cancelled while a harness still holds a claim: its next call, which no
    worker will answer, is refused once the claim is read again, not at its deadline; the
    claimed episode and those never claimed end with the run, dropped."""
    start_worker(**worker_home)
    body = gateway_run(tiny_model, max_steps=1)
    body["environment"]["episode_timeout_seconds"] = 600
    async with trainyard.Client(api_server.url, tenant.key) as ty:
        run = await ty.create_run(body)
        episode = await anext(run.episodes(concurrency=1))
        client = episode.openai_client(max_retries=0, timeout=60)
        await client.chat.completions.create(model="policy", messages=episode.messages)
        async with httpx.AsyncClient(base_url=api_server.url, headers=tenant.headers) as http:
            assert (await http.post(f"/runs/{run.id}/cancel")).status_code in (200, 202)
            async for _ in run.follow(every=0.2):
                pass
        assert run.status == "cancelled"
        with pytest.raises(openai.ConflictError) as late:
            await client.chat.completions.create(model="policy", messages=episode.messages)
    async with httpx.AsyncClient(base_url=api_server.url, headers=tenant.headers) as http:
        episodes = (await http.get(f"/runs/{run.id}/episodes")).json()["data"]
    assert "run has ended (cancelled)" in late.value.message
    # The run's episodes ended with it: none is left pending or claimed in the listing.
    assert {(e["status"], e["error"]) for e in episodes} == {
        ("dropped", "The run ended (cancelled) before the episode did.")
    }
