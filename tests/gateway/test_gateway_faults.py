"""Gateway runs under faults, on real processes: a harness that never finishes, one that sends
garbage, a worker SIGKILLed mid-step, an API SIGKILLed mid-stream. Each run completes, loses
nothing that was recorded and trains nothing twice."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import httpx
import pytest
import trainyard
from sqlalchemy import text

from tests.gateway.test_gateway_run import gateway_run
from tests.support.runs import trajectory_keys, wait_for
from tests.support.workers import letter_rows

pytestmark = pytest.mark.gateway


async def one_call(episode: trainyard.Episode) -> float:
    answer = await episode.openai_client().chat.completions.create(
        model="policy", messages=episode.messages
    )
    content = answer.choices[0].message.content or ""
    return content.count("a") / max(1, len(content))


async def claim(ty: trainyard.Client, run_id: str, n: int) -> list[trainyard.Episode]:
    """``n`` episodes of the run, claimed and held (long polls until there are that many)."""
    run = await ty.get_run(run_id)
    held: list[trainyard.Episode] = []
    async for episode in run.episodes(concurrency=n):
        held.append(episode)
        if len(held) == n:
            return held
    raise AssertionError(f"the run ended with {len(held)} of {n} episodes claimed")


async def episode_rows(sessionmaker: Any, run_id: str) -> list[Any]:
    async with sessionmaker() as s:
        result = await s.execute(
            text(
                "SELECT id, status, issued, reward, error, attempt, ended_at FROM episodes "
                "WHERE run_id = :run ORDER BY step, slot"
            ),
            {"run": uuid.UUID(run_id)},
        )
        return list(result)


async def test_an_episode_never_finished_is_handed_out_again_then_dropped(
    tenant, sessionmaker, start_worker, tiny_model, worker_home, api_server
) -> None:
    start_worker(**worker_home)
    body = gateway_run(tiny_model, max_steps=1, grpo={"groups_per_step": 1})
    body["environment"] |= {"episode_timeout_seconds": 6, "max_issues": 2}
    async with trainyard.Client(api_server.url, tenant.key) as ty:
        run = await ty.create_run(body)
        first = await claim(ty, run.id, 4)  # a harness that takes them all and hangs
        second = await claim(ty, run.id, 4)  # handed out again once the claims ran out
        assert {e.id for e in second} == {e.id for e in first}
        assert {e.data["issue"] for e in second} == {2}
        # The first claims are over: their tokens open nothing now.
        with pytest.raises(trainyard.TrainyardError) as taken_back:
            await first[0].finish(reward=1.0)
        assert taken_back.value.status == 409
        rewards = await asyncio.gather(*(one_call(e) for e in second[:3]))
        for episode, reward in zip(second[:3], rewards, strict=True):
            await episode.finish(reward=reward)
        # The fourth is never finished: after its second claim it is dropped.
        done = await wait_for(
            sessionmaker, run.id, lambda r: r.status in {"completed", "failed"}, 120
        )
    assert done.status == "completed", done.error
    rows = await episode_rows(sessionmaker, run.id)
    assert sorted(r.status for r in rows) == ["dropped", "finished", "finished", "finished"]
    dropped = next(r for r in rows if r.status == "dropped")
    assert dropped.issued == 2 and "never finished" in dropped.error
    assert await trajectory_keys(sessionmaker, run.id) == letter_rows(1, groups=1, rollouts=4)
    async with sessionmaker() as s:
        rewards = (
            await s.execute(
                text(
                    "SELECT reward, metadata FROM trajectories WHERE run_id = :r "
                    "ORDER BY rollout_index"
                ),
                {"r": uuid.UUID(run.id)},
            )
        ).all()
    assert sum(r.reward is None for r in rewards) == 1  # the dropped episode: no reward
    assert any("never finished" in str(r.metadata.get("episode_error")) for r in rewards)


async def test_garbage_from_a_harness_is_refused_and_never_stalls_the_run(
    tenant, sessionmaker, start_worker, tiny_model, worker_home, api_server
) -> None:
    start_worker(**worker_home)
    async with trainyard.Client(api_server.url, tenant.key) as ty:
        run = await ty.create_run(gateway_run(tiny_model, max_steps=1, grpo={"groups_per_step": 1}))
        held = await claim(ty, run.id, 4)
        async with httpx.AsyncClient(base_url=api_server.url) as http:
            episode = held[0]
            auth = {"Authorization": f"Bearer {episode.token}"}
            url = f"/gateway/episodes/{episode.id}/v1/chat/completions"
            responses = f"/gateway/episodes/{episode.id}/v1/responses"
            for where, body, status in [
                (url, b"not json", 400),
                (url, b'{"messages": []}', 400),
                (url, b'{"messages": [{"role": "user", "content": "hi"}], "n": 3}', 400),
                (url, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}', 400),
                (responses, b'{"input": "hi", "previous_response_id": "resp_1"}', 400),
                (responses, b'{"input": [{"type": "web_search_call"}]}', 400),
            ]:
                r = await http.post(
                    where, content=body, headers={**auth, "content-type": "application/json"}
                )
                assert r.status_code == status, r.text
                error = r.json()["error"]
                assert error["type"] == "invalid_request_error" and error["message"], error
            for raw in [
                b'{"reward": "lots"}',
                b'{"reward": Infinity}',
                b'{"reward": 1, "metrics": {"x": "y"}}',
                b"{}",
            ]:
                r = await http.post(
                    f"/episodes/{episode.id}/finish",
                    content=raw,
                    headers={**auth, "content-type": "application/json"},
                )
                assert r.status_code == 422, r.text
            # What jsonb cannot hold is no garbage: NUL (a young policy writes it, the harness
            # sends it back) and NaN in a field the gateway does not read. Answered, recorded
            # (NUL as U+FFFD, NaN as null) and the conversation kept at the finish.
            odd = held[1]
            said = {"role": "user", "content": "zero\x00byte"}
            r = await http.post(
                f"/gateway/episodes/{odd.id}/v1/chat/completions",
                content=b'{"messages": [{"role": "user", "content": "zero\\u0000byte"}], '
                b'"max_tokens": 4, "x_extra": NaN}',
                headers={
                    "Authorization": f"Bearer {odd.token}",
                    "content-type": "application/json",
                },
            )
            assert r.status_code == 200, r.text
            answer = r.json()["choices"][0]["message"]
            r = await http.post(
                f"/episodes/{odd.id}/finish",
                json={"reward": 0.5, "messages": [said, {**answer, "content": "\x00"}]},
                headers={"Authorization": f"Bearer {odd.token}"},
            )
            assert r.status_code == 200, r.text
        # The garbage cost nothing: every episode can still be played and finished.
        for episode in held:
            if episode is not odd:
                await episode.finish(reward=await one_call(episode))
    done = await wait_for(sessionmaker, run.id, lambda r: r.status in {"completed", "failed"}, 120)
    assert done.status == "completed", done.error
    async with sessionmaker() as s:
        request, messages = (
            await s.execute(
                text(
                    "SELECT c.request, e.messages FROM episode_calls c "
                    "JOIN episodes e ON e.id = c.episode_id WHERE e.id = :e"
                ),
                {"e": uuid.UUID(odd.id)},
            )
        ).one()
    assert request["messages"] == [{"role": "user", "content": "zero\ufffdbyte"}]
    assert request["x_extra"] is None
    assert messages[0]["content"] == "zero\ufffdbyte" and messages[1]["content"] == "\ufffd"


async def test_a_worker_killed_mid_step_keeps_the_finished_episodes(
    tenant, sessionmaker, start_worker, tiny_model, worker_home, api_server
) -> None:
    worker = start_worker(**worker_home)
    async with trainyard.Client(api_server.url, tenant.key) as ty:
        run = await ty.create_run(gateway_run(tiny_model, max_steps=2, grpo={"groups_per_step": 1}))
        held = await claim(ty, run.id, 4)
        for episode in held[:2]:
            await episode.finish(reward=await one_call(episode))
        for episode in held[2:]:
            await one_call(episode)  # a call in, no end yet
        before = {r.id: r for r in await episode_rows(sessionmaker, run.id)}
        worker.kill()  # mid-step: two episodes finished, two still being played
        start_worker(**worker_home)
        # The unfinished two are handed out again (their old tokens open nothing), under a
        # claim of their own: their calls of the lost attempt stay, not trained on. The
        # finished two are kept as they ended, not played again.
        again = await claim(ty, run.id, 2)
        assert {e.id for e in again} == {e.id for e in held[2:]}
        with pytest.raises(trainyard.TrainyardError) as stale:
            await held[2].finish(reward=1.0)
        assert stale.value.status == 409
        for episode in again:
            await episode.finish(reward=await one_call(episode))
        await run.play(one_call, concurrency=4)  # the rest of the run
        await run.refresh()
    assert run.status == "completed", run.data.get("error")
    after = {r.id: r for r in await episode_rows(sessionmaker, run.id)}
    for kept in held[:2]:
        old, new = before[uuid.UUID(kept.id)], after[uuid.UUID(kept.id)]
        assert (new.status, new.issued, new.reward, new.ended_at) == (
            "finished",
            1,
            old.reward,
            old.ended_at,
        )
    assert await trajectory_keys(sessionmaker, run.id) == letter_rows(2, groups=1, rollouts=4)
    assert (await wait_for(sessionmaker, run.id, lambda r: True)).attempt >= 2
    async with sessionmaker() as s:
        for replayed in again:
            calls = (
                await s.execute(
                    text(
                        "SELECT c.issue, c.seq, e.issued FROM episode_calls c JOIN episodes e"
                        " ON e.id = c.episode_id WHERE c.episode_id = :e ORDER BY c.issue, c.seq"
                    ),
                    {"e": uuid.UUID(replayed.id)},
                )
            ).all()
            # The lost attempt's call under its claim, the new one under a claim of its own.
            assert [(c.issue, c.seq) for c in calls] == [(1, 1), (2, 1)], calls
            assert calls[0].issued == 2


async def test_an_api_killed_mid_stream_loses_no_recorded_call(
    tenant, sessionmaker, start_worker, tiny_model, worker_home, api_server
) -> None:
    start_worker(**worker_home)
    body = gateway_run(tiny_model, max_steps=1, grpo={"groups_per_step": 1})
    async with trainyard.Client(api_server.url, tenant.key) as ty:
        run = await ty.create_run(body)
        held = await claim(ty, run.id, 4)
        episode = held[0]
        client = episode.openai_client(max_retries=0)
        stream = await client.chat.completions.create(
            model="policy", messages=episode.messages, stream=True
        )
        first = await stream.__anext__()  # the answer is on its way ...
        assert first.choices[0].delta.role == "assistant"
        api_server.kill()  # ... and the API dies under it
        with contextlib.suppress(Exception):
            await stream.close()
        api_server.start()
        async with sessionmaker() as s:
            calls = (
                await s.execute(
                    text("SELECT count(*) FROM episode_calls WHERE episode_id = :e"),
                    {"e": uuid.UUID(episode.id)},
                )
            ).scalar_one()
        assert calls == 1  # recorded before the first chunk left
        # The harness asks again (the same messages) and goes on.
        for each in held:
            await each.finish(reward=await one_call(each))
        done = await wait_for(
            sessionmaker, run.id, lambda r: r.status in {"completed", "failed"}, 120
        )
        assert done.status == "completed", done.error
    async with httpx.AsyncClient(base_url=api_server.url, headers=tenant.headers) as http:
        trajectories = (await http.get(f"/runs/{run.id}/trajectories")).json()["data"]
    meta = next(t["metadata"] for t in trajectories if t["metadata"]["episode_id"] == episode.id)
    # Two calls with one prompt: the retry replaces the call it retries, which is not trained.
    assert (meta["calls"], meta["sequence"], meta["trained_calls"]) == (2, "one", 1)
