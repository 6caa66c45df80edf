"""The run state machine: the only place a run's status changes.

``TRANSITIONS`` is the whole table; :func:`apply` is the only writer of ``runs.status``.
Every move — a user's cancel, a worker's claim failing a run, the training loop's per-step
moves — is a :class:`Move` applied as **one statement**: the run's row is locked, its
status compared with the statuses the table allows to reach the destination (and with what
the caller expected), the write fenced on the worker's lease when there is one; the same
statement appends the status events and writes any rows attached to the move (a step's
rollouts, rewards or metrics), so the data lands only if the move does. When nothing
moved, a second read says why: :class:`RunNotFound`, :class:`LeaseLost`,
:class:`InvalidTransition` or :class:`TransitionConflict`.

``version`` (the ETag and compare-and-set token) is not written here: PostgreSQL bumps it on
every visible change of a run's row (trigger ``runs_count_change``, migration 0006).

:func:`transition` applies a move on an ORM session and returns the run; the training loop
applies its moves on a plain asyncpg connection (:mod:`app.runs.lifecycle.step_moves`): same SQL,
same checks.
"""

from __future__ import annotations

import itertools
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from app.core.domain import Conflict, NotFound
from app.core.storable import jsonable
from app.events.service import insert_events
from app.gateway.service import ENDED_WITH_RUN
from app.runs.lifecycle.fence import Fence
from app.runs.lifecycle.status import TERMINAL, WORKING, RunStatus
from app.runs.models import Run

S = RunStatus

#: Allowed moves. Each line says why the move exists.
TRANSITIONS: dict[RunStatus, frozenset[RunStatus]] = {
    # A worker picks the run up: it makes inputs first, or — for a run resumed after a
    # pause at a step boundary whose inputs already exist — goes straight to collecting.
    S.PENDING: frozenset({S.GENERATING, S.COLLECTING, S.PAUSED, S.FAILED, S.CANCELLED}),
    # Inputs are persisted; the first step starts, or the SFT warm-up before it.
    S.GENERATING: frozenset({S.WARMING_UP, S.COLLECTING, S.PAUSED, S.FAILED, S.CANCELLED}),
    # The SFT warm-up's model is saved; GRPO's first step starts from it.
    S.WARMING_UP: frozenset({S.COLLECTING, S.PAUSED, S.FAILED, S.CANCELLED}),
    # Every rollout of the step is stored; the judges/reward functions take over. Or, before
    # the step has collected anything, training stopped early (grpo.early_stopping): done.
    S.COLLECTING: frozenset({S.SCORING, S.COMPLETED, S.PAUSED, S.FAILED, S.CANCELLED}),
    # Every trajectory has its reward; the policy update starts. Back to collecting when a
    # step is redone from the start after its worker died mid-scoring.
    S.SCORING: frozenset({S.TRAINING, S.COLLECTING, S.PAUSED, S.FAILED, S.CANCELLED}),
    # A step ends: either the next one collects, or the plan is exhausted.
    S.TRAINING: frozenset({S.COLLECTING, S.COMPLETED, S.PAUSED, S.FAILED, S.CANCELLED}),
    # Resume puts the run back in the queue; a paused run can still be given up.
    S.PAUSED: frozenset({S.PENDING, S.FAILED, S.CANCELLED}),
    # Terminal: a finished, failed or cancelled run never changes again.
    S.COMPLETED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}


def can_transition(src: RunStatus, dst: RunStatus) -> bool:
    return dst in TRANSITIONS[src]


def sources(dst: RunStatus) -> frozenset[RunStatus]:
    """The statuses the table allows to move to ``dst``."""
    return frozenset(src for src, targets in TRANSITIONS.items() if dst in targets)


class RunNotFound(NotFound):
    def __init__(self) -> None:
        super().__init__("Run")


class TransitionConflict(Conflict):
    """The run is not in a status this move can start from."""

    code = "run-state-conflict"
    title = "Run state conflict"

    def __init__(
        self,
        run_id: uuid.UUID,
        detail: str,
        *,
        current: RunStatus | None,
        retryable: bool = False,
    ) -> None:
        super().__init__(detail)
        self.run_id = run_id
        self.current = current
        # True when the caller merely lost a race and may re-read and try again.
        self.retryable = retryable

    def details(self) -> dict[str, Any]:
        return {
            "run_id": str(self.run_id),
            "current_status": self.current.value if self.current else None,
        }


class InvalidTransition(TransitionConflict):
    def __init__(self, run_id: uuid.UUID, src: RunStatus, dst: RunStatus) -> None:
        super().__init__(run_id, f"A {src.value} run cannot become {dst.value}.", current=src)


class LeaseLost(TransitionConflict):
    """The worker's lease expired or was taken over: it must stop touching the run."""

    def __init__(self, run_id: uuid.UUID) -> None:
        super().__init__(run_id, "This worker no longer holds the run's lease.", current=None)


