"""A small, fully known corpus of trajectories, and the answer every filter should give on it
computed in plain Python, so the library's SQL is checked against an independent model."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.core.pg import connect_kwargs, init_connection
from tests.support.training_data import Corpus, seed_corpus


@pytest.fixture(scope="module")
async def corpus(
    sessionmaker: async_sessionmaker[AsyncSession], service_urls: tuple[str, str]
) -> Corpus:
    return await seed_corpus(sessionmaker, service_urls[0])


@pytest.fixture
async def pg(service_urls: tuple[str, str]) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(**connect_kwargs(service_urls[0]))
    await init_connection(conn)
    try:
        yield conn
    finally:
        await conn.close()
