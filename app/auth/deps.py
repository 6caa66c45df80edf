from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.auth.roles import Role
from app.auth.service import Principal, authenticate
from app.core.errors import TYPE_BASE, Problem
from app.core.logs import bind_log_context
from app.core.query import check_query_parameters
from app.core.ratelimit import STATE_KEY, Decision, RateLimiter

_bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer ty_…`")


def unauthorized(detail: str) -> Problem:
    return Problem(401, "Unauthorized", detail, headers={"WWW-Authenticate": "Bearer"})


def _rate_limited(limiter: RateLimiter, decision: Decision) -> Problem:
    retry_after = max(1, math.ceil(decision.retry_after))
    return Problem(
        429,
        "Too Many Requests",
        f"This API key may make {limiter.rate:g} requests per second, in bursts of up to "
        f"{limiter.burst}; retry in {retry_after} s.",
        type_=TYPE_BASE + "rate-limited",
        headers={
            "Retry-After": str(retry_after),
            **{name.decode(): value.decode() for name, value in decision.headers()},
        },
    )


async def principal_of(app_state: Any, key: str) -> Principal:
    """The principal of an API key; raises the 401 problem."""
    principal = await authenticate(app_state.pg, key, app_state.key_cache)
    if principal is None:
        raise unauthorized("Unknown or revoked API key.")
    bind_log_context(project_id=principal.project_id)  # the request's lines, its access line
    return principal


async def count_request(
    app_state: Any, request_state: dict[str, Any], principal: Principal
) -> None:
    """Count the request against its key's rate limit, keeping the decision in the request's
    state for its ``RateLimit-*`` headers; raises the 429 problem (a refused request counts
    nothing, so asking again costs the key nothing)."""
    limiter: RateLimiter | None = app_state.rate_limiter
    if limiter is not None:
        decision = await limiter.hit(principal.key_id.hex)
        if decision is not None:  # None: Redis is unreachable, and the request goes through
            if not decision.allowed:
                raise _rate_limited(limiter, decision)
            request_state[STATE_KEY] = decision


_PRINCIPAL = "trainyard.principal"  # the request's principal, in its state


# Every keyed request comes through both: the routes' dependencies below, and the 304s
# answered before routing (app/events/conditional.py).
async def _principal(
    request: Request, credentials: HTTPAuthorizationCredentials | None
) -> Principal:
    """The request's principal, authenticated and counted against its key's rate limit once
    however many of the dependencies below a route names (kept in the request's state)."""
    state = request.scope.setdefault("state", {})
    principal: Principal | None = state.get(_PRINCIPAL)
    if principal is not None:
        return principal
    check_query_parameters(request)  # first, as an application dependency would be
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise unauthorized("Send an API key as 'Authorization: Bearer <key>'.")
    principal = await principal_of(request.app.state, credentials.credentials)
    await count_request(request.app.state, state, principal)
    state[_PRINCIPAL] = principal
    return principal


async def current_principal(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    return await _principal(request, credentials)


Caller = Annotated[Principal, Depends(current_principal)]


FORBIDDEN = TYPE_BASE + "forbidden"


def require(role: Role) -> Callable[..., Awaitable[Principal]]:
    """A dependency: the caller, if its key's role is ``role`` or above; else the 403 problem.

    Put it in a route's signature like ``Caller`` (``caller: Member``), and add 403 to the
    route's ``problem_responses``. FastAPI solves dependencies before it validates the path,
    query and body parameters, so a key without the role gets this 403, not a 422 about a
    body it may not send (tests/auth/test_roles.py pins the order). It authenticates the
    caller itself rather than through ``Caller``: each dependency FastAPI solves costs every
    request a few microseconds of bookkeeping, and a create is on the hot path.
    """

    async def needs_role(
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> Principal:
        caller = await _principal(request, credentials)
        if not caller.role.allows(role):
            raise Problem(
                403,
                "Forbidden",
                f"This route needs a key with the role '{role}' or above; this key's role "
                f"is '{caller.role}'.",
                type_=FORBIDDEN,
                required_role=role.value,
                key_role=caller.role.value,
            )
        return caller

    needs_role.__name__ = f"needs_{role.value}"
    return needs_role


Member = Annotated[Principal, Depends(require(Role.member))]
"""The caller of a route that creates or controls runs or uploads data: a member or admin key."""
Admin = Annotated[Principal, Depends(require(Role.admin))]
"""The caller of an admin route (webhooks): an admin key."""