@dataclass(frozen=True)
class Rows:
    """Rows the move's statement writes, only if the run moves: one data-modifying SQL
    statement that reads the CTE ``moved`` (columns ``id``, ``project_id``,
    ``learning_key`` of the run) and takes its own parameters ``$1``, ``$2`` …"""

    sql: str
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Hop:
    """A status the run passes through on its way to the move's destination, with the
    message of its event (a step's rollouts arriving already scored skip ``scoring``
    without hiding it from the event log)."""

    status: RunStatus
    message: str


@dataclass(frozen=True)
class Move:
    """One status change and everything that travels with it.

    ``expected`` narrows the statuses the caller believes the run is in; ``fence`` makes
    the move count only for the worker holding the lease (and ``renew_lease`` extends that
    lease by so many seconds). ``via`` lists statuses passed through first. ``values`` are
    other columns of the run set in the same statement (step, metrics …); ``events`` are
    extra events (``{type, message, data, level?}``) logged after the status events;
    ``rows`` are written with the move. With ``stay`` the run keeps its status (it must be
    ``dst`` already): the same fenced statement records progress and rows, with no status
    event (the last step of a run stays in ``training`` until its final model is saved).
    """

    run_id: uuid.UUID
    dst: RunStatus
    expected: RunStatus | frozenset[RunStatus] | None = None
    fence: Fence | None = None
    via: tuple[Hop, ...] = ()
    message: str | None = None
    error: str | None = None
    data: dict[str, Any] | None = None
    values: dict[str, Any] | None = None
    renew_lease: float | None = None
    events: Sequence[dict[str, Any]] = ()
    rows: Sequence[Rows] = field(default_factory=tuple)
    stay: bool = False

    def __post_init__(self) -> None:
        if self.stay and self.via:
            raise ValueError("a move that keeps its status passes through no other")
        path = [hop.status for hop in self.via] + [self.dst]
        for src, dst in itertools.pairwise(path):
            if not can_transition(src, dst):
                raise ValueError(f"a move through {src.value} cannot go on to {dst.value}")
        unknown = set(self.values or {}) - _SETTABLE
        if unknown:
            raise ValueError(f"not columns a move may set: {sorted(unknown)}")

    @property
    def first(self) -> RunStatus:
        """The status the run moves to from where it is now."""
        return self.via[0].status if self.via else self.dst

    def allowed_sources(self) -> frozenset[RunStatus]:
        allowed = frozenset({self.dst}) if self.stay else sources(self.first)
        if isinstance(self.expected, RunStatus):
            return allowed & {self.expected}
        if self.expected is not None:
            return allowed & self.expected
        return allowed


# Columns a move may set besides those the table implies; everything else about a run is
# written at creation or by its own function (leases, stop flags).
_SETTABLE = frozenset({"step", "epoch", "metrics", "dispatched_at", "failures"})
_MERGED = frozenset({"metrics"})  # jsonb objects: a move merges its keys into them

# The move's events ($4, a JSON array), in order, after the run moved: ``old`` has locked
# its row, as the event writer requires (app/events/service.py).
_EVENTS = insert_events(
    """SELECT moved.id, e.item ->> 'type', e.item ->> 'level',
           coalesce(e.item ->> 'message', moved.src || ' → ' || $2),
           CASE WHEN e.n = 1 AND e.item ->> 'type' = 'status'
                THEN jsonb_build_object('from', moved.src) || (e.item -> 'data')
                ELSE e.item -> 'data' END
      FROM moved, jsonb_array_elements(($4::text)::jsonb) WITH ORDINALITY AS e(item, n)
     ORDER BY e.n"""
)

_STATEMENT = f"""
WITH old AS (
    SELECT id, status FROM runs WHERE id = $1 FOR UPDATE
), moved AS (
    UPDATE runs AS r
       SET status = $2{{sets}}
      FROM old
     WHERE r.id = old.id AND old.status = ANY($3::text[]){{fence}}
    RETURNING r.id, r.project_id, r.learning_key, old.status AS src
), events AS (
    {_EVENTS}
){{rows}}
SELECT src FROM moved
"""

_WHY = "SELECT status, lease_owner, attempt FROM runs WHERE id = $1"

_PARAM = re.compile(r"\$(\d+)")


def json_param(value: Any) -> str:
    """``value`` as a JSON text parameter (cast to jsonb in SQL: the same on any
    connection, whatever JSON codec it has), made storable first."""
    return json.dumps(jsonable(value), separators=(",", ":"), allow_nan=False)


def _shifted(sql: str, offset: int) -> str:
    """``sql`` with its parameters ``$1, $2 …`` renumbered to follow ``offset`` others."""
    return _PARAM.sub(lambda m: f"${int(m.group(1)) + offset}", sql)


def _event_level(status: RunStatus) -> str:
    return "error" if status == S.FAILED else "info"


