"""Logs as an operator reads them: JSON lines from a real worker and a real ``trainyard api``
that parse and carry the run id, request id and project; plain text on a terminal."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pty
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from app.core.logs import ACCESS_LOGGER, LogFormatter
from tests.support import ROOT
from tests.support.cli import free_port, wait_for
from tests.support.database import api, own_database, sessionmaker  # noqa: F401  (fixtures)
from tests.support.runs import run_body
from tests.support.runs import wait_for as wait_for_run
from tests.support.workers import start_worker  # noqa: F401  (fixture)


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every log line, parsed (a line that is not JSON fails the test); Celery's start-up
    banner, printed on stdout rather than logged, is the only other text."""
    lines = [line for line in text.splitlines() if line.startswith("{")]
    return [json.loads(line) for line in lines]


async def test_a_worker_logs_json_lines_carrying_the_run_id(
    client: httpx.AsyncClient,
    tenant: Any,
    sessionmaker: Any,  # noqa: F811
    start_worker: Any,  # noqa: F811
) -> None:
    worker = start_worker()  # its log is a file, not a terminal: JSON
    body = run_body(max_steps=1, rollouts_per_group=2, config={"tick": 0.05})
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    await wait_for_run(sessionmaker, run["id"], lambda r: r.status == "completed")
    await worker.wait_for_output(f"run {run['id']}: done")

    lines = json_lines(worker.output())
    (claimed,) = [line for line in lines if line["message"].startswith(f"run {run['id']}: claim")]
    assert claimed["run_id"] == run["id"]
    assert claimed["level"] == "INFO" and claimed["logger"] == "workers.driver"
    assert datetime.fromisoformat(claimed["time"]).utcoffset().total_seconds() == 0
    # The Celery task's id, on the driver's lines (another thread) and the task's own.
    (done,) = [line for line in lines if line["message"] == f"run {run['id']}: done"]
    assert done["task_id"] == claimed["task_id"] and uuid.UUID(done["task_id"])
    # Celery's own loggers reach the one handler, once.
    assert len([line for line in lines if line["message"].endswith(" ready.")]) == 1


class Lines(list[dict[str, Any]]):
    """Access lines as they are logged (a batch at a time: app/core/logs.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.logged = asyncio.Event()

    async def wait_for(self, n: int) -> None:
        async with asyncio.timeout(10):
            while len(self) < n:
                await self.logged.wait()
                self.logged.clear()


@contextlib.contextmanager
def access_lines() -> Iterator[Lines]:
    """The access log's lines as the JSON formatter writes them."""
    seen = Lines()

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(json.loads(self.format(record)))
            seen.logged.set()

    handler = Collect()
    handler.setFormatter(LogFormatter(as_json=True))
    logger = logging.getLogger(ACCESS_LOGGER)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


async def test_each_request_gets_an_access_line_with_its_echoed_id_and_project(
    client: httpx.AsyncClient, tenant: Any
) -> None:
    with access_lines() as lines:
        given = await client.get(
            f"/runs/{uuid.uuid4()}", headers={**tenant.headers, "X-Request-ID": "req-1.a:b"}
        )
        fresh = await client.get("/runs", headers=tenant.headers)
        forged = await client.get("/runs", headers={"X-Request-ID": 'x" "level": "ERROR'})
        await lines.wait_for(3)

    assert given.status_code == 404 and given.headers["x-request-id"] == "req-1.a:b"
    assert len(fresh.headers["x-request-id"]) == 32 and int(fresh.headers["x-request-id"], 16)
    assert forged.status_code == 401
    assert forged.headers["x-request-id"] not in ("", 'x" "level": "ERROR')
    assert [
        (line["method"], line["route"], line["status"], line["request_id"]) for line in lines
    ] == [
        ("GET", "/runs/{run_id}", 404, "req-1.a:b"),
        ("GET", "/runs", 200, fresh.headers["x-request-id"]),
        ("GET", "/runs", 401, forged.headers["x-request-id"]),
    ]
    assert [line.get("project_id") for line in lines] == [str(tenant.project_id)] * 2 + [None]
    assert all(line["logger"] == ACCESS_LOGGER and line["duration_ms"] >= 0 for line in lines)


