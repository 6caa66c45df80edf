"""One export command family: ``trajectories export`` (over HTTP) and ``data export``
(straight from the database) take the same options from one declaration
(app/cli/export_options.py), and each option reaches the API's query and the library's call
under the name they give it. No server: the commands' own trees, and the library's call
caught where it is made."""

from __future__ import annotations

import inspect
from dataclasses import fields
from datetime import date
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from app.cli import app
from app.cli.common import CliError
from app.cli.export_options import ExportOptions

# What each command takes beyond the shared options: where it reads from.
SCOPE = {("trajectories", "export"): {"api_url", "api_key"}, ("data", "export"): {"project"}}


def _params(group: str, name: str) -> dict[str, Any]:
    root: Any = typer.main.get_command(app)
    context = root.context_class(root, info_name="trainyard")
    command = root.get_command(context, group).get_command(context, name)
    return {p.name: p for p in command.params}


def _described(param: Any) -> tuple[Any, ...]:
    bounds = (getattr(param, "min", None), getattr(param, "max", None))
    kind = (param.type_descriptor.annotation, param.multiple, *bounds)
    return (param.opts, param.secondary_opts, *kind, param.default, getattr(param, "help", None))


def test_both_exports_take_the_same_options_in_the_same_order() -> None:
    http, database = (_params(*command) for command in SCOPE)
    shared = [f.name for f in fields(ExportOptions)]
    for (command, scope), params in zip(SCOPE.items(), (http, database), strict=True):
        assert [n for n in params if n not in scope and n != "output"] == shared, command
    for name in [*shared, "output"]:
        assert _described(http[name]) == _described(database[name]), name


def test_every_option_has_a_name_in_the_apis_query_and_the_librarys_call() -> None:
    from fastapi import FastAPI

    from app.training_data.library import TrajectoryFilters
    from app.trajectories.router import router

    api = FastAPI()
    api.include_router(router)
    operation = api.openapi()["paths"]["/trajectories/export"]["get"]
    api_names = {p["name"] for p in operation["parameters"] if p["in"] == "query"}
    library_names = set(TrajectoryFilters.__annotations__) | {"limit", "include_messages"}

    everything = ExportOptions(
        run_id=["r"],
        learning_key=["k"],
        status=["completed"],
        step=[0, 1],
        min_reward=0.1,
        max_reward=0.9,
        min_tool_calls=1,
        since="2026-06-01",
        until="2026-06-02T12:00",
        limit=5,
        messages=False,
    )
    query, call = everything.query(), everything.library()
    assert len(query) == len(call) == len(fields(ExportOptions))
    assert set(query) <= api_names, set(query) - api_names
    assert set(call) <= library_names, set(call) - library_names
    assert query["include_messages"] == "false" and query["start_date"] == "2026-06-01"
    assert call["include_messages"] is False and call["start_date"] == date(2026, 6, 1)
    # Nothing given: only what the API would default to anyway is sent.
    assert ExportOptions().query() == {"include_messages": "true"}


def test_a_date_that_does_not_parse_names_its_option() -> None:
    with pytest.raises(CliError, match="--until '1714000000'") as caught:
        ExportOptions(until="1714000000").library()
    assert caught.value.code == 2


def test_data_export_passes_every_option_to_the_library(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from app import training_data

    calls: list[dict[str, Any]] = []

    def export_jsonl(db_url: str, destination: Any, **kwargs: Any) -> int:
        calls.append(kwargs)
        return 3

    monkeypatch.setattr(training_data, "export_jsonl", export_jsonl)
    monkeypatch.setenv("TRAINYARD_DATABASE_URL", "postgresql://nowhere/none")
    from app.core.settings import get_settings

    get_settings.cache_clear()
    try:
        done = CliRunner().invoke(
            app,
            [
                *("data", "export", str(tmp_path / "out.jsonl"), "--project", "p"),
                *("--step", "1", "--step", "2", "--since", "2026-06-01"),
                *("--no-messages", "--limit", "7"),
            ],
        )
    finally:
        get_settings.cache_clear()
    assert done.exit_code == 0, done.output
    assert "3 trajectories exported" in done.output
    (call,) = calls
    assert call["projects"] == ["p"] and call["steps"] == [1, 2] and call["limit"] == 7
    assert call["start_date"] == date(2026, 6, 1) and call["include_messages"] is False
    assert call["run_ids"] is None and call["end_date"] is None


def test_the_spelled_out_signature_is_what_typer_reads() -> None:
    from app.cli.data import data_export
    from app.cli.trajectories import trajectories_export

    for command in (data_export, trajectories_export):
        names = list(inspect.signature(command).parameters)
        assert "options" not in names and {f.name for f in fields(ExportOptions)} <= set(names)
