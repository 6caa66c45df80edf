"""The OpenAPI document's finishing touches, and the types that make it say what the API
does: links, parameters that are never null, text PostgreSQL can store, cursors, instants."""

from __future__ import annotations

import copy
import json
import re
import uuid
from datetime import UTC, date, datetime, timedelta, timezone
from typing import Annotated, Any

import jsonschema_rs
import pytest
from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from app.core.errors import INVALID_CURSOR, PROBLEM_JSON, Problem
from app.core.openapi import (
    LINKS,
    RATE_LIMIT_HEADERS,
    _subschemas,
    add_links,
    checks_as_conditions,
    drop_null_parameters,
    install_openapi,
    merge_identical_halves,
)
from app.core.pagination import cursor_int32, decode_cursor, encode_cursor
from app.core.settings import Settings
from app.core.storable import NO_NUL, NUL_FREE, STORABLE_OBJECT
from app.core.time import EARLIEST, LATEST, DayOrInstant, Instant, as_utc
from app.events.schemas import RUN_EVENT_TYPES
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
    # Text only: a generated client must not parse the stream as JSON, so the schema (each
    # event's, before Open API 3.2) has no type: the event is under `if: object`.
    assert list(content) == ["text/event-stream"]
    stream = content["text/event-stream"]["schema"]
    assert "type" not in stream and stream["if"] == {"type": "object"}
    event = stream["then"]
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
    # Any JSON value, without a union (generators refuse a recursive one): each keyword
    # applies to one kind of value, however deep.
    value = schema["$defs"]["StorableJson"]
    ref = {"$ref": "#/$defs/StorableJson"}
    assert "anyOf" not in value and "type" not in value
    assert value["pattern"] == NO_NUL and value["items"] == ref
    assert value["propertyNames"] == {"pattern": NO_NUL}
    assert value["if"] == {"type": "object"} and value["then"] == {"additionalProperties": ref}
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


# --- what generated clients need (docs/clients.md; tests/clients drive a run with them) ------

SCHEMAS = "#/components/schemas/"


