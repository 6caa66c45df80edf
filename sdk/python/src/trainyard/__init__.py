"""Trainyard's Python SDK: create and follow runs, and play a gateway run's episodes with
your own agent (docs/gateway.md).

    import trainyard

    async with trainyard.Client("http://127.0.0.1:8000", api_key="ty_…") as ty:
        run = await ty.create_run({...})            # a run with environment.type gateway
        async for episode in run.episodes(concurrency=8):
            ...                                     # play it: episode.openai_client()
            await episode.finish(reward=1.0)
"""

from trainyard.client import Client, Episode, Run, TrainyardError

__all__ = ["Client", "Episode", "Run", "TrainyardError"]
