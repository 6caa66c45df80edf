"""What the API accepts it can serve back: free-form JSON nests at most MAX_JSON_DEPTH deep,
and a row stored deeper (before the limit, or around the API) still renders.

pydantic's serializer gives up at 255 levels ("Maximum serialization depth exceeded"): a body
nested 300 deep inside ``config`` used to be stored, and then every answer holding that run,
GET /runs of the whole project included, was a 500."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from sqlalchemy import text

from app.core.limits import MAX_JSON_DEPTH, MAX_SERVED_DEPTH
from app.core.storable import TOO_DEEP, servable, unstorable
from tests.support.runs import run_body

PROBLEM = "application/problem+json"
USER_FUNCTION = "tests.rewards.test_functions:double_length"


def nest(levels: int) -> dict[str, Any]:
    """``levels`` objects, one inside the other, around a 1."""
    value: Any = 1
    for _ in range(levels):
        value = {"a": value}
    return value


def body_with(where: str, value: dict[str, Any]) -> dict[str, Any]:
    if where == "config":
        return run_body(config=value)
    if where == "inputs[0].context":
        return run_body(inputs=[{"input_text": "say a", "context": value}])
    return run_body(
        reward={"type": "function", "functions": [{"name": USER_FUNCTION, "args": value}]}
    )


PLACES = ["config", "inputs[0].context", "reward.functions[0].args"]


@pytest.mark.parametrize("where", PLACES)
async def test_deeper_than_the_limit_is_422_naming_the_field(client, tenant, where) -> None:
    for levels in (MAX_JSON_DEPTH + 1, 300):
        r = await client.post("/runs", json=body_with(where, nest(levels)), headers=tenant.headers)
        assert r.status_code == 422, r.text
        assert r.headers["content-type"] == PROBLEM
        [error] = r.json()["errors"]
        # A tagged union names its branch: body.reward.function.functions[0].args.
        assert error["field"] == "body." + where.replace("reward.", "reward.function."), error
        assert f"more than {MAX_JSON_DEPTH} levels" in error["message"]
    # Nothing was stored, so the project's list still answers.
    assert (await client.get("/runs", headers=tenant.headers)).status_code == 200


@pytest.mark.parametrize("where", PLACES)
async def test_at_the_limit_is_stored_and_served_back_everywhere(client, tenant, where) -> None:
    deep = nest(MAX_JSON_DEPTH)
    r = await client.post("/runs", json=body_with(where, deep), headers=tenant.headers)
    assert r.status_code == 202, r.text
    run_id = r.json()["id"]
    listed = await client.get("/runs", headers=tenant.headers)
    assert listed.status_code == 200, listed.text
    assert [run["id"] for run in listed.json()["data"]] == [run_id]
    one = await client.get(f"/runs/{run_id}", headers=tenant.headers)
    assert one.status_code == 200, one.text
    if where == "config":
        assert one.json()["config"] == deep == listed.json()["data"][0]["config"]
    elif where == "reward.functions[0].args":
        assert one.json()["reward"]["functions"][0]["args"] == deep
    else:
        inputs = await client.get(f"/runs/{run_id}/inputs", headers=tenant.headers)
        assert inputs.status_code == 200, inputs.text
        assert inputs.json()["data"][0]["context"] == deep
    cancelled = await client.post(f"/runs/{run_id}/cancel", headers=tenant.headers)
    assert cancelled.status_code == 200, cancelled.text


@pytest.mark.parametrize("column", ["config", "reward", "metrics"])
async def test_a_row_stored_too_deep_still_answers(client, tenant, sessionmaker, column) -> None:
    """A run written around the API (or before the limit) 300 levels deep: the list, the
    run and its actions answer, the part beyond MAX_SERVED_DEPTH shown as TOO_DEEP."""
    r = await client.post("/runs", json=run_body(), headers=tenant.headers)
    run_id = r.json()["id"]
    healthy = (await client.post("/runs", json=run_body(), headers=tenant.headers)).json()["id"]
    stored = {"type": "function", "deep": nest(300)} if column == "reward" else nest(300)
    async with sessionmaker() as s:
        await s.execute(
            text(f"UPDATE runs SET {column} = CAST(:v AS jsonb) WHERE id = :id"),
            {"v": json.dumps(stored), "id": uuid.UUID(run_id)},
        )
        await s.commit()

    listed = await client.get("/runs", headers=tenant.headers)
    assert listed.status_code == 200, listed.text
    assert {run["id"] for run in listed.json()["data"]} == {run_id, healthy}
    one = await client.get(f"/runs/{run_id}", headers=tenant.headers)
    assert one.status_code == 200, one.text
    shown = one.json()[column]
    value = shown["deep"] if column == "reward" else shown
    depth = 1 if column == "reward" else 0
    while isinstance(value, dict):
        value, depth = value["a"], depth + 1
    assert value == TOO_DEEP and depth == MAX_SERVED_DEPTH
    for action in ("pause", "cancel"):
        acted = await client.post(f"/runs/{run_id}/{action}", headers=tenant.headers)
        assert acted.status_code == 200, acted.text
        assert acted.json()["id"] == run_id


def test_servable_leaves_values_within_the_limit_alone() -> None:
    value = {"x": [nest(MAX_SERVED_DEPTH - 2)], "y": 2}
    assert servable(value) is value
    assert servable(nest(MAX_SERVED_DEPTH)) == nest(MAX_SERVED_DEPTH)
    clipped = servable({"keep": 1, "deep": nest(MAX_SERVED_DEPTH)})
    assert clipped["keep"] == 1
    assert unstorable(clipped, max_depth=MAX_SERVED_DEPTH) is None
    assert unstorable(clipped, max_depth=MAX_SERVED_DEPTH - 1) is not None


def test_unstorable_names_each_rule() -> None:
    assert unstorable(nest(MAX_JSON_DEPTH)) is None
    assert "levels deep" in (unstorable(nest(MAX_JSON_DEPTH + 1)) or "")
    assert "levels deep" in (unstorable({"l": [[[[1]]]]}, max_depth=4) or "")
    assert unstorable({"l": [[[1]]]}, max_depth=4) is None
    assert "NUL" in (unstorable({"k\x00": 1}) or "")
    assert "NUL" in (unstorable([{"k": ["a\x00"]}]) or "")
    assert "NaN" in (unstorable({"k": [float("inf")]}) or "")
    # Deep enough to exhaust Python's stack, were the walk recursive.
    assert "levels deep" in (unstorable(nest(5000)) or "")
