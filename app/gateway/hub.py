"""One API process's link to the gateway's Redis (app/gateway/wire.py): one reply list of
its own, read by one task that hands each answer to the call waiting for it, and one pattern
subscription that wakes the claims waiting on a run when its worker says episodes wait. Two
connections for every call and claim in flight, however many there are.

Every blocking read waits at most :data:`BLOCK_SECONDS`, under redis-py's socket timeout
(5 s by default): a longer BLPOP would end in a timeout error of the client's own.

The calls in flight hand their messages over on a pool of at most :data:`POOL_CONNECTIONS`
connections, a call waiting up to :data:`POOL_WAIT_SECONDS` for a free one (redis-py's
``BlockingConnectionPool``): redis-py's default pool refuses a command beyond its 100
connections (``MaxConnectionsError``), which 200 episodes calling at once reached, each
such call a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio

from app.core.embedded import redis_py_url
from app.gateway import wire

log = logging.getLogger(__name__)

BLOCK_SECONDS = 2.0
POOL_CONNECTIONS = 32  # the reply reader and the pattern subscription hold one each
POOL_WAIT_SECONDS = 5.0
# How long a call waits for its answer before its claim is read again.
RECHECK_SECONDS = 2.0


class GatewayHub:
    def __init__(self, url: str, prefix: str) -> None:
        self.prefix = prefix
        self.redis = redis.asyncio.Redis.from_pool(
            redis.asyncio.BlockingConnectionPool.from_url(
                redis_py_url(url), max_connections=POOL_CONNECTIONS, timeout=POOL_WAIT_SECONDS
            )
        )
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._listener: asyncio.Task[None] | None = None
        self._replies = wire.reply(prefix, uuid.uuid4())  # this process's
        self._calls: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def aclose(self) -> None:
        for task in (self._listener, self._reader):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await self.redis.aclose()

    # -- claims wait here ----------------------------------------------------------------------
    async def wait_available(self, run_id: uuid.UUID, seconds: float) -> None:
        """Until the run's worker says episodes wait, or ``seconds`` pass."""
        if self._listener is None or self._listener.done():
            self._listener = asyncio.create_task(self._listen(), name="gateway-available")
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
                async with self.redis.pubsub() as pubsub:
                    await pubsub.psubscribe(wire.available_pattern(self.prefix))
                    while True:
                        message = await pubsub.get_message(
                            ignore_subscribe_messages=True, timeout=BLOCK_SECONDS
                        )
                        if message is None or message.get("type") != "pmessage":
                            continue
                        channel = message["channel"]
                        channel = channel.decode() if isinstance(channel, bytes) else channel
                        for event in self._waiters.get(channel.rsplit(":", 2)[-2], ()):
                            event.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis went away: wake every claim, to look again
                log.warning("gateway hub: %s; listening again in 1 s", exc)
                for waiting in self._waiters.values():
                    for event in waiting:
                        event.set()
                await asyncio.sleep(1)

    # -- calls travel here ---------------------------------------------------------------------
    async def ask(
        self,
        run_id: uuid.UUID,
        message: dict[str, Any],
        seconds: float,
        *,
        still_open: Callable[[], Awaitable[None]] | None = None,
    ) -> dict[str, Any] | None:
        """Hand a call to the run's worker and wait for its answer (None: none in time).
        Every :data:`RECHECK_SECONDS` without one, ``still_open()`` is awaited: it raises
        once the call's claim is gone (its run cancelled, say, and no worker left to
        answer), which ends the wait with that error."""
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read_replies(), name="gateway-replies")
        call_id = str(message["call_id"])
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._calls[call_id] = answer
        try:
            await self.redis.rpush(
                wire.inbox(self.prefix, run_id), wire.dumps({**message, "reply_to": self._replies})
            )
            until = loop.time() + max(0.01, seconds)
            while (left := until - loop.time()) > 0:
                await asyncio.wait({answer}, timeout=min(left, RECHECK_SECONDS))
                if answer.done():
                    return answer.result()
                if still_open is not None:
                    await still_open()
            return None
        finally:
            self._calls.pop(call_id, None)

    async def _read_replies(self) -> None:
        """Every answer pushed to this process's reply list, to the call waiting for it (an
        answer nobody waits for any more, its call timed out, is dropped)."""
        while True:
            try:
                popped = await self.redis.blpop([self._replies], timeout=BLOCK_SECONDS)
                if popped is None:
                    continue
                self._deliver(popped[1])  # before another round trip for what queued behind
                for raw in await self.redis.lpop(self._replies, 500) or []:
                    self._deliver(raw)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis went away: the calls time out, or are retried
                log.warning("gateway replies: %s; reading again in 1 s", exc)
                await asyncio.sleep(1)

    def _deliver(self, raw: Any) -> None:
        reply = wire.loads(raw)
        waiting = self._calls.get(str(reply.get("call_id")))
        if waiting is not None and not waiting.done():
            waiting.set_result(reply)

    async def ended(self, run_id: uuid.UUID, episode_id: uuid.UUID, issue: int) -> None:
        """Tell the run's worker an episode's claim number ``issue`` ended, so it stops
        waiting for it (and refuses that claim's calls: not a later claim's)."""
        message = {"kind": "ended", "episode_id": str(episode_id), "issue": issue}
        await self.redis.rpush(wire.inbox(self.prefix, run_id), wire.dumps(message))