def compile_move(move: Move) -> tuple[str, list[Any]]:
    """The move as one SQL statement and its parameters (positional, asyncpg style)."""
    args: list[Any] = [
        move.run_id,
        move.dst.value,
        sorted(s.value for s in move.allowed_sources()),
        None,  # $4, the events: filled in below
    ]

    def param(value: Any) -> str:
        args.append(value)
        return f"${len(args)}"

    sets: list[str] = []
    dst = move.dst
    releases = dst in TERMINAL or dst == S.PAUSED
    if not move.stay and dst in WORKING:
        sets.append("started_at = coalesce(r.started_at, now())")
    if not move.stay and dst in TERMINAL:
        sets.append("completed_at = now()")
    if not move.stay and releases:
        sets += ["lease_owner = NULL", "lease_expires_at = NULL", "pause_requested = false"]
    elif move.renew_lease is not None:
        sets.append(f"lease_expires_at = now() + make_interval(secs => {param(move.renew_lease)})")
    if move.error is not None:
        sets.append(f"error = {param(move.error)}")
    for name, value in (move.values or {}).items():
        if name in _MERGED and value is not None:
            # A summary adds to what is there (an evaluation's keys, a warning set when
            # the inputs were split) instead of replacing it.
            merged = f"({param(json_param(value))}::text)::jsonb"
            sets.append(f"{name} = coalesce(r.{name}, '{{}}'::jsonb) || {merged}")
        else:
            sets.append(f"{name} = {param(value)}")

    fence = ""
    if move.fence is not None:
        fence = (
            f" AND r.lease_owner = {param(move.fence.owner)}"
            f" AND r.attempt = {param(move.fence.attempt)}"
        )

    hops: list[tuple[RunStatus, str | None]] = [(hop.status, hop.message) for hop in move.via]
    if not move.stay:
        hops.append((dst, move.message))
    events: list[dict[str, Any]] = []
    previous: RunStatus | None = None
    for status, message in hops:
        data: dict[str, Any] = {"to": status.value}
        if previous is not None:
            data["from"] = previous.value
        if status == dst:
            data.update({**({"error": move.error} if move.error else {}), **(move.data or {})})
        events.append(
            {"type": "status", "level": _event_level(status), "message": message, "data": data}
        )
        previous = status
    events += [{"level": "info", **event} for event in move.events]
    args[3] = json_param(events)

    attachments = list(move.rows)
    if not move.stay and dst in TERMINAL:
        attachments.append(Rows(ENDED_WITH_RUN, (dst.value,)))
    rows = ""
    for i, attached in enumerate(attachments):
        rows += f", rows_{i} AS ({_shifted(attached.sql, len(args))})"
        args.extend(attached.args)

    sql = _STATEMENT.format(
        sets="".join(f",\n           {s}" for s in sets), fence=fence, rows=rows
    )
    return sql, args


async def _fetchrow(db: AsyncSession | asyncpg.Connection, sql: str, args: list[Any]) -> Any:
    if isinstance(db, AsyncSession):
        # The session's own transaction (and SQLAlchemy's bind style): the move commits or
        # rolls back with whatever else the caller does in it.
        # (The space keeps a following ``::type`` cast from reading as part of the name.)
        named = _PARAM.sub(lambda m: f":p{m.group(1)} ", sql)
        result = await db.execute(text(named), {f"p{i}": a for i, a in enumerate(args, 1)})
        return result.first()
    return await db.fetchrow(sql, *args)


async def apply(db: AsyncSession | asyncpg.Connection, move: Move) -> None:
    """Make ``move`` atomically, or raise and change nothing."""
    sql, args = compile_move(move)
    row = await _fetchrow(db, sql, args)
    if row is not None:
        return

    why = await _fetchrow(db, _WHY, [move.run_id])
    if why is None:
        # To a worker, a run that is gone is a lease it no longer holds.
        raise LeaseLost(move.run_id) if move.fence is not None else RunNotFound()
    current = RunStatus(why[0])
    if move.fence is not None and (why[1], why[2]) != (move.fence.owner, move.fence.attempt):
        raise LeaseLost(move.run_id)
    expected = {move.expected} if isinstance(move.expected, RunStatus) else move.expected
    if expected is not None and current not in expected:
        raise TransitionConflict(
            move.run_id,
            f"Run is {current.value}, not {', '.join(sorted(expected))}.",
            current=current,
        )
    if move.stay and current != move.dst:
        raise TransitionConflict(
            move.run_id, f"Run is {current.value}, not {move.dst.value}.", current=current
        )
    if not move.stay and not can_transition(current, move.first):
        raise InvalidTransition(move.run_id, current, move.first)
    raise TransitionConflict(
        move.run_id,
        "The run changed while this request was being handled; fetch it and retry.",
        current=current,
        retryable=True,
    )


async def transition(
    session: AsyncSession,
    run_id: uuid.UUID,
    dst: RunStatus,
    *,
    expected: RunStatus | frozenset[RunStatus] | None = None,
    fence: Fence | None = None,
    message: str | None = None,
    error: str | None = None,
    data: dict[str, Any] | None = None,
    values: dict[str, Any] | None = None,
) -> Run:
    """Apply a move in ``session``'s transaction and return the run as it now is."""
    await apply(
        session,
        Move(
            run_id,
            dst,
            expected=expected,
            fence=fence,
            message=message,
            error=error,
            data=data,
            values=values,
        ),
    )
    run = await session.get(Run, run_id, populate_existing=True)
    assert run is not None  # the move just locked and changed it
    return run
