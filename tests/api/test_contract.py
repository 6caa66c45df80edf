"""What the Schemathesis fuzz (tests/chaos/test_openapi_fuzz.py) found, one case each: a
request the OpenAPI document allows that got a 500 or a refusal it did not foresee, one it
forbids that was accepted, an answer it does not describe."""

from __future__ import annotations

import base64
import uuid
from typing import Any

import pytest

from app.core.errors import INCONSISTENT, INVALID_CURSOR, KEY_REUSED
from app.core.pagination import encode_cursor
from app.core.settings import get_settings
from tests.support.runs import run_body

PROBLEM = "application/problem+json"
INT32_OVER = 2**31
INT64_OVER = 2**63


async def new_run(client: Any, tenant: Any) -> str:
    r = await client.post("/runs", json=run_body(), headers=tenant.headers)
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def assert_problem(r: Any, status: int, field: str, error_type: str | None = None) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == PROBLEM
    errors = r.json()["errors"]
    assert any(e["field"] == field for e in errors), errors
    if error_type is not None:
        assert all(e["type"] == error_type for e in errors), errors


# --- paging ---------------------------------------------------------------------------------


def test_the_page_size_cap_is_in_the_document() -> None:
    """`limit` had no documented maximum, so a schema-valid 1000 was refused."""
    from app.main import create_app

    settings = get_settings()
    app = create_app(settings)
    operation = app.openapi()["paths"]["/datasets"]["get"]
    limit = next(p for p in operation["parameters"] if p["name"] == "limit")
    assert limit["schema"]["maximum"] == settings.max_page_size


def _cursor(path: str, run_id: str, project_id: uuid.UUID, values: list[Any]) -> str:
    """A cursor of the list at ``path`` (its name and scope right) holding ``values``, so
    only the values are wrong."""
    from app.training_data.filters import Filters

    run = uuid.UUID(run_id)
    of, scope = {
        "/datasets": ("list_datasets", ()),
        "/trajectories": (
            "list_trajectories",
            (Filters.build(project_ids=[project_id]), "newest"),
        ),
        "/runs/{run}/events": ("list_run_events", (run,)),
        "/runs/{run}/checkpoints": ("list_run_checkpoints", (run,)),
        "/runs/{run}/inputs": ("list_run_inputs", (run, None)),
        "/runs/{run}/trajectories": ("list_run_trajectories", (run, None, None, None)),
    }[path]
    return encode_cursor(values, of=of, scope=scope)


