"""``trainyard``: run the services, manage keys, and talk to the API.

Service commands (up, api, worker, db) run locally; ``runs …`` talks to an API over HTTP with
``--api-url``/``TRAINYARD_API_URL`` and ``--api-key``/``TRAINYARD_API_KEY``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(no_args_is_help=True, help=__doc__, pretty_exceptions_enable=False)
db_app = typer.Typer(no_args_is_help=True, help="Database schema.")
keys_app = typer.Typer(no_args_is_help=True, help="API keys.")
runs_app = typer.Typer(no_args_is_help=True, help="Training runs (over HTTP).")
data_app = typer.Typer(
    no_args_is_help=True, help="Trajectories as training data (straight from the database)."
)
app.add_typer(db_app, name="db")
app.add_typer(keys_app, name="keys")
app.add_typer(runs_app, name="runs")
app.add_typer(data_app, name="data")

err = Console(stderr=True)
out = Console()


def main() -> None:
    app()


# -- services ------------------------------------------------------------------------------


def _upgrade(url: str, revision: str = "head") -> None:
    from alembic import command
    from alembic.config import Config

    root = Path(__file__).resolve().parent.parent
    cfg = Config(str(root / "alembic.ini"))
    cfg.set_main_option("script_location", str(root / "migrations"))
    cfg.attributes["url"] = url
    cfg.attributes["skip_logging"] = True
    command.upgrade(cfg, revision)


@db_app.command("upgrade")
def db_upgrade(revision: str = "head") -> None:
    """Apply migrations up to REVISION (default: the latest)."""
    from app.core.services import database_url
    from app.core.settings import get_settings

    _upgrade(database_url(get_settings()), revision)
    err.print(f"database at {revision}")


@app.command()
def api(
    host: str = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535)] = 8000,
    workers: Annotated[int, typer.Option(min=1)] = 1,
    log_level: str = "warning",
) -> None:
    """Serve the REST API with uvicorn (uvloop + httptools)."""
    import uvicorn

    from app.core.services import database_url, redis_url
    from app.core.settings import get_settings

    # Resolve embedded services once here, so uvicorn's worker processes share them.
    settings = get_settings()
    os.environ["TRAINYARD_DATABASE_URL"] = database_url(settings)
    os.environ["TRAINYARD_REDIS_URL"] = redis_url(settings)
    uvicorn.run(
        "app.asgi:app",
        host=host,
        port=port,
        workers=workers,
        loop="uvloop",
        http="httptools",
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=10,
    )


@app.command()
def worker(
    queues: str = typer.Option("control,gpu", help="Comma-separated queues to consume."),
    pool: str = typer.Option("solo", help="solo or threads: GPU work must not fork after CUDA."),
    concurrency: Annotated[int, typer.Option(min=1)] = 1,
    loglevel: str = "INFO",
) -> None:
    """Run a Celery worker."""
    from app.core.services import database_url, redis_url
    from app.core.settings import get_settings

    settings = get_settings()
    os.environ["TRAINYARD_DATABASE_URL"] = database_url(settings)
    os.environ["TRAINYARD_REDIS_URL"] = redis_url(settings)
    # Progress bars of model downloads and shard writes only clutter a worker's log.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from workers.celery_app import get_celery

    get_celery().worker_main(
        [
            "worker",
            f"--queues={queues}",
            f"--pool={pool}",
            f"--concurrency={concurrency}",
            f"--loglevel={loglevel}",
            "--without-gossip",
            "--without-mingle",
            f"--hostname=trainyard-{os.getpid()}@%h",
        ]
    )


@app.command()
def up(
    host: str = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535)] = 8000,
    api_workers: Annotated[int, typer.Option(min=1)] = 1,
) -> None:
    """Start what is needed (embedded PostgreSQL/Redis when no URL is set), migrate, then
    serve the API and one worker in the foreground; Ctrl-C or SIGTERM stops everything."""
    from app.core.settings import get_settings

    settings = get_settings()
    home = settings.home.resolve()
    started: list[Any] = []
    env = dict(os.environ)
    if settings.database_url:
        db_url = settings.database_url
    else:
        from app.core.embedded import start_postgres

        pg = start_postgres(home)
        started.append(pg)
        db_url = pg.url
        err.print(f"[dim]embedded PostgreSQL ({'started' if pg.started else 'reused'}) in {home}")
    if settings.redis_url:
        broker = settings.redis_url
    else:
        from app.core.embedded import start_redis

        rd = start_redis(home)
        started.append(rd)
        broker = rd.url
        err.print(f"[dim]embedded Redis ({'started' if rd.started else 'reused'}) in {home}")
    env.update(TRAINYARD_DATABASE_URL=db_url, TRAINYARD_REDIS_URL=broker, TRAINYARD_HOME=str(home))
    children: list[subprocess.Popen[bytes]] = []

    def shutdown(*_: object) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for child in children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
        for service in started:
            if service.started:
                service.stop()

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt  # SIGTERM stops everything the way Ctrl-C does

    signal.signal(signal.SIGTERM, interrupted)
    try:
        _upgrade(db_url)
        exe = [sys.executable, "-m", "app.cli"]
        children.append(
            subprocess.Popen(
                [*exe, "api", "--host", host, "--port", str(port), "--workers", str(api_workers)],
                env=env,
            )
        )
        children.append(subprocess.Popen([*exe, "worker"], env=env))
        err.print(f"[bold green]Trainyard is up[/] on http://{host}:{port}  (Ctrl-C stops it)")
        err.print(f"[dim]create a key: trainyard keys create --project NAME   (home {home})")
        while all(child.poll() is None for child in children):
            time.sleep(0.5)
        failed = [c for c in children if c.poll() not in (None, 0)]
        if failed:
            err.print(f"[red]a child process exited with {failed[0].returncode}; stopping")
            raise typer.Exit(1)
    except KeyboardInterrupt:
        err.print("stopping…")
    finally:
        shutdown()


@app.command()
def demo(
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    preset: Annotated[Path, typer.Option(exists=True, dir_okay=False)] = Path(
        "configs/runs/letters.yaml"
    ),
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted overrides.")] = None,
) -> None:
    """Everything end to end: services, API, worker, the tiny model, a real training run
    created over HTTP and followed to the end."""
    from app.demo import run_demo

    raise typer.Exit(run_demo(port, preset, overrides or []))


@app.command("tiny-model")
def tiny_model(
    path: Annotated[Path, typer.Argument(help="Folder to write the model and tokenizer to.")],
    seed: int = 0,
) -> None:
    """Build the tiny Llama and tokenizer used by the demo and the tests (no hub access)."""
    from workers.ml.tiny_model import build_tiny_model

    build_tiny_model(path, seed=seed)
    err.print(f"tiny model written to {path}")


# -- keys ----------------------------------------------------------------------------------


@keys_app.command("create")
def keys_create(
    project: Annotated[str, typer.Option(help="Project name; created if it does not exist.")],
    name: Annotated[str | None, typer.Option(help="A label for the key.")] = None,
) -> None:
    """Create an API key. The key is printed alone on the last line of stdout, once."""
    from app.auth.service import create_key, get_or_create_project
    from app.core.db import make_engine, make_sessionmaker, session_scope
    from app.core.services import database_url
    from app.core.settings import get_settings

    async def _create() -> tuple[str, str]:
        engine = make_engine(database_url(get_settings()), pool_size=1)
        try:
            async with session_scope(make_sessionmaker(engine)) as session:
                proj = await get_or_create_project(session, project)
                key, plain = await create_key(session, proj, name=name)
                return str(key.id), plain
        finally:
            await engine.dispose()

    key_id, plain = asyncio.run(_create())
    err.print(f"key {key_id} for project {project!r} (shown once; store it now):")
    print(plain, flush=True)


@keys_app.command("revoke")
def keys_revoke(key_id: str) -> None:
    """Revoke a key by id; API processes stop accepting it within seconds."""
    import uuid

    from app.auth.service import revoke_key
    from app.core.db import make_engine, make_sessionmaker, session_scope
    from app.core.services import database_url
    from app.core.settings import get_settings

    async def _revoke() -> bool:
        engine = make_engine(database_url(get_settings()), pool_size=1)
        try:
            async with session_scope(make_sessionmaker(engine)) as session:
                return await revoke_key(session, uuid.UUID(key_id))
        finally:
            await engine.dispose()

    if not asyncio.run(_revoke()):
        err.print("no such active key")
        raise typer.Exit(1)
    err.print("revoked")


# -- runs over HTTP --------------------------------------------------------------------------

ApiUrl = Annotated[str, typer.Option(envvar="TRAINYARD_API_URL", help="API base URL.")]
ApiKey = Annotated[str, typer.Option(envvar="TRAINYARD_API_KEY", help="API key.")]


def _client(api_url: str, api_key: str) -> Any:
    import httpx

    return httpx.Client(
        base_url=api_url.rstrip("/"),
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=30,
    )


def _check(response: Any) -> Any:
    if response.status_code >= 400:
        try:
            problem = response.json()
            detail = problem.get("detail") or problem.get("title")
        except ValueError:
            detail = response.text
        err.print(f"[red]{response.status_code}[/] {detail}")
        raise typer.Exit(1)
    return response.json()


@runs_app.command("create")
def runs_create(
    preset: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="YAML/JSON run.")],
    overrides: Annotated[
        list[str] | None, typer.Argument(help="Dotted overrides: a.b=value.")
    ] = None,
    api_url: ApiUrl = "http://127.0.0.1:8000",
    api_key: ApiKey = "",
    idempotency_key: Annotated[str | None, typer.Option()] = None,
) -> None:
    """Create a run from a preset file (plus overrides); prints the run as JSON."""
    from app.core.config_files import apply_overrides, load_preset

    body = apply_overrides(load_preset(preset), overrides or [])
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
    with _client(api_url, api_key) as client:
        run = _check(client.post("/runs", json=body, headers=headers))
    print(json.dumps(run, indent=2))


@runs_app.command("list")
def runs_list(
    status: Annotated[list[str] | None, typer.Option()] = None,
    limit: int = 20,
    api_url: ApiUrl = "http://127.0.0.1:8000",
    api_key: ApiKey = "",
) -> None:
    """List runs, newest first."""
    params: dict[str, Any] = {"limit": limit}
    if status:
        params["status"] = status
    with _client(api_url, api_key) as client:
        page = _check(client.get("/runs", params=params))
    table = Table("id", "status", "step", "model", "created")
    for run in page["data"]:
        table.add_row(
            run["id"], run["status"], str(run["step"]), run["model_name"], run["created_at"]
        )
    out.print(table)


@runs_app.command("get")
def runs_get(run_id: str, api_url: ApiUrl = "http://127.0.0.1:8000", api_key: ApiKey = "") -> None:
    """Print one run as JSON."""
    with _client(api_url, api_key) as client:
        print(json.dumps(_check(client.get(f"/runs/{run_id}")), indent=2))


@runs_app.command("cancel")
def runs_cancel(
    run_id: str, api_url: ApiUrl = "http://127.0.0.1:8000", api_key: ApiKey = ""
) -> None:
    """Cancel a run."""
    with _client(api_url, api_key) as client:
        run = _check(client.post(f"/runs/{run_id}/cancel"))
    err.print(
        f"run {run['id']}: {run['status']}"
        + (
            " (cancel requested)"
            if run["cancel_requested"] and run["status"] != "cancelled"
            else ""
        )
    )


# -- training data from the database ---------------------------------------------------------


@data_app.command("export")
def data_export(
    output: Annotated[Path, typer.Argument(help="JSONL file to write ('-' for stdout).")],
    project: Annotated[list[str] | None, typer.Option(help="Project name or id.")] = None,
    run_id: Annotated[list[str] | None, typer.Option()] = None,
    learning_key: Annotated[list[str] | None, typer.Option()] = None,
    status: Annotated[list[str] | None, typer.Option(help="The run's status.")] = None,
    min_reward: float | None = None,
    max_reward: float | None = None,
    since: Annotated[str | None, typer.Option(help="ISO date or datetime.")] = None,
    until: Annotated[str | None, typer.Option(help="ISO date or datetime (inclusive).")] = None,
    limit: Annotated[int | None, typer.Option(min=1)] = None,
    messages: Annotated[bool, typer.Option(help="Include the messages.")] = True,
) -> None:
    """Export trajectories matching the filters as JSON Lines."""
    from datetime import date, datetime

    from app.training_data import TrainingDataError, export_jsonl

    def when(value: str | None) -> date | datetime | None:
        if value is None:
            return None
        return date.fromisoformat(value) if len(value) == 10 else datetime.fromisoformat(value)

    try:
        written = export_jsonl(
            None,
            sys.stdout if str(output) == "-" else output,
            projects=project,
            run_ids=run_id,
            learning_key=learning_key,
            statuses=status,
            min_reward=min_reward,
            max_reward=max_reward,
            start_date=when(since),
            end_date=when(until),
            limit=limit,
            include_messages=messages,
        )
    except (TrainingDataError, ValueError) as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    err.print(f"{written} trajectories exported")


@data_app.command("import")
def data_import(
    source: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="JSONL file.")],
    project: Annotated[str, typer.Option(help="Project name or id to import into.")],
    learning_key: Annotated[str | None, typer.Option(help="Key for every imported run.")] = None,
) -> None:
    """Import a trajectory JSONL file into a project, all or nothing."""
    from app.training_data import TrainingDataError, import_jsonl

    try:
        result = import_jsonl(None, source, project=project, learning_key=learning_key)
    except TrainingDataError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    err.print(f"{result.trajectories} trajectories imported into {len(result.run_ids)} run(s)")


if __name__ == "__main__":
    main()
