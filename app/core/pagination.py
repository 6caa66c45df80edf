"""Cursor pagination: ``?limit=&after=`` → ``{data, has_more, next_cursor}``, and the rules
every list's query parameters follow.

A cursor is the keyset position of the last row served (base64url JSON of its order
columns), so page 10,000 costs what page 1 costs and rows inserted meanwhile neither shift
nor repeat a page. It also names the list it came from and a digest of that list's scope
(the parent resource and the filters that shape the order), so a cursor of one list given
to another, or to the same list under other filters, is a 422 ``invalid_cursor`` instead of
a page positioned by the wrong columns.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, Generic, TypeVar

from fastapi import Depends, Query, Request, Response
from pydantic import BaseModel, ConfigDict

from app.core.columns import INT32_MAX, INT64_MAX
from app.core.errors import INCONSISTENT, INVALID_CURSOR, Problem
from app.core.settings import app_settings

T = TypeVar("T")


class Page(BaseModel, Generic[T]):
    # next_cursor is always in the answer (null on the last page): documented as required.
    model_config = ConfigDict(json_schema_serialization_defaults_required=True)

    data: list[T]
    has_more: bool
    next_cursor: str | None = None


def _scope_digest(scope: Sequence[Any]) -> str:
    # Short: it only has to tell scopes apart, not resist forgery (a forged cursor is still
    # checked value by value, and positions nothing outside the caller's project). str() of
    # each part rather than a JSON encoder: every events page of every poller runs this.
    raw = "\x1f".join(map(str, scope))
    return hashlib.blake2b(raw.encode(), digest_size=6).hexdigest()


def encode_cursor(values: Sequence[Any], *, of: str, scope: Sequence[Any] = ()) -> str:
    """The cursor of keyset position ``values`` in list ``of`` (an operation's name) under
    ``scope`` (its parent id and the filters it was asked with)."""
    payload = [of, _scope_digest(scope), *values]
    raw = json.dumps(payload, separators=(",", ":"), default=str).encode()
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


def decode_cursor(
    cursor: str, *types: Callable[[Any], Any], of: str, scope: Sequence[Any] = ()
) -> list[Any]:
    """The values of ``cursor``, each converted by the matching ``types`` entry (``int``,
    :func:`cursor_int32`, ``datetime.fromisoformat``, ``uuid.UUID`` …); 422 naming
    ``query.after`` when the cursor is not one list ``of`` handed out under ``scope``."""
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        payload = json.loads(base64.urlsafe_b64decode(padded.encode()))
        if not isinstance(payload, list) or len(payload) != len(types) + 2:
            raise ValueError("wrong arity")
        name, digest, *values = payload
        if name != of or digest != _scope_digest(scope):
            raise ValueError("a cursor of another list or of other filters")
        return [
            _STRICT.get(convert, convert)(value)
            for convert, value in zip(types, values, strict=True)
        ]
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError, RecursionError) as exc:
        raise Problem(
            422,
            "Invalid cursor",
            "Not a cursor of this list with these filters.",
            field="query.after",
            error_type=INVALID_CURSOR,
        ) from exc


class PageParams(BaseModel):
    limit: int
    after: str | None


# The page size cap is a setting, so the document can state it only once the app knows it:
# app.core.openapi replaces this marker with ``maximum: max_page_size``.
PAGE_SIZE_CAP = "x-trainyard-max-page-size"


def cursor_query(description: str) -> Any:
    """The ``after`` parameter of a list: what every cursor is made of (base64url) is said
    in the document too, so with the length cap the longest ``after`` is 512 bytes of URL."""
    return Query(max_length=512, pattern=r"^[A-Za-z0-9_-]*$", description=description)


After = Annotated[
    str | None,
    cursor_query(
        "`next_cursor` of the previous page (opaque; bound to this list and these filters)."
    ),
]


async def page_params(
    request: Request,
    limit: Annotated[
        int | None,
        Query(
            ge=1,
            description="Page size; capped by the server (`TRAINYARD_MAX_PAGE_SIZE`).",
            json_schema_extra={PAGE_SIZE_CAP: True},
        ),
    ] = None,
    after: After = None,
) -> PageParams:
    settings = app_settings(request)
    if limit is not None and limit > settings.max_page_size:
        raise Problem(
            422,
            "Page size too large",
            f"limit must be at most {settings.max_page_size}.",
            field="query.limit",
            # pydantic's type for a `maximum` exceeded: the document states the cap.
            error_type="less_than_equal",
        )
    return PageParams(limit=limit or settings.default_page_size, after=after)


Paging = Annotated[PageParams, Depends(page_params)]


def make_page(
    rows: Sequence[Any],
    limit: int,
    key: Any,
    convert: Any,
    *,
    of: str,
    scope: Sequence[Any] = (),
) -> dict[str, Any]:
    """Build a page from ``limit + 1`` fetched rows; ``key(row)`` gives the cursor values,
    ``of`` and ``scope`` what :func:`decode_cursor` is then called with."""
    has_more = len(rows) > limit
    rows = rows[:limit]
    return {
        "data": [convert(r) for r in rows],
        "has_more": has_more,
        "next_cursor": encode_cursor(key(rows[-1]), of=of, scope=scope)
        if has_more and rows
        else None,
    }


def rendered_page(data: str, has_more: bool, next_cursor: str | None) -> Response:
    """A page (:class:`Page`) whose ``data`` PostgreSQL rendered as a JSON array of items in
    the shape of the response model (:func:`app.core.sql.json_object`); served as it is,
    with no Python object per row, as the pollers' routes need (docs/benchmarks.md)."""
    body = (
        f'{{"data":{data},"has_more":{json.dumps(has_more)},'
        f'"next_cursor":{json.dumps(next_cursor)}}}'
    )
    return Response(body, media_type="application/json")


def range_problem(field: str, detail: str) -> Problem:
    """The 422 of a range whose lower end is above its upper end, named by the lower end."""
    return Problem(422, "Inconsistent range", detail, field=field, error_type=INCONSISTENT)


def check_range(low_name: str, low: Any, high_name: str, high: Any) -> None:
    """Refuse an inverted range (``low > high``) of two query parameters: each is valid
    alone, but together they ask for nothing, which is a mistake to say rather than an
    empty page to serve. Equal ends are a point (or, half-open, an empty) range, not an
    error."""
    if low is not None and high is not None and low > high:
        raise range_problem(f"query.{low_name}", f"{low_name} exceeds {high_name}.")
