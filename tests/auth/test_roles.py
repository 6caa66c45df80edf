"""Key roles (app/auth/roles.py): a viewer reads, a member also creates and controls runs and
uploads datasets, an admin also manages webhooks. The write operations are taken from
``/openapi.json``, so a write route added without a role check fails here the day it is
added; ``NEEDS`` says which role each operation needs (every other one is any key's). An episode's
finish and fail take that episode's token, not a key: roles do not apply to them
(tests/gateway/test_gateway_run.py pins what the token opens)."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import jsonschema_rs
import pytest

from app.auth.deps import FORBIDDEN
from app.auth.roles import Role
from app.core.pg import connect_kwargs
from tests.support import ROOT
from tests.support.cli import cli, user_env
from tests.support.database import OwnDatabase, Tenant, own_database  # noqa: F401
from tests.support.runs import add_episodes, add_trajectories, run_body

PROBLEM = "application/problem+json"
READS = {"get", "head", "options"}
PUBLIC = {"/healthz", "/readyz"}

# The role each operation needs above viewer. Webhooks are admin's, their reads too: a target
# URL is often a credential (an incoming-webhook URL carries its token).
NEEDS = {
    "create_run": Role.member,
    "cancel_run": Role.member,
    "pause_run": Role.member,
    "resume_run": Role.member,
    "create_dataset": Role.member,
    "claim_episodes": Role.member,
    "create_webhook": Role.admin,
    "rotate_webhook_secret": Role.admin,
    "delete_webhook": Role.admin,
    "list_webhooks": Role.admin,
    "list_webhook_deliveries": Role.admin,
}
# A public address literal: the default settings refuse private targets; a literal needs no DNS.
WEBHOOK = {"url": "http://93.184.215.14/hook", "event_types": ["run.completed"]}
NDJSON = {"Content-Type": "application/x-ndjson"}


@dataclass(frozen=True)
class Project:
    """One project and a key of each role."""

    admin: Tenant
    member: Tenant
    viewer: Tenant

    def key(self, role: Role) -> Tenant:
        return {Role.admin: self.admin, Role.member: self.member, Role.viewer: self.viewer}[role]


@pytest.fixture
async def project(make_tenant: Any) -> Project:
    admin = await make_tenant()
    return Project(
        admin,
        await make_tenant(admin.name, role="member"),
        await make_tenant(admin.name, role="viewer"),
    )


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    operation_id: str
    doc: dict[str, Any]


@pytest.fixture
async def document(client: httpx.AsyncClient) -> dict[str, Any]:
    return (await client.get("/openapi.json")).json()


def operations(document: dict[str, Any]) -> list[Operation]:
    return [
        Operation(method.upper(), path, op["operationId"], op)
        for path, item in document["paths"].items()
        for method, op in item.items()
        if method in {"get", "post", "put", "patch", "delete"}
        and path not in PUBLIC
        and {"EpisodeToken": []} not in op.get("security", [])
    ]


def writes(document: dict[str, Any]) -> list[Operation]:
    return [op for op in operations(document) if op.method.lower() not in READS]


@dataclass(frozen=True)
class World:
    """Real objects of the project, one for each thing a path can name and each state an
    action needs."""

    run: str  # pending: a write that got through would show on it
    finished: str  # cancelled, with trajectories: its event stream ends
    pausable: str
    paused: str
    dataset: str
    trajectory: str
    episode: str  # of the finished run
    webhook: str
    doomed_webhook: str

    def fill(self, path: str, run: str | None = None, webhook: str | None = None) -> str:
        ids = {
            "run_id": run or self.run,
            "dataset_id": self.dataset,
            "trajectory_id": self.trajectory,
            "episode_id": self.episode,
            "webhook_id": webhook or self.webhook,
        }
        for name, value in ids.items():
            path = path.replace("{" + name + "}", value)
        assert "{" not in path, f"no id for {path}: add it to World"
        return path


@pytest.fixture
async def world(client: httpx.AsyncClient, project: Project, sessionmaker: Any) -> World:
    admin = project.admin.headers

    async def run(**body: Any) -> str:
        r = await client.post("/runs", json=run_body(**body), headers=admin)
        assert r.status_code == 202, r.text
        return str(r.json()["id"])

    async def webhook() -> str:
        r = await client.post("/webhooks", json=WEBHOOK, headers=admin)
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    finished = await run(environment={"type": "gateway"})  # it has episodes to claim
    assert (await client.post(f"/runs/{finished}/cancel", headers=admin)).status_code == 200
    await add_trajectories(sessionmaker, uuid.UUID(finished), 0, 1)
    trajectory = (await client.get("/trajectories", headers=admin)).json()["data"][0]["id"]
    (episode,) = await add_episodes(sessionmaker, uuid.UUID(finished), 1)
    paused = await run()
    assert (await client.post(f"/runs/{paused}/pause", headers=admin)).status_code == 200
    dataset = await client.post(
        "/datasets", content=b'{"input_text": "a"}\n', headers=NDJSON | admin
    )
    assert dataset.status_code == 201, dataset.text
    return World(
        run=await run(),
        finished=finished,
        pausable=await run(),
        paused=paused,
        dataset=dataset.json()["id"],
        trajectory=trajectory,
        episode=str(episode),
        webhook=await webhook(),
        doomed_webhook=await webhook(),
    )


def allowed_call(op: Operation, world: World) -> dict[str, Any]:
    """A request to ``op`` that succeeds for a key that may make it."""
    run = {
        "cancel_run": world.run,
        "pause_run": world.pausable,
        "resume_run": world.paused,
    }.get(op.operation_id, world.finished)
    call: dict[str, Any] = {
        "method": op.method,
        "url": world.fill(
            op.path, run=run, webhook=world.doomed_webhook if op.method == "DELETE" else None
        ),
    }
    if op.operation_id == "create_run":
        call["json"] = run_body()
    elif op.operation_id == "create_dataset":
        call |= {"content": b'{"input_text": "b"}\n', "headers": NDJSON}
    elif op.operation_id == "create_webhook":
        call["json"] = WEBHOOK
    return call


async def send(client: httpx.AsyncClient, call: dict[str, Any], key: Tenant) -> httpx.Response:
    call = dict(call)
    headers = {**call.pop("headers", {}), **key.headers}
    return await client.request(headers=headers, **call)


def assert_forbidden(r: httpx.Response, needed: Role, have: Role, what: str) -> None:
    assert r.status_code == 403, f"{what}: {r.status_code} {r.text}"
    assert r.headers["content-type"] == PROBLEM, what
    problem = r.json()
    assert problem["type"] == FORBIDDEN and problem["status"] == 403, (what, problem)
    assert problem["required_role"] == needed.value and problem["key_role"] == have.value
    assert f"'{needed.value}'" in problem["detail"] and f"'{have.value}'" in problem["detail"]


def validates(document: dict[str, Any], op: Operation, r: httpx.Response) -> None:
    """``r`` is the answer ``op`` documents for its status."""
    schema = op.doc["responses"][str(r.status_code)]["content"][PROBLEM]["schema"]
    validator = jsonschema_rs.validator_for({**schema, "components": document["components"]})
    validator.validate(r.json())


# --- the order and the table ----------------------------------------------------------------


def test_each_role_allows_what_the_ones_below_allow() -> None:
    assert [r.value for r in Role] == ["viewer", "member", "admin"]
    for have in Role:
        for needed in Role:
            assert have.allows(needed) == (list(Role).index(have) >= list(Role).index(needed))
    # As text, "admin" < "member" < "viewer": the order is never asked for with `<`.
    assert not Role.viewer.allows(Role.admin) and Role.admin.allows(Role.viewer)


async def test_every_write_operation_needs_a_role_and_documents_its_403(document) -> None:
    found = {op.operation_id: op for op in operations(document)}
    for op in writes(document):
        assert op.operation_id in NEEDS, f"{op.method} {op.path}: which role may call it?"
    for operation_id in NEEDS:
        op = found[operation_id]
        content = op.doc["responses"]["403"]["content"]
        assert list(content) == [PROBLEM], operation_id
        assert content[PROBLEM]["schema"] == {"$ref": "#/components/schemas/ProblemDetail"}
    assert len(writes(document)) >= 8


# --- viewer -----------------------------------------------------------------------------------


async def test_a_viewer_is_refused_every_write_operation(
    client: httpx.AsyncClient, project: Project, world: World, document: dict[str, Any]
) -> None:
    """403 on every write, whatever the body: none, empty JSON, JSON of the wrong shape, the
    wrong media type, a path id that is no UUID. FastAPI solves a route's dependencies
    (the role check) before it validates the path, query, headers and body, and raises the
    validation errors only after them, so the 403 wins over every 422 a body could earn."""
    viewer = project.viewer
    bodies: list[dict[str, Any]] = [
        {},
        {"json": {}},
        {"json": {"nonsense": [1]}},
        {"json": []},
        {"content": b"\x00\x01", "headers": {"Content-Type": "application/octet-stream"}},
        {"content": b'{"input_text": "a"}\n', "headers": NDJSON},
    ]
    checked = 0
    for op in writes(document):
        needed = NEEDS[op.operation_id]
        for body in bodies:
            call = {"method": op.method, "url": world.fill(op.path), **body}
            r = await send(client, call, viewer)
            assert_forbidden(r, needed, Role.viewer, f"{op.method} {op.path} {body}")
            validates(document, op, r)
            checked += 1
        if "{" in op.path:
            bad_id = op.path.split("{")[0] + "not-a-uuid" + op.path.split("}", 1)[1]
            r = await send(client, {"method": op.method, "url": bad_id}, viewer)
            assert_forbidden(r, needed, Role.viewer, f"{op.method} {bad_id}")
    assert checked >= 8 * len(bodies)

    # Nothing happened: the run is still pending, the webhooks and the dataset still there.
    admin = project.admin.headers
    assert (await client.get(f"/runs/{world.run}", headers=admin)).json()["status"] == "pending"
    assert (await client.get(f"/runs/{world.paused}", headers=admin)).json()["status"] == "paused"
    hooks = (await client.get("/webhooks", headers=admin)).json()["data"]
    assert {h["id"] for h in hooks} == {world.webhook, world.doomed_webhook}
    assert len((await client.get("/datasets", headers=admin)).json()["data"]) == 1
    runs = (await client.get("/runs", params={"limit": 100}, headers=admin)).json()["data"]
    assert len(runs) == 4


async def test_json_that_does_not_parse_is_refused_before_the_role_check(
    client: httpx.AsyncClient, project: Project, world: World
) -> None:
    """Pins FastAPI's order: a JSON body is *parsed* before the dependencies run (malformed
    JSON is a 422 for any key, as it is a 422 without a key), and *validated* after them
    (a well-formed body of the wrong shape is the viewer's 403, above, and a member's 422)."""
    malformed = {"content": b'{"model_name": ', "headers": {"Content-Type": "application/json"}}
    for key in (project.viewer, project.member):
        r = await send(client, {"method": "POST", "url": "/runs", **malformed}, key)
        assert r.status_code == 422 and r.json()["errors"][0]["type"] == "json_invalid", r.text
    r = await send(client, {"method": "POST", "url": "/runs", "json": {}}, project.member)
    assert r.status_code == 422 and r.headers["content-type"] == PROBLEM, r.text
    assert {e["field"] for e in r.json()["errors"]} >= {"body.model_name"}


async def test_a_viewer_reads_everything_but_webhooks(
    client: httpx.AsyncClient, project: Project, world: World, document: dict[str, Any]
) -> None:
    reads = [op for op in operations(document) if op.method.lower() in READS]
    assert len(reads) >= 15
    for op in reads:
        r = await send(client, allowed_call(op, world), project.viewer)
        if op.operation_id in NEEDS:
            assert_forbidden(r, NEEDS[op.operation_id], Role.viewer, op.operation_id)
        else:
            assert r.status_code == 200, f"{op.operation_id}: {r.status_code} {r.text}"


# --- member and admin ---------------------------------------------------------------------------


async def test_a_member_is_refused_the_admin_operations_and_allowed_the_rest(
    client: httpx.AsyncClient, project: Project, world: World, document: dict[str, Any]
) -> None:
    # DELETEs last: what they remove is named by the calls before them.
    ordered = sorted(operations(document), key=lambda op: op.method == "DELETE")
    allowed = 0
    for op in ordered:
        call = allowed_call(op, world)
        r = await send(client, call, project.member)
        if NEEDS.get(op.operation_id) == Role.admin:
            assert_forbidden(r, Role.admin, Role.member, op.operation_id)
            validates(document, op, r)
        else:
            assert r.is_success, f"{op.operation_id}: {r.status_code} {r.text}"
            allowed += 1
    assert allowed >= 20
    member_ops = [name for name, role in NEEDS.items() if role == Role.member]
    assert set(member_ops) <= {op.operation_id for op in ordered}
    # What the member did took effect: its run (202 above), the actions.
    admin = project.admin.headers
    assert (await client.get(f"/runs/{world.run}", headers=admin)).json()["status"] == "cancelled"
    assert (await client.get(f"/runs/{world.paused}", headers=admin)).json()["status"] == "pending"
    r = await client.post("/runs", json=run_body(), headers=project.member.headers)
    assert r.status_code == 202, r.text


async def test_an_admin_may_do_everything(
    client: httpx.AsyncClient, project: Project, world: World, document: dict[str, Any]
) -> None:
    ordered = sorted(operations(document), key=lambda op: op.method == "DELETE")
    for op in ordered:
        r = await send(client, allowed_call(op, world), project.admin)
        assert r.is_success, f"{op.operation_id}: {r.status_code} {r.text}"
    hooks = (await client.get("/webhooks", headers=project.admin.headers)).json()["data"]
    assert world.doomed_webhook not in {h["id"] for h in hooks}


# --- GET /me and other projects ----------------------------------------------------------------


async def test_me_says_which_key_of_which_project_and_its_role(
    client: httpx.AsyncClient, project: Project, document: dict[str, Any]
) -> None:
    schema = document["paths"]["/me"]["get"]["responses"]["200"]["content"]["application/json"]
    validator = jsonschema_rs.validator_for(
        {**schema["schema"], "components": document["components"]}
    )
    for role in Role:
        tenant = project.key(role)
        r = await client.get("/me", headers=tenant.headers)
        assert r.status_code == 200, r.text
        me = r.json()
        validator.validate(me)
        assert me == {
            "project": {"id": str(tenant.project_id), "name": tenant.name},
            "key": {
                "id": str(tenant.key_id),
                "name": None,
                "prefix": tenant.key[:10],
                "role": role.value,
            },
        }
    r = await client.get("/me")
    assert r.status_code == 401 and r.headers["content-type"] == PROBLEM
    assert "401" in document["paths"]["/me"]["get"]["responses"]


async def test_another_projects_keys_see_404_whatever_their_role(
    client: httpx.AsyncClient, project: Project, world: World, make_tenant: Any
) -> None:
    admin = await make_tenant()
    others = [
        admin,
        await make_tenant(admin.name, role="member"),
        await make_tenant(admin.name, role="viewer"),
    ]
    for other in others:
        for path in (f"/runs/{world.run}", f"/datasets/{world.dataset}"):
            r = await client.get(path, headers=other.headers)
            assert r.status_code == 404 and r.headers["content-type"] == PROBLEM, (other.role, path)
        r = await client.post(f"/runs/{world.run}/cancel", headers=other.headers)
        if other.role == "viewer":
            # The role is checked before the run is looked up: a viewer's 403 is the same for
            # any id, so it says nothing about this project's runs.
            guessed = await client.post(f"/runs/{uuid.uuid4()}/cancel", headers=other.headers)
            assert r.status_code == guessed.status_code == 403
            assert r.json()["detail"] == guessed.json()["detail"]
        else:
            assert r.status_code == 404, (other.role, r.text)
    r = await client.delete(f"/webhooks/{world.webhook}", headers=admin.headers)
    assert r.status_code == 404
    me = (await client.get(f"/runs/{world.run}", headers=project.viewer.headers)).json()
    assert me["status"] == "pending"


# --- the column and its migration ---------------------------------------------------------------


# A key as every version of the schema takes it: no role.
INSERT_KEY = "INSERT INTO api_keys (id, project_id, prefix, key_hash) VALUES ($1, $2, $3, $4)"


def _migrate(url: str, command: str, revision: str) -> None:
    from alembic import command as commands
    from alembic.config import Config

    cfg = Config(str(ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(ROOT / "migrations"))
    cfg.attributes["url"] = url
    cfg.attributes["skip_logging"] = True
    getattr(commands, command)(cfg, revision)


async def test_keys_made_before_roles_become_admin(own_database: OwnDatabase) -> None:  # noqa: F811
    url = own_database.url
    # Alembic's env runs its own event loop: in a thread of its own.
    await asyncio.to_thread(_migrate, url, "downgrade", "0012")
    conn = await asyncpg.connect(**connect_kwargs(url))
    try:
        project_id, key_id = uuid.uuid4(), uuid.uuid4()
        await conn.execute("INSERT INTO projects (id, name) VALUES ($1, 'old')", project_id)
        await conn.execute(INSERT_KEY, key_id, project_id, "ty_old", "h1")
        await asyncio.to_thread(_migrate, url, "upgrade", "head")
        assert await conn.fetchval("SELECT role FROM api_keys WHERE id = $1", key_id) == "admin"
        # A row inserted without a role is admin too (the server default stays) ...
        await conn.execute(INSERT_KEY, uuid.uuid4(), project_id, "ty_new", "h2")
        roles = await conn.fetch("SELECT role FROM api_keys WHERE project_id = $1", project_id)
        assert [r["role"] for r in roles] == ["admin", "admin"]
        # ... and a role is one of the three.
        with pytest.raises(asyncpg.CheckViolationError):
            await conn.execute(
                "INSERT INTO api_keys (id, project_id, prefix, key_hash, role)"
                " VALUES ($1, $2, 'ty_bad', 'h3', 'owner')",
                uuid.uuid4(),
                project_id,
            )
        # The downgrade takes the column away again.
        await asyncio.to_thread(_migrate, url, "downgrade", "0012")
        columns = await conn.fetch(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'api_keys'"
        )
        assert "role" not in {c["column_name"] for c in columns}
    finally:
        await conn.close()


async def test_a_key_inserted_without_a_role_is_an_admin_to_the_api(
    client: httpx.AsyncClient, sessionmaker: Any, service_urls: tuple[str, str]
) -> None:
    from app.auth.service import KEY_PREFIX, get_or_create_project, hash_key

    plain = KEY_PREFIX + uuid.uuid4().hex
    async with sessionmaker() as s:
        project = await get_or_create_project(s, f"proj-{uuid.uuid4().hex[:8]}")
        await s.commit()
    conn = await asyncpg.connect(**connect_kwargs(service_urls[0]))
    try:
        await conn.execute(INSERT_KEY, uuid.uuid4(), project.id, plain[:10], hash_key(plain))
    finally:
        await conn.close()
    r = await client.get("/me", headers={"Authorization": f"Bearer {plain}"})
    assert r.status_code == 200 and r.json()["key"]["role"] == "admin", r.text


# --- the CLI ----------------------------------------------------------------------------------


async def test_keys_create_takes_a_role_and_keys_list_shows_it(
    client: httpx.AsyncClient, service_urls: tuple[str, str], tmp_path: Path
) -> None:
    env = user_env(tmp_path / "user", TRAINYARD_DATABASE_URL=service_urls[0])
    name = f"roles-{uuid.uuid4().hex[:8]}"

    async def create(*args: str) -> dict[str, Any]:
        made = await asyncio.to_thread(
            cli, "keys", "create", "--project", name, "--json", *args, cwd=tmp_path, env=env
        )
        assert made.returncode == 0, made.stderr
        return dict(json.loads(made.stdout))

    default, viewer = await create(), await create("--role", "viewer")
    assert default["role"] == "member" and viewer["role"] == "viewer"
    for made in (default, viewer):
        me = await client.get("/me", headers={"Authorization": f"Bearer {made['key']}"})
        assert me.json()["key"]["role"] == made["role"], me.text
    refused = await asyncio.to_thread(
        cli, "keys", "create", "--project", name, "--role", "owner", cwd=tmp_path, env=env
    )
    assert refused.returncode != 0 and "owner" in refused.stderr
    listed = await asyncio.to_thread(
        cli, "keys", "list", "--project", name, "--json", cwd=tmp_path, env=env
    )
    roles = {k["id"]: k["role"] for k in json.loads(listed.stdout)}
    assert roles == {default["id"]: "member", viewer["id"]: "viewer"}
    human = await asyncio.to_thread(cli, "keys", "list", "--project", name, cwd=tmp_path, env=env)
    assert "role" in human.stdout.splitlines()[0] and "viewer" in human.stdout
