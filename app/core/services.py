"""Where PostgreSQL and Redis are: runtime configuration the API, the workers and the CLI
share.

Service processes (``trainyard api``, ``worker``, ``db upgrade``) use the configured URLs or
start embedded servers under ``home`` (:func:`database_url`, :func:`redis_url`); ``trainyard
up`` starts them once, passes the URLs on to its children and stops them.

Client commands (``keys``, ``data``) and the training-data library never start anything:
they use the configured URL or that of the installation a running ``trainyard up`` describes
in its state file (app/cli/installation.py), and say there is none otherwise
(:func:`client_database_url`).
"""

from __future__ import annotations

from app.core.settings import Settings


def database_url(settings: Settings) -> str:
    if settings.database_url:
        return settings.database_url
    from app.core.embedded import start_postgres

    return start_postgres(settings.home.resolve()).url


def redis_url(settings: Settings) -> str:
    if settings.redis_url:
        return settings.redis_url
    from app.core.embedded import start_redis

    return start_redis(settings.home.resolve()).url


def client_database_url(settings: Settings) -> str:
    """The database a client command should use; never starts one (an empty embedded
    database in the wrong folder is worse than an error)."""
    if settings.database_url:
        return settings.database_url
    # Only without a configured URL: the API and the workers never load the CLI's package.
    from app.cli.installation import find_installation, no_installation

    found = find_installation(settings)
    if found is None:
        raise no_installation(settings, ", and TRAINYARD_DATABASE_URL is not set")
    return found.database_url
