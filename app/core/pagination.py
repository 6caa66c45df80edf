"""Cursor pagination: ``?limit=&after=`` → ``{data, has_more, next_cursor}``.

A cursor is the keyset position of the last row served (base64url JSON of its order
columns), so page 10,000 costs what page 1 costs and rows inserted meanwhile neither shift
nor repeat a page.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Generic, TypeVar

from fastapi import Depends, Query, Request
from pydantic import BaseModel

from app.core.errors import Problem
from app.core.settings import app_settings

T = TypeVar("T")


class Page(BaseModel, Generic[T]):
    data: list[T]
    has_more: bool
    next_cursor: str | None = None


def encode_cursor(values: Sequence[Any]) -> str:
    raw = json.dumps(list(values), separators=(",", ":"), default=str).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def decode_cursor(cursor: str, *types: Callable[[Any], Any]) -> list[Any]:
    """The values of ``cursor``, each converted by the matching ``types`` entry; 422 naming
    ``query.after`` when the cursor is not one this list handed out."""
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        values = json.loads(base64.urlsafe_b64decode(padded.encode()))
        if not isinstance(values, list) or len(values) != len(types):
            raise ValueError("wrong arity")
        return [convert(value) for convert, value in zip(types, values, strict=True)]
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError) as exc:
        raise Problem(
            422, "Invalid cursor", "Not a cursor of this list.", field="query.after"
        ) from exc


class PageParams(BaseModel):
    limit: int
    after: str | None


def page_params(
    request: Request,
    limit: Annotated[
        int | None, Query(ge=1, description="Page size; capped by the server.")
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
