"""The SDK's episodes share one connection pool for their model calls (one async, one
blocking): an ``AsyncOpenAI`` with a client of its own costs about 30 ms of CPU (its SSL
context), which a harness playing hundreds of episodes at once pays per episode
(bench/gateway.py's tiny-model phase)."""

from __future__ import annotations

import asyncio

import trainyard


async def test_every_episode_of_a_client_calls_through_one_pool() -> None:
    async with trainyard.Client("http://127.0.0.1:1", "key") as client:
        episodes = [
            trainyard.Episode(client, {"base_url": f"http://127.0.0.1:1/e/{i}/v1", "token": "t"})
            for i in range(2)
        ]
        first, second = (e.openai_client() for e in episodes)
        assert first._client is second._client is client.model_http()
        assert str(first.base_url) != str(second.base_url)
        pool = client.model_http()
    assert pool.is_closed  # closed with the client


async def test_blocking_episodes_share_one_pool_across_threads() -> None:
    """A harness playing episodes on threads (``asyncio.to_thread``) gets one blocking pool
    for all of them, made once however many threads ask at the same moment."""
    async with trainyard.Client("http://127.0.0.1:1", "key") as client:
        episodes = [
            trainyard.Episode(client, {"base_url": f"http://127.0.0.1:1/e/{i}/v1", "token": "t"})
            for i in range(16)
        ]
        clients = await asyncio.gather(*(asyncio.to_thread(e.sync_openai_client) for e in episodes))
        assert {id(c._client) for c in clients} == {id(client.sync_model_http())}
        assert len({str(c.base_url) for c in clients}) == 16
        pool = client.sync_model_http()
    assert pool.is_closed
