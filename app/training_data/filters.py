"""What a training-data query asks for, checked once, and the SQL ``WHERE`` it becomes.

The library functions and the REST endpoints build the same :class:`Filters`, so a filter
means the same thing wherever it is used. Bad arguments raise :class:`TrainingDataError`
naming the argument; the API turns that into a 422 naming the query parameter.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Any, Literal

from app.core.sql import Where
from app.core.time import as_utc
from app.runs.lifecycle.status import RunStatus

Order = Literal["newest", "oldest"]
ORDERS: tuple[Order, ...] = ("newest", "oldest")
MAX_LIST_VALUES = 1000  # ids, keys, steps or projects in one filter
MAX_KEY_CHARS = 200


class TrainingDataError(ValueError):
    """A training-data argument that cannot be used; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class EmptyRangeError(TrainingDataError):
    """A range whose lower end is above its upper end (``min_reward`` > ``max_reward``)."""


@dataclass(frozen=True, slots=True)
class Filters:
    """Every filter of a trajectory (or run) query; ``None`` means "any"."""

    min_reward: float | None = None
    max_reward: float | None = None
    projects: tuple[str, ...] | None = None  # names or ids
    project_ids: tuple[uuid.UUID, ...] | None = None  # resolved (the API sets these directly)
    run_ids: tuple[uuid.UUID, ...] | None = None
    learning_keys: tuple[str, ...] | None = None
    statuses: tuple[RunStatus, ...] | None = None
    start_date: datetime | None = None
    end_date: datetime | None = None  # inclusive
    steps: tuple[int, ...] | range | None = None
    min_tool_calls: int | None = None  # episodes with at least this many (metadata.tool_calls)

    @classmethod
    def build(
        cls,
        *,
        min_reward: float | None = None,
        max_reward: float | None = None,
        projects: str | Iterable[str | uuid.UUID] | None = None,
        project_ids: Iterable[uuid.UUID] | None = None,
        run_ids: str | uuid.UUID | Iterable[str | uuid.UUID] | None = None,
        learning_key: str | Iterable[str] | None = None,
        statuses: str | Iterable[str] | None = None,
        start_date: datetime | date | None = None,
        end_date: datetime | date | None = None,
        steps: int | Iterable[int] | None = None,
        min_tool_calls: int | None = None,
    ) -> Filters:
        """Check and normalise the public arguments (see the module's functions)."""
        lo = _reward("min_reward", min_reward)
        hi = _reward("max_reward", max_reward)
        if lo is not None and hi is not None and lo > hi:
            raise EmptyRangeError("min_reward", f"{lo} exceeds max_reward {hi}")
        start = _instant("start_date", start_date, end_of_day=False)
        end = _instant("end_date", end_date, end_of_day=True)
        if start is not None and end is not None and start > end:
            raise EmptyRangeError("start_date", "is after end_date")
        return cls(
            min_reward=lo,
            max_reward=hi,
            projects=_strings("projects", projects),
            project_ids=_values("project_ids", project_ids, _uuid),
            run_ids=_values("run_ids", run_ids, _uuid),
            learning_keys=_strings("learning_key", learning_key),
            statuses=_values("statuses", statuses, _status),
            start_date=start,
            end_date=end,
            steps=_steps(steps),
            min_tool_calls=_count("min_tool_calls", min_tool_calls),
        )


def _reward(field: str, value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TrainingDataError(field, f"must be a number, not {type(value).__name__}")
    if not math.isfinite(value):
        raise TrainingDataError(field, "must be a finite number")
    return float(value)


MAX_COUNT = 2**31 - 1  # what an int4 parameter holds


def _count(field: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TrainingDataError(field, f"must be an integer, not {type(value).__name__}")
    if not 0 <= value <= MAX_COUNT:
        raise TrainingDataError(field, f"must be from 0 to {MAX_COUNT}")
    return value


def _instant(field: str, value: datetime | date | None, *, end_of_day: bool) -> datetime | None:
    """An aware datetime in UTC. A naive one is UTC, as everywhere in Trainyard (the API's
    query parameters too); a ``date`` starts at its midnight (UTC) and, as an end, lasts
    through its last microsecond."""
    if value is None:
        return None
    if isinstance(value, datetime):
        return as_utc(value)
    if isinstance(value, date):
        start = datetime.combine(value, time(), tzinfo=UTC)
        return start + timedelta(days=1, microseconds=-1) if end_of_day else start
    raise TrainingDataError(field, f"must be a datetime or date, not {type(value).__name__}")


def _values(field: str, value: Any, convert: Any) -> tuple[Any, ...] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, str | uuid.UUID) else list(value)
    if not items:
        raise TrainingDataError(field, "is empty; pass None for no filter")
    if len(items) > MAX_LIST_VALUES:
        raise TrainingDataError(field, f"has {len(items)} values; at most {MAX_LIST_VALUES}")
    out = []
    for item in items:
        try:
            out.append(convert(item))
        except (TypeError, ValueError, AttributeError) as exc:
            raise TrainingDataError(field, f"{item!r} is not valid: {exc}") from exc
    return tuple(dict.fromkeys(out))


def _uuid(value: str | uuid.UUID) -> uuid.UUID:
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))


