"""Request-scoped dependencies: database sessions, committed at the edge.

``Session`` is transactional: it commits when the handler returns and rolls back when it
raises, before the answer is sent (``scope="function"``), so a handler never commits and a
failed commit is never answered as a success. ``ReadSession`` runs each statement in
autocommit mode: no BEGIN/ROLLBACK round trips on the GET paths, which only ever issue
single-statement reads.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    async with request.app.state.sessionmaker() as session:
        yield session
        await session.commit()


async def get_read_session(request: Request) -> AsyncIterator[AsyncSession]:
    async with request.app.state.read_sessionmaker() as session:
        yield session


Session = Annotated[AsyncSession, Depends(get_session, scope="function")]
ReadSession = Annotated[AsyncSession, Depends(get_read_session)]
