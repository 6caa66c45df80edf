"""``/trajectories``: the training-data queries over HTTP, scoped to the caller's project."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any

import httpx
import pytest

from tests.support.training_data import BASE, Corpus


def _headers(corpus: Corpus, project: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {corpus.keys[project]}"}


async def _walk(client: httpx.AsyncClient, headers: dict[str, str], **params: Any) -> list[str]:
    ids: list[str] = []
    after = None
    while True:
        query = {**params, **({"after": after} if after else {})}
        r = await client.get("/trajectories", params=query, headers=headers)
        assert r.status_code == 200, r.text
        page = r.json()
        ids += [t["id"] for t in page["data"]]
        if not page["has_more"]:
            assert page["next_cursor"] is None
            return ids
        after = page["next_cursor"]


async def test_list_pages_through_the_projects_rows_only(
    client: httpx.AsyncClient, corpus: Corpus
) -> None:
    a = _headers(corpus, "a")
    ids = await _walk(client, a, limit=7, min_reward=0.3)
    assert ids == [str(i) for i in corpus.expected(projects=["a"], min_reward=0.3)]
    oldest = await _walk(client, a, limit=50, order="oldest")
    assert oldest == [str(i) for i in corpus.expected(projects=["a"], order="oldest")]
    b_ids = await _walk(client, _headers(corpus, "b"), limit=100)
    assert b_ids == [str(i) for i in corpus.expected(projects=["b"])]


async def test_filters_combine(client: httpx.AsyncClient, corpus: Corpus) -> None:
    a1, a3 = corpus.runs["a1"], corpus.runs["a3"]
    params = [
        ("run_id", str(a1["id"])),
        ("run_id", str(a3["id"])),
        ("status", "completed"),
        ("step", "0"),
        ("step", "2"),
        ("min_reward", "0.1"),
        ("max_reward", "0.9"),
        ("start_date", (BASE + timedelta(days=1)).isoformat()),
        ("end_date", (BASE + timedelta(days=20)).replace(tzinfo=None).isoformat()),
        ("learning_key", a1["learning_key"]),
        ("learning_key", a3["learning_key"]),
        ("limit", "100"),
    ]
    r = await client.get("/trajectories", params=params, headers=_headers(corpus, "a"))
    assert r.status_code == 200, r.text
    expected = corpus.expected(
        projects=["a"],
        run_ids=[a1["id"], a3["id"]],
        statuses=["completed"],
        steps=[0, 2],
        min_reward=0.1,
        max_reward=0.9,
        start_date=BASE + timedelta(days=1),
        end_date=BASE + timedelta(days=20),
        learning_key=[a1["learning_key"], a3["learning_key"]],
    )
    assert expected and [t["id"] for t in r.json()["data"]] == [str(i) for i in expected]
    count = await client.get(
        "/trajectories/count", params=params[:-1], headers=_headers(corpus, "a")
    )
    assert count.json() == {"count": len(expected)}


async def test_selective_loading_and_one_by_id(client: httpx.AsyncClient, corpus: Corpus) -> None:
    a = _headers(corpus, "a")
    lean = await client.get(
        "/trajectories",
        params={"limit": 3, "include_messages": "false", "include_metadata": "false"},
        headers=a,
    )
    rows = lean.json()["data"]
    assert all(t["messages"] is None and t["metadata"] is None for t in rows)
    full = await client.get(f"/trajectories/{rows[0]['id']}", headers=a)
    assert full.status_code == 200
    body = full.json()
    assert body["messages"][-1]["role"] == "assistant"
    assert body["project_id"] == str(corpus.projects["a"])
    assert body["metadata"] == {"engine": "transformers"}


async def test_other_projects_rows_are_not_found(client: httpx.AsyncClient, corpus: Corpus) -> None:
    b_row = next(r for r in corpus.rows if r["project_id"] == corpus.projects["b"])
    a = _headers(corpus, "a")
    for path in (f"/trajectories/{b_row['id']}", f"/trajectories/{uuid.uuid4()}"):
        r = await client.get(path, headers=a)
        assert r.status_code == 404
        assert r.headers["content-type"] == "application/problem+json"
    # Naming another project's run filters to nothing rather than leaking its rows.
    r = await client.get("/trajectories", params={"run_id": str(b_row["run_id"])}, headers=a)
    assert r.json()["data"] == []
    r = await client.get("/trajectories/export", params={"run_id": str(b_row["run_id"])}, headers=a)
    assert r.status_code == 200 and r.text == ""
    for path in ("/trajectories", "/trajectories/count", "/trajectories/export"):
        assert (await client.get(path)).status_code == 401


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"min_reward": "0.9", "max_reward": "0.1"}, "query.min_reward"),
        ({"min_reward": "nan"}, "query.min_reward"),
        ({"min_reward": "high"}, "query.min_reward"),
        ({"run_id": "nope"}, "query.run_id"),
        ({"status": "done"}, "query.status"),
        ({"step": "-1"}, "query.step"),
        ({"start_date": "yesterday"}, "query.start_date"),
        ({"start_date": "2026-02-01T00:00:00Z", "end_date": "2026-01-01"}, "query.start_date"),
        ({"learning_key": "k" * 201}, "query.learning_key"),
        ({"order": "random"}, "query.order"),
        ({"limit": "100000"}, "query.limit"),
        ({"after": "garbage"}, "query.after"),
    ],
)
async def test_bad_filters_are_422_naming_the_parameter(
    client: httpx.AsyncClient, corpus: Corpus, params: dict[str, str], field: str
) -> None:
    r = await client.get("/trajectories", params=params, headers=_headers(corpus, "a"))
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/problem+json"
    body = r.json()
    fields = [e["field"] for e in body.get("errors") or []] + [body.get("field")]
    assert any(f and (f == field or f.startswith(f"{field}[")) for f in fields), body
    # Every item says why, for programs (the page-size cap had no type).
    assert all(e.get("type") for e in body["errors"]), body


async def test_a_cursor_is_bound_to_the_filters_and_order_it_was_given_under(
    client: httpx.AsyncClient, corpus: Corpus
) -> None:
    """The keyset position of one order or filter set would silently skip or repeat rows
    in another: a 422 `invalid_cursor` instead."""
    a = _headers(corpus, "a")
    r = await client.get("/trajectories", params={"limit": 2, "min_reward": 0.3}, headers=a)
    cursor = r.json()["next_cursor"]
    assert cursor
    for params in (
        {"min_reward": 0.4},
        {"min_reward": 0.3, "order": "oldest"},
        {},
    ):
        r = await client.get("/trajectories", params={**params, "after": cursor}, headers=a)
        assert r.status_code == 422, (params, r.text)
        assert [(e["field"], e["type"]) for e in r.json()["errors"]] == [
            ("query.after", "invalid_cursor")
        ]
    # What is included is not part of the position: the page still follows.
    r = await client.get(
        "/trajectories",
        params={"min_reward": 0.3, "include_messages": "false", "after": cursor},
        headers=a,
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("name", "most"), [("run_id", 100), ("learning_key", 10), ("step", 200)])
async def test_list_filters_take_what_fits_in_a_url(
    client: httpx.AsyncClient, corpus: Corpus, name: str, most: int
) -> None:
    """Over HTTP the list filters take fewer values than the library's 1,000, so the longest
    URL the document allows is one the server reads (tests/api/test_url_limits.py)."""
    value = {"run_id": str(uuid.uuid4()), "learning_key": "k", "step": "1"}[name]
    a = _headers(corpus, "a")
    r = await client.get("/trajectories/count", params={name: [value] * most}, headers=a)
    assert r.status_code == 200, r.text
    r = await client.get("/trajectories/count", params={name: [value] * (most + 1)}, headers=a)
    assert r.status_code == 422, r.text
    assert [(e["field"], e["type"]) for e in r.json()["errors"]] == [(f"query.{name}", "too_long")]


async def test_export_streams_json_lines(client: httpx.AsyncClient, corpus: Corpus) -> None:
    a = _headers(corpus, "a")
    async with client.stream(
        "GET", "/trajectories/export", params={"format": "jsonl", "min_reward": 0.2}, headers=a
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        assert "attachment" in r.headers["content-disposition"]
        lines = [json.loads(line) async for line in r.aiter_lines() if line]
    assert [line["id"] for line in lines] == [
        str(i) for i in corpus.expected(projects=["a"], min_reward=0.2)
    ]
    listed = (await client.get(f"/trajectories/{lines[0]['id']}", headers=a)).json()
    assert {k: listed[k] for k in lines[0] if k != "created_at"} == {
        k: v for k, v in lines[0].items() if k != "created_at"
    }
    limited = await client.get(
        "/trajectories/export", params={"limit": 3, "include_messages": "false"}, headers=a
    )
    rows = [json.loads(line) for line in limited.text.splitlines()]
    assert len(rows) == 3 and all("messages" not in row for row in rows)
    bad = await client.get("/trajectories/export", params={"format": "csv"}, headers=a)
    assert bad.status_code == 422
