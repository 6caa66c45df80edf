import re
from datetime import UTC, date, datetime
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, WithJsonSchema

EARLIEST = datetime.min.replace(tzinfo=UTC)
LATEST = datetime.max.replace(tzinfo=UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(value: datetime) -> datetime:
    """``value`` in UTC; a naive one is UTC already. The API, the training-data library and
    the CLI all read a time without a zone through this one function, so it means the same
    everywhere. An instant Python cannot hold in UTC (``0001-01-01T00:00+05:00`` is in year
    0 there) is clamped to the first or last one it can: every stored timestamp is inside
    those, so as a bound it means the same, and the database driver, which converts to UTC,
    would otherwise fail the request."""
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    try:
        return value.astimezone(UTC)
    except OverflowError:
        return EARLIEST if value.year == 1 else LATEST


# ISO 8601 text, the zone optional: pydantic alone would also take "0.5" or "1714000000" for
# Unix time, which the document (format: date-time) does not allow.
_ISO_DATETIME = re.compile(
    r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?([Zz]|[+-]\d{2}(:?\d{2})?)?$"
)
_ISO_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_EXAMPLE = "such as 2024-05-01T12:00:00Z"


def _instant_text(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    if not _ISO_DATETIME.match(value):
        raise ValueError(f"must be an ISO 8601 date and time, {_EXAMPLE}")
    return datetime.fromisoformat(value)


def _day_or_instant_text(value: Any) -> Any:
    if isinstance(value, str) and _ISO_DATE.match(value):
        return date.fromisoformat(value)
    if isinstance(value, str) and not _ISO_DATETIME.match(value):
        raise ValueError(f"must be an ISO 8601 date, or date and time {_EXAMPLE}")
    return _instant_text(value)


def _utc_if_instant(value: date) -> date:
    return as_utc(value) if isinstance(value, datetime) else value


def parse_day_or_instant(text: str) -> date | datetime:
    """``2024-05-01`` as that day, or an ISO 8601 date and time in UTC (no zone: UTC), as
    the API's :data:`DayOrInstant` reads it; ``ValueError`` saying what is expected."""
    return _utc_if_instant(_day_or_instant_text(text))


# A datetime query parameter: ISO 8601 text only, in UTC (no zone: UTC already).
Instant = Annotated[datetime, BeforeValidator(_instant_text), AfterValidator(as_utc)]
# The same, or a whole day (``2024-05-01``), which the caller reads as its first or last
# instant.
DayOrInstant = Annotated[
    datetime | date,
    BeforeValidator(_day_or_instant_text),
    AfterValidator(_utc_if_instant),
    WithJsonSchema(
        {"anyOf": [{"type": "string", "format": "date-time"}, {"type": "string", "format": "date"}]}
    ),
]
