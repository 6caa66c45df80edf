"""The database: migrations (:func:`upgrade`, which ``trainyard up`` runs too), ``trainyard
db upgrade``, and :func:`on_database`, which says in one line what is wrong when a command
that works on the database straight (``keys``, ``data``) cannot use it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import typer

from app.cli.common import CliError, err, settings

T = TypeVar("T")

db_app = typer.Typer(no_args_is_help=True, help="Database schema.")


def upgrade(url: str, revision: str = "head") -> None:
    """Apply the migrations up to ``revision`` to the database at ``url``."""
    from alembic import command
    from alembic.config import Config

    root = Path(__file__).resolve().parents[2]
    cfg = Config(str(root / "alembic.ini"))
    cfg.set_main_option("script_location", str(root / "migrations"))
    cfg.attributes["url"] = url
    cfg.attributes["skip_logging"] = True
    command.upgrade(cfg, revision)


@db_app.command("upgrade")
def db_upgrade(revision: str = "head") -> None:
    """Apply migrations up to REVISION (default: the latest) to TRAINYARD_DATABASE_URL, or
    to the running `trainyard up`'s database (which `up` itself migrates when it starts)."""
    from app.core.services import client_database_url

    url = client_database_url(settings())
    on_database(url, lambda: upgrade(url, revision))
    err.print(f"database at {revision}")


def safe_url(url: str) -> str:
    """``url`` without its password, to be printed."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<the configured database URL>"


def on_database(url: str, work: Callable[[], T]) -> T:
    """Run ``work`` and say in one line what to do when the database is not usable."""
    import asyncpg
    import sqlalchemy.exc

    try:
        return work()
    except (OSError, asyncpg.PostgresError, sqlalchemy.exc.DBAPIError) as exc:
        orig = getattr(exc, "orig", None)
        causes = (exc, orig, getattr(orig, "__cause__", None))
        if any(getattr(c, "sqlstate", None) == "42P01" for c in causes):  # undefined_table
            raise CliError(
                f"the database {safe_url(url)} has no Trainyard tables: run `trainyard db "
                "upgrade` with TRAINYARD_DATABASE_URL set to it"
            ) from exc
        reason = " ".join(str(orig or exc).split())
        raise CliError(f"cannot use the database {safe_url(url)}: {reason}") from exc
