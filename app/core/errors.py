"""RFC 9457 problem details for every error the API returns.

Handlers turn :class:`Problem`, validation errors, Starlette's HTTP errors and anything
unexpected into ``application/problem+json``; validation problems name each offending field
(``body.grpo.beta``, ``query.limit``, ``header.Idempotency-Key``).
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Annotated, Any, get_args

import asyncpg
import sqlalchemy.exc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema
from pydantic_core import PydanticCustomError
from pydantic_core.core_schema import ErrorType
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.core.domain import Conflict, DomainError, InvalidInput, LimitReached, NotFound

log = logging.getLogger(__name__)

PROBLEM_JSON = "application/problem+json"
TYPE_BASE = "https://trainyard.dev/problems/"

# ``errors[].type`` of the rejections a request that matches the OpenAPI document can still
# get, because no document can state them: fields each valid alone but not together (an
# inverted range, exclusive options, one setting a multiple of another), a cursor the server
# never handed out (it is opaque: only the server can read it), an Idempotency-Key first
# used with another body, an id in the body that names nothing the project has, a webhook
# URL whose host does not resolve or resolves to an address the service must not reach.
INCONSISTENT = "inconsistent"
INVALID_CURSOR = "invalid_cursor"
KEY_REUSED = "idempotency_key_reused"
UNKNOWN_REFERENCE = "unknown_reference"
UNUSABLE_TARGET = "unusable_target"
NOT_IN_CATALOG = "not_in_catalog"
UNKNOWN_QUERY_PARAMETER = "unknown_query_parameter"  # app/core/query.py


def inconsistent(message: str) -> PydanticCustomError:
    """Raise it from a validator that compares fields: the 422 says ``type: inconsistent``."""
    return PydanticCustomError(INCONSISTENT, "{message}", {"message": message})


# Every errors[].type there is: pydantic's error types (what a validation error says) and
# this service's own.
ERROR_TYPES = (
    *get_args(ErrorType),
    INCONSISTENT,
    INVALID_CURSOR,
    KEY_REUSED,
    UNKNOWN_REFERENCE,
    UNUSABLE_TARGET,
    NOT_IN_CATALOG,
    UNKNOWN_QUERY_PARAMETER,
)


class FieldError(BaseModel):
    field: str = Field(description="Where the problem is: body.x.y, query.limit, header.X, …")
    message: str
    # Documented as an enum, validated as a string: a type pydantic adds in a later version
    # must not turn a 422 into a 500.
    type: Annotated[str, WithJsonSchema({"type": "string", "enum": list(ERROR_TYPES)})] | None = (
        Field(
            default=None,
            description="Why, for programs: pydantic's error type (string_too_long, …), "
            f"'{INCONSISTENT}' for fields valid alone but not together, '{INVALID_CURSOR}', "
            f"'{KEY_REUSED}', '{UNKNOWN_REFERENCE}', '{UNUSABLE_TARGET}', '{NOT_IN_CATALOG}' (the "
            f"run names what the code policy does not allow), '{UNKNOWN_QUERY_PARAMETER}'.",
        )
    )


def _type_is_always_there(schema: dict[str, Any]) -> None:
    # `type` has a default, and the answer always says it: required (the other fields with
    # defaults are left out when they are null).
    schema["required"] = ["type", *schema.get("required", [])]


class ProblemDetail(BaseModel):
    """RFC 9457 problem details."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_type_is_always_there)

    type: str = "about:blank"
    title: str
    status: int
    detail: str | None = None
    instance: str | None = None
    errors: list[FieldError] | None = None


class Problem(Exception):
    """Raise anywhere in a request to answer with a problem+json response."""

    def __init__(
        self,
        status: int,
        title: str,
        detail: str | None = None,
        *,
        field: str | None = None,
        error_type: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail or title)
        self.status = status
        self.title = title
        self.detail = detail
        self.type = type_ or "about:blank"
        self.headers = headers
        # Every field error says why, for programs (pydantic's generic kind by default).
        self.errors = (
            [FieldError(field=field, message=detail or title, type=error_type or "value_error")]
            if field
            else None
        )
        self.extra = extra