def test_trainyard_api_writes_json_access_lines(service_urls: Any, tmp_path: Path) -> None:
    """Under ``trainyard api`` with two uvicorn processes: uvicorn applies our logging
    configuration in each, and its own access log stays off."""
    port = free_port()
    log = tmp_path / "api.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRAINYARD_METRICS_ENABLED": "false"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "api", "--port", str(port), "--workers", "2"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"

    def answered() -> httpx.Response | None:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{base}/healthz", headers={"X-Request-ID": "probe"}, timeout=2)
        return None

    def logged() -> list[dict[str, Any]]:
        return [line for line in json_lines(log.read_text()) if line.get("request_id") == "probe"]

    try:
        answer = wait_for("the API", answered, 60, log)
        assert answer.headers["x-request-id"] == "probe"
        line = wait_for("its access line", logged, 10, log)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    assert line["logger"] == ACCESS_LOGGER and line["route"] == "/healthz"
    assert "uvicorn.access" not in log.read_text()
    assert all(text.startswith("{") for text in log.read_text().splitlines())


def test_a_stopped_api_writes_its_last_access_lines(service_urls: Any, tmp_path: Path) -> None:
    """Lines are written a batch at a time (within 0.1 s): a SIGTERM right after the last
    answers loses none of their lines."""
    port = free_port()
    log = tmp_path / "api.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRAINYARD_METRICS_ENABLED": "false"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "api", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"

    def answered() -> httpx.Response | None:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{base}/healthz", timeout=2)
        return None

    try:
        wait_for("the API", answered, 60, log)
        with httpx.Client(base_url=base) as client:
            for i in range(20):
                client.get("/healthz", headers={"X-Request-ID": f"last-{i}"})
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    ids = {line.get("request_id") for line in json_lines(log.read_text())}
    assert {f"last-{i}" for i in range(20)} <= ids


LOG_SOME = """
import logging
from app.core.logs import configure_logging, log_context
configure_logging("INFO")
configure_logging("INFO")  # twice: still one handler
with log_context(run_id="r-1"):
    logging.getLogger("trainyard.test").info("hello %s", "there")
"""


def logged_by(*, terminal: bool, **env: str) -> str:
    """What :data:`LOG_SOME` writes on stderr: a pseudo-terminal, or a pipe."""
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    argv = [sys.executable, "-c", LOG_SOME]
    if not terminal:
        return subprocess.run(argv, env=environ, capture_output=True, text=True, check=True).stderr
    leader, follower = pty.openpty()
    try:
        subprocess.run(argv, env=environ, stderr=follower, check=True)
        os.close(follower)
        out = b""
        with contextlib.suppress(OSError):  # EIO once everything written is read
            while chunk := os.read(leader, 4096):
                out += chunk
    finally:
        os.close(leader)
    return out.decode().replace("\r\n", "\n")


def test_plain_text_on_a_terminal_json_otherwise_or_as_the_setting_says() -> None:
    text = logged_by(terminal=True).splitlines()
    assert len(text) == 1 and text[0].endswith(" INFO trainyard.test: hello there [run_id=r-1]")
    (line,) = json_lines(logged_by(terminal=False))
    assert (line["message"], line["run_id"], line["level"]) == ("hello there", "r-1", "INFO")
    forced = logged_by(terminal=False, TRAINYARD_LOG_FORMAT="text").splitlines()
    assert len(forced) == 1 and forced[0].endswith(" INFO trainyard.test: hello there [run_id=r-1]")
    assert json_lines(logged_by(terminal=True, TRAINYARD_LOG_FORMAT="json"))[0]["run_id"] == "r-1"


def test_an_exception_is_logged_with_its_traceback() -> None:
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(self.format(record))

    handler = Collect()
    handler.setFormatter(LogFormatter(as_json=True))
    logger = logging.getLogger("trainyard.test.exc")
    logger.addHandler(handler)
    try:
        try:
            raise ValueError("boom")
        except ValueError:
            logger.error("it broke", exc_info=True, extra={"step": 3})
    finally:
        logger.removeHandler(handler)
    (line,) = [json.loads(text) for text in seen]
    assert line["message"] == "it broke" and line["step"] == 3
    assert line["exc_info"].startswith("Traceback") and "ValueError: boom" in line["exc_info"]
