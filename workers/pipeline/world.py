"""The processes that train a run, as the trainer's hooks see them from inside: the worker
alone, or the N ranks ``accelerate launch`` started for it (workers/pipeline/ranks.py).
Rank 0 scores and writes; stops are its decision, shared with every rank at the same point.
Below the training loop and the rank program alike, so neither imports the other.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

from app.runs.lifecycle.state import LeaseLost
from app.runs.lifecycle.status import RunStatus
from workers.context import HandOver, RunContext, StopRequested

T = TypeVar("T")


class FollowedRankZero(RuntimeError):
    """A rank other than 0 stopping because rank 0 raised (its outcome is rank 0's)."""


_STOPS: dict[str, type[BaseException]] = {"lost": LeaseLost, "handover": HandOver}


def stop_code(exc: BaseException) -> str | None:
    """A stop as a word every rank can be sent (None: not a stop, an error)."""
    if isinstance(exc, LeaseLost):
        return "lost"
    if isinstance(exc, StopRequested):
        return exc.status.value
    if isinstance(exc, HandOver):
        return "handover"
    return None


def _check_code(ctx: RunContext, *, pause_ok: bool) -> str | None:
    """What ``ctx.check(pause_ok=...)`` would raise, as a word."""
    try:
        ctx.check(pause_ok=pause_ok)
    except (LeaseLost, StopRequested, HandOver) as exc:
        return stop_code(exc)
    return None


def raise_stop(code: str | None, ctx: RunContext) -> None:
    if code is None:
        return
    if code in _STOPS:
        raise _STOPS[code](ctx.run_id if code == "lost" else str(ctx.run_id))
    raise StopRequested(RunStatus(code))


class Ranks:
    """The processes training a run: the worker alone, or the N ranks ``accelerate launch``
    started (their rank and number from the launcher's ``RANK`` and ``WORLD_SIZE``; the
    collectives through accelerate, whose process group the trainer set up)."""

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def writer(self) -> bool:
        """Rank 0: the one that scores, writes to the database and promotes checkpoints."""
        return self.rank == 0

    def gather(self, items: list[T]) -> list[T]:
        """Every rank's ``items``, in rank order (the global batch's order), on every rank."""
        if self.world == 1:
            return items
        from accelerate.utils import gather_object

        return list(gather_object(items))

    def share(self, value: T | None) -> T:
        """Rank 0's ``value``, on every rank."""
        if self.world == 1:
            return value  # type: ignore[return-value]
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([value], from_process=0)[0]  # type: ignore[no-any-return]

    def wait(self) -> None:
        """Until every rank gets here (its part of a checkpoint written, say)."""
        if self.world > 1:
            from accelerate import PartialState

            PartialState().wait_for_everyone()

    def check(self, ctx: RunContext, *, pause_ok: bool = True) -> None:
        """``ctx.check``, decided by rank 0 for all: every rank raises the same, here."""
        if self.world == 1:
            ctx.check(pause_ok=pause_ok)
            return
        raise_stop(self.share(_check_code(ctx, pause_ok=pause_ok) if self.writer else None), ctx)

    def stops_at_step_end(self, ctx: RunContext) -> bool:
        return self.share(ctx.stops_at_step_end if self.writer else None) is True

    def stop_at_step_end(self, ctx: RunContext) -> None:
        """``ctx.stop_at_step_end``, decided by rank 0 for all."""
        if self.world == 1:
            ctx.stop_at_step_end()
            return
        code = None
        if self.writer:
            try:
                ctx.stop_at_step_end()
            except (StopRequested, HandOver) as exc:
                code = stop_code(exc)
        raise_stop(self.share(code), ctx)

    def on_rank_zero(self, work: Any) -> Any:
        """``work()`` on rank 0, its result (or that it raised) shared with every rank: a
        rank 0 that raises takes the others down with it at once, not at a timeout."""
        if self.world == 1:
            return work()
        result, failed = None, None
        if self.writer:
            try:
                result = work()
            except BaseException as exc:
                failed = stop_code(exc) or "error"
                self.share((None, failed))
                raise
        result, failed = self.share((result, failed))
        if failed == "error":
            raise FollowedRankZero("rank 0 raised; see its outcome")
        if failed is not None:
            raise FollowedRankZero(failed)
        return result
