"""Per-key request rate limit, shared by every API process through Redis.

GCRA (the generic cell rate algorithm, a token bucket that stores one number): each key has
a theoretical arrival time ``tat``; a request is allowed when ``tat - burst * interval`` is
not in the future, and moves ``tat`` on by one ``interval`` (1 / rate). The check and the
update are one Lua script (``register_script``: ``EVALSHA``, loaded again after a
``NOSCRIPT``), so a request costs one Redis round trip; the clock is Redis's own (``TIME``),
so API hosts with skewed clocks still agree.

redis-py speaks the protocol: URL, TLS, ``AUTH`` and ``SELECT``, parsing, errors. The one
thing done here is sharing. redis-py's asyncio client gives each command a pooled connection
of its own, behind its retry, pool and observability layers; every keyed request pays for a
limiter call, and on two cores serving ~2,300 GETs/s (870 µs of CPU each, all processes
together) that layer costs ~8 % of the throughput. So every request of a process writes its
``EVALSHA`` to one redis-py connection, the commands of one turn of the event loop go out in
one write, and a reader hands the replies, which Redis sends in order, to the oldest waiting
request. Client CPU per call, side by side, uvloop, 4-32 callers at once: redis-py's client
82-91 µs, this 28-45 µs, the hand-written RESP client this replaced 12-19 µs.

A rate limiter must not turn a Redis blip into an outage: when Redis cannot be reached or
answers too slowly the request is let through, a warning is logged at most once a minute,
and Redis is not asked again for a second, so a dead Redis costs requests nothing.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import redis.asyncio
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, ResponseError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.core.embedded import redis_py_url

log = logging.getLogger(__name__)

# KEYS[1]: the key's bucket. ARGV[1]: emission interval (µs). ARGV[2]: burst.
# Returns {allowed, remaining, retry_after_us, reset_us}. Times are integer microseconds
# (exact in Lua's doubles); the stored value is formatted with %.0f because Lua would write
# a 16-digit number as 1.7e+15 and lose precision.
GCRA_SCRIPT = """
local interval = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local tat = tonumber(redis.call('GET', KEYS[1])) or now
if tat < now then tat = now end
local new_tat = tat + interval
local allow_at = new_tat - burst * interval
if now < allow_at then
  return {0, 0, allow_at - now, tat - now}
end
redis.call('SET', KEYS[1], string.format('%.0f', new_tat), 'PX',
  math.max(1, math.ceil((new_tat - now) / 1000)))
