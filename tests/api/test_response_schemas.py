"""Every route answers what /openapi.json says it answers.

Each operation of the served document is called with a valid request on a run that has
events, metrics, checkpoints, inputs and trajectories, and each answer's body is validated
against the schema the document gives for that status code and media type, ``$ref``s
resolved against the document itself. A route added without a case here fails the first
test, so none goes unchecked.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import jsonschema_rs
import pytest

from app.checkpoints import service as checkpoints
from app.metrics import service as metrics
from tests.support.runs import add_episodes, add_trajectories, run_body


@dataclass
class Call:
    method: str
    path: str
    params: dict[str, Any] = field(default_factory=dict)
    json: Any = None
    content: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class World:
    """What the calls need: a run with something in every sub-resource, runs to pause,
    resume and cancel, a dataset and a trajectory."""

    run: str
    pausable: str
    paused: str
    cancellable: str
    dataset: str
    trajectory: str
    webhook: str
    doomed_webhook: str
    # A run with an episode waiting to be claimed, and claimed episodes with their tokens.
    gateway_run: str = ""
    episodes: dict[str, tuple[str, str]] = field(default_factory=dict)


def _calls(w: World) -> dict[str, Call]:
    return {
        "healthz": Call("GET", "/healthz"),
        "readyz": Call("GET", "/readyz"),
        "create_run": Call("POST", "/runs", json=run_body()),
        "list_runs": Call("GET", "/runs", {"limit": 1}),
        "get_run": Call("GET", f"/runs/{w.run}"),
        "cancel_run": Call("POST", f"/runs/{w.cancellable}/cancel"),
        "pause_run": Call("POST", f"/runs/{w.pausable}/pause"),
        "resume_run": Call("POST", f"/runs/{w.paused}/resume"),
        "list_run_events": Call("GET", f"/runs/{w.run}/events", {"limit": 1}),
        "stream_run_events": Call("GET", f"/runs/{w.run}/events/stream"),
        "get_run_metrics": Call("GET", f"/runs/{w.run}/metrics"),
        "list_run_checkpoints": Call("GET", f"/runs/{w.run}/checkpoints", {"limit": 1}),
        "list_run_inputs": Call("GET", f"/runs/{w.run}/inputs", {"limit": 1}),
        "list_run_trajectories": Call("GET", f"/runs/{w.run}/trajectories", {"limit": 1}),
        "list_trajectories": Call("GET", "/trajectories", {"limit": 1}),
        "count_trajectories": Call("GET", "/trajectories/count"),
        "export_trajectories": Call("GET", "/trajectories/export"),
        "get_trajectory": Call("GET", f"/trajectories/{w.trajectory}"),
        "create_dataset": Call(
            "POST",
            "/datasets",
            {"name": "d"},
            content=b'{"input_text": "a"}\n',
            headers={"content-type": "application/x-ndjson"},
        ),
        "list_datasets": Call("GET", "/datasets", {"limit": 1}),
        "get_dataset": Call("GET", f"/datasets/{w.dataset}"),
        "list_dataset_rows": Call("GET", f"/datasets/{w.dataset}/rows", {"limit": 1}),
        # A public address literal: the default settings refuse private targets, and a
        # literal needs no DNS.
        "create_webhook": Call("POST", "/webhooks", json=_WEBHOOK),
        "list_webhooks": Call("GET", "/webhooks", {"limit": 1}),
        "rotate_webhook_secret": Call("POST", f"/webhooks/{w.webhook}/rotate"),
        "list_webhook_deliveries": Call("GET", f"/webhooks/{w.webhook}/deliveries", {"limit": 1}),
        "delete_webhook": Call("DELETE", f"/webhooks/{w.doomed_webhook}"),
        "get_catalog": Call("GET", "/catalog"),
        "get_me": Call("GET", "/me"),
        "claim_episodes": Call(
            "POST", f"/runs/{w.gateway_run}/episodes/claim", json={"max": 1, "wait_seconds": 0}
        ),
        "list_episodes": Call("GET", f"/runs/{w.gateway_run}/episodes", {"limit": 1}),
        "get_episode": Call("GET", f"/episodes/{_episode(w, 'read')[0]}", {"tokens": "true"}),
        "finish_episode": _with_token(w, "finish", json={"reward": 0.5, "metrics": {"turns": 2}}),
        "fail_episode": _with_token(w, "fail", json={"error": "the sandbox died"}),
    }


def _episode(w: World, use: str) -> tuple[str, str]:
    return w.episodes.get(use, (str(uuid.uuid4()), "tye_none"))


def _with_token(w: World, verb: str, json: Any) -> Call:
    """A call to an episode route with the episode's token (not the project's key)."""
    episode, token = _episode(w, verb)
    return Call(
        "POST",
        f"/episodes/{episode}/{verb}",
        json=json,
        headers={"Authorization": f"Bearer {token}"},
    )


_WEBHOOK = {"url": "http://93.184.215.14/hook", "event_types": ["run.completed"]}


def _operations(doc: dict[str, Any]) -> dict[str, tuple[str, str, dict[str, Any]]]:
    return {
        op["operationId"]: (method.upper(), path, op)
        for path, ops in doc["paths"].items()
        for method, op in ops.items()
    }


def _validator(doc: dict[str, Any], schema: dict[str, Any]) -> Any:
    root = {**schema, "components": doc["components"]}
    return jsonschema_rs.Draft202012Validator(root, validate_formats=True)


def _check(doc: dict[str, Any], op: dict[str, Any], r: httpx.Response) -> int:
    """Validate ``r`` against ``op``'s documented answer; how many bodies were checked."""
    documented = op["responses"].get(str(r.status_code))
    assert documented is not None, f"{r.status_code} is not documented: {r.text[:500]}"
    if r.status_code == 204:  # No Content: documented without a body, and sent without one
        assert not r.content and not documented.get("content"), (r.content, documented)
        return 1
    media = r.headers["content-type"].split(";")[0]
    content = documented.get("content", {})
    assert media in content, (media, list(content))
    schema = content[media].get("schema")
    if media == "text/event-stream":
        return _check_events(doc, schema, r.text)
    if media == "application/x-ndjson":
        # The document says each line is a trajectory as GET /trajectories/{id} shows it.
        assert schema == {"type": "string", "contentMediaType": "application/x-ndjson"}
        assert content[media]["x-line-schema"] == {"$ref": "#/components/schemas/TrajectoryPublic"}
        line = _validator(doc, content[media]["x-line-schema"])
        lines = r.text.splitlines()
        for text in lines:
            _assert_valid(line, json.loads(text))
        return len(lines)
    assert schema is not None, f"{media} answer without a schema"
    _assert_valid(_validator(doc, schema), r.json())
    return 1


