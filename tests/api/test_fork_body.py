"""POST /runs with from_checkpoint: a fork of this project's run at a step it has a
checkpoint of; another project's run is a 404, a step without one a 409 naming those there
are, another base model a 422."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import text

from tests.support.runs import run_body


async def _run_with_checkpoints(client: Any, tenant: Any, sessionmaker: Any, *steps: int) -> str:
    run = (await client.post("/runs", json=run_body(), headers=tenant.headers)).json()
    async with sessionmaker() as s, s.begin():
        for step in steps:
            await s.execute(
                text(
                    "INSERT INTO checkpoints (id, run_id, step, path, is_final, metrics)"
                    " VALUES (gen_random_uuid(), :run, :step, :path, false, '{}')"
                ),
                {"run": uuid.UUID(run["id"]), "step": step, "path": f"/ckpt/{step}"},
            )
    return str(run["id"])


def _fork(parent: str, step: int, **body: Any) -> dict[str, Any]:
    return run_body(from_checkpoint={"run_id": parent, "step": step}, **body)


async def test_a_fork_names_its_parent_and_step(client, tenant, sessionmaker) -> None:
    parent = await _run_with_checkpoints(client, tenant, sessionmaker, 2, 4)
    created = await client.post("/runs", json=_fork(parent, 4), headers=tenant.headers)
    assert created.status_code == 202, created.text
    fork = created.json()
    assert (fork["parent_run_id"], fork["parent_step"]) == (parent, 4)
    got = (await client.get(f"/runs/{fork['id']}", headers=tenant.headers)).json()
    assert (got["parent_run_id"], got["parent_step"]) == (parent, 4)
    plain = (await client.post("/runs", json=run_body(), headers=tenant.headers)).json()
    assert (plain["parent_run_id"], plain["parent_step"]) == (None, None)


async def test_a_step_without_a_checkpoint_is_a_409_naming_the_steps(
    client, tenant, sessionmaker
) -> None:
    parent = await _run_with_checkpoints(client, tenant, sessionmaker, 2, 4)
    answer = await client.post("/runs", json=_fork(parent, 3), headers=tenant.headers)
    assert answer.status_code == 409
    problem = answer.json()
    assert answer.headers["content-type"] == "application/problem+json"
    assert problem["checkpoint_steps"] == [2, 4]
    assert "2, 4" in problem["detail"]
    bare = await _run_with_checkpoints(client, tenant, sessionmaker)
    assert (await client.post("/runs", json=_fork(bare, 0), headers=tenant.headers)).json()[
        "checkpoint_steps"
    ] == []


async def test_another_projects_run_is_a_404(client, tenant, make_tenant, sessionmaker) -> None:
    parent = await _run_with_checkpoints(client, tenant, sessionmaker, 2)
    stranger = await make_tenant()
    answer = await client.post("/runs", json=_fork(parent, 2), headers=stranger.headers)
    assert answer.status_code == 404
    assert "from_checkpoint" in answer.json()["detail"]
    unknown = await client.post("/runs", json=_fork(str(uuid.uuid4()), 2), headers=tenant.headers)
    assert unknown.status_code == 404
    document = (await client.get("/openapi.json")).json()
    assert "404" in document["paths"]["/runs"]["post"]["responses"]


async def test_a_fork_of_another_model_is_a_422(client, tenant, sessionmaker) -> None:
    parent = await _run_with_checkpoints(client, tenant, sessionmaker, 2)
    answer = await client.post(
        "/runs", json=_fork(parent, 2, model_name="another-model"), headers=tenant.headers
    )
    assert answer.status_code == 422
    assert answer.json()["errors"][0]["field"] == "body.model_name"


async def test_a_negative_step_is_a_422(client, tenant) -> None:
    answer = await client.post("/runs", json=_fork(str(uuid.uuid4()), -1), headers=tenant.headers)
    assert answer.status_code == 422
    assert answer.json()["errors"][0]["field"] == "body.from_checkpoint.step"
