"""A datetime without a zone is UTC everywhere: in the API's query parameters, in the
training-data library and in the CLI, whatever the machine's local zone is (it used to be
local time in the library and the CLI)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta

import pytest
from pydantic import TypeAdapter

from app.core.time import DayOrInstant, Instant, as_utc, parse_day_or_instant
from app.training_data.filters import Filters

NOON_UTC = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def far_from_utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A local zone 10 hours off UTC, so local time and UTC cannot be confused."""
    monkeypatch.setenv("TZ", "Pacific/Honolulu")
    time.tzset()
    assert datetime(2026, 6, 1, 12).astimezone().utcoffset() == timedelta(hours=-10)
    try:
        yield
    finally:
        monkeypatch.undo()
        time.tzset()


@pytest.mark.usefixtures("far_from_utc")
def test_a_naive_datetime_is_utc_in_the_api_the_library_and_the_cli() -> None:
    naive = datetime(2026, 6, 1, 12, 0)
    assert as_utc(naive) == NOON_UTC and as_utc(naive).utcoffset() == timedelta(0)

    # The API's query parameters.
    assert TypeAdapter(Instant).validate_python("2026-06-01T12:00") == NOON_UTC
    assert TypeAdapter(DayOrInstant).validate_python("2026-06-01T12:00") == NOON_UTC

    # The library.
    built = Filters.build(start_date=naive, end_date=naive)
    assert built.start_date == NOON_UTC and built.end_date == NOON_UTC
    assert built.start_date is not None and built.start_date.utcoffset() == timedelta(0)

    # The CLI (`trainyard data export --since/--until`).
    assert parse_day_or_instant("2026-06-01T12:00") == NOON_UTC
    assert parse_day_or_instant("2026-06-01 12:00") == NOON_UTC


@pytest.mark.usefixtures("far_from_utc")
def test_zones_and_days_keep_their_meaning() -> None:
    assert parse_day_or_instant("2026-06-01T14:00+02:00") == NOON_UTC
    assert Filters.build(start_date=datetime(2026, 6, 1, 2, tzinfo=UTC)).start_date == datetime(
        2026, 6, 1, 2, tzinfo=UTC
    )
    day = parse_day_or_instant("2026-06-01")
    assert day == date(2026, 6, 1) and not isinstance(day, datetime)
    whole = Filters.build(start_date=day, end_date=day)
    assert whole.start_date == datetime(2026, 6, 1, tzinfo=UTC)
    assert whole.end_date == datetime(2026, 6, 2, tzinfo=UTC) - timedelta(microseconds=1)
    with pytest.raises(ValueError, match="ISO 8601"):
        parse_day_or_instant("1714000000")