def problem_response(
    status: int,
    title: str,
    detail: str | None = None,
    *,
    type_: str = "about:blank",
    instance: str | None = None,
    errors: list[FieldError] | None = None,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    body = ProblemDetail(
        type=type_,
        title=title,
        status=status,
        detail=detail,
        instance=instance,
        errors=errors,
        **extra,
    ).model_dump(exclude_none=True)
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


def _field_path(loc: tuple[Any, ...] | list[Any]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def validation_errors(exc: RequestValidationError) -> list[FieldError]:
    errors = []
    for err in exc.errors():
        loc = list(err.get("loc", ()))
        # Tagged unions add the tag to the path (body.reward.ruler.rubric); keep it: it says
        # which variant was validated.
        message = err.get("msg", "invalid")
        if err.get("type") == "extra_forbidden":
            message = "unknown or read-only field"
        errors.append(FieldError(field=_field_path(loc), message=message, type=err.get("type")))
    return errors


_STATUS_TITLES = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    406: "Not Acceptable",
    409: "Conflict",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    422: "Unprocessable Content",
    429: "Too Many Requests",
}


# Each kind of domain error and its answer: the one place a rule's "no" becomes HTTP.
_DOMAIN_STATUSES: tuple[tuple[type[DomainError], int], ...] = (
    (NotFound, 404),
    (Conflict, 409),
    (InvalidInput, 422),
    (LimitReached, 429),
)


def domain_problem(request: Request, exc: DomainError) -> JSONResponse:
    status = next((code for kind, code in _DOMAIN_STATUSES if isinstance(exc, kind)), 500)
    if status == 500:
        return _internal_error(request)
    headers = None
    errors = None
    if isinstance(exc, LimitReached) and exc.retry_after is not None:
        headers = {"Retry-After": str(exc.retry_after)}
    if isinstance(exc, InvalidInput):
        errors = [FieldError(field=exc.field, message=exc.detail, type=exc.error_type)]
    # Not found and field errors (told apart by errors[].type) are generic; kinds of
    # problem of their own get a URI.
    generic = isinstance(exc, InvalidInput | NotFound) or type(exc) in {
        k for k, _ in _DOMAIN_STATUSES
    }
    return problem_response(
        status,
        exc.title or _STATUS_TITLES[status],
        exc.detail,
        type_="about:blank" if generic else TYPE_BASE + exc.code,
        instance=request.url.path,
        errors=errors,
        headers=headers,
        **exc.details(),
    )


# FastAPI's 400 for a JSON body its parser failed on other than by JSONDecodeError.
_UNPARSABLE_BODY = "There was an error parsing the body"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(Problem)
    async def _problem(request: Request, exc: Problem) -> JSONResponse:
        return problem_response(
            exc.status,
            exc.title,
            exc.detail,
            type_=exc.type,
            instance=request.url.path,
            errors=exc.errors,
            headers=exc.headers,
            **exc.extra,
        )

    @app.exception_handler(DomainError)
    async def _domain(request: Request, exc: DomainError) -> JSONResponse:
        return domain_problem(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = validation_errors(exc)
        first = errors[0] if errors else None
        detail = f"{first.field}: {first.message}" if first else "Invalid request."
        if len(errors) > 1:
            detail += f" (and {len(errors) - 1} more)"
        return problem_response(
            422, "Validation failed", detail, instance=request.url.path, errors=errors
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == _UNPARSABLE_BODY:
            # FastAPI's answer when the JSON parser raises anything but JSONDecodeError:
            # bytes that are not UTF-8, nesting deeper than the parser recurses. Malformed
            # JSON all the same, so the same 422 as any other.
            cause = type(exc.__cause__).__name__ if exc.__cause__ else "error"
            error = FieldError(
                field="body", message=f"not a JSON document ({cause})", type="json_invalid"
            )
            return problem_response(
                422,
                "Validation failed",
                f"body: {error.message}",
                instance=request.url.path,
                errors=[error],
            )
        title = _STATUS_TITLES.get(exc.status_code, "Error")
        detail = exc.detail if isinstance(exc.detail, str) and exc.detail != title else None
        headers = getattr(exc, "headers", None)
        allow = allowed_methods(request) if exc.status_code == 405 else None
        if allow:
            headers = {**(headers or {}), "Allow": allow}
        return problem_response(
            exc.status_code,
            title,
            detail,
            instance=request.url.path,
            headers=headers,
        )

    # Database errors get a handler of their own (not only the catch-all below, which
    # Starlette runs after the fact and then re-raises): when PostgreSQL has no connection
    # to spare, or the pool waited too long for one, the answer is a 503 the client can
    # retry, not a 500 and a dropped connection.
    for database_error in (asyncpg.PostgresError, sqlalchemy.exc.DBAPIError, OSError):

        @app.exception_handler(database_error)
        async def _database(request: Request, exc: Exception) -> JSONResponse:
            if database_unavailable(exc):
                log.warning(
                    "database unavailable on %s %s: %s", request.method, request.url.path, exc
                )
                return problem_response(
                    503,
                    "Service Unavailable",
                    "The database is at its connection limit or unreachable; retry shortly.",
                    instance=request.url.path,
                    headers={"Retry-After": "1"},
                )
            return _internal_error(request)

    @app.exception_handler(sqlalchemy.exc.TimeoutError)
    async def _pool_timeout(request: Request, exc: Exception) -> JSONResponse:
        log.warning("connection pool exhausted on %s %s", request.method, request.url.path)
        return problem_response(
            503,
            "Service Unavailable",
            "Every database connection of this API process is busy; retry shortly.",
            instance=request.url.path,
            headers={"Retry-After": "1"},
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return _internal_error(request)


_UNAVAILABLE = (
    asyncpg.TooManyConnectionsError,
    asyncpg.CannotConnectNowError,
    asyncpg.ConnectionDoesNotExistError,
    ConnectionError,
)


def database_unavailable(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) says the database cannot be reached right now."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, _UNAVAILABLE) or (isinstance(exc, OSError) and _connecting(exc)):
            return True
        exc = getattr(exc, "orig", None) or exc.__cause__
        seen += 1
    return False


def _connecting(exc: OSError) -> bool:
    """Raised while asyncpg connected: a server gone from its Unix socket is a
    FileNotFoundError there, which anywhere else means a missing file (a 500)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__") == "asyncpg.connect_utils":
            return True
        tb = tb.tb_next
    return False


def _internal_error(request: Request) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return problem_response(
        500,
        "Internal Server Error",
        "The server failed to handle this request; it has been logged.",
        instance=request.url.path,
    )


def allowed_methods(request: Request) -> str | None:
    """The methods the OpenAPI document gives the request's path, for a 405's ``Allow``
    (Starlette names only those of the first route matching the path, and ``GET /datasets``
    and ``POST /datasets`` are two routes); None for a path the document does not have."""
    document = request.app.openapi()
    path = request.scope.get("path", "")
    for template, operations in document.get("paths", {}).items():
        if _template_regex(template).fullmatch(path):
            return ", ".join(sorted(m.upper() for m in operations if m in _HTTP_METHODS))
    return None


_HTTP_METHODS = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})


@functools.lru_cache(maxsize=256)
def _template_regex(template: str) -> re.Pattern[str]:
    parts = re.split(r"(\{[^/{}]+\})", template)
    return re.compile("".join("[^/]+" if p.startswith("{") else re.escape(p) for p in parts))


def problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries so generated clients get typed errors."""
    return {
        status: {
            "model": ProblemDetail,
            "description": _STATUS_TITLES.get(status, "Error"),
            "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/ProblemDetail"}}},
        }
        for status in statuses
    }
