"""Reading an uploaded JSONL dataset while it streams in. Nothing here touches the database.

The body is either ``multipart/form-data`` (a ``file`` part and an optional ``name`` part)
or the file itself (``application/x-ndjson``); python-multipart's streaming parser splits the
former as it arrives. Either way each chunk of the file goes straight to a
:class:`JsonlReader`, which counts bytes against the limit (413 as soon as it is passed, not
after buffering), hashes them, validates every line with the inline inputs' own rules
(:class:`~app.runs.spec.body.InputItem`) and keeps the valid rows as PostgreSQL ``COPY`` text,
ready to send: no per-row Python objects outlive their line.

Lines are numbered from 1 as an editor shows them (blank lines count, and are skipped); a
row's ``index`` counts the stored rows from 0.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import AsyncIterable
from typing import TYPE_CHECKING

from pydantic import ValidationError
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from app.core.copy_format import copy_field
from app.core.errors import FieldError, Problem
from app.core.limits import MAX_DATASET_ROWS
from app.runs.spec.body import InputItem

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

MAX_LINES = MAX_DATASET_ROWS
MAX_NAME_CHARS = 200
MAX_REPORTED_LINES = 10  # bad lines named in one 422 before reading stops
MULTIPART_ENVELOPE_BYTES = 64 * 1024  # what a multipart body may carry beyond its file
MAX_PART_HEADER_BYTES = 16 * 1024
_FEED_BYTES = 64 * 1024  # the most handed to the multipart parser at once
JSONL_MEDIA_TYPES = frozenset(
    {
        "application/x-ndjson",
        "application/jsonl",
        "application/x-jsonlines",
        "application/jsonlines",
    }
)
_BOM = b"\xef\xbb\xbf"
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _loc(loc: tuple[int | str, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)


def _too_large(what: str, limit: int) -> Problem:
    return Problem(
        413,
        "Content Too Large",
        f"{what} is limited to {limit} bytes.",
        field="file",
        headers={"Connection": "close"},
    )


class JsonlReader:
    """Validates a JSONL file fed in chunks and keeps its rows as COPY text.

    Raises :class:`Problem`: 413 past ``max_bytes`` or ``max_lines``; 422 naming each bad
    line (``file.line[17].input_text``), as soon as ``MAX_REPORTED_LINES`` are bad or at
    :meth:`close`; 422 for a file with no rows.
    """

    def __init__(self, dataset_id: uuid.UUID, *, max_bytes: int, max_lines: int = MAX_LINES):
        self.max_bytes = max_bytes
        self.max_lines = max_lines
        self.size = 0
        self.num_rows = 0
        self.num_train_rows = 0
        self.num_validation_rows = 0
        self.copy = bytearray()  # COPY text of dataset_rows (dataset_id, index, …)
        self._sha = hashlib.sha256()
        self._pending = bytearray()  # the line not yet ended
        self._line_no = 0
        self._errors: list[FieldError] = []
        self._bad_lines: list[int] = []
        self._prefix = f"{dataset_id}\t"

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()

    def feed(self, data: bytes) -> None:
        if not data:
            return
        self.size += len(data)
        if self.size > self.max_bytes:
            raise _too_large("A dataset file", self.max_bytes)
        self._sha.update(data)
        if b"\n" not in data:  # only new data is searched: a long line stays linear
            self._pending += data
            return
        self._pending += data
        lines = self._pending.split(b"\n")
        self._pending = bytearray(lines.pop())
        for line in lines:
            self._line(line)

    def close(self) -> None:
        if self._pending:
            self._line(bytes(self._pending))
            self._pending = bytearray()
        if self._errors:
            raise self._invalid()
        if self.num_rows == 0:
            raise Problem(
                422,
                "Empty dataset",
                "The file has no lines: send one JSON object per line.",
                field="file",
            )

    def _line(self, raw: bytes | bytearray) -> None:
        self._line_no += 1
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        if self._line_no == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM) :]
        if not raw.strip():
            return
        if self.num_rows >= self.max_lines:
            raise Problem(
                413,
                "Content Too Large",
                f"line {self._line_no}: a dataset has at most {self.max_lines} rows.",
                field=f"file.line[{self._line_no}]",
                headers={"Connection": "close"},
            )
        index = self.num_rows
        self.num_rows += 1
        try:
            item = InputItem.model_validate_json(raw)
        except ValidationError as exc:
            self._bad(exc)
            return
        if item.split == "train":
            self.num_train_rows += 1
        else:
            self.num_validation_rows += 1
        if self._errors:
            return  # nothing will be stored: stop keeping rows
        context = (
            "\\N"
            if item.context is None
            # JSON text never holds a raw tab or line end: only backslashes need doubling.
            else _JSON.encode(item.context).replace("\\", "\\\\")
        )
        self.copy += (
            f"{self._prefix}{index}\t{copy_field(item.input_text)}\t{context}\t{item.split}\n"
        ).encode()

    def _bad(self, exc: ValidationError) -> None:
        n = self._line_no
        self._bad_lines.append(n)
        self.copy = bytearray()
        for err in exc.errors(include_url=False):
            message = err.get("msg", "invalid")
            if err["type"] == "extra_forbidden":
                message = "unknown field"
            elif err["type"] == "json_invalid":
                # Positions are within the line, which is always "line 1" to the parser.
                message = message.replace(" at line 1 column ", " at column ")
            self._errors.append(
                FieldError(
                    field=f"file.line[{n}]{_loc(err['loc'])}", message=message, type=err["type"]
                )
            )
        if len(self._bad_lines) >= MAX_REPORTED_LINES:
            raise self._invalid()

    def _invalid(self) -> Problem:
        first = self._errors[0]
        where = first.field.removeprefix(f"file.line[{self._bad_lines[0]}]").lstrip(".")
        detail = f"line {self._bad_lines[0]}: " + (f"{where}: " if where else "") + first.message
        if len(self._bad_lines) > 1:
            more = len(self._bad_lines) - 1
            detail += f" (and {more} more bad line{'s' if more > 1 else ''})"
        if len(self._bad_lines) >= MAX_REPORTED_LINES:
            detail += f"; reading stopped at line {self._line_no}"
        problem = Problem(422, "Invalid dataset", detail, headers={"Connection": "close"})
        problem.errors = self._errors
        return problem


# --- multipart/form-data ------------------------------------------------------------------


def _malformed(detail: str) -> Problem:
    return Problem(
        422,
        "Malformed multipart body",
        detail,
        field="body",
        headers={"Connection": "close"},
    )


def multipart_boundary(content_type: str) -> bytes:
    boundary = parse_options_header(content_type)[1].get(b"boundary")
    if not boundary or len(boundary) > 200:
        raise Problem(
            422,
            "Malformed multipart body",
            "multipart/form-data needs a boundary parameter (1 to 70 characters).",
            field="header.Content-Type",
        )
    return boundary


class Upload:
    """What the body said besides the file: the form's ``name`` and the file's own name."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.filename: str | None = None


