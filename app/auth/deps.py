from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.auth.service import Principal, authenticate
from app.core.errors import Problem

_bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer ty_…`")


def _unauthorized(detail: str) -> Problem:
    return Problem(401, "Unauthorized", detail, headers={"WWW-Authenticate": "Bearer"})


async def current_principal(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise _unauthorized("Send an API key as 'Authorization: Bearer <key>'.")
    principal = await authenticate(
        request.app.state.pg, credentials.credentials, request.app.state.key_cache
    )
    if principal is None:
        raise _unauthorized("Unknown or revoked API key.")
    return principal


Caller = Annotated[Principal, Depends(current_principal)]
