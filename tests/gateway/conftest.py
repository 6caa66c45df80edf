"""Gateway runs: the API and the worker in processes of their own, each test on a database
and broker prefix of its own; harnesses on the ``openai`` SDK and the Trainyard SDK."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.api_process import ApiProcess, api_process
from tests.support.database import (  # noqa: F401  (fixtures)
    OwnDatabase,
    api,
    own_database,
    sessionmaker,
)
from tests.support.workers import (  # noqa: F401  (fixtures)
    start_worker,
    tiny_model,
    tool_model,
    worker_home,
)


@pytest.fixture
def api_server(own_database: OwnDatabase, tmp_path: Path) -> Iterator[ApiProcess]:  # noqa: F811
    """The API in a process of its own on the test's database: what harnesses talk to."""
    with api_process(tmp_path / "api.log", own_database.env()) as server:
        yield server
