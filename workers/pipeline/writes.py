"""Write-behind for the training thread: its database writes run in order on the runtime's
event loop while the next generation or optimizer step goes on.

Safe because every write that changes the run's phase carries its data in the same
transaction: the database never says "scoring" before the rollouts are stored, whatever is
still in flight, and a worker that dies with writes pending is resumed from its last
checkpoint, redoing those steps. A write that fails (lease lost, database unreachable) is
raised in the training thread at its next :meth:`WriteBehind.check` or :meth:`flush`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

from workers.runtime import Runtime


class WriteBehind:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._tail: Future[Any] | None = None

    def submit(self, write: Callable[[], Awaitable[Any]]) -> None:
        """Queue ``write()`` after every write submitted before it."""
        self.check()
        previous = self._tail

        async def ordered() -> None:
            if previous is not None:
                await asyncio.wrap_future(previous)
            await write()

        self._tail = asyncio.run_coroutine_threadsafe(ordered(), self.runtime.loop)

    def check(self) -> None:
        """Raise the error of a write that already failed, if any."""
        tail = self._tail
        if tail is not None and tail.done():
            tail.result()

    def flush(self) -> None:
        """Wait until every submitted write is committed (or raise why one was not)."""
        if self._tail is not None:
            self._tail.result()
