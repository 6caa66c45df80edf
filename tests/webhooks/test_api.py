"""``/webhooks``: create, list, rotate, delete and their refusals; a project sees only its
own webhooks; private targets are refused unless the server allows them."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from standardwebhooks import Webhook

from app.checkpoints import service as checkpoints
from app.webhooks.targets import _private
from tests.support.runs import create_run

PROBLEM = "application/problem+json"
HOOK = {"url": "http://127.0.0.1:9/hook", "event_types": ["run.completed", "checkpoint.saved"]}


def assert_problem(r: Any, status: int, field: str | None = None) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == PROBLEM
    if field is not None:
        assert any(e["field"] == field for e in r.json()["errors"]), r.json()


async def test_create_list_rotate_delete(private_client, tenant) -> None:
    r = await private_client.post("/webhooks", json=HOOK, headers=tenant.headers)
    assert r.status_code == 201, r.text
    created = r.json()
    assert created["url"] == HOOK["url"]
    assert created["event_types"] == HOOK["event_types"]
    secret = created["secret"]
    assert secret.startswith("whsec_")
    Webhook(secret)  # a secret the Standard Webhooks library takes

    listed = await private_client.get("/webhooks", headers=tenant.headers)
    assert listed.status_code == 200
    assert [w["id"] for w in listed.json()["data"]] == [created["id"]]
    assert "secret" not in listed.json()["data"][0]

    rotated = await private_client.post(f"/webhooks/{created['id']}/rotate", headers=tenant.headers)
    assert rotated.status_code == 200, rotated.text
    assert rotated.json()["secret"].startswith("whsec_")
    assert rotated.json()["secret"] != secret

    gone = await private_client.delete(f"/webhooks/{created['id']}", headers=tenant.headers)
    assert gone.status_code == 204
    assert_problem(
        await private_client.delete(f"/webhooks/{created['id']}", headers=tenant.headers), 404
    )
    listed = await private_client.get("/webhooks", headers=tenant.headers)
    assert listed.json()["data"] == []


async def test_event_types_named_twice_count_once(private_client, tenant) -> None:
    body = {"url": HOOK["url"], "event_types": ["run.failed", "run.failed", "run.paused"]}
    r = await private_client.post("/webhooks", json=body, headers=tenant.headers)
    assert r.status_code == 201, r.text
    assert r.json()["event_types"] == ["run.failed", "run.paused"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**HOOK, "url": "ftp://127.0.0.1/hook"}, "body.url"),
        ({**HOOK, "url": "http://"}, "body.url"),
        ({**HOOK, "url": "http://127.0.0.1:99999/"}, "body.url"),
        ({**HOOK, "url": "http://" + "a" * 64 + ".example/"}, "body.url"),
        ({**HOOK, "event_types": []}, "body.event_types"),
        ({**HOOK, "event_types": ["run.started"]}, "body.event_types[0]"),
        ({"url": HOOK["url"]}, "body.event_types"),
        ({**HOOK, "secret": "whsec_mine"}, "body.secret"),
    ],
    ids=[
        "scheme",
        "no-host",
        "port",
        "label",
        "no-types",
        "unknown-type",
        "missing-types",
        "read-only-secret",
    ],
)
async def test_bad_input_is_422(private_client, tenant, body, field) -> None:
    r = await private_client.post("/webhooks", json=body, headers=tenant.headers)
    assert_problem(r, 422, field)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8080/hook",
        "http://localhost/hook",
        "http://10.1.2.3/hook",
        "http://169.254.169.254/latest/meta-data",
        "http://[::1]/hook",
        "http://[::ffff:127.0.0.1]/hook",
    ],
)
async def test_private_targets_refused_without_the_setting(public_client, tenant, url) -> None:
    r = await public_client.post("/webhooks", json={**HOOK, "url": url}, headers=tenant.headers)
    assert_problem(r, 422, "body.url")
    assert "webhooks_allow_private" in r.json()["errors"][0]["message"]


def test_what_counts_as_private() -> None:
    for address in (
        "127.0.0.1",
        "10.0.0.1",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",
        "100.64.0.1",
        "0.0.0.0",
        "::1",
        "fe80::1%eth0",
        "fc00::1",
        "::ffff:10.0.0.1",
        "224.0.0.1",
    ):
        assert _private(address), address
    for address in ("8.8.8.8", "2606:4700:4700::1111"):
        assert not _private(address), address


async def test_a_project_sees_only_its_webhooks(private_client, make_tenant) -> None:
    owner, other = await make_tenant(), await make_tenant()
    r = await private_client.post("/webhooks", json=HOOK, headers=owner.headers)
    webhook_id = r.json()["id"]
    listed = await private_client.get("/webhooks", headers=other.headers)
    assert listed.json()["data"] == []
    for method, path in (
        ("DELETE", f"/webhooks/{webhook_id}"),
        ("POST", f"/webhooks/{webhook_id}/rotate"),
        ("GET", f"/webhooks/{webhook_id}/deliveries"),
        ("GET", f"/webhooks/{uuid.uuid4()}/deliveries"),
    ):
        assert_problem(await private_client.request(method, path, headers=other.headers), 404)
    # Still there for its owner.
    listed = await private_client.get("/webhooks", headers=owner.headers)
    assert [w["id"] for w in listed.json()["data"]] == [webhook_id]


async def test_deliveries_page_newest_first(private_client, sessionmaker, tenant) -> None:
    r = await private_client.post("/webhooks", json=HOOK, headers=tenant.headers)
    webhook_id = r.json()["id"]
    run = await create_run(sessionmaker, project_id=tenant.project_id)
    async with sessionmaker() as s:
        for step in (1, 2, 3):
            await checkpoints.record(s, run.id, step, f"/ckpt/{step}")
            await s.commit()  # one transaction each: three distinct created_at
    path = f"/webhooks/{webhook_id}/deliveries"
    first = await private_client.get(path, params={"limit": 2}, headers=tenant.headers)
    assert first.status_code == 200, first.text
    page = first.json()
    assert page["has_more"] is True
    steps = [d["payload"]["data"]["step"] for d in page["data"]]
    assert steps == [3, 2]
    assert {d["state"] for d in page["data"]} == {"pending"}
    assert all(d["attempts"] == 0 and d["event_type"] == "checkpoint.saved" for d in page["data"])
    rest = await private_client.get(
        path, params={"limit": 2, "after": page["next_cursor"]}, headers=tenant.headers
    )
    assert [d["payload"]["data"]["step"] for d in rest.json()["data"]] == [1]
    assert rest.json()["has_more"] is False
    # A cursor of this list is not one of another webhook's.
    r = await private_client.post("/webhooks", json=HOOK, headers=tenant.headers)
    other = f"/webhooks/{r.json()['id']}/deliveries"
    bad = await private_client.get(
        other, params={"after": page["next_cursor"]}, headers=tenant.headers
    )
    assert_problem(bad, 422, "query.after")

    # Deleting the webhook drops what it had still to send.
    await private_client.delete(f"/webhooks/{webhook_id}", headers=tenant.headers)
    assert_problem(await private_client.get(path, headers=tenant.headers), 404)


async def test_list_pages_oldest_first(private_client, tenant) -> None:
    ids = []
    for _ in range(3):
        r = await private_client.post("/webhooks", json=HOOK, headers=tenant.headers)
        ids.append(r.json()["id"])
    first = await private_client.get("/webhooks", params={"limit": 2}, headers=tenant.headers)
    assert [w["id"] for w in first.json()["data"]] == ids[:2]
    assert first.json()["has_more"] is True
    rest = await private_client.get(
        "/webhooks",
        params={"limit": 2, "after": first.json()["next_cursor"]},
        headers=tenant.headers,
    )
    assert [w["id"] for w in rest.json()["data"]] == ids[2:]
    assert rest.json()["has_more"] is False


async def test_a_project_has_at_most_so_many_webhooks(private_client, tenant) -> None:
    from app.webhooks.service import MAX_WEBHOOKS_PER_PROJECT

    for _ in range(MAX_WEBHOOKS_PER_PROJECT):
        r = await private_client.post("/webhooks", json=HOOK, headers=tenant.headers)
        assert r.status_code == 201, r.text
    r = await private_client.post("/webhooks", json=HOOK, headers=tenant.headers)
    assert_problem(r, 429)
