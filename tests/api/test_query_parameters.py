"""A query parameter an operation does not take is a 422 naming it (app/core/query.py): a
typo in a filter must not widen it to every row."""

from __future__ import annotations

import re
import uuid
from typing import Any

import httpx

from tests.support.runs import add_trajectories, run_body

PROBLEM = "application/problem+json"


def _operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (method.upper(), path, op)
        for path, item in document["paths"].items()
        for method, op in item.items()
        if method in {"get", "post", "put", "patch", "delete"}
    ]


async def test_every_operation_answers_an_unknown_query_parameter_with_a_422_naming_it(
    client: httpx.AsyncClient, tenant: Any
) -> None:
    document = (await client.get("/openapi.json", headers=tenant.headers)).json()
    operations = _operations(document)
    assert len(operations) >= 30
    for method, path, op in operations:
        url = re.sub(r"\{[^}]+\}", str(uuid.uuid4()), path)
        declared = [p["name"] for p in op.get("parameters", []) if p["in"] == "query"]
        # A known parameter beside the unknown ones does not hide them; each is named.
        params = [("run_ids", "x"), ("colour", "red"), ("colour", "blue")]
        if "limit" in declared:
            params.append(("limit", "1"))
        r = await client.request(method, url, params=params, headers=tenant.headers)
        what = f"{method} {path}"
        assert r.status_code == 422, f"{what}: {r.status_code} {r.text}"
        assert r.headers["content-type"] == PROBLEM, what
        errors = r.json()["errors"]
        assert [e["field"] for e in errors] == ["query.run_ids", "query.colour"], what
        assert {e["type"] for e in errors} == {"unknown_query_parameter"}, what
        takes = ", ".join(sorted(declared)) or "none"
        assert errors[0]["message"].endswith(f"this operation takes: {takes}"), (what, errors)
        assert "422" in op["responses"], f"{what} does not document its 422"


async def test_a_misspelt_filter_is_refused_and_the_right_one_filters(
    client: httpx.AsyncClient, tenant: Any, sessionmaker: Any
) -> None:
    runs = []
    for _ in range(2):
        r = await client.post("/runs", json=run_body(), headers=tenant.headers)
        assert r.status_code == 202, r.text
        runs.append(r.json()["id"])
    await add_trajectories(sessionmaker, uuid.UUID(runs[0]), 0, 3)
    await add_trajectories(sessionmaker, uuid.UUID(runs[1]), 0, 5)

    r = await client.get("/trajectories/count", params={"run_ids": runs[0]}, headers=tenant.headers)
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"] == "query.run_ids"
    r = await client.get("/trajectories/count", params={"run_id": runs[0]}, headers=tenant.headers)
    assert r.status_code == 200 and r.json()["count"] == 3, r.text
    # A parameter given twice is still one the operation takes.
    r = await client.get("/runs", params=[("limit", "1"), ("limit", "2")], headers=tenant.headers)
    assert r.status_code == 200, r.text


async def test_the_openai_routes_ignore_unknown_parameters_as_openai_does(
    client: httpx.AsyncClient,
) -> None:
    """They are OpenAI's API, not ours: the SDKs' ``extra_query`` relies on unknown
    parameters being ignored. Without an episode token the answer is OpenAI's 401."""
    r = await client.get(f"/gateway/episodes/{uuid.uuid4()}/v1/models", params={"x": "1"})
    assert r.status_code == 401, r.text
    assert "error" in r.json()
