"""Documented limits are sendable: the longest URL the OpenAPI document allows, for every
operation, reaches the application through the real server (``trainyard api``: uvicorn with
httptools) and gets a proper answer, not the HTTP parser's plain-text 400.

httptools refuses a URL over 65,535 bytes (a constant compiled into it), so the array and
length limits of the query parameters are set to keep the longest URL of any operation
within :data:`BUDGET`, with room to spare for the path and the headers.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from tests.support import ROOT

HTTPTOOLS_MAX_URL = 65_535
BUDGET = 48 * 1024

# The longest value of each kind of string a parameter documents. Any other pattern fails
# the test: a new one needs its longest value here.
_WIDE = "\U0001f600"  # 4 bytes of UTF-8, 12 once percent-encoded
_LONGEST_BY_PATTERN = {
    "^[^\\x00]*$": lambda n: _WIDE * n,  # what PostgreSQL text takes: anything but NUL
    "^[A-Za-z0-9_-]*$": lambda n: "A" * n,  # a cursor
    "^(train|validation)$": lambda n: "validation",
}
_LONGEST_BY_FORMAT = {
    "uuid": str(uuid.UUID(int=0)),
    "date-time": "2026-12-31T23:59:59.999999+14:00",
    "date": "2026-12-31",
}


def _longest(schema: dict[str, Any], doc: dict[str, Any]) -> str:
    """The longest value, percent-encoded, that ``schema`` allows (numbers at their widest)."""
    if "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    if "anyOf" in schema:
        return max((_longest(s, doc) for s in schema["anyOf"]), key=len)
    if "enum" in schema:
        return max((quote(str(v)) for v in schema["enum"]), key=len)
    if "const" in schema:
        return quote(str(schema["const"]))
    kind = schema.get("type")
    if kind == "boolean":
        return "false"
    if kind == "integer":
        assert "maximum" in schema, f"an integer without a maximum: {schema}"
        return str(max(abs(schema.get("minimum", 0)), schema["maximum"]))
    if kind == "number":
        return "-2.2250738585072014e-308"  # as long as a double's shortest form gets
    assert kind == "string", schema
    if "format" in schema:
        return _LONGEST_BY_FORMAT[schema["format"]]
    assert "maxLength" in schema or schema.get("pattern") == "^(train|validation)$", (
        f"a string without a maxLength: {schema}"
    )
    return quote(_LONGEST_BY_PATTERN[schema["pattern"]](schema.get("maxLength", 0)), safe="")


def longest_url(doc: dict[str, Any], path: str, op: dict[str, Any]) -> str:
    """``path`` with its ids and every query parameter at its documented maximum."""
    url = path
    query = []
    for p in op.get("parameters", []):
        schema = p["schema"]
        if p["in"] == "path":
            url = url.replace(f"{{{p['name']}}}", str(uuid.uuid4()))
        elif p["in"] == "query":
            if schema.get("type") == "array":
                value = _longest(schema["items"], doc)
                query += [f"{p['name']}={value}"] * schema["maxItems"]
            else:
                query.append(f"{p['name']}={_longest(schema, doc)}")
    return f"{url}?{'&'.join(query)}" if query else url


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(
    service_urls: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """``trainyard api`` on a free port, as deployed (uvloop, httptools)."""
    port = _free_port()
    log = Path(tmp_path_factory.mktemp("api")) / "api.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRAINYARD_RATE_LIMIT_PER_SECOND": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "api", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60  # only turns a server that never starts into a failure
    try:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/healthz", timeout=1).is_success:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"API did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def document(server: str) -> dict[str, Any]:
    return dict(httpx.get(f"{server}/openapi.json").json())


def _operations(doc: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(m.upper(), path, op) for path, ops in doc["paths"].items() for m, op in ops.items()]


def test_the_longest_documented_url_of_every_operation_is_within_budget(document) -> None:
    lengths = {
        op["operationId"]: len(longest_url(document, path, op))
        for _, path, op in _operations(document)
    }
    over = {name: n for name, n in lengths.items() if n > BUDGET}
    assert not over, over
    # The budget is not vacuous: the widest lists come close to it.
    assert max(lengths.values()) > BUDGET // 2, lengths


async def test_the_longest_documented_urls_get_an_answer_from_the_app(
    server: str, document: dict[str, Any], tenant: Any
) -> None:
    async with httpx.AsyncClient(base_url=server, headers=tenant.headers, timeout=30) as http:
        for method, path, op in _operations(document):
            if method != "GET" or path.endswith("/stream"):
                continue  # the stream of a run that is not there is a 404 all the same
            url = longest_url(document, path, op)
            r = await http.get(url)
            # Whatever the app makes of it (a cursor of 512 'A's is no cursor: a 422), the
            # answer is one the operation documents, not the HTTP parser's.
            assert str(r.status_code) in op["responses"], (op["operationId"], r.text)
            assert r.headers["content-type"].split(";")[0] in (
                "application/json",
                "application/problem+json",
            ), (op["operationId"], r.headers["content-type"])


def test_a_url_past_the_parsers_limit_is_what_the_budget_is_for(server: str) -> None:
    """The limit the budget keeps clear of: one byte more than httptools reads is its
    plain-text 400 (sent on a bare socket: httpx refuses to build such a URL)."""
    host, port = server.removeprefix("http://").split(":")
    target = "/healthz?x=" + "a" * HTTPTOOLS_MAX_URL
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        head = sock.recv(65_536).decode("latin-1")
    assert head.startswith("HTTP/1.1 400"), head[:200]
    assert "content-type: text/plain" in head.lower(), head[:500]