def _check_events(doc: dict[str, Any], stream: dict[str, Any], text: str) -> int:
    """Each event of the stream against the event schema (the stream's, under `if: object`:
    text to a generated client), its data against contentSchema."""
    assert "type" not in stream and stream["if"] == {"type": "object"}
    schema = stream["then"]
    event_schema = _validator(doc, schema)
    data_schema = _validator(doc, schema["properties"]["data"]["contentSchema"])
    events = 0
    for block in text.split("\n\n"):
        fields: dict[str, Any] = {}
        for line in block.splitlines():
            if line.startswith(":"):
                continue
            name, _, value = line.partition(": ")
            fields[name] = int(value) if name == "retry" else value
        if "data" not in fields:
            continue
        _assert_valid(event_schema, fields)
        _assert_valid(data_schema, json.loads(fields["data"]))
        events += 1
    return events


def _assert_valid(validator: Any, instance: Any) -> None:
    errors = [
        f"{'/'.join(map(str, e.instance_path))}: {e.message}"
        for e in validator.iter_errors(instance)
    ]
    assert not errors, (errors[:5], json.dumps(instance)[:500])


async def _send(client: httpx.AsyncClient, call: Call, headers: dict[str, str]) -> httpx.Response:
    return await client.request(
        call.method,
        call.path,
        params=call.params,
        json=call.json,
        content=call.content,
        headers={**headers, **call.headers},
    )


