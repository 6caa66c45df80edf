"""The ``trainyard`` command: the Typer app, :func:`main`, and where each command lives.

- ``serve.py``: ``api`` and ``worker``, the service processes.
- ``up.py``: ``up``, ``status``, ``demo``; ``supervisor.py`` keeps ``up``'s children running,
  ``installation.py`` is the state file ``up`` leaves for the other commands, ``demo.py``
  the demo.
- ``models.py``: ``tiny-model``, and the model folders a run body names.
- ``db.py``: ``db upgrade``, the migrations; ``keys.py``: ``keys``; ``data.py``: ``data``
  (these three work on the database straight).
- ``runs.py``: ``runs``, ``follow.py`` following one live; ``trajectories.py``:
  ``trajectories`` (these two over HTTP, through ``http.py``).
- ``export_options.py``: the options ``trajectories export`` and ``data export`` share.
- ``common.py``: errors as one line, ``--json``, tables.

Modules load what is heavy inside their commands: ``trainyard --help`` imports no HTTP
client, database driver or settings.
"""

from __future__ import annotations

import typer

from app.cli import data, db, keys, models, runs, serve, trajectories, up
from app.cli.common import OneLineErrors

HELP = """``trainyard``: run the services, manage keys, and talk to the API.

Service commands (up, api, worker, db) run locally. The others find the running
installation: the URLs and key in the state file ``trainyard up`` writes (``<home>/up.json``,
and ``~/.trainyard/up.json`` when ``TRAINYARD_HOME`` is unset), unless ``--api-url`` /
``TRAINYARD_API_URL``, ``--api-key`` / ``TRAINYARD_API_KEY`` or ``TRAINYARD_DATABASE_URL``
say otherwise. Every error is one line on stderr and a non-zero exit status.
"""

app = typer.Typer(
    cls=OneLineErrors,
    no_args_is_help=True,
    help=HELP,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # paragraphs rewrapped, `code` shown as code
)
app.command()(serve.api)
app.command()(serve.worker)
app.command()(up.up)
app.command()(up.status)
app.command()(up.demo)
app.command("tiny-model")(models.tiny_model)
app.add_typer(db.db_app, name="db")
app.add_typer(keys.keys_app, name="keys")
app.add_typer(runs.runs_app, name="runs")
app.add_typer(data.data_app, name="data")
app.add_typer(trajectories.trajectories_app, name="trajectories")


def main() -> None:
    app()
