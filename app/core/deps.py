"""Request-scoped dependencies: database sessions.

``Session`` is transactional: the handler commits explicitly, anything else rolls back.
``ReadSession`` runs each statement in autocommit mode: no BEGIN/ROLLBACK round trips on
the GET paths, which only ever issue single-statement reads.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    async with request.app.state.sessionmaker() as session:
        yield session


async def get_read_session(request: Request) -> AsyncIterator[AsyncSession]:
    async with request.app.state.read_sessionmaker() as session:
        yield session


Session = Annotated[AsyncSession, Depends(get_session)]
ReadSession = Annotated[AsyncSession, Depends(get_read_session)]
