"""Fixtures of the generated clients' tests: the pinned generators, and a live API (uvicorn)
with a real worker behind it, on a database of the test's own."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api_process import api_process
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
    # uvicorn serving the ASGI app, as a deployment does.
    with api_process(tmp_path / "api.log", own_database.env(), uvicorn=True) as api:
        document = tmp_path / "openapi.json"
        async with httpx.AsyncClient(base_url=api.url) as client:
            document.write_text((await client.get("/openapi.json")).text)
        yield api.url, tenant.key, document
