"""Episodes are claimed from gateway runs only: any other run is a 409 at once, not a long
poll that waits out its seconds for episodes that never come."""

from __future__ import annotations

from typing import Any

import httpx

from tests.support.runs import run_body


async def test_claiming_from_a_run_that_is_not_a_gateway_run_is_a_409_at_once(
    client: httpx.AsyncClient, tenant: Any
) -> None:
    run = (await client.post("/runs", json=run_body(), headers=tenant.headers)).json()
    r = await client.post(
        f"/runs/{run['id']}/episodes/claim", json={"wait_seconds": 30}, headers=tenant.headers
    )
    assert r.status_code == 409, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["type"].endswith("not-a-gateway-run")
    document = (await client.get("/openapi.json")).json()
    assert "409" in document["paths"]["/runs/{run_id}/episodes/claim"]["post"]["responses"]
