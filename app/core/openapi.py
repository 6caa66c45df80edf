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

Generated clients (docs/clients.md; tests/clients drive a run with openapi-python-client's
and openapi-typescript's) need a few more finishing touches, each a function below: errors
are ``application/problem+json`` only; ``X-Input``/``X-Output`` halves that say the same
are one schema again, and the others are titled by name; checks by case (``anyOf`` on a
model) are ``if``/``then``/``else``; a property that may be absent has no ``default`` (its
description says it); answers document their headers (``ETag``, ``Retry-After``,
``RateLimit-*``, ``Idempotent-Replayed``) and every keyed operation its 503.

:func:`install_openapi` makes ``app.openapi()`` (and so ``/openapi.json``) the finished one.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI
from pydantic import GetJsonSchemaHandler, TypeAdapter
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema
from pydantic_core import core_schema as cs

from app.core.errors import PROBLEM_JSON
from app.core.pagination import PAGE_SIZE_CAP
from app.core.settings import Settings


class DocumentedAs:
    """A document-only marker: the field is documented as ``tp`` (its component schema, in
    the mode of the document's side: the ``-Output`` one in an answer), while it validates
    as its own type. For answers that serve a stored value a request model wrote (a run's
    ``reward``, ``grpo`` …): clients get the precise type, and the route does not
    re-validate what was validated on the way in.

    >>> reward: Annotated[dict[str, Any], DocumentedAs(RewardSpec)]
    """

    def __init__(self, tp: Any) -> None:
        schema = TypeAdapter[Any](tp).core_schema
        if "ref" in schema:  # a model: by reference (pydantic inlines it otherwise)
            schema = cs.definitions_schema(cs.definition_reference_schema(schema["ref"]), [schema])
        self.core_schema = schema

    def __get_pydantic_json_schema__(
        self, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return handler(self.core_schema)


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


def distinct_titles(document: dict[str, Any]) -> dict[str, Any]:
    """Title each schema FastAPI split in two (``ToolCall-Input``, ``ToolCall-Output``) by its
    name, in place: both halves keep the model's title otherwise, and generators that name
    classes by title (openapi-python-client) refuse the second one as a duplicate."""
    for name, schema in document.get("components", {}).get("schemas", {}).items():
        if name.endswith(("-Input", "-Output")):
            schema["title"] = name.replace("-", "")
    return document


def _constant_of(branch: Any) -> tuple[str, Any] | None:
    """(key, value) when ``branch`` is a check of an object's properties that applies when
    one property is a constant (``{"properties": {"name": {"const": "regex"}, …}}``)."""
    if not isinstance(branch, dict) or set(branch) - {"properties", "required"}:
        return None
    constants = [
        (key, prop["const"])
        for key, prop in branch["properties"].items()
        if isinstance(prop, dict) and set(prop) == {"const"}
    ]
    return constants[0] if len(constants) == 1 else None


def checks_as_conditions(document: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a model's checks by case (``anyOf`` of property checks, one per value of a
    property, and a last one for the rest) as ``if``/``then``/``else``, in place: the same
    rule, but generators read an object with ``anyOf`` as a union of partial objects
    (openapi-python-client then drops the model), and ignore conditions."""
    for schema in document.get("components", {}).get("schemas", {}).values():
        branches = schema.get("anyOf")
        if schema.get("type") != "object" or "properties" not in schema or not branches:
            continue
        cases = [_constant_of(branch) for branch in branches[:-1]]
        if None in cases or not isinstance(branches[-1], dict):
            continue
        rule: dict[str, Any] = branches[-1]
        for (key, value), branch in zip(reversed(cases), reversed(branches[:-1]), strict=True):
            condition = {"properties": {key: {"const": value}}, "required": [key]}
            rule = {"if": condition, "then": branch, "else": rule}
        del schema["anyOf"]
        schema.update(rule)
    return document


def _renamed_refs(value: Any, names: dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {
            k: names.get(v, v)
            if k == "$ref"
            else {t: names.get(r, r) for t, r in v.items()}
            if k == "mapping" and isinstance(v, dict)  # a discriminator's
            else _renamed_refs(v, names)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_renamed_refs(v, names) for v in value]
    return value


_SCHEMAS = "#/components/schemas/"


def merge_identical_halves(document: dict[str, Any]) -> dict[str, Any]:
    """Make ``X-Input`` and ``X-Output`` one ``X`` again where they say the same (once their
    own references are merged too), in place: pydantic splits a schema whose parts differ
    by mode, and a recursive one always."""
    schemas = document.get("components", {}).get("schemas", {})
    while True:
        names: dict[str, str] = {}
        for name in schemas:
            base = name.removesuffix("-Input")
            if base == name or f"{base}-Output" not in schemas or base in schemas:
                continue
            halves = {f"{base}-Input": base, f"{base}-Output": base}
            refs = {_SCHEMAS + half: _SCHEMAS + base for half in halves}
            one, other = (_renamed_refs(schemas[half], refs) for half in halves)
            one.pop("title", None)
            other.pop("title", None)
            if one == other:
                names |= refs
        if not names:
            return document
        merged = _renamed_refs(document, names)
        document.clear()
        document.update(merged)
        schemas = document["components"]["schemas"]
        for ref, target in names.items():
            half, base = ref.removeprefix(_SCHEMAS), target.removeprefix(_SCHEMAS)
            schema = schemas.pop(half)
            if half.endswith("-Input"):
                schema["title"] = base
                schemas[base] = schema


def _subschemas(schema: Any) -> Iterator[dict[str, Any]]:
    """``schema`` and every schema inside it (not following ``$ref``)."""
    stack = [schema]
    while stack:
        item = stack.pop()
        if not isinstance(item, dict):
            continue
        yield item
        for key, value in item.items():
            if key in {"properties", "patternProperties", "$defs"} and isinstance(value, dict):
                stack.extend(value.values())
            elif key in {"anyOf", "oneOf", "allOf", "prefixItems"} and isinstance(value, list):
                stack.extend(value)
            elif key in {"items", "additionalProperties", "not", "if", "then", "else"}:
                stack.append(value)


def _body_schemas(document: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from document.get("components", {}).get("schemas", {}).values()
    for operation in _operations(document):
        for media in operation.get("requestBody", {}).get("content", {}).values():
            yield media.get("schema", {})
        for response in operation.get("responses", {}).values():
            for media in response.get("content", {}).values():
                yield media.get("schema", {})


def defaults_only_when_required(document: dict[str, Any]) -> dict[str, Any]:
    """A property that may be absent has no ``default`` keyword; its description says the
    default instead, in place.

    openapi-typescript (by default) types a property with a ``default`` as always there:
    right for an answer, whose fields with defaults are always present (and in
    ``required``: the response models are documented in serialization mode), wrong for a
    request, where a client may leave them out. So only properties that are ``required``
    keep their ``default``. Parameters keep theirs: generators read those as optional."""
    for root in _body_schemas(document):
        for schema in _subschemas(root):
            required = set(schema.get("required", ()))
            for name, prop in schema.get("properties", {}).items():
                if name in required or not isinstance(prop, dict) or "default" not in prop:
                    continue
                default = prop.pop("default")
                if default is None:
                    continue
                said = f"Default: `{json.dumps(default, separators=(', ', ': '))}`."
                prop["description"] = (
                    f"{prop['description']} {said}" if "description" in prop else said
                )
    return document


def problem_json_only(document: dict[str, Any]) -> dict[str, Any]:
    """Error answers are ``application/problem+json`` only, in place (FastAPI adds an
    ``application/json`` twin to every response that names a model)."""
    for operation in _operations(document):
        for response in operation.get("responses", {}).values():
            content = response.get("content", {})
            if PROBLEM_JSON in content:
                content.pop("application/json", None)
    return document


def _header(description: str, kind: str = "string") -> dict[str, Any]:
    return {"description": description, "schema": {"type": kind}}


RETRY_AFTER = _header("Seconds to wait before retrying.", "integer")
# Sent when the per-key rate limit is on (TRAINYARD_RATE_LIMIT_PER_SECOND > 0); documented
# either way, so the document does not depend on the setting.
RATE_LIMIT_HEADERS = {
    "RateLimit-Limit": _header("Requests this API key may make in a burst.", "integer"),
    "RateLimit-Remaining": _header("Requests left in the current burst.", "integer"),
    "RateLimit-Reset": _header("Seconds until the full burst is available again.", "integer"),
}
RUN_ETAG = _header("The run's version: send it as `If-None-Match` to poll `GET /runs/{id}`.")
# Operations that answer with the run and its ETag, and their success status.
RUN_ANSWERS = {"create_run": "202", "get_run": "200", "cancel_run": "200"}
RUN_ANSWERS |= {"pause_run": "200", "resume_run": "200"}
IDEMPOTENT_REPLAYED = _header(
    "`true` when the answer is the replay of an earlier request with the same "
    "`Idempotency-Key`; absent otherwise."
)
SERVICE_UNAVAILABLE = {
    "description": "Service Unavailable: the database is at its connection limit or "
    "unreachable; retry after `Retry-After` seconds.",
    "headers": {"Retry-After": RETRY_AFTER},
    "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/ProblemDetail"}}},
}


def document_headers(document: dict[str, Any]) -> dict[str, Any]:
    """The answers' headers and the 503 of every keyed operation, in place: ``Retry-After``
    (429, 503), ``RateLimit-*`` (every keyed answer but a 401 or a 503, while the per-key
    rate limit is on), the run's ``ETag`` and a replay's ``Idempotent-Replayed``."""
    for operation in _operations(document):
        responses = operation.get("responses", {})
        if "401" not in responses:
            continue  # not keyed: /healthz, /readyz, /metrics
        responses.setdefault("503", copy.deepcopy(SERVICE_UNAVAILABLE))
        for status, response in responses.items():
            headers = response.setdefault("headers", {})
            if status in {"429", "503"}:
                headers.setdefault("Retry-After", copy.deepcopy(RETRY_AFTER))
            if status not in {"401", "503"}:
                for name, header in RATE_LIMIT_HEADERS.items():
                    headers.setdefault(name, copy.deepcopy(header))
            if not headers:
                del response["headers"]
        success = RUN_ANSWERS.get(operation.get("operationId", ""))
        if success in responses:
            headers = responses[success].setdefault("headers", {})
            headers["ETag"] = copy.deepcopy(RUN_ETAG)
            if operation["operationId"] == "create_run":
                headers["Idempotent-Replayed"] = copy.deepcopy(IDEMPOTENT_REPLAYED)
    return document


UNPROCESSABLE = {
    "description": "Unprocessable Content: a parameter or the body is invalid, or a query "
    "parameter is unknown; `errors` names each field.",
    "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/ProblemDetail"}}},
}


def document_unknown_query(document: dict[str, Any]) -> dict[str, Any]:
    """Every operation's 422, in place: any of them answers it for an unknown query
    parameter (app/core/query.py), including those that take no parameters at all."""
    for operation in _operations(document):
        operation.setdefault("responses", {}).setdefault("422", copy.deepcopy(UNPROCESSABLE))
    return document


def finish(document: dict[str, Any], settings: Settings) -> dict[str, Any]:
    document = document_unknown_query(document)
    document = state_page_size_cap(document, settings.max_page_size)
    document = checks_as_conditions(merge_identical_halves(problem_json_only(document)))
    document = distinct_titles(defaults_only_when_required(document))
    document = document_headers(document)
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