class _Form:
    """python-multipart's callbacks for one upload: the ``file`` part goes to ``reader`` as it
    arrives, ``name`` is kept (a few hundred bytes at most), any other part is a 422."""

    def __init__(self, reader: JsonlReader) -> None:
        self.reader = reader
        self.upload = Upload()
        self.seen: set[str] = set()
        self.ended = False
        self.data_bytes = 0  # the parts' contents; the rest of the body is envelope
        self._current: str | None = None
        self._name = bytearray()
        self._header_bytes = 0
        self._field = bytearray()
        self._value = bytearray()
        self._disposition: bytes | None = None

    def callbacks(self) -> MultipartCallbacks:
        return {
            "on_part_begin": self._part_begin,
            "on_header_field": self._header_field,
            "on_header_value": self._header_value,
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
            "on_end": self._end,
        }

    def _part_begin(self) -> None:
        self._header_bytes = 0
        self._disposition = None

    def _header_bytes_add(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > MAX_PART_HEADER_BYTES:
            raise _malformed("A part's headers are too large.")

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_bytes_add(end - start)
        self._field += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_bytes_add(end - start)
        self._value += data[start:end]

    def _header_end(self) -> None:
        if self._field.lower() == b"content-disposition":
            self._disposition = bytes(self._value).strip()
        self._field.clear()
        self._value.clear()

    def _headers_finished(self) -> None:
        # Parameters come back as latin-1 bytes of what was sent (UTF-8 in practice).
        kind, params = parse_options_header(self._disposition)
        if kind.lower() != b"form-data":
            raise _malformed("Every part needs 'Content-Disposition: form-data; name=…'.")
        current = params.get(b"name", b"").decode("utf-8", "replace")
        if current not in ("file", "name"):
            raise Problem(
                422,
                "Validation failed",
                "unknown field: send the JSONL file as 'file' and optionally 'name'",
                field=f"body.{current}" if current else "body",
            )
        if current in self.seen:
            raise Problem(
                422,
                "Validation failed",
                f"The '{current}' field is sent more than once.",
                field=f"body.{current}",
            )
        self.seen.add(current)
        self._current = current
        if current == "file":
            filename = params.get(b"filename")
            self.upload.filename = None if filename is None else filename.decode("utf-8", "replace")

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        self.data_bytes += end - start
        if self._current == "file":
            self.reader.feed(data[start:end])
        else:
            self._name += data[start:end]
            if len(self._name) > MAX_NAME_CHARS * 4:
                raise _bad_name()

    def _part_end(self) -> None:
        if self._current == "name":
            self.upload.name = _form_name(bytes(self._name))
        self._current = None

    def _end(self) -> None:
        self.ended = True


async def read_multipart(
    chunks: AsyncIterable[bytes], boundary: bytes, reader: JsonlReader
) -> Upload:
    """Feed the ``file`` part to ``reader``; 422 naming ``body.<part>`` for anything else."""
    form = _Form(reader)
    parser = MultipartParser(boundary, form.callbacks())
    fed = 0
    async for chunk in chunks:
        # The parser walks boundaries and headers byte by byte in Python: slices keep the
        # time spent on one of them short, and the envelope limit bounds their number.
        for at in range(0, len(chunk), _FEED_BYTES):
            if form.ended:
                break  # the epilogue is ignored
            piece = chunk[at : at + _FEED_BYTES] if len(chunk) > _FEED_BYTES else chunk
            try:
                parser.write(piece)
            except MultipartParseError:
                raise _malformed("The body is not well-formed multipart/form-data.") from None
            fed += len(piece)
            if fed - form.data_bytes > MULTIPART_ENVELOPE_BYTES:
                raise _malformed(
                    f"More than {MULTIPART_ENVELOPE_BYTES} bytes of the body are not a part's "
                    "content (delimiters, headers or padding)."
                )
    if not form.ended:
        raise _malformed("The multipart body ends before its closing boundary.")
    if "file" not in form.seen:
        raise Problem(
            422,
            "Validation failed",
            "Send the JSONL file as the multipart field 'file'.",
            field="body.file",
        )
    reader.close()
    return form.upload


def _bad_name() -> Problem:
    return Problem(
        422,
        "Validation failed",
        f"name must be 1 to {MAX_NAME_CHARS} characters of UTF-8.",
        field="body.name",
    )


def _form_name(raw: bytes) -> str | None:
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _bad_name() from None
    if len(name) > MAX_NAME_CHARS or "\x00" in name:
        raise _bad_name()
    return name or None


async def read_raw(chunks: AsyncIterable[bytes], reader: JsonlReader) -> None:
    async for chunk in chunks:
        reader.feed(chunk)
    reader.close()
