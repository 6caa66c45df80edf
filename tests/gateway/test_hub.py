"""The API's link to the gateway's Redis under many calls at once (real Redis)."""

from __future__ import annotations

import asyncio
import uuid

from app.gateway import wire
from app.gateway.hub import POOL_CONNECTIONS, GatewayHub
from tests.support.database import OwnDatabase


async def test_hundreds_of_calls_handed_over_at_once_wait_for_a_connection(
    own_database: OwnDatabase,
) -> None:
    """300 messages pushed at once (200 episodes calling together reach that): each waits
    for one of the pool's connections and goes through; redis-py's default pool refused the
    101st (MaxConnectionsError, a 503 to the harness)."""
    hub = GatewayHub(own_database.broker_url, own_database.broker_prefix)
    run_id = uuid.uuid4()
    try:
        await asyncio.gather(*(hub.ended(run_id, uuid.uuid4(), 1) for _ in range(300)))
        inbox = wire.inbox(own_database.broker_prefix, run_id)
        assert await hub.redis.llen(inbox) == 300
        assert hub.redis.connection_pool.max_connections == POOL_CONNECTIONS
        await hub.redis.delete(inbox)
    finally:
        await hub.aclose()
