"""``trainyard keys``: create, list and revoke API keys, straight on the database (whoever
reaches the database is trusted); :func:`create_key` also makes the key of ``trainyard up``."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import typer

from app.auth.roles import Role  # an enum alone: `keys create --role` lists its values
from app.cli.common import CliError, Json, err, print_json, settings, table
from app.cli.db import on_database

keys_app = typer.Typer(no_args_is_help=True, help="API keys (straight from the database).")


def create_key(db_url: str, project: str, name: str | None, role: Role) -> tuple[str, str]:
    """A new key of ``role`` in ``project`` (made if missing): its id and the key itself."""
    from app.auth.service import create_key as new_key
    from app.auth.service import get_or_create_project
    from app.core.db import make_engine, make_sessionmaker, session_scope

    async def _create() -> tuple[str, str]:
        engine = make_engine(db_url, pool_size=1)
        try:
            async with session_scope(make_sessionmaker(engine)) as session:
                proj = await get_or_create_project(session, project)
                key, plain = await new_key(session, proj, name=name, role=role)
                return str(key.id), plain
        finally:
            await engine.dispose()

    return on_database(db_url, lambda: asyncio.run(_create()))


@keys_app.command("create")
def keys_create(
    project: Annotated[str, typer.Option(help="Project name; created if it does not exist.")],
    name: Annotated[str | None, typer.Option(help="A label for the key.")] = None,
    role: Annotated[
        Role,
        typer.Option(
            help="What the key may do in its project: viewer (read only), member (also "
            "create and control runs, upload datasets) or admin (also webhooks).",
        ),
    ] = Role.member,
    as_json: Json = False,
) -> None:
    """Create an API key. The key is printed alone on the last line of stdout, once."""
    from app.core.services import client_database_url

    key_id, plain = create_key(client_database_url(settings()), project, name, role)
    if as_json:
        print_json(
            {"id": key_id, "project": project, "name": name, "role": role.value, "key": plain}
        )
        return
    err.print(f"{role.value} key {key_id} for project {project!r} (shown once; store it now):")
    print(plain, flush=True)


@keys_app.command("revoke")
def keys_revoke(key_id: str) -> None:
    """Revoke a key by id; API processes stop accepting it within seconds."""
    import uuid

    from app.auth.service import revoke_key
    from app.core.db import make_engine, make_sessionmaker, session_scope
    from app.core.services import client_database_url

    try:
        parsed = uuid.UUID(key_id)
    except ValueError:
        raise CliError(f"{key_id!r} is not a key id (a UUID, as `keys create` prints)") from None
    db_url = client_database_url(settings())

    async def _revoke() -> bool:
        engine = make_engine(db_url, pool_size=1)
        try:
            async with session_scope(make_sessionmaker(engine)) as session:
                return await revoke_key(session, parsed)
        finally:
            await engine.dispose()

    if not on_database(db_url, lambda: asyncio.run(_revoke())):
        raise CliError(f"no active key {key_id}")
    err.print("revoked")


@keys_app.command("list")
def keys_list(
    project: Annotated[str | None, typer.Option(help="Only this project's keys.")] = None,
    as_json: Json = False,
) -> None:
    """List API keys, newest first: id, project, name, role, the key's first characters, when
    it was made, last used and revoked. Never a key itself (only its hash is stored)."""
    from app.auth.service import list_keys
    from app.core.db import make_engine, make_sessionmaker, session_scope
    from app.core.services import client_database_url

    db_url = client_database_url(settings())

    async def _list() -> list[dict[str, Any]]:
        engine = make_engine(db_url, pool_size=1)
        try:
            async with session_scope(make_sessionmaker(engine)) as session:
                rows = await list_keys(session, project=project)
        finally:
            await engine.dispose()

        def when(value: Any) -> str | None:
            return value.isoformat() if value is not None else None

        return [
            {
                "id": str(key.id),
                "project": name,
                "name": key.name,
                "role": str(key.role),
                "prefix": key.prefix,
                "created_at": when(key.created_at),
                "last_used_at": when(key.last_used_at),
                "revoked_at": when(key.revoked_at),
            }
            for key, name in rows
        ]

    keys = on_database(db_url, lambda: asyncio.run(_list()))
    if as_json:
        print_json(keys)
        return
    headers = ["id", "project", "name", "role", "prefix", "created", "last used", "revoked"]
    fields = [
        "id",
        "project",
        "name",
        "role",
        "prefix",
        "created_at",
        "last_used_at",
        "revoked_at",
    ]
    print(table(headers, [[str(k[f] or "-") for f in fields] for k in keys]), flush=True)
