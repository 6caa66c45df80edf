"""Cursor pagination: ``?limit=&after=`` → ``{data, has_more, next_cursor}``.

A cursor is the keyset position of the last row served (base64url JSON of its order
columns), so page 10,000 costs what page 1 costs and rows inserted meanwhile neither shift
nor repeat a page.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, Generic, TypeVar

from fastapi import Depends, Query, Request
from pydantic import BaseModel

from app.core.columns import INT32_MAX, INT64_MAX
from app.core.errors import INVALID_CURSOR, Problem
from app.core.settings import app_settings

T = TypeVar("T")


class Page(BaseModel, Generic[T]):
    data: list[T]
    has_more: bool
    next_cursor: str | None = None


def encode_cursor(values: Sequence[Any]) -> str:
    raw = json.dumps(list(values), separators=(",", ":"), default=str).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _cursor_int(value: Any, maximum: int) -> int:
    if type(value) is not int or not -maximum - 1 <= value <= maximum:
        raise ValueError("not an integer of the column's range")
    return value


def cursor_int32(value: Any) -> int:
    """A cursor position on an ``integer`` column (``int`` means ``bigint``)."""
    return _cursor_int(value, INT32_MAX)


def _cursor_int64(value: Any) -> int:
    return _cursor_int(value, INT64_MAX)


def _cursor_instant(value: Any) -> datetime:
    if not isinstance(value, str):
        raise TypeError("not an ISO 8601 string")
    instant = datetime.fromisoformat(value)
    if instant.tzinfo is None:
        instant = instant.replace(tzinfo=UTC)
    try:
        instant.astimezone(UTC)  # what the driver sends: it must exist in UTC too
    except OverflowError as exc:
        raise ValueError("out of range") from exc
    return instant


def _cursor_uuid(value: Any) -> uuid.UUID:
    if not isinstance(value, str):
        raise TypeError("not a UUID string")
    return uuid.UUID(value)


# The converters callers name, made strict: a cursor is client input like any other, and a
# value the database cannot take (an int beyond bigint, a year-0 timestamp) must be a 422
# here, not a driver error later.
_STRICT: dict[Any, Callable[[Any], Any]] = {
    int: _cursor_int64,
    datetime.fromisoformat: _cursor_instant,
    uuid.UUID: _cursor_uuid,
}


def decode_cursor(cursor: str, *types: Callable[[Any], Any]) -> list[Any]:
    """The values of ``cursor``, each converted by the matching ``types`` entry (``int``,
    :func:`cursor_int32`, ``datetime.fromisoformat``, ``uuid.UUID`` …); 422 naming
    ``query.after`` when the cursor is not one this list handed out."""
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        values = json.loads(base64.urlsafe_b64decode(padded.encode()))
        if not isinstance(values, list) or len(values) != len(types):
            raise ValueError("wrong arity")
        return [
            _STRICT.get(convert, convert)(value)
            for convert, value in zip(types, values, strict=True)
        ]
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError, RecursionError) as exc:
        raise Problem(
            422,
            "Invalid cursor",
            "Not a cursor of this list.",
            field="query.after",
            error_type=INVALID_CURSOR,
        ) from exc


class PageParams(BaseModel):
    limit: int
    after: str | None


# The page size cap is a setting, so the document can state it only once the app knows it:
# app.core.openapi replaces this marker with ``maximum: max_page_size``.
PAGE_SIZE_CAP = "x-trainyard-max-page-size"


def page_params(
    request: Request,
    limit: Annotated[
        int | None,
        Query(
            ge=1,
            description="Page size; capped by the server (`TRAINYARD_MAX_PAGE_SIZE`).",
            json_schema_extra={PAGE_SIZE_CAP: True},
        ),
    ] = None,
    after: Annotated[
        str | None,
        Query(max_length=512, description="`next_cursor` of the previous page."),
    ] = None,
) -> PageParams:
    settings = app_settings(request)
    if limit is not None and limit > settings.max_page_size:
        raise Problem(
            422,
            "Page size too large",
            f"limit must be at most {settings.max_page_size}.",
            field="query.limit",
        )
    return PageParams(limit=limit or settings.default_page_size, after=after)


Paging = Annotated[PageParams, Depends(page_params)]


def make_page(rows: Sequence[Any], limit: int, key: Any, convert: Any) -> dict[str, Any]:
    """Build a page from ``limit + 1`` fetched rows; ``key(row)`` gives the cursor values."""
    has_more = len(rows) > limit
    rows = rows[:limit]
    return {
        "data": [convert(r) for r in rows],
        "has_more": has_more,
        "next_cursor": encode_cursor(key(rows[-1])) if has_more and rows else None,
    }
