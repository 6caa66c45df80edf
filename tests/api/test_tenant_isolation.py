"""Tenant isolation on every route of the OpenAPI document: another project's ids (and
guessed ones) are a 404, a missing key or a revoked one a 401, and no list, count or export
shows another project's rows. Routes are taken from ``/openapi.json``, so a new route is
covered the day it is added."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from tests.support.runs import add_episodes, add_trajectories, run_body

PUBLIC = {"/healthz", "/readyz"}


async def _openapi_operations(client: httpx.AsyncClient) -> list[tuple[str, str, dict[str, Any]]]:
    """Every operation an API key opens. (An episode's finish and fail take that episode's
    token instead, which opens nothing else: tests/gateway/test_gateway_run.py.)"""
    doc = (await client.get("/openapi.json")).json()
    return [
        (method.upper(), path, op)
        for path, item in doc["paths"].items()
        for method, op in item.items()
        if method in {"get", "post", "put", "patch", "delete"}
        and {"EpisodeToken": []} not in op.get("security", [])
    ]


async def _owned_ids(client: httpx.AsyncClient, owner: Any, sessionmaker: Any) -> dict[str, str]:
    """One of each kind of thing a path can name, owned by ``owner``'s project."""
    run = (await client.post("/runs", json=run_body(), headers=owner.headers)).json()
    await add_trajectories(sessionmaker, uuid.UUID(run["id"]), 0, 1)
    trajectory = (await client.get("/trajectories", headers=owner.headers)).json()["data"][0]
    dataset = await client.post(
        "/datasets",
        content=b'{"input_text": "say a"}\n',
        headers={**owner.headers, "Content-Type": "application/x-ndjson"},
    )
    assert dataset.status_code == 201, dataset.text
    webhook = await client.post(
        "/webhooks",
        json={"url": "http://93.184.215.14/hook", "event_types": ["run.completed"]},
        headers=owner.headers,
    )
    assert webhook.status_code == 201, webhook.text
    (episode,) = await add_episodes(sessionmaker, uuid.UUID(run["id"]), 1)
    return {
        "episode_id": str(episode),
        "run_id": run["id"],
        "dataset_id": dataset.json()["id"],
        "trajectory_id": trajectory["id"],
        "webhook_id": webhook.json()["id"],
    }


def _fill(path: str, ids: dict[str, str]) -> str:
    for name, value in ids.items():
        path = path.replace("{" + name + "}", value)
    assert "{" not in path, f"no id for {path}: add it to _owned_ids"
    return path


async def test_every_route_hides_other_projects(
    client: httpx.AsyncClient, make_tenant: Any, sessionmaker: Any
) -> None:
    owner, other = await make_tenant(), await make_tenant()
    ids = await _owned_ids(client, owner, sessionmaker)
    guessed = {name: str(uuid.uuid4()) for name in ids}
    operations = await _openapi_operations(client)
    # DELETEs last: the owner's own call would remove what the routes after it name.
    by_id = sorted(((m, p) for m, p, _ in operations if "{" in p), key=lambda mp: mp[0] == "DELETE")
    assert len(by_id) >= 12, by_id
    for method, path in by_id:
        for label, values in (("another project's", ids), ("a guessed", guessed)):
            r = await client.request(method, _fill(path, values), headers=other.headers)
            assert r.status_code == 404, f"{method} {path} with {label} id: {r.status_code}"
            assert r.headers["content-type"] == "application/problem+json"
        # The owner does see it (so the 404 above is about the project, not the route).
        mine = await client.request(method, _fill(path, ids), headers=owner.headers)
        assert mine.status_code < 400 or mine.status_code == 409, f"{method} {path}: {mine.text}"

    # Lists, counts and exports of the other project show none of the owner's rows.
    for path in ("/runs", "/datasets", "/trajectories"):
        r = await client.get(path, headers=other.headers)
        assert r.status_code == 200 and r.json()["data"] == [], path
    assert (await client.get("/trajectories/count", headers=other.headers)).json()["count"] == 0
    export = await client.get("/trajectories/export", headers=other.headers)
    assert export.status_code == 200 and export.text == ""
    r = await client.get("/runs", params={"learning_key": "x"}, headers=other.headers)
    assert r.json()["data"] == []


@pytest.mark.parametrize("auth", ["none", "garbage", "revoked"])
async def test_every_route_needs_a_live_key(
    client: httpx.AsyncClient, make_tenant: Any, api: Any, auth: str
) -> None:
    from app.auth.service import revoke_key

    tenant = await make_tenant()
    headers: dict[str, str] = {}
    if auth == "garbage":
        headers = {"Authorization": "Bearer ty_not-a-key"}
    elif auth == "revoked":
        async with api.state.sessionmaker() as s:
            assert await revoke_key(s, tenant.key_id)
            await s.commit()
        api.state.key_cache.clear()
        headers = tenant.headers
    ids = {"run_id": str(uuid.uuid4()), "dataset_id": str(uuid.uuid4())}
    ids["trajectory_id"] = str(uuid.uuid4())
    ids["webhook_id"] = str(uuid.uuid4())
    ids["episode_id"] = str(uuid.uuid4())
    for method, path, _ in await _openapi_operations(client):
        if path in PUBLIC:
            continue
        r = await client.request(method, _fill(path, ids), headers=headers)
        assert r.status_code == 401, f"{method} {path} ({auth}): {r.status_code}"
        assert r.headers.get("www-authenticate", "").startswith("Bearer")