def _schemas(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return document["components"]["schemas"]


def test_free_form_json_is_one_schema_without_a_union(document) -> None:
    """openapi-python-client refuses a recursive union (and drops create_run with it)."""
    schemas = _schemas(document)
    assert [name for name in schemas if name.startswith("StorableJson")] == ["StorableJson"]
    value = schemas["StorableJson"]
    assert "anyOf" not in value and value["items"] == {"$ref": SCHEMAS + "StorableJson"}
    validator = jsonschema_rs.validator_for({**value, "components": document["components"]})
    for fine in [1, 1.5, "a", None, True, [{"a": ["b", {"c": None}]}], {"k": {"l": [1]}}]:
        assert validator.is_valid(fine), fine
    for bad in ["a\x00", ["a\x00"], {"k\x00": 1}, {"k": {"l": ["\x00"]}}]:
        assert not validator.is_valid(bad), bad


def test_only_required_properties_have_a_default(document) -> None:
    """openapi-typescript types a property with a default as always present: right in an
    answer, wrong in a request, where the defaults must be optional."""
    found = 0
    for name, root in _schemas(document).items():
        for schema in _subschemas(root):
            required = set(schema.get("required", ()))
            for key, prop in schema.get("properties", {}).items():
                assert key in required or "default" not in prop, (name, key)
                found += key not in required
    assert found > 100
    run = _schemas(document)["RunCreate"]
    assert run["required"] == ["model_name", "task_description"]
    assert run["properties"]["num_examples"]["description"].endswith("Default: `100`.")


def test_answers_require_every_field_they_always_have(document) -> None:
    schemas = _schemas(document)
    for name in ("RunPublic", "GrpoSettings-Output", "TrainingMetrics", "JudgeEndpoint-Output"):
        assert set(schemas[name]["required"]) == set(schemas[name]["properties"]), name
    assert "next_cursor" in schemas["RunsPage"]["required"]
    # A problem leaves its null fields out: only what it always says is required.
    assert set(schemas["ProblemDetail"]["required"]) == {"type", "title", "status"}
    # Requests keep their defaults optional.
    assert schemas["GrpoSettings-Input"].get("required", []) == []


def test_a_run_answer_types_its_settings_as_the_request_does(document) -> None:
    schemas = _schemas(document)
    asked, answered = schemas["RunCreate"]["properties"], schemas["RunPublic"]["properties"]

    def refs(schema: dict[str, Any]) -> list[str]:
        return sorted(re.findall(r'"\$ref": "([^"]+)"', json.dumps(schema)))

    for field in ("reward", "grpo", "generator", "environment", "sft"):
        request = [ref.removesuffix("-Input") for ref in refs(asked[field])]
        answer = [ref.removesuffix("-Output") for ref in refs(answered[field])]
        assert request == answer and answer, field
    assert answered["grpo"] == {"$ref": SCHEMAS + "GrpoSettings-Output", "title": "Grpo"}
    assert answered["reward"]["discriminator"]["mapping"]["function"].endswith("-Output")


def test_closed_sets_are_enums(document) -> None:
    schemas = _schemas(document)
    assert schemas["InputItem"]["properties"]["split"]["enum"] == ["train", "validation"]
    assert schemas["DatasetRowPublic"]["properties"]["split"]["enum"] == ["train", "validation"]
    event = schemas["RunEventPublic"]["properties"]
    assert event["type"]["enum"] == list(RUN_EVENT_TYPES) and "status" in RUN_EVENT_TYPES
    assert event["level"]["enum"] == ["info", "warning", "error"]
    error_type = schemas["FieldError"]["properties"]["type"]["anyOf"][0]["enum"]
    assert {INVALID_CURSOR, "string_too_long", "missing", "json_invalid"} <= set(error_type)
    assert "less_than_equal" in error_type  # the page size cap's own 422


def test_free_form_answers_are_objects_of_json_values(document) -> None:
    schemas = _schemas(document)
    value = {"$ref": SCHEMAS + "StorableJson"}
    assert schemas["RunEventPublic"]["properties"]["data"]["additionalProperties"] == value
    breakdown = schemas["TrajectoryPublic"]["properties"]["reward_breakdown"]["anyOf"][0]
    assert breakdown["additionalProperties"] == value
    messages = schemas["TrajectoryPublic"]["properties"]["messages"]["anyOf"][0]
    assert messages["items"] == {"$ref": SCHEMAS + "TrajectoryMessage-Output"}


def test_split_schemas_are_titled_by_name(document) -> None:
    titles = [schema.get("title") for schema in _schemas(document).values()]
    assert len(titles) == len(set(titles))
    assert _schemas(document)["ToolCall-Output"]["title"] == "ToolCallOutput"


def test_identical_halves_are_merged_and_refs_follow() -> None:
    same = {"type": "object", "properties": {"x": {"$ref": SCHEMAS + "A-Input"}}}
    doc = {
        "components": {
            "schemas": {
                "A-Input": {**copy.deepcopy(same), "title": "A"},
                "A-Output": {
                    "type": "object",
                    "properties": {"x": {"$ref": SCHEMAS + "A-Output"}},
                    "title": "A",
                },
                "B-Input": {"type": "string"},
                "B-Output": {"type": "integer"},
                "U": {
                    "oneOf": [{"$ref": SCHEMAS + "A-Output"}],
                    "discriminator": {"propertyName": "t", "mapping": {"a": SCHEMAS + "A-Output"}},
                },
            }
        }
    }
    merge_identical_halves(doc)
    schemas = doc["components"]["schemas"]
    assert sorted(schemas) == ["A", "B-Input", "B-Output", "U"]
    assert schemas["A"]["properties"]["x"] == {"$ref": SCHEMAS + "A"}
    assert schemas["U"]["discriminator"]["mapping"] == {"a": SCHEMAS + "A"}


def test_checks_by_case_are_conditions_with_the_same_meaning(document) -> None:
    """openapi-python-client reads an object with anyOf as a union of partial objects; the
    rule, as if/then/else, still refuses what it refused."""
    schemas = _schemas(document)
    function = schemas["RewardFunction-Input"]
    assert "anyOf" not in function and function["if"]["properties"]["name"]["const"]
    assert "anyOf" not in schemas["PythonEnvironment-Input"]
    validator = jsonschema_rs.validator_for(
        {"$ref": SCHEMAS + "RewardFunction-Input", "components": document["components"]}
    )
    assert validator.is_valid({"name": "char_fraction", "args": {"char": "a"}})
    assert validator.is_valid({"name": "regex", "args": {"pattern": "a+"}})
    assert validator.is_valid({"name": "pkg.mod:score", "args": {"anything": [1]}})
    assert not validator.is_valid({"name": "regex", "args": {}})  # its pattern is required
    assert not validator.is_valid({"name": "char_fraction", "args": {"char": "ab"}})
    assert not validator.is_valid({"name": "exact_match", "args": {"surprise": 1}})
    doc = {
        "components": {
            "schemas": {
                "X": {
                    "type": "object",
                    "properties": {},
                    "anyOf": [
                        {"properties": {"k": {"const": 1}, "v": {"type": "string"}}},
                        {"properties": {"k": {"minimum": 5}}},
                    ],
                }
            }
        }
    }
    checks_as_conditions(doc)
    x = doc["components"]["schemas"]["X"]
    assert x["if"] == {"properties": {"k": {"const": 1}}, "required": ["k"]}
    assert x["else"] == {"properties": {"k": {"minimum": 5}}}


def test_answers_document_their_headers(document) -> None:
    ops = _operations(document)
    created = ops["create_run"]["responses"]["202"]["headers"]
    assert {"Location", "ETag", "Idempotent-Replayed", *RATE_LIMIT_HEADERS} <= set(created)
    for op in ("get_run", "cancel_run", "pause_run", "resume_run"):
        assert "ETag" in ops[op]["responses"]["200"]["headers"], op
    keyed = [op for op in ops.values() if "401" in op["responses"]]
    assert len(keyed) > 20
    for op in keyed:
        responses = op["responses"]
        assert responses["429"]["headers"]["Retry-After"]["schema"]["type"] == "integer"
        assert responses["503"]["headers"]["Retry-After"], op["operationId"]
        assert list(responses["503"]["content"]) == ["application/problem+json"]
        assert set(RATE_LIMIT_HEADERS) <= set(
            responses["200" if "200" in responses else min(responses)]["headers"]
        )
    assert "400" in ops["create_dataset"]["responses"]  # an upload cut off


def test_the_document_does_not_depend_on_the_rate_limit(document) -> None:
    """The headers are documented whether the limit is on or not: one document for every
    deployment (and the fuzz's app, without the limit, serves the one it was built from)."""
    settings = Settings(max_page_size=77, rate_limit_per_second=0)
    assert create_app(settings).openapi() == document


def test_errors_are_problem_json_only(document) -> None:
    for op in _operations(document).values():
        for status, response in op["responses"].items():
            if status.startswith(("4", "5")) and op["operationId"] != "readyz":
                assert list(response.get("content", {})) == [PROBLEM_JSON], (op, status)


def test_the_export_is_described_as_json_lines(document) -> None:
    content = _operations(document)["export_trajectories"]["responses"]["200"]["content"]
    assert list(content) == ["application/x-ndjson"]
    media = content["application/x-ndjson"]
    assert media["schema"]["type"] == "string"
    assert media["x-line-schema"] == {"$ref": SCHEMAS + "TrajectoryPublic"}
