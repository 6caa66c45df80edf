"""Where PostgreSQL and Redis are: the configured URLs, or embedded servers under ``home``.

Embedded servers are started on first use and reused by every later process in the same
folder (``trainyard up`` starts them once and passes the URLs on; it also stops them).
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
