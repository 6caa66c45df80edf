"""Reading an uploaded JSONL dataset while it streams in. Nothing here touches the database.

The body is either ``multipart/form-data`` (a ``file`` part and an optional ``name`` part)
or the file itself (``application/x-ndjson``). Either way each chunk goes straight to a
:class:`JsonlReader`, which counts bytes against the limit (413 as soon as it is passed, not
after buffering), hashes them, validates every line with the inline inputs' own rules
(:class:`~app.runs.schemas.InputItem`) and keeps the valid rows as PostgreSQL ``COPY`` text,
ready to send: no per-row Python objects outlive their line.

Lines are numbered from 1 as an editor shows them (blank lines count, and are skipped); a
row's ``index`` counts the stored rows from 0.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import AsyncIterable
from email.message import Message
from typing import Any

from pydantic import ValidationError

from app.core.errors import FieldError, Problem
from app.runs.schemas import InputItem

MAX_LINES = 100_000  # rows of one dataset; also the most num_examples a run may ask for
MAX_NAME_CHARS = 200
MAX_REPORTED_LINES = 10  # bad lines named in one 422 before reading stops
MULTIPART_ENVELOPE_BYTES = 64 * 1024  # what a multipart body may carry beyond its file
MAX_PART_HEADER_BYTES = 16 * 1024
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


def _copy_text(value: str) -> str:
    """``value`` as a field of PostgreSQL's COPY text format (most need no escaping)."""
    if "\\" in value:
        value = value.replace("\\", "\\\\")
    if "\n" in value:
        value = value.replace("\n", "\\n")
    if "\r" in value:
        value = value.replace("\r", "\\r")
    if "\t" in value:
        value = value.replace("\t", "\\t")
    return value


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
            f"{self._prefix}{index}\t{_copy_text(item.input_text)}\t{context}\t{item.split}\n"
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


def _header_param(header: str, value: str, param: str) -> str | None:
    message = Message()
    message[header] = value
    found: Any = message.get_param(param, header=header)
    if found is None:
        return None
    if isinstance(found, tuple):  # RFC 2231 (charset, language, value)
        from email.utils import collapse_rfc2231_value

        return collapse_rfc2231_value(found)
    return str(found)


def multipart_boundary(content_type: str) -> bytes:
    boundary = _header_param("content-type", content_type, "boundary")
    if not boundary or len(boundary) > 200:
        raise Problem(
            422,
            "Malformed multipart body",
            "multipart/form-data needs a boundary parameter (1 to 70 characters).",
            field="header.Content-Type",
        )
    return boundary.encode("latin-1", "replace")


class _PartStart:
    __slots__ = ("filename", "name")

    def __init__(self, name: str | None, filename: str | None) -> None:
        self.name = name
        self.filename = filename


class _PartEnd:
    __slots__ = ()


_PART_END = _PartEnd()
_Event = _PartStart | bytes | _PartEnd


