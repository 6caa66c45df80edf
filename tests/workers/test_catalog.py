"""The catalog code policy on real worker processes: a run written past the API that names
what the worker's catalog does not list fails before anything it names runs, and catalog
entries (an MCP server, a reward function under an import prefix, a judge endpoint) work
end to end, each named by a run that an API under the same policy accepted."""

from __future__ import annotations

import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from sqlalchemy import select

from app.trajectories.models import Trajectory
from tests.support import ROOT
from tests.support.database import OwnDatabase, Tenant, app_on, client_of
from tests.support.llm import ruler_by_share_of_a
from tests.support.runs import create_run, wait_for
from tests.support.workers import addition_run, letters_run


def _catalog(folder: Path, **entries: Any) -> Path:
    path = folder / "catalog.yaml"
    path.write_text(yaml.safe_dump(entries))
    return path


def _under_catalog(catalog: Path) -> dict[str, str]:
    return {"TRAINYARD_CODE_POLICY": "catalog", "TRAINYARD_CATALOG": str(catalog)}


async def test_a_worker_refuses_a_run_its_catalog_does_not_allow_before_running_it(
    sessionmaker: Any,
    make_tenant: Any,
    start_worker: Any,
    worker_home: dict[str, str],
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    """The issue's example, inserted past the API (as an API under `open`, or one with
    another catalog, would have let it in): the worker does not run the command."""
    tenant = await make_tenant()
    owned = tmp_path / "owned.txt"
    run = await create_run(
        sessionmaker,
        project_id=tenant.project_id,
        model_name=str(tiny_model),
        environment={
            "type": "mcp",
            "command": ["sh", "-c", f"id > {owned}"],
            "url": None,
            "server": None,
            "tools": None,
            "env": {},
            "max_turns": 2,
            "tool_timeout_seconds": 10,
            "max_tool_output_chars": 4000,
        },
    )
    catalog = _catalog(tmp_path, models={"folders": [str(tiny_model.parent)]})
    start_worker(**worker_home, **_under_catalog(catalog))
    done = await wait_for(sessionmaker, str(run.id), lambda r: r.status == "failed", within=120)
    assert done.error is not None
    assert done.error.startswith("RunRefused: this worker's code policy (catalog) refuses")
    assert "environment.command: under the catalog code policy" in done.error
    assert "model_name" not in done.error  # its folder is in the catalog
    assert not owned.exists()


@pytest.fixture
async def catalog_api(
    own_database: OwnDatabase, tmp_path: Path, tool_model: Path, tiny_model: Path, llm: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, Path]]:
    """An API under the catalog policy on the test's database, and its catalog file."""
    catalog = _catalog(
        tmp_path,
        mcp_servers={
            "calc": {
                "description": "add and friends over MCP",
                "command": [sys.executable, "-m", "tests.support.mcp_server"],
                "env": {"PYTHONPATH": str(ROOT)},
            }
        },
        imports=[{"prefix": "tests.support.agent_tools"}],
        endpoints={"judge": {"base_url": llm.base_url, "model": "judge-small"}},
        models={"folders": [str(tool_model.parent), str(tiny_model.parent)]},
    )
    settings = own_database.settings.model_copy(
        update={"code_policy": "catalog", "catalog": catalog}
    )
    async with app_on(settings) as application, client_of(application) as client:
        yield client, catalog


async def test_catalog_entries_work_end_to_end(
    catalog_api: tuple[httpx.AsyncClient, Path],
    tenant: Tenant,
    sessionmaker: Any,
    start_worker: Any,
    worker_home: dict[str, str],
    tool_model: Path,
    tiny_model: Path,
    llm: Any,
) -> None:
    client, catalog = catalog_api
    llm.handle(ruler_by_share_of_a)
    start_worker(**worker_home, **_under_catalog(catalog))
    agent = addition_run(
        tool_model,
        ["add"],
        environment={"type": "mcp", "server": "calc", "tools": ["add"]},
        reward={
            "type": "function",
            "functions": [{"name": "tests.support.agent_tools:saw_episode"}],
        },
    )
    judged = letters_run(
        tiny_model, max_steps=2, reward={"type": "ruler", "judge": {"endpoint": "judge"}}
    )
    ids = []
    for body in (agent, judged):
        created = await client.post("/runs", json=body, headers=tenant.headers)
        assert created.status_code == 202, created.text
        ids.append(created.json()["id"])
    for run_id in ids:
        done = await wait_for(
            sessionmaker, run_id, lambda r: r.status in {"completed", "failed"}, within=300
        )
        assert done.status == "completed", done.error

    async with sessionmaker() as s:
        rows = list(
            (
                await s.execute(select(Trajectory).where(Trajectory.run_id == uuid.UUID(ids[0])))
            ).scalars()
        )
    # The catalog's MCP server answered the model's calls: add's results are in the episodes.
    tool_results = [m for t in rows for m in t.messages if m.get("role") == "tool"]
    assert tool_results and all(m["name"] == "add" for m in tool_results)
    # The reward function under the catalog's prefix scored them: its reward counts the
    # messages the model's turn made (plus a half for the environment it was given), which
    # no built-in reward reaches.
    assert rows and all(t.reward is not None and t.reward > 1 for t in rows)
    # The judge endpoint named by the run scored the other run's groups.
    assert llm.schema_names().count("ruler_scores") >= 2 * 2