return {1, math.floor((now - allow_at) / interval), 0, new_tat - now}
"""

# A limiter call normally takes well under a millisecond; past these it fails open.
CONNECT_TIMEOUT = 0.25
COMMAND_TIMEOUT = 0.25
# After a failure, requests skip Redis this long (then one of them tries again) ...
SKIP_AFTER_FAILURE = 1.0
# ... and the warning about it is logged at most this often.
WARN_EVERY = 60.0


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    limit: int
    remaining: int
    retry_after: float  # seconds until this key may make one request (0 when allowed)
    reset: float  # seconds until the key's full burst is available again

    def headers(self) -> list[tuple[bytes, bytes]]:
        """``RateLimit-*`` headers (draft-ietf-httpapi-ratelimit-headers, field per value)."""
        return [
            (b"ratelimit-limit", str(self.limit).encode()),
            (b"ratelimit-remaining", str(self.remaining).encode()),
            (b"ratelimit-reset", str(max(0, math.ceil(self.reset))).encode()),
        ]


class SharedConnection:
    """One redis-py connection that many requests use at once (see the module docstring).

    Only commands whose replies come back in order belong here (no pub/sub, no blocking
    commands). A request that gives up waiting keeps its place in the queue, so a late
    reply still goes to it (and nowhere else).
    """

    def __init__(self, connection: AbstractConnection) -> None:
        self._conn = connection
        self._waiters: deque[asyncio.Future[Any]] = deque()
        self._outbox: list[bytes] = []
        self._reader: asyncio.Task[None] | None = None
        self.lost = False

    async def open(self) -> None:
        await self._conn.connect()  # with the handshake the URL asks for: AUTH, SELECT
        self._reader = asyncio.ensure_future(self._read_replies())

    def call(self, *args: bytes | str | int) -> asyncio.Future[Any]:
        """The reply to one command, as a future (an error reply is raised from it)."""
        if self.lost:
            raise ConnectionError("the rate limiter's Redis connection is closed")
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        # A send is a system call and costs more than everything else here: the commands of
        # one turn of the event loop go out together.
        if not self._outbox:
            loop.call_soon(self._flush)
        self._outbox.extend(self._conn.pack_command(*args))
        self._waiters.append(waiter)
        return waiter

    def _flush(self) -> None:
        chunks, self._outbox = self._outbox, []
        if not self.lost:
            sending = asyncio.ensure_future(self._send(chunks))
            sending.add_done_callback(_retrieved)

    async def _send(self, chunks: list[bytes]) -> None:
        if self.lost or not self._conn.is_connected:
            return  # (redis-py would connect again, to a socket nobody reads)
        try:
            await self._conn.send_packed_command(chunks, check_health=False)
        except Exception as exc:
            self.close(exc)

    async def _read_replies(self) -> None:
        try:
            while True:
                error: ResponseError | None = None
                try:
                    # No timeout here: an idle connection waits for as long as it is idle;
                    # each request bounds its own wait.
                    reply = await self._conn.read_response(timeout=math.inf)
                except ResponseError as exc:  # an error reply, e.g. NOSCRIPT
                    reply, error = None, exc
                if not self._waiters:
                    raise ConnectionError("Redis sent a reply nobody asked for")
                waiter = self._waiters.popleft()
                if waiter.done():  # its request gave up waiting
                    continue
                if error is not None:
                    waiter.set_exception(error)
                else:
                    waiter.set_result(reply)
        except Exception as exc:  # the connection broke: fail every waiting request
            self.close(exc)
        finally:
            await self._conn.disconnect(nowait=True)

    def close(self, exc: BaseException | None = None) -> None:
        self.lost = True
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()  # and the reader disconnects
        error = ConnectionError(f"the rate limiter's Redis connection closed ({exc or 'EOF'})")
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(error)

    async def aclose(self) -> None:
        self.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        await self._conn.disconnect()


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


# ---------------------------------------------------------------------- the limiter


class RateLimiter:
    """``rate`` requests per second per key on average, up to ``burst`` at once."""

    def __init__(self, url: str, *, rate: float, burst: int, prefix: str = "") -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("a rate limiter needs rate > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        # Failing open is the retry policy: redis-py's own retries would only add waits.
        self._client = redis.asyncio.from_url(  # a malformed URL fails at startup
            redis_py_url(url),
            socket_connect_timeout=CONNECT_TIMEOUT,
            socket_timeout=COMMAND_TIMEOUT,
            retry=Retry(NoBackoff(), 0),
            # RESP2: nothing but replies ever arrives (no RESP3 push messages), which is
            # what lets the shared connection pair each reply with the oldest request.
            protocol=2,
        )
        # Loads the script after a NOSCRIPT (a Redis restart or SCRIPT FLUSH), through the
        # client's own pool; the shared connection only ever sends EVALSHA.
        self._script = self._client.register_script(GCRA_SCRIPT)
        self._key_prefix = f"{prefix}trainyard:ratelimit:"
        self._args = (max(1, round(1_000_000 / rate)), burst)
        self._shared: SharedConnection | None = None
        self._connecting: asyncio.Task[SharedConnection] | None = None
        self._skip_until = 0.0
        self._warned_at = -math.inf

    async def hit(self, key: str) -> Decision | None:
        """Count one request for ``key``; None when Redis could not be asked (let it pass)."""
        if self._skip_until:
            if time.monotonic() < self._skip_until:
                return None
            self._skip_until = 0.0
        bucket = self._key_prefix + key
        try:
            shared = self._shared
            if shared is None or shared.lost:
                shared = await self._connect()
            try:
                reply = await self._evalsha(shared, bucket)
            except NoScriptError:
                async with asyncio.timeout(COMMAND_TIMEOUT):
                    reply = await self._script(keys=[bucket], args=self._args)
            allowed, remaining, retry_us, reset_us = reply
        except Exception as exc:  # fail open, whatever went wrong
            self._failed(exc)
            return None
        return Decision(
            allowed=allowed == 1,
            limit=self.burst,
            remaining=remaining,
            retry_after=retry_us / 1_000_000,
            reset=reset_us / 1_000_000,
        )

    async def _evalsha(self, shared: SharedConnection, bucket: str) -> Any:
        reply = shared.call("EVALSHA", self._script.sha, 1, bucket, *self._args)
        try:
            async with asyncio.timeout(COMMAND_TIMEOUT):
                return await reply
        except TimeoutError:
            # Slow enough to be sick, or gone without a word (a partition, a half-dead
            # socket), and every later request would wait out its timeout behind it: start
            # over with a fresh connection after the pause.
            shared.close(TimeoutError(f"no reply in {COMMAND_TIMEOUT} s"))
            raise

    async def _connect(self) -> SharedConnection:
        # Requests that find no connection share one attempt.
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
            self._connecting.add_done_callback(self._connected)
        return await asyncio.shield(self._connecting)

    async def _open(self) -> SharedConnection:
        pool = self._client.connection_pool
        # Its own connection, outside the pool: it is never handed to another command, and
        # its reads wait without a socket timeout (each request bounds its own wait).
        kwargs = {**pool.connection_kwargs, "socket_timeout": None}
        shared = SharedConnection(pool.connection_class(**kwargs))
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                await shared.open()
        except BaseException:
            await shared.aclose()
            raise
        self._shared = shared
        return shared

    def _connected(self, task: asyncio.Task[SharedConnection]) -> None:
        self._connecting = None
        if not task.cancelled():
            task.exception()  # retrieved here, and raised in every waiter

    def _failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        self._skip_until = now + SKIP_AFTER_FAILURE
        if now - self._warned_at >= WARN_EVERY:
            self._warned_at = now
            log.warning(
                "rate limiter: Redis unreachable (%s: %s); requests are not rate-limited "
                "until it answers (this warning repeats at most every %.0f s)",
                type(exc).__name__,
                exc,
                WARN_EVERY,
            )

    async def aclose(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
        if self._shared is not None:
            await self._shared.aclose()
        await self._client.aclose()


# ---------------------------------------------------------------- response headers

# Where the request's decision is kept (``request.state``) for RateLimitHeaders.
STATE_KEY = "ratelimit"


class RateLimitHeaders:
    """Adds the ``RateLimit-*`` headers of the request's :class:`Decision` to its response.

    The decision is taken after authentication, inside the route's dependencies, which
    cannot add headers to a ``Response`` a route returns itself; this pure ASGI wrapper
    can. Installed only when the limit is on.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # request.state is this dict, whatever scope copies the app makes on the way in.
        state = scope.setdefault("state", {})

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                decision = state.get(STATE_KEY)
                if decision is not None and decision.allowed:
                    message["headers"] = [*message.get("headers", ()), *decision.headers()]
            await send(message)

        await self.app(scope, receive, send_with_headers)
