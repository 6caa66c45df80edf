"""Fixtures of the generated clients' tests: the pinned generators, and a live API (uvicorn)
with a real worker behind it, on a database of the test's own."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import ROOT
from tests.support.cli import free_port, wait_for
from tests.support.database import OwnDatabase, Tenant, own_database, sessionmaker  # noqa: F401
from tests.support.workers import start_worker, tiny_model, worker_home  # noqa: F401

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def generators() -> None:
    """The pinned generators, installed once (setup.sh does nothing when they are)."""
    done = subprocess.run(
        ["bash", str(HERE / "setup.sh")], capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


@contextlib.contextmanager
def live_api(log: Path, env: dict[str, str]) -> Iterator[str]:
    """``uvicorn app.asgi:app`` on a free port with ``env``; its base URL once it answers."""
    port = free_port()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "uvicorn", "app.asgi:app"),
            *("--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"),
        ],
        cwd=ROOT,
        env={**os.environ, **env, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"},
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{base}/readyz", timeout=2).status_code == 200
        return False

    try:
        wait_for("the API under uvicorn", ready, 60, log)
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


@pytest.fixture
async def service(
    generators: None,
    own_database: OwnDatabase,  # noqa: F811
    start_worker: Any,  # noqa: F811
    worker_home: dict[str, str],  # noqa: F811
    make_tenant: Any,
    tmp_path: Path,
) -> AsyncIterator[tuple[str, str, Path]]:
    """(base URL of a live API, an API key, its document saved as a file) with a worker
    running the real training pipeline behind it."""
    start_worker(**worker_home)
    tenant: Tenant = await make_tenant()
    with live_api(tmp_path / "api.log", own_database.env()) as base:
        document = tmp_path / "openapi.json"
        async with httpx.AsyncClient(base_url=base) as client:
            document.write_text((await client.get("/openapi.json")).text)
        yield base, tenant.key, document
