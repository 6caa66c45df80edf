"""Client CPU per rate-limiter call: app.core.ratelimit.RateLimiter vs redis-py's plain
asyncio client running the same script, and (optionally) the hand-written RESP limiter of
commit 1056d03, side by side in one process, on uvloop as the API runs.

    .venv/bin/python bench/ratelimit.py [--calls 8000] [--redis-url redis://127.0.0.1:6379/15]
    git show 1056d03:app/core/ratelimit.py > /tmp/ratelimit_hand.py   # to add the old one
    .venv/bin/python bench/ratelimit.py --hand /tmp/ratelimit_hand.py

CPU is time.process_time() of this process only (Redis runs elsewhere), best of 3, for N
callers awaiting the limiter at once (as N requests in flight in one API worker).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import redis.asyncio
import uvloop
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from app.core.embedded import redis_py_url
from app.core.ratelimit import GCRA_SCRIPT, RateLimiter


class PlainRedisPy:
    """What the limiter would be with redis-py's client as is."""

    def __init__(self, url: str) -> None:
        self.client = redis.asyncio.from_url(
            redis_py_url(url),
            socket_connect_timeout=0.25,
            socket_timeout=0.25,
            retry=Retry(NoBackoff(), 0),
        )
        self.script = self.client.register_script(GCRA_SCRIPT)

    async def hit(self, key: str) -> Any:
        return await self.script(keys=["bench:ratelimit:" + key], args=[1, 10**9])

    async def aclose(self) -> None:
        await self.client.aclose()


async def measure(make: Any, callers: int, calls: int) -> float:
    limiter = make()
    key = uuid.uuid4().hex
    for _ in range(200):  # connect, load the script, warm up
        assert await limiter.hit(key) is not None
    per = calls // callers

    async def caller() -> None:
        for _ in range(per):
            assert await limiter.hit(key) is not None

    started = time.process_time()
    await asyncio.gather(*[caller() for _ in range(callers)])
    spent = time.process_time() - started
    await limiter.aclose()
    return spent / (per * callers) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--calls", type=int, default=8000)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    p.add_argument("--hand", type=Path, help="the old hand-written ratelimit.py, to compare")
    args = p.parse_args()
    url = args.redis_url
    makers: dict[str, Any] = {
        "RateLimiter": lambda: RateLimiter(url, rate=1e6, burst=10**9, prefix="bench:"),
        "plain redis-py": lambda: PlainRedisPy(url),
    }
    if args.hand:
        spec = importlib.util.spec_from_file_location("ratelimit_hand", args.hand)
        assert spec and spec.loader
        hand = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = hand  # dataclasses look their module up
        spec.loader.exec_module(hand)
        makers["hand RESP (1056d03)"] = lambda: hand.RateLimiter(
            url, rate=1e6, burst=10**9, prefix="bench:"
        )
    print("| callers at once | " + " | ".join(f"{n} µs" for n in makers) + " |")
    print("|---:|" + "---:|" * len(makers))
    for callers in (1, 4, 8, 16, 32):
        row = [
            min(uvloop.run(measure(m, callers, args.calls)) for _ in range(3))
            for m in makers.values()
        ]
        print(f"| {callers} | " + " | ".join(f"{v:.1f}" for v in row) + " |", flush=True)


if __name__ == "__main__":
    main()