def _status(value: str) -> RunStatus:
    try:
        return RunStatus(value)
    except ValueError:
        allowed = ", ".join(s.value for s in RunStatus)
        raise ValueError(f"not a run status (one of {allowed})") from None


def _string(value: str | uuid.UUID) -> str:
    text = str(value) if isinstance(value, uuid.UUID) else value
    if not isinstance(text, str) or not text or len(text) > MAX_KEY_CHARS or "\x00" in text:
        raise ValueError(f"must be a non-empty string of at most {MAX_KEY_CHARS} characters")
    return text


def _strings(field: str, value: Any) -> tuple[str, ...] | None:
    return _values(field, value, _string)


def _steps(value: int | Iterable[int] | None) -> tuple[int, ...] | range | None:
    if isinstance(value, range):
        if value.step != 1 or value.start < 0 or len(value) == 0:
            raise TrainingDataError("steps", "a range must be non-empty, from 0 up, by 1")
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]

    def step(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError("steps are integers from 0")
        return int(v)

    return _values("steps", value, step)


def tool_calls_sql(alias: str) -> str:
    """How many tool calls the trajectory ``alias`` made, as SQL: what the workers store in
    an episode's metadata. A row without it (a single turn, an import) or with something
    else there made none. CASE, not AND: the cast is never tried on a value that is no
    number."""
    calls = f"{alias}.metadata->'tool_calls'"
    return f"CASE WHEN jsonb_typeof({calls}) = 'number' THEN ({calls})::numeric ELSE 0 END"


def trajectory_where(f: Filters, project_ids: Sequence[uuid.UUID] | None) -> Where:
    """The filters on ``trajectories AS t`` (``project_ids`` already resolved)."""
    w = Where()
    if project_ids is not None:
        w.among("t.project_id", project_ids, "uuid")
    if f.learning_keys is not None:
        w.among("t.learning_key", f.learning_keys, "text")
    if f.run_ids is not None:
        w.among("t.run_id", f.run_ids, "uuid")
    if f.statuses is not None:
        statuses = [s.value for s in f.statuses]
        w.add(f"t.run_id IN (SELECT id FROM runs WHERE status = ANY({w.param(statuses)}::text[]))")
    if f.min_reward is not None:
        w.add(f"t.reward >= {w.param(f.min_reward)}")
    if f.max_reward is not None:
        w.add(f"t.reward <= {w.param(f.max_reward)}")
    _dates(w, "t.created_at", f)
    if isinstance(f.steps, range):
        w.add(f"t.step BETWEEN {w.param(f.steps.start)} AND {w.param(f.steps.stop - 1)}")
    elif f.steps is not None:
        w.among("t.step", f.steps, "int")
    if f.min_tool_calls is not None:
        w.add(f"{tool_calls_sql('t')} >= {w.param(f.min_tool_calls)}::int")
    return w


def run_where(f: Filters, project_ids: Sequence[uuid.UUID] | None) -> Where:
    """The filters on ``runs AS r`` (reward, step and tool-call filters do not apply to
    runs)."""
    w = Where()
    if project_ids is not None:
        w.among("r.project_id", project_ids, "uuid")
    if f.learning_keys is not None:
        w.among("r.learning_key", f.learning_keys, "text")
    if f.run_ids is not None:
        w.among("r.id", f.run_ids, "uuid")
    if f.statuses is not None:
        w.among("r.status", [s.value for s in f.statuses], "text")
    _dates(w, "r.created_at", f)
    return w


def _dates(w: Where, column: str, f: Filters) -> None:
    if f.start_date is not None:
        w.add(f"{column} >= {w.param(f.start_date)}")
    if f.end_date is not None:
        w.add(f"{column} <= {w.param(f.end_date)}")


def check_order(order: str) -> Order:
    if order not in ORDERS:
        raise TrainingDataError("order", f"must be one of {', '.join(ORDERS)}")
    return order


def check_limit(field: str, limit: int | None, *, allow_none: bool = True) -> int | None:
    if limit is None and allow_none:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise TrainingDataError(field, "must be a positive integer")
    return limit