@pytest.fixture
async def world(client: httpx.AsyncClient, tenant: Any, sessionmaker: Any) -> World:
    async def create(**overrides: Any) -> str:
        r = await client.post("/runs", json=run_body(**overrides), headers=tenant.headers)
        assert r.status_code == 202, r.text
        return str(r.json()["id"])

    run = await create()
    await client.post(f"/runs/{run}/cancel", headers=tenant.headers)  # the stream then ends
    run_id = uuid.UUID(run)
    await add_trajectories(sessionmaker, run_id, step=1, count=2, reward=0.25)
    async with sessionmaker() as s:
        await metrics.record(s, run_id, 1, {"loss": 0.5, "reward_mean": 1})
        await metrics.record(s, run_id, 2, {"loss": 0.25})
        await checkpoints.record(s, run_id, 1, "/tmp/ckpt-1", metrics={"loss": 0.5})
        await checkpoints.record(s, run_id, 2, "/tmp/final", is_final=True)
        await s.commit()
    paused = await create()
    r = await client.post(f"/runs/{paused}/pause", headers=tenant.headers)
    assert r.status_code == 200, r.text
    r = await client.post(
        "/datasets",
        params={"name": "d"},
        content=b'{"input_text": "a"}\n{"input_text": "b", "split": "validation"}\n',
        headers={**tenant.headers, "content-type": "application/x-ndjson"},
    )
    assert r.status_code == 201, r.text
    page = (await client.get(f"/runs/{run}/trajectories", headers=tenant.headers)).json()

    async def webhook() -> str:
        r = await client.post("/webhooks", json=_WEBHOOK, headers=tenant.headers)
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    gateway_run = await create(environment={"type": "gateway"})
    await add_episodes(sessionmaker, uuid.UUID(gateway_run), 4)
    claim = await client.post(
        f"/runs/{gateway_run}/episodes/claim",
        json={"max": 3, "wait_seconds": 0},
        headers=tenant.headers,
    )
    assert claim.status_code == 200, claim.text
    claimed = [(e["id"], e["token"]) for e in claim.json()["episodes"]]
    assert len(claimed) == 3, claim.text

    return World(
        gateway_run=gateway_run,
        episodes=dict(zip(["read", "finish", "fail"], claimed, strict=True)),
        run=run,
        pausable=await create(),
        paused=paused,
        cancellable=await create(),
        dataset=str(r.json()["id"]),
        trajectory=page["data"][0]["id"],
        webhook=await webhook(),
        doomed_webhook=await webhook(),
    )


