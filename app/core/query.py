"""Unknown query parameters are a 422 naming them, on every documented operation.

A typo in a filter must not widen it: ``GET /trajectories/count?run_ids=…`` (the parameter is
``run_id``) would otherwise count the whole project. Starlette hands every query parameter to
the route and FastAPI reads the ones it declares, silently ignoring the rest;
:func:`check_query_parameters` compares the request's names with the ones the matched route
declares (its own and its dependencies', by alias), computed once per route.

It runs first in the dependency that admits each request: the API key's (app/auth/deps.py),
the episode token's (app/gateway/router.py), and :func:`known_query_parameters` on the one
router that needs neither (app/health.py). Not as a dependency of the application: FastAPI
spends some 15–25 µs per request on every dependency it solves, and every request would
solve this one besides its key's. tests/api/test_query_parameters.py walks every operation.

Routes outside ``/openapi.json`` keep their own rules: the dashboard's pages, and the
gateway's OpenAI routes, which answer as OpenAI's API does (it ignores unknown parameters,
and the SDKs' ``extra_query`` relies on that).
"""

from __future__ import annotations

from fastapi import Request
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel

from app.core.errors import UNKNOWN_QUERY_PARAMETER

_declared: dict[int, frozenset[str] | None] = {}  # id(route) -> its names; None: not checked


def _names(route: APIRoute) -> frozenset[str] | None:
    if not route.include_in_schema:
        return None
    names: set[str] = set()
    pending: list[Dependant] = [route.dependant]
    while pending:
        dependant = pending.pop()
        pending.extend(dependant.dependencies)
        for field in dependant.query_params:
            model = field.field_info.annotation
            if isinstance(model, type) and issubclass(model, BaseModel):
                # A query parameter model (``Annotated[Filters, Query()]``): its fields.
                names.update(f.alias or n for n, f in model.model_fields.items())
            else:
                names.add(field.alias)
    return frozenset(names)


def check_query_parameters(request: Request) -> None:
    """422 for any query parameter the matched operation does not declare."""
    if not request.scope.get("query_string"):
        return
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return
    key = id(route)
    if key not in _declared:
        _declared[key] = _names(route)
    declared = _declared[key]
    if declared is None:
        return
    unknown = [name for name in dict.fromkeys(request.query_params) if name not in declared]
    if not unknown:
        return
    takes = ", ".join(sorted(declared)) or "none"
    raise RequestValidationError(
        [
            {
                "type": UNKNOWN_QUERY_PARAMETER,
                "loc": ("query", name),
                "msg": f"unknown query parameter; this operation takes: {takes}",
                "input": request.query_params.getlist(name),
            }
            for name in unknown
        ]
    )


async def known_query_parameters(request: Request) -> None:
    """The check as a dependency, for a router whose routes admit requests without a key."""
    check_query_parameters(request)