class MultipartParser:
    """An incremental ``multipart/form-data`` parser (RFC 7578) that never holds a part.

    :meth:`feed` returns events: a :class:`_PartStart`, then the part's content as ``bytes``
    chunks, then ``_PART_END``. Only a delimiter's worth of bytes is kept between calls.
    """

    _PREAMBLE, _AFTER_DELIMITER, _HEADERS, _BODY, _DONE = range(5)

    def __init__(self, boundary: bytes) -> None:
        self._delimiter = b"\r\n--" + boundary
        # The first delimiter may open the body with no CRLF before it.
        self._buf = bytearray(b"\r\n")
        self._state = self._PREAMBLE

    @property
    def done(self) -> bool:
        return self._state == self._DONE

    def feed(self, data: bytes) -> list[_Event]:
        self._buf += data
        events: list[_Event] = []
        buf = self._buf
        delimiter = self._delimiter
        while True:
            if self._state == self._PREAMBLE:
                at = buf.find(delimiter)
                if at < 0:
                    del buf[: max(0, len(buf) - len(delimiter) + 1)]
                    break
                del buf[: at + len(delimiter)]
                self._state = self._AFTER_DELIMITER
            elif self._state == self._AFTER_DELIMITER:
                if len(buf) < 2:
                    break
                if buf.startswith(b"--"):
                    self._state = self._DONE  # the close delimiter; the epilogue is ignored
                    continue
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > 256:
                        raise _malformed("A boundary delimiter is not followed by a line end.")
                    break
                if buf[:end].strip(b" \t"):
                    raise _malformed("A boundary delimiter is followed by unexpected bytes.")
                del buf[: end + 2]
                self._state = self._HEADERS
            elif self._state == self._HEADERS:
                if buf.startswith(b"\r\n"):
                    head, skip = b"", 2
                else:
                    end = buf.find(b"\r\n\r\n")
                    if end < 0:
                        if len(buf) > MAX_PART_HEADER_BYTES:
                            raise _malformed("A part's headers are too large.")
                        break
                    head, skip = bytes(buf[:end]), end + 4
                if skip > MAX_PART_HEADER_BYTES:
                    raise _malformed("A part's headers are too large.")
                del buf[:skip]
                events.append(self._part_start(head))
                self._state = self._BODY
            elif self._state == self._BODY:
                at = buf.find(delimiter)
                if at < 0:
                    keep = len(delimiter) - 1  # may be the start of a delimiter
                    if len(buf) > keep:
                        events.append(bytes(buf[: len(buf) - keep]))
                        del buf[: len(buf) - keep]
                    break
                if at:
                    events.append(bytes(buf[:at]))
                events.append(_PART_END)
                del buf[: at + len(delimiter)]
                self._state = self._AFTER_DELIMITER
            else:  # done: drop the epilogue
                buf.clear()
                break
        return events

    def close(self) -> None:
        if self._state != self._DONE:
            raise _malformed("The multipart body ends before its closing boundary.")

    @staticmethod
    def _part_start(head: bytes) -> _PartStart:
        disposition = None
        for line in head.decode("utf-8", "replace").split("\r\n"):
            key, sep, value = line.partition(":")
            if not sep:
                raise _malformed("A part header line has no colon.")
            if key.strip().lower() == "content-disposition":
                disposition = value.strip()
        if disposition is None or not disposition.lower().startswith("form-data"):
            raise _malformed("Every part needs 'Content-Disposition: form-data; name=…'.")
        return _PartStart(
            _header_param("content-disposition", disposition, "name"),
            _header_param("content-disposition", disposition, "filename"),
        )


class Upload:
    """What the body said besides the file: the form's ``name`` and the file's own name."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.filename: str | None = None


async def read_multipart(
    chunks: AsyncIterable[bytes], boundary: bytes, reader: JsonlReader
) -> Upload:
    """Feed the ``file`` part to ``reader``; 422 naming ``body.<part>`` for anything else."""
    parser = MultipartParser(boundary)
    upload = Upload()
    current: str | None = None
    seen: set[str] = set()
    name_bytes = bytearray()
    async for chunk in chunks:
        for event in parser.feed(chunk):
            if isinstance(event, bytes):
                if current == "file":
                    reader.feed(event)
                else:
                    name_bytes += event
                    if len(name_bytes) > MAX_NAME_CHARS * 4:
                        raise _bad_name()
            elif isinstance(event, _PartStart):
                current = event.name or ""
                if current not in ("file", "name"):
                    raise Problem(
                        422,
                        "Validation failed",
                        "unknown field: send the JSONL file as 'file' and optionally 'name'",
                        field=f"body.{current}" if current else "body",
                    )
                if current in seen:
                    raise Problem(
                        422,
                        "Validation failed",
                        f"The '{current}' field is sent more than once.",
                        field=f"body.{current}",
                    )
                seen.add(current)
                if current == "file":
                    upload.filename = event.filename
            else:
                if current == "name":
                    upload.name = _form_name(bytes(name_bytes))
                current = None
    parser.close()
    if "file" not in seen:
        raise Problem(
            422,
            "Validation failed",
            "Send the JSONL file as the multipart field 'file'.",
            field="body.file",
        )
    reader.close()
    return upload


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
