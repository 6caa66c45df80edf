"""The OpenAPI document's finishing touches, and the types that make it say what the API
does: links, parameters that are never null, text PostgreSQL can store, cursors, instants."""

from __future__ import annotations

import copy
import json
import uuid
from datetime import UTC, date, datetime, timedelta, timezone
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from app.core.errors import INVALID_CURSOR, Problem
from app.core.openapi import LINKS, add_links, drop_null_parameters, install_openapi
from app.core.pagination import cursor_int32, decode_cursor, encode_cursor
from app.core.settings import Settings
from app.core.storable import NO_NUL, NUL_FREE, STORABLE_OBJECT
from app.core.time import EARLIEST, LATEST, DayOrInstant, Instant, as_utc
from app.main import create_app


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    settings = Settings(max_page_size=77)
    app = create_app(settings)
    install_openapi(app, settings)
    install_openapi(app, settings)  # idempotent
    return app.openapi()


def _operations(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        op["operationId"]: op
        for item in document["paths"].values()
        for op in item.values()
        if isinstance(op, dict) and "operationId" in op
    }


def test_links_name_real_operations_and_parameters(document) -> None:
    ops = _operations(document)
    count = 0
    for (source, status), _ in LINKS.items():
        for name, link in ops[source]["responses"][status]["links"].items():
            target = ops[link["operationId"]]
            declared = {(p["in"], p["name"]) for p in target.get("parameters", [])}
            for key in link["parameters"]:
                location, _, parameter = key.partition(".")
                assert (location, parameter) in declared, (source, name, key)
            count += 1
    assert count > 40
    run_links = ops["create_run"]["responses"]["202"]["links"]
    assert run_links["CancelRun"]["parameters"] == {"path.run_id": "$response.body#/id"}
    assert ops["get_run"]["responses"]["200"]["links"]["GetRunIfChanged"]["parameters"] == {
        "path.run_id": "$response.body#/id",
        "header.If-None-Match": "$response.header.ETag",
    }


def test_add_links_leaves_out_operations_the_document_lacks() -> None:
    doc = {
        "paths": {
            "/runs": {"post": {"operationId": "create_run", "responses": {"202": {}}}},
            "/runs/{run_id}": {"get": {"operationId": "get_run", "responses": {"200": {}}}},
        }
    }
    add_links(doc)
    links = doc["paths"]["/runs"]["post"]["responses"]["202"]["links"]
    assert set(links) == {"GetRun"}


def test_no_parameter_is_documented_as_null(document) -> None:
    """A query parameter or a header is text or absent; clients that read `null` in the
    document send the text "null" (Schemathesis did, to Last-Event-ID)."""
    for op in _operations(document).values():
        for parameter in op.get("parameters", []):
            assert '"null"' not in json.dumps(parameter["schema"]), parameter
    stream = _operations(document)["stream_run_events"]["parameters"]
    header = next(p for p in stream if p["name"] == "Last-Event-ID")
    assert header["schema"]["type"] == "string" and header["schema"]["pattern"] == "^[0-9]+$"


