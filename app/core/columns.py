"""Column helpers: every table stores UTC timestamps and JSONB the same way."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Column, DateTime, func, text
from sqlalchemy.dialects.postgresql import JSONB

# The largest values of PostgreSQL's integer and bigint: a query parameter compared with such
# a column must fit it, or the driver refuses the statement (a 500, not a 422).
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def timestamp(*, nullable: bool = False, default_now: bool = True, index: bool = False) -> Any:
    return Column(
        DateTime(timezone=True),
        nullable=nullable,
        server_default=func.now() if default_now else None,
        index=index,
    )


def jsonb(*, nullable: bool = False, default: str | None = "{}", name: str | None = None) -> Any:
    return Column(
        JSONB,
        name=name or None,
        nullable=nullable,
        server_default=text(f"'{default}'::jsonb") if default is not None else None,
    )