@pytest.mark.parametrize(
    ("path", "values"),
    [
        # A number where a UUID goes: uuid.UUID(5) raised AttributeError, a 500.
        ("/datasets", ["2024-01-01T00:00:00+00:00", 5]),
        ("/trajectories", ["2024-01-01T00:00:00+00:00", 5]),
        # An instant that does not exist in UTC: the driver raised OverflowError.
        ("/datasets", ["0001-01-01T00:00:00+05:00", str(uuid.uuid4())]),
        # Positions beyond the integer columns: the driver refused the statement.
        ("/runs/{run}/events", [INT64_OVER]),
        ("/runs/{run}/checkpoints", [INT32_OVER]),
        ("/runs/{run}/inputs", [INT32_OVER]),
        ("/runs/{run}/trajectories", [0, 0, INT32_OVER]),
        ("/runs/{run}/events", [True]),
        ("/runs/{run}/events", [[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]),
        # Not a cursor at all.
        ("/runs/{run}/events", None),
    ],
)
async def test_a_cursor_the_server_never_gave_is_422_not_500(client, tenant, path, values) -> None:
    run_id = await new_run(client, tenant)
    url = path.format(run=run_id)
    if values is None:
        cursor = base64.urlsafe_b64encode(b"[1]").decode().rstrip("=")
    else:
        cursor = _cursor(path, run_id, tenant.project_id, values)
    r = await client.get(url, params={"after": cursor}, headers=tenant.headers)
    assert_problem(r, 422, "query.after", INVALID_CURSOR)


async def test_a_well_formed_cursor_of_the_list_positions_it(client, tenant) -> None:
    """The counterpart of the cases above: the same construction, with good values, pages."""
    run_id = await new_run(client, tenant)
    cursor = _cursor("/runs/{run}/events", run_id, tenant.project_id, [0])
    r = await client.get(f"/runs/{run_id}/events", params={"after": cursor}, headers=tenant.headers)
    assert r.status_code == 200 and r.json()["data"], r.text


async def test_cursors_the_server_gave_still_page(client, tenant) -> None:
    for _ in range(3):
        await new_run(client, tenant)
    first = (await client.get("/runs", params={"limit": 2}, headers=tenant.headers)).json()
    r = await client.get(
        "/runs", params={"limit": 2, "after": first["next_cursor"]}, headers=tenant.headers
    )
    assert r.status_code == 200 and len(r.json()["data"]) == 1


# --- integers and text bound for PostgreSQL -------------------------------------------------


@pytest.mark.parametrize(
    ("path", "params", "field"),
    [
        ("/runs/{run}/trajectories", {"step": INT32_OVER}, "query.step"),
        ("/runs/{run}/metrics", {"step_min": INT32_OVER}, "query.step_min"),
        ("/runs/{run}/metrics", {"step_max": INT32_OVER}, "query.step_max"),
        ("/trajectories", {"step": INT32_OVER}, "query.step[0]"),
        ("/trajectories/count", {"step": INT32_OVER}, "query.step[0]"),
        ("/runs/{run}/metrics", {"name": "loss\x00"}, "query.name[0]"),
        ("/trajectories", {"learning_key": "k\x00"}, "query.learning_key[0]"),
    ],
)
async def test_values_the_database_cannot_take_are_422_not_500(
    client, tenant, path, params, field
) -> None:
    """Each was a 500 (asyncpg refusing an integer beyond its column or a NUL in text),
    or for the event stream a 200 whose body broke off."""
    url = path.format(run=await new_run(client, tenant))
    r = await client.get(url, params=params, headers=tenant.headers)
    assert_problem(r, 422, field)


async def test_the_largest_values_the_columns_take_are_fine(client, tenant) -> None:
    run_id = await new_run(client, tenant)
    for url, params in [
        (f"/runs/{run_id}/trajectories", {"step": INT32_OVER - 1}),
        (f"/runs/{run_id}/metrics", {"step_min": 0, "step_max": INT32_OVER - 1}),
        ("/trajectories/count", {"step": INT32_OVER - 1}),
    ]:
        r = await client.get(url, params=params, headers=tenant.headers)
        assert r.status_code == 200, (url, r.text)


async def test_a_run_body_with_nul_in_grpo_or_generator_is_422_not_500(client, tenant) -> None:
    """jsonb cannot hold \\u0000; only some of the body's fields were checked for it."""
    for patch, field in [
        ({"grpo": {"vllm_dtype": "a\u0000"}}, "body.grpo.vllm_dtype"),
        ({"generator": {"base_url": "http://x\u0000", "model": "m"}}, "body.generator.base_url"),
    ]:
        r = await client.post("/runs", json=run_body(**patch), headers=tenant.headers)
        assert_problem(r, 422, field)


async def test_a_dataset_name_with_nul_is_422_not_500(client, tenant) -> None:
    r = await client.post(
        "/datasets",
        params={"name": "d\x00"},
        content=b'{"input_text": "a"}\n',
        headers={**tenant.headers, "content-type": "application/x-ndjson"},
    )
    assert_problem(r, 422, "query.name")


async def test_a_file_name_with_nul_is_only_a_default_name(client, tenant) -> None:
    """The file's name becomes the dataset's name when none is given; NUL is replaced."""
    body = (
        b"--b\r\n"
        b'Content-Disposition: form-data; name="file"; filename="in\x00puts.jsonl"\r\n\r\n'
        b'{"input_text": "a"}\n\r\n'
        b"--b--\r\n"
    )
    r = await client.post(
        "/datasets",
        content=body,
        headers={**tenant.headers, "content-type": "multipart/form-data; boundary=b"},
    )
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "in\ufffdputs.jsonl"


# --- the event stream -----------------------------------------------------------------------


@pytest.mark.parametrize("value", ["\u00b2", "1 ", "-1", "abc"])
async def test_a_last_event_id_that_is_not_ascii_digits_is_422(client, tenant, value) -> None:
    """'²' passed str.isdigit() and then failed int(): a 500."""
    run_id = await new_run(client, tenant)
    r = await client.get(
        f"/runs/{run_id}/events/stream",
        headers={**tenant.headers, "Last-Event-ID": value.encode("latin-1")},
    )
    assert_problem(r, 422, "header.Last-Event-ID")


async def test_a_last_event_id_past_every_event_resumes_after_all(client, tenant) -> None:
    """Twenty digits fit the header but not bigint: it now means "after the last event"
    (the run is cancelled so the stream ends)."""
    run_id = await new_run(client, tenant)
    await client.post(f"/runs/{run_id}/cancel", headers=tenant.headers)
    r = await client.get(
        f"/runs/{run_id}/events/stream",
        headers={**tenant.headers, "Last-Event-ID": "9" * 20},
    )
    assert r.status_code == 200
    assert "id:" not in r.text and "event: end" in r.text


# --- datetimes ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0.5", "1714000000", "2024-05-01T", "2024-02-30"])
async def test_a_datetime_filter_takes_iso_8601_only(client, tenant, value) -> None:
    """pydantic took "0.5" for Unix time; the document says date-time (or date)."""
    r = await client.get("/trajectories", params={"start_date": value}, headers=tenant.headers)
    assert_problem(r, 422, "query.start_date")


@pytest.mark.parametrize(
    "value",
    [
        "0001-01-01T00:00:00+05:00",
        "9999-12-31T23:59:59-05:00",
        "2024-05-01T12:00",
        "0001-01-01",
        "9999-12-31",
    ],
)
async def test_datetimes_at_the_edges_of_utc_are_bounds_not_500(client, tenant, value) -> None:
    """An instant before year 1 or after 9999 in UTC made the driver overflow."""
    for name in ("start_date", "end_date"):
        r = await client.get("/trajectories/count", params={name: value}, headers=tenant.headers)
        assert r.status_code == 200, r.text


# GET /runs: the same rules as every other list.


async def test_run_list_datetime_filters_take_iso_8601_only(client, tenant) -> None:
    r = await client.get("/runs", params={"created_before": "0.5"}, headers=tenant.headers)
    assert_problem(r, 422, "query.created_before")


async def test_run_list_datetimes_at_the_edges_of_utc_are_not_500(client, tenant) -> None:
    r = await client.get(
        "/runs", params={"created_after": "0001-01-01T00:00:00+05:00"}, headers=tenant.headers
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("name", ["model_name", "learning_key"])
async def test_run_list_text_filters_with_nul_are_422_not_500(client, tenant, name) -> None:
    r = await client.get("/runs", params={name: "a\x00"}, headers=tenant.headers)
    assert_problem(r, 422, f"query.{name}")


# --- bodies ---------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [b"\xff\xfe{", b"[" * 100_000 + b"]" * 100_000])
async def test_a_body_json_cannot_parse_is_422_like_any_malformed_json(client, tenant, body):
    """Bytes that are not UTF-8, or nesting deeper than the parser recurses, were FastAPI's
    undocumented 400."""
    r = await client.post(
        "/runs", content=body, headers={**tenant.headers, "content-type": "application/json"}
    )
    assert_problem(r, 422, "body", "json_invalid")


# --- rejections the document cannot foresee say so ------------------------------------------


async def test_fields_valid_alone_but_not_together_are_typed_inconsistent(client, tenant) -> None:
    run_id = await new_run(client, tenant)
    for url, params in [
        (f"/runs/{run_id}/metrics", {"step_min": 2, "step_max": 1}),
        (f"/runs/{run_id}/trajectories", {"min_reward": 1, "max_reward": 0}),
        ("/trajectories", {"min_reward": 1, "max_reward": 0}),
        ("/trajectories", {"start_date": "2024-02-01T00:00:00Z", "end_date": "2024-01-01T00:00Z"}),
    ]:
        r = await client.get(url, params=params, headers=tenant.headers)
        assert r.status_code == 422, (url, r.text)
        assert [e["type"] for e in r.json()["errors"]] == [INCONSISTENT], r.text
    for patch in [
        {"grpo": {"bf16": True, "fp16": True}},
        {"grpo": {"groups_per_step": 3, "gradient_accumulation_steps": 2}},
        {"grpo": {"engine": "vllm-server"}},
        {"inputs": [{"input_text": "a", "split": "validation"}]},
        {"dataset_id": str(uuid.uuid4())},  # with run_body's inputs
        {
            "reward": {
                "type": "function",
                "functions": [{"name": "regex", "args": {"pattern": "a"}, "weight": 0}],
            }
        },
    ]:
        r = await client.post("/runs", json=run_body(**patch), headers=tenant.headers)
        assert r.status_code == 422, (patch, r.text)
        assert [e["type"] for e in r.json()["errors"]] == [INCONSISTENT], (patch, r.text)


async def test_a_dataset_name_given_twice_is_typed_inconsistent(client, tenant) -> None:
    r = await client.post(
        "/datasets",
        params={"name": "a"},
        files={"file": ("f.jsonl", b'{"input_text": "a"}\n', "application/x-ndjson")},
        data={"name": "b"},
        headers=tenant.headers,
    )
    assert_problem(r, 422, "body.name", INCONSISTENT)


async def test_a_reused_idempotency_key_is_typed(client, tenant) -> None:
    headers = {**tenant.headers, "Idempotency-Key": f"k-{uuid.uuid4()}"}
    assert (await client.post("/runs", json=run_body(), headers=headers)).status_code == 202
    r = await client.post("/runs", json=run_body(max_steps=3), headers=headers)
    assert_problem(r, 422, "header.Idempotency-Key", KEY_REUSED)


# --- answers the document describes ---------------------------------------------------------


async def test_405_allows_every_method_of_the_path(client, tenant) -> None:
    """Starlette named only the first route's methods: `Allow: POST` for /datasets."""
    run = f"/runs/{uuid.uuid4()}"
    for path, allowed in [("/datasets", "GET, POST"), ("/runs", "GET, POST"), (run, "GET")]:
        r = await client.request("DELETE", path, headers=tenant.headers)
        assert r.status_code == 405 and r.headers["content-type"] == PROBLEM
        assert r.headers["allow"] == allowed


async def test_reward_function_names_follow_the_documented_pattern(client, tenant) -> None:
    """The document's pattern and the check agree (\\w was Unicode in one, ASCII in another;
    `$` let a trailing newline through)."""
    for name, status in [("pkg.mod:fn", 202), ("é.mod:fn", 422), ("pkg.mod:fn\n", 422)]:
        reward = {"type": "function", "functions": [{"name": name}]}
        r = await client.post("/runs", json=run_body(reward=reward), headers=tenant.headers)
        assert r.status_code == status, (name, r.text)


async def test_the_document_states_what_postgresql_cannot_store(client) -> None:
    doc = (await client.get("/openapi.json")).json()
    schemas = doc["components"]["schemas"]
    run = schemas["RunCreate"]["properties"]
    assert run["model_name"]["pattern"] == "^[^\\x00]*$"
    assert run["config"]["propertyNames"] == {"pattern": "^[^\\x00]*$"}
    assert run["config"]["additionalProperties"] == {"$ref": "#/components/schemas/StorableJson"}
    value = schemas["StorableJson"]
    assert (
        value["pattern"] == "^[^\\x00]*$"
        and value["propertyNames"] == run["config"]["propertyNames"]
    )
    assert get_settings().max_page_size  # the cap is the server's, not the document's
