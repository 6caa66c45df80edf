"""Per-key request rate limit, shared by every API process through Redis.

GCRA (the generic cell rate algorithm, a token bucket that stores one number): each key has
a theoretical arrival time ``tat``; a request is allowed when ``tat - burst * interval`` is
not in the future, and moves ``tat`` on by one ``interval`` (1 / rate). The check and the
update are one Lua script run by ``EVALSHA`` (``EVAL`` once after a ``NOSCRIPT``, which
also loads it again), so a request costs one Redis round trip; the clock is Redis's own
(``TIME``), so API hosts with skewed clocks still agree.

The round trip goes over one connection per process that every request shares: commands
are written as they come, and Redis answers them in order, so each reply resolves the oldest
waiting request. That costs a request about a tenth of the CPU of a redis-py call (pool,
retry and parser layers), which matters on a route that serves thousands of GETs a second.
redis-py still parses the URL and builds the TLS context, so every URL the broker takes
works here too.

A rate limiter must not turn a Redis blip into an outage: when Redis cannot be reached or
answers too slowly the request is let through, a warning is logged at most once a minute,
and Redis is not asked again for a second, so a dead Redis costs requests nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import ssl
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, cast

from redis.asyncio.connection import RedisSSLContext, SSLConnection, parse_url
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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


# ------------------------------------------------------------------ the Redis connection


class ReplyError(Exception):
    """An error reply (``-ERR …``, ``-NOSCRIPT …``) from Redis."""


class ProtocolError(Exception):
    pass


def bulks(*parts: bytes | str | int) -> bytes:
    """RESP bulk strings, one after another."""
    out = []
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def command(*parts: bytes | str | int) -> bytes:
    """A command in RESP: an array of bulk strings."""
    return b"*%d\r\n" % len(parts) + bulks(*parts)


def parse_reply(buf: bytes | bytearray, pos: int = 0) -> tuple[Any, int] | None:
    """The reply starting at ``pos`` and where the next one starts; None if incomplete.

    RESP2 as Redis answers scripts: integers, simple and bulk strings, errors (returned as
    :class:`ReplyError`, not raised) and arrays of those.
    """
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return None
    kind, line, nxt = buf[pos], bytes(buf[pos + 1 : end]), end + 2
    if kind == 0x3A:  # :
        return int(line), nxt
    if kind == 0x2A:  # *
        items = []
        for _ in range(int(line)):
            parsed = parse_reply(buf, nxt)
            if parsed is None:
                return None
            item, nxt = parsed
            items.append(item)
        return items, nxt
    if kind == 0x2B:  # +
        return line, nxt
    if kind == 0x2D:  # -
        return ReplyError(line.decode(errors="replace")), nxt
    if kind == 0x24:  # $
        size = int(line)
        if size < 0:
            return None, nxt
        if len(buf) < nxt + size + 2:
            return None
        return bytes(buf[nxt : nxt + size]), nxt + size + 2
    raise ProtocolError(f"unexpected reply type {chr(kind)!r}")


class Pipe(asyncio.Protocol):
    """One connection that many requests share: each writes its command at once, and the
    replies, which Redis sends in order, resolve the waiters oldest first."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self._buf = bytearray()
        self._waiters: deque[asyncio.Future[Any]] = deque()
        self._outbox: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos = 0
        try:
            while buf:
                parsed = parse_reply(buf, pos)
                if parsed is None:
                    break
                reply, pos = parsed
                if not self._waiters:
                    raise ProtocolError("a reply nobody asked for")
                waiter = self._waiters.popleft()
                if not waiter.done():  # else its request gave up waiting
                    waiter.set_result(reply)
        except (ProtocolError, ValueError) as exc:
            self.close(exc)
            return
        del buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        self.close(exc)

    def request(self, payload: bytes) -> asyncio.Future[Any]:
        if self.lost or self.transport is None:
            raise ConnectionError("the rate limiter's Redis connection is closed")
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiters.append(waiter)
        # The commands of one turn of the event loop go out in one write: a send is a
        # system call, and costs more than everything else here.
        if not self._outbox:
            loop.call_soon(self._flush)
        self._outbox.append(payload)
        return waiter

    def _flush(self) -> None:
        if not self.lost and self.transport is not None:
            self.transport.write(b"".join(self._outbox))
        self._outbox.clear()

    def close(self, exc: BaseException | None = None) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()
        error = ConnectionError(f"the rate limiter's Redis connection closed ({exc or 'EOF'})")
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(error)


