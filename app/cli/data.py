"""``trainyard data``: export trajectories as JSON Lines and import such a file into a
project, straight on the database (app/training_data); the export's options are
app/cli/export_options.py's, shared with ``trainyard trajectories export``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from app.cli.common import CliError, Json, err, print_json, settings
from app.cli.db import on_database
from app.cli.export_options import ExportOptions, export_options

data_app = typer.Typer(
    no_args_is_help=True, help="Trajectories as training data (straight from the database)."
)


@data_app.command("export")
@export_options
def data_export(
    output: Annotated[Path, typer.Argument(help="JSONL file to write ('-' for stdout).")],
    project: Annotated[list[str] | None, typer.Option(help="Project name or id.")] = None,
    *,
    options: ExportOptions,
) -> None:
    """Export trajectories matching the filters as JSON Lines."""
    from app.core.services import client_database_url
    from app.training_data import TrainingDataError, export_jsonl

    arguments = options.library()
    db_url = client_database_url(settings())

    def _export() -> int:
        return export_jsonl(
            db_url, sys.stdout if str(output) == "-" else output, projects=project, **arguments
        )

    try:
        written = on_database(db_url, _export)
    except TrainingDataError as exc:
        raise CliError(str(exc), code=2) from exc
    err.print(f"{written} trajectories exported")


@data_app.command("import")
def data_import(
    source: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="JSONL file.")],
    project: Annotated[str, typer.Option(help="Project name or id to import into.")],
    learning_key: Annotated[str | None, typer.Option(help="Key for every imported run.")] = None,
    as_json: Json = False,
) -> None:
    """Import a trajectory JSONL file into a project, all or nothing."""
    from app.core.services import client_database_url
    from app.training_data import TrainingDataError, import_jsonl

    db_url = client_database_url(settings())

    def _import() -> Any:
        return import_jsonl(db_url, source, project=project, learning_key=learning_key)

    try:
        result = on_database(db_url, _import)
    except TrainingDataError as exc:
        raise CliError(str(exc), code=2) from exc
    if as_json:
        print_json(
            {
                "project_id": str(result.project_id),
                "trajectories": result.trajectories,
                "run_ids": {k: str(v) for k, v in result.run_ids.items()},
            }
        )
        return
    err.print(f"{result.trajectories} trajectories imported into {len(result.run_ids)} run(s)")
