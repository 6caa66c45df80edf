"""Routers parse, call a service and shape the answer: no router runs a query or commits
(the session dependency commits at the edge, app/core/deps.py)."""

from __future__ import annotations

import re

import pytest

from tests.support import ROOT

ROUTERS = sorted((ROOT / "app").glob("*/router.py"))

# A statement run or committed, or the builders of one.
_QUERYING = re.compile(
    r"\.(execute|executemany|fetch|fetchrow|fetchval|scalar|scalars|commit|copy_records_to_table)\("
    r"|^from (sqlalchemy|sqlmodel)\b|^import asyncpg\b|\b(SELECT|INSERT|UPDATE|DELETE)\s",
    re.MULTILINE,
)


@pytest.mark.parametrize("router", ROUTERS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_router_queries_the_database(router) -> None:
    found = [m.group(0) for m in _QUERYING.finditer(router.read_text())]
    assert not found, found


def test_the_check_sees_a_query() -> None:
    assert _QUERYING.search("    rows = await session.execute(select(Run))\n")
    assert _QUERYING.search("from sqlalchemy import select\n")
    assert not _QUERYING.search("    run = await service.fetch_run(conn, project_id, run_id)\n")
