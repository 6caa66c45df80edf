"""One API process's link to the gateway's Redis (app/gateway/wire.py): one reply list of
its own, read by one task that hands each answer to the call waiting for it, and one pattern
subscription that wakes the claims waiting on a run when its worker says episodes wait. Two
connections for every call and claim in flight, however many there are."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

import redis.asyncio

from app.core.embedded import redis_py_url
from app.gateway import wire

log = logging.getLogger(__name__)


class GatewayHub:
    def __init__(self, url: str, prefix: str) -> None:
        self.prefix = prefix
        self.redis = redis.asyncio.from_url(redis_py_url(url))
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None
        self._replies = wire.reply(prefix, uuid.uuid4())  # this process's
        self._calls: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def aclose(self) -> None:
        for task in (self._task, self._reader):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await self.redis.aclose()

    # -- claims wait here ----------------------------------------------------------------------
    async def wait_available(self, run_id: uuid.UUID, seconds: float) -> None:
        """Until the run's worker says episodes wait, or ``seconds`` pass."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._listen(), name="gateway-hub")
        event = asyncio.Event()
        key = str(run_id)
        self._waiters.setdefault(key, set()).add(event)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), seconds)
        finally:
            waiting = self._waiters.get(key)
            if waiting is not None:
                waiting.discard(event)
                if not waiting:
                    del self._waiters[key]

    async def _listen(self) -> None:
        while True:
            try:
                pubsub = self.redis.pubsub()
                await pubsub.psubscribe(wire.available_pattern(self.prefix))
                async for message in pubsub.listen():
                    if message.get("type") != "pmessage":
                        continue
                    channel = message["channel"]
                    channel = channel.decode() if isinstance(channel, bytes) else channel
                    run = channel.rsplit(":", 2)[-2]
                    for event in self._waiters.get(run, ()):
                        event.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis went away: claims fall back to their timeout
                log.warning("gateway hub: %s; listening again in 1 s", exc)
                for waiting in self._waiters.values():
                    for event in waiting:
                        event.set()
                await asyncio.sleep(1)

    # -- calls travel here ---------------------------------------------------------------------
    async def ask(
        self, run_id: uuid.UUID, message: dict[str, Any], seconds: float
    ) -> dict[str, Any] | None:
        """Hand a call to the run's worker and wait for its answer (None: none in time)."""
        reply_to = wire.reply(self.prefix, message["call_id"])
        message = {**message, "reply_to": reply_to}
        await self.redis.rpush(wire.inbox(self.prefix, run_id), wire.dumps(message))
        popped = await self.redis.blpop([reply_to], timeout=max(0.01, seconds))
        return None if popped is None else wire.loads(popped[1])

    async def ended(self, run_id: uuid.UUID, episode_id: uuid.UUID) -> None:
        """Tell the run's worker an episode ended, so it stops waiting for it."""
        await self.redis.rpush(
            wire.inbox(self.prefix, run_id),
            wire.dumps({"kind": "ended", "episode_id": str(episode_id)}),
        )
