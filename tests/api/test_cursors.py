"""Cursors are bound to their list and its scope, and the list parameters follow one rule:
an event cursor means the same on the page and on the stream, an inverted range is a 422
``inconsistent`` on every list, and every 422 item says its type."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from app.core.errors import INCONSISTENT, INVALID_CURSOR, Problem
from app.core.pagination import cursor_int32, decode_cursor, encode_cursor
from tests.support.runs import run_body

PROBLEM = "application/problem+json"


def assert_problem(r: Any, field: str, error_type: str) -> None:
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == PROBLEM
    assert [(e["field"], e["type"]) for e in r.json()["errors"]] == [(field, error_type)], r.text


async def _cancelled_run(client: Any, tenant: Any) -> str:
    """A finished run (so its event stream ends) with events and two inputs."""
    r = await client.post("/runs", json=run_body(), headers=tenant.headers)
    assert r.status_code == 202, r.text
    run_id = str(r.json()["id"])
    assert (await client.post(f"/runs/{run_id}/cancel", headers=tenant.headers)).is_success
    return run_id


async def _cursor(client: Any, tenant: Any, url: str, **params: Any) -> str:
    r = await client.get(url, params={"limit": 1, **params}, headers=tenant.headers)
    assert r.status_code == 200, r.text
    cursor = r.json()["next_cursor"]
    assert cursor, r.text
    return str(cursor)


async def _dataset(client: Any, tenant: Any) -> str:
    r = await client.post(
        "/datasets",
        params={"name": "d"},
        content=b'{"input_text": "a"}\n{"input_text": "b"}\n',
        headers={**tenant.headers, "content-type": "application/x-ndjson"},
    )
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def test_a_cursor_of_another_list_is_invalid_cursor(client, tenant) -> None:
    """A /datasets cursor (created_at, id) used to position a /trajectories page, and a
    /runs one a /datasets page: same shape, another list."""
    run_a = await _cancelled_run(client, tenant)
    await _cancelled_run(client, tenant)
    dataset = await _dataset(client, tenant)
    await _dataset(client, tenant)
    cursors = {
        "/runs": await _cursor(client, tenant, "/runs"),
        "/datasets": await _cursor(client, tenant, "/datasets"),
        "rows": await _cursor(client, tenant, f"/datasets/{dataset}/rows"),
        "events": await _cursor(client, tenant, f"/runs/{run_a}/events"),
        "inputs": await _cursor(client, tenant, f"/runs/{run_a}/inputs"),
    }
    lists = {
        "/runs": "/runs",
        "/datasets": "/datasets",
        "rows": f"/datasets/{dataset}/rows",
        "events": f"/runs/{run_a}/events",
        "inputs": f"/runs/{run_a}/inputs",
        "trajectories": "/trajectories",
        "run trajectories": f"/runs/{run_a}/trajectories",
        "checkpoints": f"/runs/{run_a}/checkpoints",
        "stream": f"/runs/{run_a}/events/stream",
    }
    for source, cursor in cursors.items():
        for target, url in lists.items():
            if target == source or (source, target) == ("events", "stream"):
                continue
            r = await client.get(url, params={"after": cursor}, headers=tenant.headers)
            assert r.status_code == 422, (source, target, r.text)
            assert_problem(r, "query.after", INVALID_CURSOR)


async def test_a_cursor_is_bound_to_its_parent_and_filters(client, tenant) -> None:
    run_a = await _cancelled_run(client, tenant)
    run_b = await _cancelled_run(client, tenant)
    await _cancelled_run(client, tenant)
    events_a = await _cursor(client, tenant, f"/runs/{run_a}/events")
    r = await client.get(
        f"/runs/{run_b}/events", params={"after": events_a}, headers=tenant.headers
    )
    assert_problem(r, "query.after", INVALID_CURSOR)
    # The same list asked with other filters: the position was of another ordering or set.
    runs = await _cursor(client, tenant, "/runs", status="cancelled")
    r = await client.get("/runs", params={"after": runs}, headers=tenant.headers)
    assert_problem(r, "query.after", INVALID_CURSOR)
    r = await client.get(
        "/runs", params={"after": runs, "status": "cancelled", "limit": 1}, headers=tenant.headers
    )
    assert r.status_code == 200 and len(r.json()["data"]) == 1, r.text
    inputs = await _cursor(client, tenant, f"/runs/{run_a}/inputs", split="train")
    r = await client.get(f"/runs/{run_a}/inputs", params={"after": inputs}, headers=tenant.headers)
    assert_problem(r, "query.after", INVALID_CURSOR)


async def test_the_event_stream_takes_the_pages_cursor(client, tenant) -> None:
    """`?after=` was an event id on the stream and a cursor on the page: now the cursor on
    both, and `Last-Event-ID` the raw id."""
    run_id = await _cancelled_run(client, tenant)
    page = (
        await client.get(f"/runs/{run_id}/events", params={"limit": 1}, headers=tenant.headers)
    ).json()
    everything = await client.get(f"/runs/{run_id}/events", headers=tenant.headers)
    ids = [e["id"] for e in everything.json()["data"]]
    assert len(ids) >= 2 and page["data"][0]["id"] == ids[0]

    async def stream(params: dict[str, Any], headers: dict[str, str] | None = None) -> list[int]:
        got = []
        async with client.stream(
            "GET",
            f"/runs/{run_id}/events/stream",
            params=params,
            headers=headers or tenant.headers,
        ) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("id: "):
                    got.append(int(line[4:]))
        return got

    assert await stream({"after": page["next_cursor"]}) == ids[1:]
    # The raw id wins over the cursor, as an EventSource reconnecting sends it.
    last = {**tenant.headers, "Last-Event-ID": str(ids[-1])}
    assert await stream({"after": page["next_cursor"]}, last) == []
    r = await client.get(
        f"/runs/{run_id}/events/stream", params={"after": ids[0]}, headers=tenant.headers
    )
    assert_problem(r, "query.after", INVALID_CURSOR)


async def test_the_parameter_descriptions_say_what_after_means(client) -> None:
    doc = (await client.get("/openapi.json")).json()

    def after(path: str) -> dict[str, Any]:
        params = doc["paths"][path]["get"]["parameters"]
        return next(p for p in params if p["name"] == "after")

    stream = after("/runs/{run_id}/events/stream")
    page = after("/runs/{run_id}/events")
    same = ("type", "maxLength", "pattern")
    assert [stream["schema"][k] for k in same] == [page["schema"][k] for k in same]
    assert "next_cursor" in stream["description"] and "Last-Event-ID" in stream["description"]


@pytest.mark.parametrize(
    ("path", "params", "field"),
    [
        (
            "/runs",
            {"created_after": "2026-02-01T00:00:00Z", "created_before": "2026-01-01T00:00:00Z"},
            "query.created_after",
        ),
        ("/runs/{run}/metrics", {"step_min": 2, "step_max": 1}, "query.step_min"),
        ("/runs/{run}/trajectories", {"min_reward": 1, "max_reward": 0}, "query.min_reward"),
        ("/trajectories", {"min_reward": 1, "max_reward": 0}, "query.min_reward"),
        ("/trajectories/count", {"min_reward": 1, "max_reward": 0}, "query.min_reward"),
        (
            "/trajectories/export",
            {"start_date": "2026-02-01", "end_date": "2026-01-01"},
            "query.start_date",
        ),
    ],
)
async def test_an_inverted_range_is_inconsistent_everywhere(
    client, tenant, path, params, field
) -> None:
    """An inverted created_after/created_before on GET /runs was a 200 with nothing."""
    run_id = await _cancelled_run(client, tenant)
    r = await client.get(path.format(run=run_id), params=params, headers=tenant.headers)
    assert_problem(r, field, INCONSISTENT)


async def test_equal_ends_are_a_range_not_an_error(client, tenant) -> None:
    run_id = await _cancelled_run(client, tenant)
    instant = "2026-01-01T00:00:00Z"
    for url, params in [
        ("/runs", {"created_after": instant, "created_before": instant}),
        (f"/runs/{run_id}/metrics", {"step_min": 1, "step_max": 1}),
        (f"/runs/{run_id}/trajectories", {"min_reward": 0.5, "max_reward": 0.5}),
    ]:
        r = await client.get(url, params=params, headers=tenant.headers)
        assert r.status_code == 200, (url, r.text)


async def test_a_page_size_over_the_cap_says_its_type(client, tenant) -> None:
    r = await client.get("/runs", params={"limit": 10_000}, headers=tenant.headers)
    assert_problem(r, "query.limit", "less_than_equal")


# --- the cursor itself ----------------------------------------------------------------------


def test_a_cursor_round_trips_only_in_its_list_and_scope() -> None:
    at = datetime(2024, 5, 1, tzinfo=UTC)
    run = uuid.uuid4()
    cursor = encode_cursor([at.isoformat(), str(run)], of="a", scope=(run, None))
    assert decode_cursor(cursor, datetime.fromisoformat, uuid.UUID, of="a", scope=(run, None)) == [
        at,
        run,
    ]
    good = encode_cursor([2**31 - 1], of="a")
    assert decode_cursor(good, cursor_int32, of="a") == [2**31 - 1]
    for of, scope in [("b", ()), ("a", (run,)), ("a", (None,))]:
        with pytest.raises(Problem) as raised:
            decode_cursor(good, cursor_int32, of=of, scope=scope)
        assert raised.value.errors is not None
        assert raised.value.errors[0].type == INVALID_CURSOR
        assert raised.value.errors[0].field == "query.after"