async def test_every_operation_has_a_case(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/openapi.json")).json()
    fake = World(*(str(uuid.uuid4()) for _ in range(9)))
    assert set(_operations(doc)) == set(_calls(fake))


async def test_every_answer_validates_against_the_document(
    client: httpx.AsyncClient, tenant: Any, world: World
) -> None:
    doc = (await client.get("/openapi.json")).json()
    operations = _operations(doc)
    for operation_id, call in _calls(world).items():
        method, _, op = operations[operation_id]
        assert call.method == method, operation_id
        r = await _send(client, call, tenant.headers)
        # /readyz says what the broker says; either answer must be the documented one.
        assert r.is_success or operation_id == "readyz", (operation_id, r.status_code, r.text)
        assert _check(doc, op, r) >= 1, operation_id


async def test_the_full_answers_of_the_hot_routes_validate(
    client: httpx.AsyncClient, tenant: Any, world: World
) -> None:
    """The routes PostgreSQL renders, with everything in them (not one row per page)."""
    doc = (await client.get("/openapi.json")).json()
    operations = _operations(doc)
    for operation_id, params in [
        ("list_run_events", {}),
        ("get_run_metrics", {}),
        ("get_run_metrics", {"name": ["loss", "none"], "step_min": 2}),
        ("list_run_trajectories", {}),
        ("list_trajectories", {"include_messages": "false", "include_metadata": "false"}),
    ]:
        _, path, op = operations[operation_id]
        url = path.format(run_id=world.run)
        r = await client.get(url, params=params, headers=tenant.headers)
        assert r.status_code == 200, r.text
        _check(doc, op, r)
    series = (await client.get(f"/runs/{world.run}/metrics", headers=tenant.headers)).json()
    assert series["series"] == [
        {"name": "loss", "points": [{"step": 1, "value": 0.5}, {"step": 2, "value": 0.25}]},
        {"name": "reward_mean", "points": [{"step": 1, "value": 1.0}]},
    ]


async def test_every_refusal_validates_against_the_document(
    client: httpx.AsyncClient, tenant: Any, world: World
) -> None:
    """401 without a key, 404 for an id the project does not have, 422 for a bad page size:
    each as the problem schema the operation declares for that status."""
    doc = (await client.get("/openapi.json")).json()
    operations = _operations(doc)
    unknown = str(uuid.uuid4())
    checked = 0
    for operation_id, call in _calls(world).items():
        _, path, op = operations[operation_id]
        if "401" in op["responses"]:
            _check(doc, op, await _send(client, call, {}))
            checked += 1
        if "{" in path:
            missing = Call(
                call.method,
                path.format(**dict.fromkeys(_names(path), unknown)),
                headers=call.headers,  # an episode route's token: it opens another episode
            )
            r = await _send(client, missing, tenant.headers)
            assert r.status_code == 404, (operation_id, r.text)
            _check(doc, op, r)
            checked += 1
        if any(p["name"] == "limit" for p in op.get("parameters", [])):
            r = await _send(client, Call(call.method, call.path, {"limit": 0}), tenant.headers)
            assert r.status_code == 422, (operation_id, r.text)
            _check(doc, op, r)
            checked += 1
    assert checked > len(operations)


def _names(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{")]


async def test_rows_wider_than_their_field_still_answer_the_schema(
    client: httpx.AsyncClient, tenant: Any, world: World, sessionmaker: Any
) -> None:
    """PostgreSQL renders these answers, so the SQL narrows what a column can hold beyond
    its field: a NaN metric value (JSON has no NaN; PostgreSQL writes the string "NaN") and
    an event whose jsonb `data` is not an object. Neither is written by the service; a row
    put there by hand must not make the answer break its schema."""
    from sqlalchemy import text

    async with sessionmaker() as s:
        await s.execute(
            text(
                "INSERT INTO metric_points (run_id, step, name, value)"
                " VALUES (:run, 3, 'loss', 'NaN'), (:run, 4, 'loss', 'Infinity')"
            ),
            {"run": uuid.UUID(world.run)},
        )
        await s.execute(
            text(
                "INSERT INTO run_events (run_id, type, level, message, data)"
                # A type the document names (an enum); the data is what is too wide.
                " VALUES (:run, 'status', 'info', 'by hand', '[1, 2]')"
            ),
            {"run": uuid.UUID(world.run)},
        )
        await s.commit()
    doc = (await client.get("/openapi.json")).json()
    operations = _operations(doc)
    r = await client.get(f"/runs/{world.run}/metrics", headers=tenant.headers)
    _check(doc, operations["get_run_metrics"][2], r)
    loss = next(x for x in r.json()["series"] if x["name"] == "loss")
    assert [p["step"] for p in loss["points"]] == [1, 2]
    r = await client.get(f"/runs/{world.run}/events", headers=tenant.headers)
    _check(doc, operations["list_run_events"][2], r)
    assert r.json()["data"][-1]["data"] == {}
