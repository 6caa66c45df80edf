"""``/datasets``: upload a JSONL file of training inputs once, start runs from it by id."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from starlette.requests import ClientDisconnect

from app.auth.deps import Caller, Member
from app.core.deps import ReadSession
from app.core.errors import INCONSISTENT, Problem, problem_responses
from app.core.pagination import Paging, cursor_int32, decode_cursor, make_page
from app.core.settings import app_settings
from app.core.storable import NO_NUL, jsonable
from app.datasets import service
from app.datasets.models import Dataset, DatasetRow
from app.datasets.schemas import DatasetPublic, DatasetRowPublic, DatasetRowsPage, DatasetsPage
from app.datasets.upload import (
    JSONL_MEDIA_TYPES,
    MAX_LINES,
    MAX_NAME_CHARS,
    JsonlReader,
    multipart_boundary,
    read_multipart,
    read_raw,
)

router = APIRouter(prefix="/datasets", tags=["datasets"])

_LINE_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["input_text"],
    "properties": {
        "input_text": {"type": "string", "minLength": 1, "maxLength": 32000},
        "context": {"anyOf": [{"type": "object"}, {"type": "null"}]},
        "split": {"enum": ["train", "validation"], "default": "train"},
    },
}

_REQUEST_BODY: dict[str, Any] = {
    "required": True,
    "description": "A JSONL file: one JSON object per line (x-line-schema); blank lines are "
    f"skipped; at most {MAX_LINES} rows.",
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["file"],
                "properties": {
                    "file": {"type": "string", "format": "binary"},
                    "name": {"type": "string", "maxLength": MAX_NAME_CHARS, "pattern": NO_NUL},
                },
                "additionalProperties": False,
            },
            "encoding": {"file": {"contentType": "application/x-ndjson"}},
        },
        "application/x-ndjson": {"schema": {"type": "string", "format": "binary"}},
    },
    "x-line-schema": _LINE_SCHEMA,
}


async def _body(request: Request) -> AsyncIterator[bytes]:
    try:
        async for chunk in request.stream():
            yield chunk
    except ClientDisconnect:
        # The client went away, or the size limit cut the body off and has answered 413
        # already: whatever is said now is not heard.
        raise Problem(400, "Bad Request", "The upload was cut off.") from None


@router.post(
    "",
    status_code=201,
    operation_id="create_dataset",
    response_model=DatasetPublic,
    responses={
        201: {
            "description": "Created: the dataset and all its rows are stored.",
            "headers": {"Location": {"schema": {"type": "string"}}},
        },
        **problem_responses(400, 401, 403, 413, 415, 422),
    },
    openapi_extra={"requestBody": _REQUEST_BODY},
)
async def create_dataset(
    request: Request,
    caller: Member,
    name: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=MAX_NAME_CHARS,
            pattern=NO_NUL,
            description="The dataset's name (a multipart body may send it as a field instead).",
        ),
    ] = None,
) -> Response:
    """Upload a JSONL file of training inputs, as `multipart/form-data` (field `file`, and
    optionally `name`) or as the raw body (`Content-Type: application/x-ndjson`).

    Each line is `{"input_text": str, "context": object|null, "split": "train"|"validation"}`
    (unknown keys refused); blank lines are skipped. All or nothing: a bad line is a 422 whose
    errors name it (`file.line[17].input_text`) and nothing is stored. Files over the size
    limit (`TRAINYARD_MAX_DATASET_BYTES`, 64 MiB) or with more than 100,000 rows are a 413.
    """
    settings = app_settings(request)
    content_type = request.headers.get("content-type", "")
    media_type = content_type.partition(";")[0].strip().lower()
    dataset_id = uuid.uuid4()
    reader = JsonlReader(dataset_id, max_bytes=settings.max_dataset_bytes)
    if media_type == "multipart/form-data":
        upload = await read_multipart(_body(request), multipart_boundary(content_type), reader)
        if upload.name is not None and name is not None:
            raise Problem(
                422,
                "Validation failed",
                "name is given both as a query parameter and as a form field.",
                field="body.name",
                error_type=INCONSISTENT,
            )
        # The file's name is only a default: what PostgreSQL cannot store (NUL) is replaced.
        filename = jsonable(upload.filename or "")
        name = name or upload.name or filename[:MAX_NAME_CHARS] or None
    elif media_type in JSONL_MEDIA_TYPES:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > settings.max_dataset_bytes:
            raise Problem(
                413,
                "Content Too Large",
                f"A dataset file is limited to {settings.max_dataset_bytes} bytes.",
                field="file",
                headers={"Connection": "close"},
            )
        await read_raw(_body(request), reader)
    else:
        raise Problem(
            415,
            "Unsupported Media Type",
            "Send the JSONL file as multipart/form-data (field 'file') or as an "
            "application/x-ndjson body.",
            field="header.Content-Type",
        )
    async with request.app.state.pg.acquire() as conn:
        row = await service.insert_dataset(conn, caller.project_id, dataset_id, name, reader)
    dataset = DatasetPublic.model_validate(row)
    return Response(
        dataset.model_dump_json(),
        status_code=201,
        media_type="application/json",
        headers={"Location": f"/datasets/{dataset.id}"},
    )


@router.get(
    "",
    operation_id="list_datasets",
    response_model=DatasetsPage,
    responses=problem_responses(401, 422),
)
async def list_datasets(caller: Caller, session: ReadSession, page: Paging) -> dict[str, object]:
    """The project's datasets, newest first."""
    after = None
    if page.after:
        created, last_id = decode_cursor(
            page.after, datetime.fromisoformat, uuid.UUID, of="list_datasets"
        )
        after = (created, last_id)
    rows = await service.list_datasets(session, caller.project_id, limit=page.limit, after=after)
    return make_page(
        rows, page.limit, _dataset_cursor, DatasetPublic.model_validate, of="list_datasets"
    )


def _dataset_cursor(d: Dataset) -> tuple[str, str]:
    assert d.created_at is not None
    return (d.created_at.isoformat(), str(d.id))


@router.get(
    "/{dataset_id}",
    operation_id="get_dataset",
    response_model=DatasetPublic,
    responses=problem_responses(401, 404, 422),
)
async def get_dataset(dataset_id: uuid.UUID, caller: Caller, session: ReadSession) -> Dataset:
    """One dataset: its name, row counts per split, size and SHA-256."""
    return await service.get_dataset(session, caller.project_id, dataset_id)


@router.get(
    "/{dataset_id}/rows",
    operation_id="list_dataset_rows",
    response_model=DatasetRowsPage,
    responses=problem_responses(401, 404, 422),
)
async def list_dataset_rows(
    dataset_id: uuid.UUID,
    caller: Caller,
    session: ReadSession,
    page: Paging,
    split: Annotated[str | None, Query(pattern=r"^(train|validation)$")] = None,
) -> dict[str, object]:
    """The dataset's rows, by index; `split` keeps one split."""
    await service.ensure_dataset_visible(session, caller.project_id, dataset_id)
    scope = (dataset_id, split)
    after = (
        decode_cursor(page.after, cursor_int32, of="list_dataset_rows", scope=scope)[0]
        if page.after
        else None
    )
    rows = await service.list_rows(session, dataset_id, split=split, limit=page.limit, after=after)
    return make_page(
        rows,
        page.limit,
        _row_cursor,
        DatasetRowPublic.model_validate,
        of="list_dataset_rows",
        scope=scope,
    )


def _row_cursor(r: DatasetRow) -> tuple[int]:
    return (r.index,)
