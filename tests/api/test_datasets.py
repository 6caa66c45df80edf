"""POST/GET /datasets and runs started from a dataset, over the real app and database."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import func, select

from app.core.errors import Problem
from app.core.settings import get_settings
from app.datasets.models import Dataset, DatasetRow
from app.datasets.upload import (
    MAX_LINES,
    MAX_PART_HEADER_BYTES,
    MAX_REPORTED_LINES,
    MULTIPART_ENVELOPE_BYTES,
    JsonlReader,
    read_multipart,
)
from tests.support.runs import run_body

PROBLEM = "application/problem+json"
NDJSON = {"content-type": "application/x-ndjson"}


def jsonl(*rows: Any) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


async def upload(client, tenant, content: bytes, name: str | None = "d", **kw: Any):
    data = {"name": name} if name is not None else None
    return await client.post(
        "/datasets",
        files={"file": ("inputs.jsonl", content, "application/jsonl")},
        data=data,
        headers=tenant.headers,
        **kw,
    )


async def count_datasets(sessionmaker, tenant) -> int:
    async with sessionmaker() as s:
        return await s.scalar(select(func.count()).where(Dataset.project_id == tenant.project_id))


async def test_upload_stores_counts_and_rows_that_page(client, tenant, sessionmaker) -> None:
    content = jsonl(
        *[{"input_text": f"t{i}", "context": {"answer": str(i)}} for i in range(5)],
        {"input_text": "v0", "split": "validation"},
        {"input_text": "t5", "split": "train", "context": None},
        {"input_text": "v1", "split": "validation"},
    )
    r = await upload(client, tenant, content, name="letters v1")
    assert r.status_code == 201, r.text
    ds = r.json()
    assert r.headers["location"] == f"/datasets/{ds['id']}"
    assert ds["name"] == "letters v1"
    assert ds["project_id"] == str(tenant.project_id)
    assert (ds["num_rows"], ds["num_train_rows"], ds["num_validation_rows"]) == (8, 6, 2)
    assert ds["size_bytes"] == len(content)
    assert ds["sha256"] == hashlib.sha256(content).hexdigest()
    assert (await client.get(f"/datasets/{ds['id']}", headers=tenant.headers)).json() == ds

    seen, cursor = [], None
    while True:
        params: dict[str, Any] = {"limit": 3, **({"after": cursor} if cursor else {})}
        page = (
            await client.get(f"/datasets/{ds['id']}/rows", params=params, headers=tenant.headers)
        ).json()
        seen += page["data"]
        if not page["has_more"]:
            assert page["next_cursor"] is None
            break
        cursor = page["next_cursor"]
    assert [row["index"] for row in seen] == list(range(8))
    assert [row["input_text"] for row in seen] == ["t0", "t1", "t2", "t3", "t4", "v0", "t5", "v1"]
    assert seen[0] == {"index": 0, "input_text": "t0", "context": {"answer": "0"}, "split": "train"}
    assert seen[6]["context"] is None

    val = (
        await client.get(
            f"/datasets/{ds['id']}/rows",
            params={"split": "validation", "limit": 1},
            headers=tenant.headers,
        )
    ).json()
    assert [(v["index"], v["input_text"]) for v in val["data"]] == [(5, "v0")] and val["has_more"]
    rest = (
        await client.get(
            f"/datasets/{ds['id']}/rows",
            params={"split": "validation", "after": val["next_cursor"]},
            headers=tenant.headers,
        )
    ).json()
    assert [v["input_text"] for v in rest["data"]] == ["v1"] and not rest["has_more"]
    r = await client.get(
        f"/datasets/{ds['id']}/rows", params={"split": "test"}, headers=tenant.headers
    )
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "query.split"


async def test_raw_ndjson_body_with_bom_crlf_and_blank_lines(client, tenant) -> None:
    content = (
        b'\xef\xbb\xbf{"input_text": "a"}\r\n\r\n   \n'
        + b'{"input_text": "b", "split": "validation"}\r\n'
        + b'{"input_text": "c"}'  # no final newline
    )
    r = await client.post(
        "/datasets", content=content, params={"name": "raw"}, headers={**tenant.headers, **NDJSON}
    )
    assert r.status_code == 201, r.text
    ds = r.json()
    assert ds["name"] == "raw"
    assert (ds["num_rows"], ds["num_train_rows"], ds["num_validation_rows"]) == (3, 2, 1)
    rows = (await client.get(f"/datasets/{ds['id']}/rows", headers=tenant.headers)).json()
    assert [(x["index"], x["input_text"]) for x in rows["data"]] == [(0, "a"), (1, "b"), (2, "c")]


async def test_name_defaults_to_the_file_name(client, tenant) -> None:
    r = await upload(client, tenant, jsonl({"input_text": "a"}), name=None)
    assert r.status_code == 201 and r.json()["name"] == "inputs.jsonl"
    r = await client.post(
        "/datasets", content=jsonl({"input_text": "a"}), headers={**tenant.headers, **NDJSON}
    )
    assert r.status_code == 201 and r.json()["name"] is None


async def test_text_and_context_round_trip_exactly(client, tenant) -> None:
    text = 'tab\there\nnew line \\ back\\slash \r cr "quoted" \\N ünïcödé 🐍 \\.'
    context = {"answer": "a\tb\nc\\d", "nested": {"list": [1, 2.5, None, True, "\\u0041"]}}
    r = await upload(client, tenant, jsonl({"input_text": text, "context": context}))
    assert r.status_code == 201, r.text
    rows = (await client.get(f"/datasets/{r.json()['id']}/rows", headers=tenant.headers)).json()
    assert rows["data"][0]["input_text"] == text
    assert rows["data"][0]["context"] == context


async def test_bad_line_is_named_and_nothing_is_stored(client, tenant, sessionmaker) -> None:
    content = jsonl({"input_text": "ok"}, b"", {"input_text": ""}, {"input_text": "ok"})
    r = await upload(client, tenant, content)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == PROBLEM
    problem = r.json()
    # Lines count as an editor shows them: the blank line 2 counts, and is skipped.
    assert problem["detail"].startswith("line 3: input_text: String should have at least 1")
    assert problem["errors"][0]["field"] == "file.line[3].input_text"
    assert await count_datasets(sessionmaker, tenant) == 0


@pytest.mark.parametrize(
    ("line", "field", "message"),
    [
        (b'{"input_text": "a", "surprise": 1}', "file.line[2].surprise", "unknown field"),
        (b'{"input_text": "a", "split": "test"}', "file.line[2].split", "pattern"),
        (b'{"input_text": 7}', "file.line[2].input_text", "valid string"),
        (b'{"input_text": "a", "context": [1]}', "file.line[2].context", "object"),
        (b'{"context": {}}', "file.line[2].input_text", "required"),
        (b'{"input_text": "a" ', "file.line[2]", "Invalid JSON"),
        (b'["input_text"]', "file.line[2]", "object"),
        (b'{"input_text": "a\\u0000"}', "file.line[2].input_text", "NUL"),
        (b'{"input_text": "a", "context": {"x": NaN}}', "file.line[2].context", "NaN"),
        (b'{"input_text": "\xff"}', "file.line[2]", "Invalid JSON"),
        ('{"input_text": "' + "x" * 32_001 + '"}', "file.line[2].input_text", "32000"),
    ],
)
async def test_each_kind_of_bad_line_names_its_field(client, tenant, line, field, message) -> None:
    raw = line if isinstance(line, bytes) else line.encode()
    r = await upload(client, tenant, jsonl({"input_text": "fine"}, raw))
    assert r.status_code == 422, r.text
    errors = r.json()["errors"]
    assert errors[0]["field"] == field, errors
    assert message in errors[0]["message"], errors


async def test_several_bad_lines_are_listed_up_to_a_cap(client, tenant) -> None:
    content = jsonl(*([{"input_text": ""}] * 3), {"input_text": "ok"})
    problem = (await upload(client, tenant, content)).json()
    assert [e["field"] for e in problem["errors"]] == [
        f"file.line[{n}].input_text" for n in (1, 2, 3)
    ]
    assert "(and 2 more bad lines)" in problem["detail"]

    many = jsonl(*([{"input_text": ""}] * (MAX_REPORTED_LINES + 5)))
    problem = (await upload(client, tenant, many)).json()
    assert len(problem["errors"]) == MAX_REPORTED_LINES
    assert f"reading stopped at line {MAX_REPORTED_LINES}" in problem["detail"]


@pytest.mark.parametrize("content", [b"", b"\n\n  \r\n"])
async def test_empty_file_is_422(client, tenant, content) -> None:
    r = await upload(client, tenant, content)
    assert r.status_code == 422
    assert r.json()["errors"][0]["field"] == "file"
    r = await client.post("/datasets", content=content, headers={**tenant.headers, **NDJSON})
    assert r.status_code == 422


async def test_too_many_lines_is_413(client, tenant, sessionmaker) -> None:
    content = b'{"input_text":"a"}\n' * (MAX_LINES + 1)
    r = await client.post("/datasets", content=content, headers={**tenant.headers, **NDJSON})
    assert r.status_code == 413, r.text
    assert r.headers["content-type"] == PROBLEM
    assert r.json()["errors"][0]["field"] == f"file.line[{MAX_LINES + 1}]"
    assert await count_datasets(sessionmaker, tenant) == 0


async def test_a_file_over_the_json_body_limit_is_accepted(client, tenant) -> None:
    # 3 MiB: over max_body_bytes (2 MiB), which every other route keeps.
    line = json.dumps({"input_text": "x" * 3000}).encode() + b"\n"
    content = line * (3 * 1024 * 1024 // len(line) + 1)
    assert len(content) > get_settings().max_body_bytes
    r = await upload(client, tenant, content)
    assert r.status_code == 201, r.text
    assert r.json()["size_bytes"] == len(content)


async def test_a_file_over_the_dataset_limit_is_413(
    client, tenant, sessionmaker, monkeypatch
) -> None:
    monkeypatch.setattr(get_settings(), "max_dataset_bytes", 4096)
    content = jsonl(*[{"input_text": "y" * 100}] * 100)  # ~12 KiB
    r = await upload(client, tenant, content)
    assert r.status_code == 413 and r.headers["content-type"] == PROBLEM
    assert "4096 bytes" in r.json()["detail"]
    # Declared by Content-Length: refused before a byte is read.
    r = await client.post("/datasets", content=content, headers={**tenant.headers, **NDJSON})
    assert r.status_code == 413

    async def chunks():
        for _ in range(100):
            yield json.dumps({"input_text": "y" * 100}).encode() + b"\n"

    r = await client.post("/datasets", content=chunks(), headers={**tenant.headers, **NDJSON})
    assert r.status_code == 413
    assert await count_datasets(sessionmaker, tenant) == 0


async def test_the_middleware_gives_only_the_upload_route_a_larger_limit(api) -> None:
    from app.core.limits import BodySizeLimit

    middleware = next(m for m in api.user_middleware if m.cls is BodySizeLimit)
    limiter = BodySizeLimit(api, **middleware.kwargs)
    settings = get_settings()
    assert limiter.limit_for({"method": "POST", "path": "/datasets"}) > settings.max_dataset_bytes
    assert limiter.limit_for({"method": "POST", "path": "/runs"}) == settings.max_body_bytes
    assert limiter.limit_for({"method": "PUT", "path": "/datasets"}) == settings.max_body_bytes
    assert (
        limiter.limit_for({"method": "POST", "path": "/api/datasets", "root_path": "/api"})
        > settings.max_dataset_bytes
    )


async def test_chunked_multipart_upload(client, tenant) -> None:
    boundary = "----tyboundary42"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\nchunked\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="f.jsonl"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + jsonl(*[{"input_text": f"row {i}"} for i in range(50)])
        + (f"\r\n--{boundary}--\r\n").encode()
    )

    async def chunks():
        for i in range(0, len(body), 7):
            yield body[i : i + 7]

    r = await client.post(
        "/datasets",
        content=chunks(),
        headers={**tenant.headers, "content-type": f"multipart/form-data; boundary={boundary}"},
    )
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "chunked" and r.json()["num_rows"] == 50


class RecordingReader(JsonlReader):
    """Keeps what the multipart reader hands it, unvalidated."""

    def __init__(self) -> None:
        super().__init__(uuid.uuid4(), max_bytes=1 << 20)
        self.data = bytearray()

    def feed(self, data: bytes) -> None:
        self.data += data

    def close(self) -> None:
        pass


async def chunked(body: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(body), size):
        yield body[i : i + size]


async def test_multipart_reader_splits_parts_whatever_the_chunking() -> None:
    # Look-alikes of the delimiter inside the file: cut short, followed by neither CRLF nor
    # "--", and followed by a single hyphen.
    content = b"abc\r\n--b0und\r\n--b0undaryX\r\n--b0undary-y\r\r\n"
    body = (
        b'\r\n--b0undary\r\nContent-Disposition: form-data; name="file"; filename="f.jsonl"\r\n'
        + b"Content-Type: application/jsonl\r\n\r\n"
        + content
        + b'\r\n--b0undary\r\nContent-Disposition: form-data; name="name"\r\n\r\n'
        + b"n\r\n--b0undary--\r\nepilogue"
    )
    for size in (1, 2, 3, 5, 11, len(body)):
        reader = RecordingReader()
        form = await read_multipart(chunked(body, size), b"b0undary", reader)
        assert bytes(reader.data) == content, size
        assert (form.name, form.filename) == ("n", "f.jsonl"), size


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        (b"preamble\r\n--bb\r\n", "well-formed"),
        (b"--bb\r\nContent-Disposition form-data\r\n\r\n", "well-formed"),
        (b"--bb\r\nContent-Type: text/plain\r\n\r\nx\r\n--bb--", "Content-Disposition"),
        (b'--bb\r\nContent-Disposition: attachment; name="file"\r\n\r\n', "Content-Disposition"),
        (b"--bb\r\nX-Big: " + b"x" * MAX_PART_HEADER_BYTES + b"\r\n\r\n", "headers"),
        (b"\r\n" * MULTIPART_ENVELOPE_BYTES + b"--bb--", "bytes of the body"),
        (b'--bb\r\nContent-Disposition: form-data; name="file"\r\n\r\n{}\r\n', "ends"),
    ],
)
async def test_malformed_multipart_is_422_naming_the_body(body, detail) -> None:
    for size in (7, 64 * 1024, len(body)):
        with pytest.raises(Problem) as caught:
            await read_multipart(chunked(body, size), b"bb", RecordingReader())
        problem = caught.value
        assert (problem.status, problem.errors[0].field) == (422, "body"), size
        assert detail in problem.detail, (size, problem.detail)


@pytest.mark.parametrize(
    ("files", "data", "field"),
    [
        ({"other": ("x", b"{}")}, None, "body.other"),
        ({"file": ("x", b'{"input_text": "a"}\n')}, {"extra": "1"}, "body.extra"),
        ({"file": ("x", b'{"input_text": "a"}\n')}, {"name": "n" * 201}, "body.name"),
    ],
)
async def test_bad_forms_are_422_naming_the_field(client, tenant, files, data, field) -> None:
    r = await client.post("/datasets", files=files, data=data, headers=tenant.headers)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == PROBLEM
    assert r.json()["errors"][0]["field"] == field


async def test_missing_file_part_is_422(client, tenant) -> None:
    boundary = "bb"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\nx\r\n'
        f"--{boundary}--\r\n"
    )
    r = await client.post(
        "/datasets",
        content=body.encode(),
        headers={**tenant.headers, "content-type": f"multipart/form-data; boundary={boundary}"},
    )
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "body.file"


async def test_malformed_multipart_and_other_media_types(client, tenant) -> None:
    headers = {**tenant.headers, "content-type": "multipart/form-data; boundary=zz"}
    r = await client.post(
        "/datasets",
        content=b'--zz\r\nContent-Disposition: form-data; name="file"\r\n\r\n{"input_text":"a"}',
        headers=headers,
    )
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "body"
    r = await client.post(
        "/datasets",
        content=b"x",
        headers={**tenant.headers, "content-type": "multipart/form-data"},
    )
    assert r.status_code == 422
    assert r.json()["errors"][0]["field"] == "header.Content-Type"
    r = await client.post("/datasets", json={"input_text": "a"}, headers=tenant.headers)
    assert r.status_code == 415 and r.headers["content-type"] == PROBLEM
    r = await client.post(
        "/datasets",
        content=b'{"input_text":"a"}\n',
        params={"name": "q"},
        headers={**tenant.headers, **NDJSON},
    )
    assert r.status_code == 201
    r = await upload(client, tenant, jsonl({"input_text": "a"}), params={"name": "q"})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "body.name"


async def test_list_is_newest_first_and_pages(client, make_tenant) -> None:
    t = await make_tenant()
    ids = [
        (await upload(client, t, jsonl({"input_text": str(i)}), name=f"d{i}")).json()["id"]
        for i in range(5)
    ]
    seen, cursor = [], None
    while True:
        params: dict[str, Any] = {"limit": 2, **({"after": cursor} if cursor else {})}
        page = (await client.get("/datasets", params=params, headers=t.headers)).json()
        seen += [d["id"] for d in page["data"]]
        if not page["has_more"]:
            break
        cursor = page["next_cursor"]
    assert seen == list(reversed(ids))
    r = await client.get("/datasets", params={"after": "garbage!"}, headers=t.headers)
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "query.after"


async def test_datasets_are_scoped_to_their_project(client, make_tenant) -> None:
    a, b = await make_tenant(), await make_tenant()
    ds = (await upload(client, a, jsonl({"input_text": "secret"}))).json()
    assert (await client.get("/datasets")).status_code == 401
    for path in ("", "/rows"):
        r = await client.get(f"/datasets/{ds['id']}{path}", headers=b.headers)
        assert r.status_code == 404 and r.headers["content-type"] == PROBLEM
    assert (await client.get("/datasets", headers=b.headers)).json()["data"] == []
    r = await client.post(
        "/runs", json=run_body(inputs=None, dataset_id=ds["id"]), headers=b.headers
    )
    assert r.status_code == 422
    assert r.json()["errors"][0]["field"] == "body.dataset_id"
    r = await client.post(
        "/runs", json=run_body(inputs=None, dataset_id=str(uuid.uuid4())), headers=a.headers
    )
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "body.dataset_id"
    assert (await client.get(f"/datasets/{uuid.uuid4()}", headers=a.headers)).status_code == 404
    r = await client.get("/datasets/not-a-uuid", headers=a.headers)
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "path.dataset_id"


async def test_upload_needs_a_key(client) -> None:
    r = await client.post("/datasets", content=b'{"input_text":"a"}\n', headers=NDJSON)
    assert r.status_code == 401


async def test_a_run_from_a_dataset_gets_its_rows_as_inputs(client, tenant, sessionmaker) -> None:
    rows = [
        {"input_text": "say a", "context": {"answer": "a"}},
        {"input_text": "check", "split": "validation"},
        {"input_text": "say aa"},
    ]
    ds = (await upload(client, tenant, jsonl(*rows))).json()
    r = await client.post(
        "/runs", json=run_body(inputs=None, dataset_id=ds["id"]), headers=tenant.headers
    )
    assert r.status_code == 202, r.text
    run = r.json()
    assert run["dataset_id"] == ds["id"]
    assert run["num_examples"] == 2  # the train rows
    assert (await client.get(f"/runs/{run['id']}", headers=tenant.headers)).json()[
        "dataset_id"
    ] == ds["id"]
    inputs = (await client.get(f"/runs/{run['id']}/inputs", headers=tenant.headers)).json()
    assert [(i["index"], i["input_text"], i["context"], i["split"]) for i in inputs["data"]] == [
        (0, "say a", {"answer": "a"}, "train"),
        (1, "check", None, "validation"),
        (2, "say aa", None, "train"),
    ]
    train = (
        await client.get(
            f"/runs/{run['id']}/inputs", params={"split": "train"}, headers=tenant.headers
        )
    ).json()
    assert [i["index"] for i in train["data"]] == [0, 2]
    events = (await client.get(f"/runs/{run['id']}/events", headers=tenant.headers)).json()
    assert events["data"][0]["type"] == "created"
    assert events["data"][0]["data"] == {"dataset_id": ds["id"], "dataset_inputs": 3}

    # Idempotent creation takes the same path inside its transaction.
    headers = {**tenant.headers, "Idempotency-Key": "from-dataset"}
    body = run_body(inputs=None, dataset_id=ds["id"])
    first = await client.post("/runs", json=body, headers=headers)
    again = await client.post("/runs", json=body, headers=headers)
    assert first.status_code == again.status_code == 202
    assert first.json()["id"] == again.json()["id"]
    assert again.headers["idempotent-replayed"] == "true"

    # A run without a dataset says so.
    plain = (await client.post("/runs", json=run_body(), headers=tenant.headers)).json()
    assert plain["dataset_id"] is None


async def test_inputs_and_dataset_id_together_are_422(client, tenant) -> None:
    ds = (await upload(client, tenant, jsonl({"input_text": "a"}))).json()
    r = await client.post("/runs", json=run_body(dataset_id=ds["id"]), headers=tenant.headers)
    assert r.status_code == 422 and r.headers["content-type"] == PROBLEM
    assert r.json()["errors"][0]["field"] == "body.dataset_id"


async def test_a_dataset_without_train_rows_cannot_start_a_run(client, tenant) -> None:
    ds = (await upload(client, tenant, jsonl({"input_text": "v", "split": "validation"}))).json()
    assert ds["num_train_rows"] == 0
    r = await client.post(
        "/runs", json=run_body(inputs=None, dataset_id=ds["id"]), headers=tenant.headers
    )
    assert r.status_code == 422
    assert r.json()["errors"][0]["field"] == "body.dataset_id"
    assert "no train rows" in r.json()["detail"]


async def test_unstorable_inline_inputs_are_422_not_500(client, tenant) -> None:
    for item in (
        {"input_text": "a\u0000"},
        {"input_text": "a", "context": {"k\u0000": 1}},
    ):
        r = await client.post("/runs", json=run_body(inputs=[item]), headers=tenant.headers)
        assert r.status_code == 422, r.text
    r = await client.post(
        "/runs",
        content=b'{"model_name": "m", "task_description": "t",'
        b' "inputs": [{"input_text": "a", "context": {"x": NaN}}]}',
        headers={**tenant.headers, "content-type": "application/json"},
    )
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"] == "body.inputs[0].context"


async def test_dataset_rows_survive_in_runs_and_in_the_database(client, tenant, sessionmaker):
    ds = (await upload(client, tenant, jsonl({"input_text": "a"}, {"input_text": "b"}))).json()
    async with sessionmaker() as s:
        n = await s.scalar(select(func.count()).where(DatasetRow.dataset_id == uuid.UUID(ds["id"])))
    assert n == 2


async def test_openapi_has_the_dataset_operations(client) -> None:
    spec = (await client.get("/openapi.json")).json()
    ops = {op["operationId"] for path in spec["paths"].values() for op in path.values()}
    assert {"create_dataset", "list_datasets", "get_dataset", "list_dataset_rows"} <= ops
    create = spec["paths"]["/datasets"]["post"]
    assert set(create["requestBody"]["content"]) == {"multipart/form-data", "application/x-ndjson"}
    assert {"201", "413", "415", "422"} <= set(create["responses"])
    assert "dataset_id" in spec["components"]["schemas"]["RunCreate"]["properties"]