@dataclass(frozen=True)
class Target:
    """Where Redis is and how to log in, from a URL redis-py understands."""

    host: str = "localhost"
    port: int = 6379
    path: str | None = None  # a unix socket
    tls: ssl.SSLContext | None = None
    handshake: tuple[bytes, ...] = ()

    @classmethod
    def from_url(cls, url: str) -> Target:
        if url.startswith("redis+socket://"):  # Celery's spelling of the embedded server
            url = "unix://" + url.removeprefix("redis+socket://")
        kw: dict[str, Any] = dict(parse_url(url))
        handshake = []
        if kw.get("password"):
            user = kw.get("username")
            handshake.append(
                command(b"AUTH", user, kw["password"]) if user else command(b"AUTH", kw["password"])
            )
        if kw.get("db"):
            handshake.append(command(b"SELECT", kw["db"]))
        context = None
        if kw.get("connection_class") is SSLConnection:
            cert_reqs = kw.get("ssl_cert_reqs", "required")
            context = RedisSSLContext(
                keyfile=kw.get("ssl_keyfile"),
                certfile=kw.get("ssl_certfile"),
                cert_reqs=cert_reqs,
                ca_certs=kw.get("ssl_ca_certs"),
                ca_path=kw.get("ssl_ca_path"),
                check_hostname=bool(kw.get("ssl_check_hostname", True))
                and cert_reqs not in ("none", ssl.CERT_NONE),
            ).get()
        return cls(
            host=kw.get("host") or "localhost",
            port=int(kw.get("port") or 6379),
            path=kw.get("path"),
            tls=context,
            handshake=tuple(handshake),
        )

    async def connect(self) -> Pipe:
        loop = asyncio.get_running_loop()
        if self.path:
            _, pipe = await loop.create_unix_connection(Pipe, self.path)
        else:
            _, pipe = await loop.create_connection(Pipe, self.host, self.port, ssl=self.tls)
        try:
            for step in self.handshake:
                reply = await pipe.request(step)
                if isinstance(reply, ReplyError):
                    raise reply
        except BaseException:
            pipe.close()
            raise
        return pipe


# ---------------------------------------------------------------------- the limiter


class RateLimiter:
    """``rate`` requests per second per key on average, up to ``burst`` at once."""

    def __init__(self, url: str, *, rate: float, burst: int, prefix: str = "") -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("a rate limiter needs rate > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self._target = Target.from_url(url)  # a malformed URL fails at startup
        self._prefix = f"{prefix}trainyard:ratelimit:".encode()
        script = GCRA_SCRIPT.encode()
        args = bulks(max(1, round(1_000_000 / rate)), burst)
        sha = hashlib.sha1(script).hexdigest().encode()
        # EVALSHA/EVAL <script> 1 <key> <interval> <burst>: only the key changes.
        self._evalsha = (bulks(b"EVALSHA", sha, 1), args)
        self._eval = (bulks(b"EVAL", script, 1), args)
        self._pipe: Pipe | None = None
        self._connecting: asyncio.Task[Pipe] | None = None
        self._skip_until = 0.0
        self._warned_at = -math.inf

    async def hit(self, key: str) -> Decision | None:
        """Count one request for ``key``; None when Redis could not be asked (let it pass)."""
        if self._skip_until:
            if time.monotonic() < self._skip_until:
                return None
            self._skip_until = 0.0
        bucket = self._prefix + key.encode()
        try:
            pipe = self._pipe
            if pipe is None or pipe.lost:
                pipe = await self._connect()
            reply = await self._call(pipe, self._evalsha, bucket)
            if isinstance(reply, ReplyError) and str(reply).startswith("NOSCRIPT"):
                reply = await self._call(pipe, self._eval, bucket)  # EVAL loads it again
            if isinstance(reply, ReplyError):
                raise reply
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

    async def _call(self, pipe: Pipe, parts: tuple[bytes, bytes], bucket: bytes) -> Any:
        head, args = parts
        waiter = pipe.request(b"*6\r\n%s$%d\r\n%s\r\n%s" % (head, len(bucket), bucket, args))
        try:
            async with asyncio.timeout(COMMAND_TIMEOUT):
                return await waiter
        except TimeoutError:
            # Slow enough to be sick (or gone without a word, as behind a partition): start
            # over with a fresh connection after the pause.
            pipe.close(TimeoutError(f"no reply in {COMMAND_TIMEOUT} s"))
            raise

    async def _connect(self) -> Pipe:
        # Requests that find no connection share one attempt.
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
            self._connecting.add_done_callback(self._connected)
        return await asyncio.shield(self._connecting)

    async def _open(self) -> Pipe:
        async with asyncio.timeout(CONNECT_TIMEOUT):
            self._pipe = await self._target.connect()
        return self._pipe

    def _connected(self, task: asyncio.Task[Pipe]) -> None:
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
        if self._pipe is not None:
            self._pipe.close()


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
