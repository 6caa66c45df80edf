"""The SDK's episodes share one connection pool for their model calls: an ``AsyncOpenAI``
with a client of its own costs about 30 ms of CPU (its SSL context), which a harness playing
hundreds of episodes at once pays per episode (bench/gateway.py's tiny-model phase)."""

from __future__ import annotations

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
