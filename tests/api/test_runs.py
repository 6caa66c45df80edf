"""POST/GET /runs and the run actions, over the real app and database."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from sqlalchemy import func, select

from app.inputs.models import TaskInput
from app.runs.lifecycle.status import RunStatus
from app.runs.models import Run
from tests.support.runs import create_run, run_body

PROBLEM = "application/problem+json"


async def test_create_returns_202_location_and_the_run(client, tenant, sessionmaker) -> None:
    r = await client.post("/runs", json=run_body(learning_key="letters"), headers=tenant.headers)
    assert r.status_code == 202, r.text
    run = r.json()
    assert r.headers["location"] == f"/runs/{run['id']}"
    assert run["status"] == "pending"
    assert run["project_id"] == str(tenant.project_id)
    assert run["num_examples"] == 2
    mixed = run_body(inputs=[{"input_text": "a"}, {"input_text": "b", "split": "validation"}])
    r = await client.post("/runs", json=mixed, headers=tenant.headers)
    assert r.json()["num_examples"] == 1  # train inputs only
    assert run["reward"]["type"] == "function"
    assert run["grpo"]["beta"] == 0.04  # the reference recipe's default
    assert run["learning_key"] == "letters"
    async with sessionmaker() as s:
        n = await s.scalar(select(func.count()).where(TaskInput.run_id == uuid.UUID(run["id"])))
    assert n == 2


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"status": "completed"}, "body.status"),
        ({"project": "other"}, "body.project"),
        ({"project_id": str(uuid.uuid4())}, "body.project_id"),
        ({"attempt": 7}, "body.attempt"),
        ({"version": 3}, "body.version"),
        ({"lease_owner": "me"}, "body.lease_owner"),
        ({"surprise": 1}, "body.surprise"),
        ({"rollouts_per_group": 1}, "body.rollouts_per_group"),
        ({"grpo": {"beta": -1}}, "body.grpo.beta"),
        ({"grpo": {"unknown_knob": 1}}, "body.grpo.unknown_knob"),
        ({"reward": {"type": "nope"}}, "body.reward"),
        ({"model_name": "x" * 501}, "body.model_name"),
        ({"inputs": [{"input_text": ""}]}, "body.inputs[0].input_text"),
        ({"task_description": "nul \u0000 byte"}, "body.task_description"),
        ({"reward": {"type": "ruler", "rubric": "a\u0000"}}, "body.reward"),
    ],
)
async def test_bad_bodies_are_422_naming_the_field(client, tenant, patch, field) -> None:
    r = await client.post("/runs", json=run_body(**patch), headers=tenant.headers)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == PROBLEM
    problem = r.json()
    assert problem["status"] == 422 and problem["title"]
    assert any(e["field"].startswith(field) for e in problem["errors"]), problem


async def test_nan_in_config_is_422_not_500(client, tenant) -> None:
    """Python's JSON parser accepts NaN; PostgreSQL's jsonb does not."""
    raw = json.dumps(run_body(config={"x": [1, float("nan")]}))
    r = await client.post(
        "/runs", content=raw, headers={**tenant.headers, "content-type": "application/json"}
    )
    assert r.status_code == 422
    assert r.json()["errors"][0]["field"] == "body.config"


async def test_too_many_inline_inputs_is_422(client, tenant) -> None:
    body = run_body(inputs=[{"input_text": "a"}] * 10_001)
    r = await client.post("/runs", json=body, headers=tenant.headers)
    assert r.status_code == 422
    assert r.json()["errors"][0]["field"] == "body.inputs"


async def test_three_mib_body_is_413(client, tenant, sessionmaker) -> None:
    body = run_body(task_description="x" * (3 * 1024 * 1024))
    async with sessionmaker() as s:
        before = await s.scalar(select(func.count()).where(Run.project_id == tenant.project_id))
    r = await client.post("/runs", json=body, headers=tenant.headers)
    assert r.status_code == 413
    assert r.headers["content-type"] == PROBLEM
    assert r.json()["status"] == 413
    async with sessionmaker() as s:
        after = await s.scalar(select(func.count()).where(Run.project_id == tenant.project_id))
    assert after == before


async def test_chunked_oversized_body_is_413(client, tenant) -> None:
    async def chunks():
        yield b'{"model_name": "m", "task_description": "'
        for _ in range(3 * 1024):
            yield b"x" * 1024
        yield b'"}'

    r = await client.post(
        "/runs", content=chunks(), headers={**tenant.headers, "content-type": "application/json"}
    )
    assert r.status_code == 413


async def test_malformed_json_is_a_problem(client, tenant) -> None:
    r = await client.post(
        "/runs",
        content=b"{not json",
        headers={**tenant.headers, "content-type": "application/json"},
    )
    assert r.status_code == 422
    assert r.headers["content-type"] == PROBLEM


async def test_get_has_etag_and_304(client, tenant) -> None:
    run = (await client.post("/runs", json=run_body(), headers=tenant.headers)).json()
    r = await client.get(f"/runs/{run['id']}", headers=tenant.headers)
    assert r.status_code == 200
    etag = r.headers["etag"]
    r2 = await client.get(f"/runs/{run['id']}", headers={**tenant.headers, "If-None-Match": etag})
    assert r2.status_code == 304
    await client.post(f"/runs/{run['id']}/cancel", headers=tenant.headers)
    r3 = await client.get(f"/runs/{run['id']}", headers={**tenant.headers, "If-None-Match": etag})
    assert r3.status_code == 200 and r3.headers["etag"] != etag


async def test_unknown_run_is_404_problem(client, tenant) -> None:
    r = await client.get(f"/runs/{uuid.uuid4()}", headers=tenant.headers)
    assert r.status_code == 404 and r.headers["content-type"] == PROBLEM
    r = await client.get("/runs/not-a-uuid", headers=tenant.headers)
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "path.run_id"


async def test_auth_is_required_and_scoped(client, make_tenant, sessionmaker, api) -> None:
    a, b = await make_tenant(), await make_tenant()
    run = (await client.post("/runs", json=run_body(), headers=a.headers)).json()
    assert (await client.get("/runs")).status_code == 401
    r = await client.get("/runs", headers={"Authorization": "Bearer ty_nope"})
    assert r.status_code == 401 and r.headers["content-type"] == PROBLEM
    assert r.headers["www-authenticate"] == "Bearer"
    for path in ("", "/events", "/metrics", "/checkpoints", "/inputs", "/trajectories"):
        assert (await client.get(f"/runs/{run['id']}{path}", headers=b.headers)).status_code == 404
    for action in ("cancel", "pause", "resume"):
        r = await client.post(f"/runs/{run['id']}/{action}", headers=b.headers)
        assert r.status_code == 404
    assert run["id"] not in {
        x["id"] for x in (await client.get("/runs", headers=b.headers)).json()["data"]
    }

    from app.auth.service import revoke_key

    async with sessionmaker() as s:
        assert await revoke_key(s, a.key_id)
        await s.commit()
    api.state.key_cache.clear()
    assert (await client.get(f"/runs/{run['id']}", headers=a.headers)).status_code == 401


async def test_list_paginates_newest_first_with_filters(client, make_tenant, sessionmaker) -> None:
    t = await make_tenant()
    ids = []
    for i in range(7):
        body = run_body(model_name="model-b" if i % 2 else "model-a")
        ids.append((await client.post("/runs", json=body, headers=t.headers)).json()["id"])
    seen, cursor = [], None
    while True:
        params = {"limit": 3, **({"after": cursor} if cursor else {})}
        page = (await client.get("/runs", params=params, headers=t.headers)).json()
        seen += [r["id"] for r in page["data"]]
        if not page["has_more"]:
            assert page["next_cursor"] is None
            break
        cursor = page["next_cursor"]
    assert seen == list(reversed(ids))

    page = (await client.get("/runs", params={"model_name": "model-b"}, headers=t.headers)).json()
    assert [r["id"] for r in page["data"]] == [ids[5], ids[3], ids[1]]

    await client.post(f"/runs/{ids[0]}/cancel", headers=t.headers)
    page = (await client.get("/runs", params={"status": "cancelled"}, headers=t.headers)).json()
    assert [r["id"] for r in page["data"]] == [ids[0]]
    page = (
        await client.get(
            "/runs", params=[("status", "cancelled"), ("status", "pending")], headers=t.headers
        )
    ).json()
    assert len(page["data"]) == 7

    created = (await client.get(f"/runs/{ids[3]}", headers=t.headers)).json()["created_at"]
    page = (await client.get("/runs", params={"created_after": created}, headers=t.headers)).json()
    assert [r["id"] for r in page["data"]] == list(reversed(ids[3:]))
    page = (await client.get("/runs", params={"created_before": created}, headers=t.headers)).json()
    assert [r["id"] for r in page["data"]] == list(reversed(ids[:3]))


@pytest.mark.parametrize(
    "params",
    [
        {"limit": 0},
        {"limit": 201},
        {"after": "garbage!"},
        {"status": "sleeping"},
        {"created_after": "yesterday"},
    ],
)
async def test_bad_list_params_are_422(client, tenant, params) -> None:
    r = await client.get("/runs", params=params, headers=tenant.headers)
    assert r.status_code == 422
    assert r.json()["errors"][0]["field"].startswith("query.")


async def test_idempotency_key_replays_and_guards(client, tenant, sessionmaker) -> None:
    headers = {**tenant.headers, "Idempotency-Key": "k-1"}
    first = await client.post("/runs", json=run_body(), headers=headers)
    second = await client.post("/runs", json=run_body(), headers=headers)
    assert first.status_code == second.status_code == 202
    assert second.json() == first.json()
    assert second.headers["idempotent-replayed"] == "true"
    other = await client.post("/runs", json=run_body(model_name="other"), headers=headers)
    assert other.status_code == 422
    assert other.json()["errors"][0]["field"] == "header.Idempotency-Key"
    async with sessionmaker() as s:
        n = await s.scalar(select(func.count()).where(Run.project_id == tenant.project_id))
    assert n == 1


async def test_concurrent_idempotent_creates_make_one_run(client, tenant, sessionmaker) -> None:
    headers = {**tenant.headers, "Idempotency-Key": "same"}
    answers = await asyncio.gather(
        *[client.post("/runs", json=run_body(), headers=headers) for _ in range(20)]
    )
    assert {a.status_code for a in answers} == {202}
    assert len({a.json()["id"] for a in answers}) == 1
    async with sessionmaker() as s:
        n = await s.scalar(select(func.count()).where(Run.project_id == tenant.project_id))
    assert n == 1


async def test_idempotency_keys_are_per_project(client, make_tenant) -> None:
    a, b = await make_tenant(), await make_tenant()
    ra = await client.post("/runs", json=run_body(), headers={**a.headers, "Idempotency-Key": "x"})
    rb = await client.post("/runs", json=run_body(), headers={**b.headers, "Idempotency-Key": "x"})
    assert ra.json()["id"] != rb.json()["id"]


async def test_cancel_pending_then_idempotent_then_completed_is_409(
    client, tenant, sessionmaker
) -> None:
    run = (await client.post("/runs", json=run_body(), headers=tenant.headers)).json()
    r = await client.post(f"/runs/{run['id']}/cancel", headers=tenant.headers)
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    r = await client.post(f"/runs/{run['id']}/cancel", headers=tenant.headers)
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    done = await create_run(sessionmaker, project_id=tenant.project_id, status=RunStatus.COMPLETED)
    r = await client.post(f"/runs/{done.id}/cancel", headers=tenant.headers)
    assert r.status_code == 409 and r.headers["content-type"] == PROBLEM
    assert r.json()["current_status"] == "completed"


async def test_cancel_of_a_leased_run_sets_the_flag(client, tenant, sessionmaker) -> None:
    from datetime import timedelta

    from app.core.time import utcnow

    run = await create_run(
        sessionmaker,
        project_id=tenant.project_id,
        status=RunStatus.COLLECTING,
        lease_owner="w",
        attempt=1,
        lease_expires_at=utcnow() + timedelta(minutes=5),
    )
    r = await client.post(f"/runs/{run.id}/cancel", headers=tenant.headers)
    body = r.json()
    assert body["status"] == "collecting" and body["cancel_requested"] is True


async def test_pause_and_resume(client, tenant) -> None:
    run = (await client.post("/runs", json=run_body(), headers=tenant.headers)).json()
    r = await client.post(f"/runs/{run['id']}/resume", headers=tenant.headers)
    assert r.status_code == 409
    r = await client.post(f"/runs/{run['id']}/pause", headers=tenant.headers)
    assert r.json()["status"] == "paused"
    r = await client.post(f"/runs/{run['id']}/pause", headers=tenant.headers)
    assert r.status_code == 200 and r.json()["status"] == "paused"
    r = await client.post(f"/runs/{run['id']}/resume", headers=tenant.headers)
    assert r.status_code == 200 and r.json()["status"] == "pending"


async def test_events_page_and_stream(client, tenant) -> None:
    run = (await client.post("/runs", json=run_body(), headers=tenant.headers)).json()
    await client.post(f"/runs/{run['id']}/pause", headers=tenant.headers)
    await client.post(f"/runs/{run['id']}/cancel", headers=tenant.headers)
    page = (
        await client.get(f"/runs/{run['id']}/events", params={"limit": 2}, headers=tenant.headers)
    ).json()
    assert [e["type"] for e in page["data"]] == ["created", "status"]
    assert page["has_more"]
    rest = (
        await client.get(
            f"/runs/{run['id']}/events",
            params={"after": page["next_cursor"]},
            headers=tenant.headers,
        )
    ).json()
    assert [e["data"]["to"] for e in rest["data"]] == ["cancelled"]
    all_ids = [e["id"] for e in page["data"] + rest["data"]]

    async def stream(headers: dict[str, str]) -> list[tuple[str, str]]:
        got = []
        async with client.stream("GET", f"/runs/{run['id']}/events/stream", headers=headers) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            event_id, event = None, None
            async for line in r.aiter_lines():
                if line.startswith("id: "):
                    event_id = line[4:]
                elif line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: "):
                    got.append((event_id, event))
                    if event == "end":
                        break
        return got

    full = await stream(tenant.headers)
    assert [int(i) for i, e in full if e != "end"] == all_ids
    assert full[-1][1] == "end"
    resumed = await stream({**tenant.headers, "Last-Event-ID": str(all_ids[0])})
    assert [int(i) for i, e in resumed if e != "end"] == all_ids[1:]


async def test_sub_resources_list_empty_and_inputs(client, tenant) -> None:
    run = (await client.post("/runs", json=run_body(), headers=tenant.headers)).json()
    base = f"/runs/{run['id']}"
    inputs = (
        await client.get(f"{base}/inputs", params={"limit": 1}, headers=tenant.headers)
    ).json()
    assert [i["input_text"] for i in inputs["data"]] == ["say a"] and inputs["has_more"]
    nxt = (
        await client.get(
            f"{base}/inputs", params={"after": inputs["next_cursor"]}, headers=tenant.headers
        )
    ).json()
    assert [i["index"] for i in nxt["data"]] == [1]
    for path in ("checkpoints", "trajectories"):
        page = (await client.get(f"{base}/{path}", headers=tenant.headers)).json()
        assert page == {"data": [], "has_more": False, "next_cursor": None}
    metrics = (await client.get(f"{base}/metrics", headers=tenant.headers)).json()
    assert metrics == {"run_id": run["id"], "series": []}
    r = await client.get(
        f"{base}/trajectories", params={"min_reward": 1, "max_reward": 0}, headers=tenant.headers
    )
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "query.min_reward"


async def test_health_and_openapi(client) -> None:
    assert (await client.get("/healthz")).json()["status"] == "ok"
    ready = await client.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["checks"] == {"database": "ok", "broker": "ok"}
    spec = (await client.get("/openapi.json")).json()
    ops = {op["operationId"] for path in spec["paths"].values() for op in path.values()}
    assert {
        "create_run",
        "list_runs",
        "get_run",
        "cancel_run",
        "pause_run",
        "resume_run",
        "list_run_events",
        "stream_run_events",
        "get_run_metrics",
        "list_run_checkpoints",
        "list_run_inputs",
        "list_run_trajectories",
        "healthz",
        "readyz",
    } <= ops
    create = spec["paths"]["/runs"]["post"]["responses"]
    assert create["422"]["content"]["application/problem+json"]["schema"]["$ref"].endswith(
        "ProblemDetail"
    )
    assert "ProblemDetail" in spec["components"]["schemas"]
    json.dumps(spec)


async def test_pause_of_a_finished_run_is_409_even_with_a_stale_request(
    client, tenant, sessionmaker
) -> None:
    run = await create_run(
        sessionmaker,
        project_id=tenant.project_id,
        status=RunStatus.CANCELLED,
        pause_requested=True,
    )
    r = await client.post(f"/runs/{run.id}/pause", headers=tenant.headers)
    assert r.status_code == 409


async def test_expired_idempotency_key_is_taken_over(client, tenant, sessionmaker) -> None:
    from sqlalchemy import update

    from app.core.idempotency import IdempotencyKey

    headers = {**tenant.headers, "Idempotency-Key": "old"}
    first = (await client.post("/runs", json=run_body(), headers=headers)).json()
    async with sessionmaker() as s:
        await s.execute(
            update(IdempotencyKey)
            .where(IdempotencyKey.project_id == tenant.project_id)
            .values(created_at=func.now() - func.make_interval(0, 0, 0, 2))
        )
        await s.commit()
    second = await client.post("/runs", json=run_body(model_name="new"), headers=headers)
    assert second.status_code == 202 and second.json()["id"] != first["id"]
    assert "idempotent-replayed" not in second.headers
