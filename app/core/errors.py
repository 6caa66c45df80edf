"""RFC 9457 problem details for every error the API returns.

Handlers turn :class:`Problem`, validation errors, Starlette's HTTP errors and anything
unexpected into ``application/problem+json``; validation problems name each offending field
(``body.grpo.beta``, ``query.limit``, ``header.Idempotency-Key``).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

PROBLEM_JSON = "application/problem+json"
TYPE_BASE = "https://trainyard.dev/problems/"


class FieldError(BaseModel):
    field: str = Field(description="Where the problem is: body.x.y, query.limit, header.X, …")
    message: str
    type: str | None = None


class ProblemDetail(BaseModel):
    """RFC 9457 problem details."""

    model_config = ConfigDict(extra="allow")

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
        self.errors = [FieldError(field=field, message=detail or title)] if field else None
        self.extra = extra


class NotFound(Problem):
    def __init__(self, what: str) -> None:
        super().__init__(404, "Not Found", f"{what} not found.")


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
        title = _STATUS_TITLES.get(exc.status_code, "Error")
        detail = exc.detail if isinstance(exc.detail, str) and exc.detail != title else None
        return problem_response(
            exc.status_code,
            title,
            detail,
            instance=request.url.path,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return problem_response(
            500,
            "Internal Server Error",
            "The server failed to handle this request; it has been logged.",
            instance=request.url.path,
        )


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
