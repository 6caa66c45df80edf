"""The OpenAPI document, finished: FastAPI's, with its links added and its parameters exact.

Links say how a response's ids feed the next request: ``POST /runs`` answers with the run,
whose ``id`` is the ``run_id`` of every run-scoped operation, and ``GET /runs/{id}``'s
``ETag`` is the ``If-None-Match`` of the next poll. Client generators and stateful API
testing follow them (Schemathesis: create a run, then read, pause, resume, cancel it …).
They are added here rather than written into each route, so the routers stay about
behaviour.

The page size cap is a setting (``TRAINYARD_MAX_PAGE_SIZE``), stated as the ``maximum`` of
every ``limit``.

FastAPI documents an optional parameter (``str | None = None``) as ``anyOf: [string,
null]``, but a query parameter or a header is text or absent, never JSON ``null``; clients
that believe the document send the text ``null``. Parameters lose that branch here.

:func:`install_openapi` makes ``app.openapi()`` (and so ``/openapi.json``) the finished one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI

from app.core.pagination import PAGE_SIZE_CAP
from app.core.settings import Settings

# Operations that take the run's id as their ``run_id`` path parameter.
RUN_OPERATIONS = (
    "get_run",
    "cancel_run",
    "pause_run",
    "resume_run",
    "list_run_events",
    "stream_run_events",
    "get_run_metrics",
    "list_run_checkpoints",
    "list_run_inputs",
    "list_run_trajectories",
)
# Operations that take the run's id as their (repeatable) ``run_id`` query filter.
RUN_FILTER_OPERATIONS = ("list_trajectories", "count_trajectories")
DATASET_OPERATIONS = ("get_dataset", "list_dataset_rows")


def _pascal(operation_id: str) -> str:
    return "".join(part.capitalize() for part in operation_id.split("_"))


def _run_links(run_id: str) -> dict[str, dict[str, Any]]:
    links: dict[str, dict[str, Any]] = {
        _pascal(op): {
            "operationId": op,
            "parameters": {"path.run_id": run_id},
            "description": f"`{op}` of this run.",
        }
        for op in RUN_OPERATIONS
    }
    for op in RUN_FILTER_OPERATIONS:
        links[_pascal(op) + "OfRun"] = {
            "operationId": op,
            "parameters": {"query.run_id": run_id},
            "description": f"`{op}` filtered to this run.",
        }
    return links


def _dataset_links(dataset_id: str) -> dict[str, dict[str, Any]]:
    return {
        _pascal(op): {
            "operationId": op,
            "parameters": {"path.dataset_id": dataset_id},
            "description": f"`{op}` of this dataset.",
        }
        for op in DATASET_OPERATIONS
    }


# (operation id, status) → the links of that response.
_BODY_ID = "$response.body#/id"
LINKS: dict[tuple[str, str], Callable[[], dict[str, dict[str, Any]]]] = {
    ("create_run", "202"): lambda: _run_links(_BODY_ID),
    ("cancel_run", "200"): lambda: _run_links(_BODY_ID),
    ("pause_run", "200"): lambda: _run_links(_BODY_ID),
    ("resume_run", "200"): lambda: _run_links(_BODY_ID),
    ("get_run", "200"): lambda: {
        **_run_links(_BODY_ID),
        "GetRunIfChanged": {
            "operationId": "get_run",
            "parameters": {
                "path.run_id": _BODY_ID,
                "header.If-None-Match": "$response.header.ETag",
            },
            "description": "Poll the run cheaply: 304 while its ETag is unchanged.",
        },
    },
    ("list_runs", "200"): lambda: _run_links("$response.body#/data/0/id"),
    ("create_dataset", "201"): lambda: _dataset_links(_BODY_ID),
    ("get_dataset", "200"): lambda: _dataset_links(_BODY_ID),
    ("list_datasets", "200"): lambda: _dataset_links("$response.body#/data/0/id"),
}


def _operations(document: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for item in document.get("paths", {}).values():
        for method, operation in item.items():
            if method in {"get", "put", "post", "delete", "patch", "head", "options", "trace"}:
                yield operation


def add_links(document: dict[str, Any]) -> dict[str, Any]:
    """Add :data:`LINKS` to ``document`` in place (and return it); links to operations the
    document does not have are left out, so a trimmed app still has a valid document."""
    by_id = {op["operationId"]: op for op in _operations(document) if "operationId" in op}
    for (source, status), make in LINKS.items():
        operation = by_id.get(source)
        if operation is None:
            continue
        response = operation.get("responses", {}).get(status)
        if response is None:
            continue
        links = {name: link for name, link in make().items() if link["operationId"] in by_id}
        response.setdefault("links", {}).update(links)
    return document


_NULL = {"type": "null"}


def drop_null_parameters(document: dict[str, Any]) -> dict[str, Any]:
    """Take ``null`` out of every parameter's schema, in place (and return the document)."""
    for operation in _operations(document):
        for parameter in operation.get("parameters", []):
            schema = parameter.get("schema", {})
            branches = schema.get("anyOf")
            if not branches or _NULL not in branches:
                continue
            rest = [branch for branch in branches if branch != _NULL]
            del schema["anyOf"]
            if len(rest) == 1:
                schema.update(rest[0])
            else:
                schema["anyOf"] = rest
    return document


def state_page_size_cap(document: dict[str, Any], max_page_size: int) -> dict[str, Any]:
    """Give every page-size parameter its ``maximum`` (a setting), in place."""
    for operation in _operations(document):
        for parameter in operation.get("parameters", []):
            schema = parameter.get("schema", {})
            for branch in [schema, *schema.get("anyOf", [])]:
                if branch.pop(PAGE_SIZE_CAP, None):
                    branch["maximum"] = max_page_size
    return document


def finish(document: dict[str, Any], settings: Settings) -> dict[str, Any]:
    document = state_page_size_cap(document, settings.max_page_size)
    return add_links(drop_null_parameters(document))


def install_openapi(app: FastAPI, settings: Settings) -> None:
    """Make ``app.openapi()`` (and so ``/openapi.json``) the finished document, for an app
    created with ``settings``. Idempotent."""
    if getattr(app.openapi, "_finished", False):
        return
    generate = app.openapi  # FastAPI's: builds the document once and caches it
    done: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        document = generate()
        if done.get("document") is not document:
            finish(document, settings)
            done["document"] = document
        return document

    openapi._finished = True  # type: ignore[attr-defined]
    app.openapi = openapi  # type: ignore[method-assign]
