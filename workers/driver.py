"""Drive one run under a lease: claim, heartbeat, run the pipeline, settle the outcome.

Whatever the pipeline does, the run ends in a truthful state: its next status (completed,
cancelled, paused), ``failed`` with the error, or — if this worker lost the lease — left
alone for the worker that took it over.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import traceback
import uuid
from collections.abc import Awaitable, Callable
from importlib import import_module

from app.core.errors import database_unavailable
from app.core.logs import log_context
from app.events import service as events
from app.runs.lifecycle import leases
from app.runs.lifecycle.state import LeaseLost, TransitionConflict
from app.runs.lifecycle.status import RunStatus
from app.runs.models import Run
from workers.context import AttemptEnded, HandOver, RunContext, StopRequested
from workers.runtime import Runtime

log = logging.getLogger(__name__)

Pipeline = Callable[[RunContext], Awaitable[None]]


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def load_pipeline(dotted: str) -> Pipeline:
    module, _, name = dotted.partition(":")
    return getattr(import_module(module), name)  # type: ignore[no-any-return]


async def drive(runtime: Runtime, run_id: uuid.UUID, pipeline: Pipeline) -> str:
    """Run ``pipeline`` on ``run_id`` if this worker can claim it; returns what happened."""
    # Every line logged while the run is driven, here or in the pipeline, carries its id.
    with log_context(run_id=run_id):
        return await _drive(runtime, run_id, pipeline)


async def _drive(runtime: Runtime, run_id: uuid.UUID, pipeline: Pipeline) -> str:
    settings = runtime.settings
    async with runtime.session() as session:
        claimed = await leases.claim(
            session,
            run_id,
            owner=worker_id(),
            ttl_seconds=settings.lease_ttl_seconds,
            max_attempts=settings.max_attempts,
        )
    if claimed is None:
        return "not-claimed"
    run, fence = claimed
    log.info("run %s: claimed (attempt %d)", run_id, run.attempt)
    ctx = RunContext(runtime, run_id, fence)
    heartbeat = asyncio.create_task(ctx.heartbeat_forever())
    try:
        await pipeline(ctx)
        return "done"
    except StopRequested as stop:
        await _settle(ctx, stop.status, message=f"{stop.status.value} at the user's request")
        return stop.status.value
    except HandOver:
        await _hand_over(runtime, ctx)
        return "handed-over"
    except AttemptEnded as ended:
        await _give_back(runtime, ctx, ended)
        return "attempt-ended"
    except LeaseLost:
        log.warning("run %s: lease lost; another worker owns it now", run_id)
        return "lease-lost"
    except Exception as exc:
        if database_unavailable(exc):
            # Not the run's fault: it resumes (from its last checkpoint) on the next claim.
            log.warning("run %s: database unreachable (%s); leaving it to resume", run_id, exc)
            return "database-unavailable"
        log.exception("run %s failed", run_id)
        # A database error's own message, not the statement and its parameters.
        cause = getattr(exc, "orig", None) or exc
        detail = f"{type(cause).__name__}: {cause}"
        await _settle(
            ctx,
            RunStatus.FAILED,
            error=detail[:4000],
            data={"traceback": traceback.format_exc()[-8000:]},
        )
        return "failed"
    finally:
        heartbeat.cancel()
        try:
            async with runtime.session() as session:
                await leases.release(session, run_id, fence)
        except Exception as exc:
            if not database_unavailable(exc):
                raise
            log.warning("run %s: cannot release its lease (%s); it runs out", run_id, exc)


async def _hand_over(runtime: Runtime, ctx: RunContext) -> None:
    """Back to the queue, due at once, with its checkpoint recorded; the lease is released
    here (the ``finally`` of ``_drive`` then finds nothing to release)."""
    async with runtime.session() as session:
        if await leases.release(session, ctx.run_id, ctx.fence, due_now=True):
            run = await session.get(Run, ctx.run_id)
            step = run.step if run is not None else 0
            await events.append(
                session,
                ctx.run_id,
                "handover",
                f"worker {ctx.fence.owner} is shutting down: handed over after step {step}",
                data={"step": step, "worker": ctx.fence.owner},
            )
    log.info("run %s: handed over (this worker is shutting down)", ctx.run_id)


async def _give_back(runtime: Runtime, ctx: RunContext, ended: AttemptEnded) -> None:
    """Back to the queue (at once, or after the re-dispatch interval), a failure counted: the
    next claim resumes the run from its last checkpoint, or fails it once ``max_attempts``
    are used up."""
    log.warning("run %s: attempt %d ended: %s", ctx.run_id, ctx.fence.attempt, ended)
    async with runtime.session() as session:
        released = await leases.release(
            session, ctx.run_id, ctx.fence, due_now=ended.due_now, failed=True
        )
        if released:
            await events.append(
                session,
                ctx.run_id,
                "attempt_ended",
                f"attempt {ctx.fence.attempt} ended: {ended}; the run resumes from its last "
                "checkpoint",
                level="warning",
                data={"attempt": ctx.fence.attempt, "reason": str(ended)},
            )


async def _settle(ctx: RunContext, dst: RunStatus, **kwargs: object) -> None:
    try:
        await ctx.move(dst, **kwargs)  # type: ignore[arg-type]
    except (LeaseLost, TransitionConflict) as exc:
        log.warning("run %s: could not record %s (%s)", ctx.run_id, dst.value, exc)
