"""What a pipeline sees of the run it works on: fenced sessions, stop checks, events.

The heartbeat renews the lease every ``heartbeat_seconds`` on the runtime loop. When it
learns that the run was cancelled or paused, or that the lease is gone, it sets a flag;
the pipeline calls :meth:`RunContext.check` at safe points and stops there.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm.attributes import set_committed_value

from app.catalog.policy import NAMING, CodePolicy, RunRefused
from app.events import service as events
from app.observability import prometheus
from app.runs.lifecycle import leases
from app.runs.lifecycle.fence import Fence
from app.runs.lifecycle.state import LeaseLost, transition
from app.runs.lifecycle.status import RunStatus
from app.runs.models import Run
from workers.runtime import Runtime

log = logging.getLogger(__name__)


class StopRequested(Exception):
    """The user asked the run to stop; ``status`` is where it goes (cancelled or paused)."""

    def __init__(self, status: RunStatus) -> None:
        super().__init__(status.value)
        self.status = status


class HandOver(Exception):
    """This worker is shutting down (SIGTERM: a deploy): the run stopped at a step boundary,
    after its checkpoint, and goes back to the queue for another worker at once."""


class AttemptEnded(Exception):
    """This attempt at the run is over, not the run: it goes back to the queue at once, the
    failure counted towards ``max_attempts``, and resumes from its last checkpoint on any
    worker (a rank of its training died). ``due_now``: at once, or after the re-dispatch
    interval (what failed may need a while to come back)."""

    due_now = True


# Set once, by the worker's warm shutdown (workers/tasks.py): every run this process drives
# stops at its next step boundary and is handed over.
SHUTTING_DOWN = threading.Event()


def resolved(policy: CodePolicy, run: Run, placed: list[str] | None = None) -> Run:
    """``run`` checked against ``policy`` (RunRefused naming every refusal) and with its
    catalog names replaced in place (the object is detached from its session); ``placed``:
    the URLs of the vLLM servers Ray placed for this attempt (workers/pipeline/ray_servers.py)."""
    spec = {name: getattr(run, name) for name in NAMING}
    refusals = policy.refusals(spec, on_worker=True)
    if refusals:
        raise RunRefused(
            f"this worker's code policy ({policy.mode}) refuses the run: "
            + "; ".join(map(str, refusals))
        )
    for name, value in policy.resolve(spec, placed=placed).items():
        set_committed_value(run, name, value)  # never flushed, should it meet a session
    return run


class RunContext:
    def __init__(self, runtime: Runtime, run_id: uuid.UUID, fence: Fence) -> None:
        self.runtime = runtime
        self.settings = runtime.settings
        self.run_id = run_id
        self.fence = fence
        self.lost = False
        self.stop: RunStatus | None = None
        # The URLs of the vLLM servers Ray placed for this attempt; load() resolves into them.
        self.placed_servers: list[str] | None = None
        self._changed = asyncio.Event()

    # -- lease ---------------------------------------------------------------------------
    async def lease_state(self) -> leases.LeaseState:
        """Renew the lease; what the run's row says of it (raises LeaseLost if not ours)."""
        async with self.runtime.session() as session:
            return await leases.renew(
                session, self.run_id, self.fence, ttl_seconds=self.settings.lease_ttl_seconds
            )

    async def heartbeat_once(self) -> None:
        try:
            state = await self.lease_state()
        except LeaseLost:
            prometheus.LEASE_RENEWALS_FAILED.labels("lost").inc()
            log.warning("run %s: lease lost; stopping", self.run_id)
            self.lost = True
            self._changed.set()
            return
        if state.cancel_requested:
            self.stop = RunStatus.CANCELLED
            self._changed.set()
        elif state.pause_requested and self.stop is None:
            self.stop = RunStatus.PAUSED
            self._changed.set()

    async def heartbeat_forever(self) -> None:
        renewed = time.monotonic()  # the claim renewed the lease just now
        while not self.lost:
            await asyncio.sleep(self.settings.heartbeat_seconds)
            try:
                await self.heartbeat_once()
                renewed = time.monotonic()
            except Exception as exc:  # database unreachable: retry until the lease runs out
                prometheus.LEASE_RENEWALS_FAILED.labels("error").inc()
                if time.monotonic() - renewed < self.settings.lease_ttl_seconds:
                    log.warning("run %s: heartbeat failed (%s); retrying", self.run_id, exc)
                    continue
                # Another worker may hold the run by now: stop working on it, and writing.
                log.error(
                    "run %s: lease expired, not renewed for %.1fs (%s); stopping",
                    self.run_id,
                    time.monotonic() - renewed,
                    exc,
                )
                self.lost = True
                self._changed.set()

    @property
    def stops_at_step_end(self) -> bool:
        """Paused, or handed over: stop at the next step boundary, after a checkpoint."""
        return self.stop == RunStatus.PAUSED or SHUTTING_DOWN.is_set()

    @property
    def cancelled(self) -> bool:
        """Nothing more to compute: cancelled, or the lease is gone (safe from any thread)."""
        return self.lost or self.stop == RunStatus.CANCELLED

    def check(self, *, pause_ok: bool = True) -> None:
        """Raise if the run must stop here: lease lost, cancelled, or (at a safe point, a
        step boundary) paused or handed over. Call between units of work."""
        if self.lost:
            raise LeaseLost(self.run_id)
        if self.stop == RunStatus.CANCELLED:
            raise StopRequested(self.stop)
        if pause_ok:
            self.stop_at_step_end()

    def stop_at_step_end(self) -> None:
        """At a step boundary, its checkpoint recorded: raise the stop a pause or a shutdown
        asked for. A pause wins: the user asked for it, and it holds on any worker."""
        if self.stop == RunStatus.PAUSED:
            raise StopRequested(self.stop)
        if SHUTTING_DOWN.is_set():
            raise HandOver(str(self.run_id))

    async def wait_for_stop(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, waking early if a stop arrives."""
        try:
            await asyncio.wait_for(self._changed.wait(), seconds)
        except TimeoutError:
            return False
        return True

    # -- fenced writes ---------------------------------------------------------------------
    @asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        """A transaction that commits only while this worker still holds the lease."""
        async with self.runtime.session() as session:
            await leases.renew(
                session, self.run_id, self.fence, ttl_seconds=self.settings.lease_ttl_seconds
            )
            yield session

    async def load(self) -> Run:
        """The run as the pipeline works on it: checked against this worker's code policy
        (RunRefused: the run fails with the reason, before anything it names is run) and
        with the catalog entries it names replaced by what they stand for. The row keeps
        the names; the returned object is detached, never written back."""
        async with self.runtime.session() as session:
            run = await session.get(Run, self.run_id)
            assert run is not None
        return resolved(self.runtime.policy, run, self.placed_servers)

    async def move(self, dst: RunStatus, **kwargs: Any) -> Run:
        """Transition the run, fenced on this worker's lease."""
        async with self.runtime.session() as session:
            return await transition(session, self.run_id, dst, fence=self.fence, **kwargs)

    async def event(self, type_: str, message: str, **kwargs: Any) -> None:
        async with self.session() as session:
            await events.append(session, self.run_id, type_, message, **kwargs)