def test_drop_null_parameters_keeps_other_branches() -> None:
    schema = {"anyOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}], "title": "X"}
    doc = {"paths": {"/x": {"get": {"parameters": [{"name": "x", "schema": schema}]}}}}
    drop_null_parameters(copy.deepcopy(doc))
    drop_null_parameters(doc)
    assert schema == {"anyOf": [{"type": "integer"}, {"type": "string"}], "title": "X"}


def test_every_page_size_states_the_configured_cap(document) -> None:
    paged = [op for op in _operations(document).values() if op["operationId"].startswith("list_")]
    limits = [p["schema"] for op in paged for p in op["parameters"] if p["name"] == "limit"]
    assert len(limits) == len(paged) >= 8
    assert all(s == {**s, "type": "integer", "minimum": 1, "maximum": 77} for s in limits), limits
    assert "x-trainyard" not in json.dumps(document)


def test_the_event_stream_documents_its_events(document) -> None:
    content = _operations(document)["stream_run_events"]["responses"]["200"]["content"]
    event = content["text/event-stream"]["schema"]
    assert event["required"] == ["data"] and event["properties"]["data"]["type"] == "string"


# --- storable text --------------------------------------------------------------------------


class _Model(BaseModel):
    text: Annotated[str, NUL_FREE] = Field(max_length=5)
    url: Annotated[str, NUL_FREE] = Field(default="http://x", pattern="^http")
    config: Annotated[dict[str, Any], STORABLE_OBJECT] = Field(default_factory=dict)


def test_markers_document_and_do_not_validate() -> None:
    schema = _Model.model_json_schema()
    props = schema["properties"]
    assert props["text"] == {"maxLength": 5, "pattern": NO_NUL, "title": "Text", "type": "string"}
    assert props["url"]["pattern"] == "^http" and props["url"]["allOf"] == [{"pattern": NO_NUL}]
    assert props["config"]["propertyNames"] == {"pattern": NO_NUL}
    value = schema["$defs"]["StorableJson"]
    assert {"type": "string", "pattern": NO_NUL} in value["anyOf"]
    assert {
        "type": "object",
        "propertyNames": {"pattern": NO_NUL},
        "additionalProperties": {"$ref": "#/$defs/StorableJson"},
    } in value["anyOf"]
    # Validation is the models' validators' job: the markers accept anything.
    assert _Model(text="a\x00", config={"k\x00": ["\x00"]}).config == {"k\x00": ["\x00"]}


# --- cursors --------------------------------------------------------------------------------


def test_cursors_round_trip_and_refuse_what_the_columns_cannot_hold() -> None:
    at = datetime(2024, 5, 1, tzinfo=UTC)
    assert decode_cursor(
        encode_cursor([at.isoformat(), "0" * 32], of="x"), datetime.fromisoformat, str, of="x"
    )
    assert decode_cursor(encode_cursor([2**31 - 1], of="x"), cursor_int32, of="x") == [2**31 - 1]
    assert decode_cursor(encode_cursor([2**63 - 1], of="x"), int, of="x") == [2**63 - 1]
    for values, types in [
        ([2**31], (cursor_int32,)),
        ([2**63], (int,)),
        ([True], (int,)),
        ([1.5], (int,)),
        (["x"], (int,)),
        ([5], (datetime.fromisoformat,)),
        (["0001-01-01T00:00:00+05:00"], (datetime.fromisoformat,)),
        ([5], (uuid.UUID,)),
        ([1, 2], (int,)),
        ({"a": 1}, (int,)),
    ]:
        with pytest.raises(Problem) as raised:
            decode_cursor(
                encode_cursor(values, of="x") if isinstance(values, list) else "e30",
                *types,
                of="x",
            )
        assert raised.value.errors is not None
        assert raised.value.errors[0].type == INVALID_CURSOR
    with pytest.raises(Problem):
        decode_cursor("%%%", int, of="x")


# --- instants -------------------------------------------------------------------------------


def test_as_utc_clamps_instants_python_cannot_hold_in_utc() -> None:
    plus5 = timezone(timedelta(hours=5))
    assert as_utc(datetime(1, 1, 1, tzinfo=plus5)) == EARLIEST
    assert as_utc(datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-5)))) == LATEST
    assert as_utc(datetime(2024, 5, 1, 12)) == datetime(2024, 5, 1, 12, tzinfo=UTC)
    assert as_utc(datetime(2024, 5, 1, 12, tzinfo=plus5)) == datetime(2024, 5, 1, 7, tzinfo=UTC)


def test_instants_are_iso_8601_text_in_utc() -> None:
    instant = TypeAdapter(Instant)
    assert instant.validate_python("2024-05-01T12:00:00Z") == datetime(2024, 5, 1, 12, tzinfo=UTC)
    assert instant.validate_python("2024-05-01 12:00") == datetime(2024, 5, 1, 12, tzinfo=UTC)
    for bad in ["0.5", "1714000000", "2024-05-01", "yesterday", "2024-05-01T25:00"]:
        with pytest.raises(ValidationError):
            instant.validate_python(bad)
    day = TypeAdapter(DayOrInstant)
    assert day.validate_python("2024-05-01") == date(2024, 5, 1)
    assert day.validate_python("2024-05-01T00:00:00+02:00") == datetime(2024, 4, 30, 22, tzinfo=UTC)
    with pytest.raises(ValidationError):
        day.validate_python("0.5")
