"""The service processes: ``trainyard api`` (the REST API under uvicorn) and ``trainyard
worker`` (a Celery worker), each on the configured PostgreSQL and Redis or embedded ones;
``trainyard up`` runs one of each under its supervisor."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from app.cli.common import settings as _settings

#: How long the API keeps an idle client connection open.
KEEP_ALIVE_SECONDS = 75


def api(
    host: str = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535)] = 8000,
    workers: Annotated[int, typer.Option(min=1)] = 1,
    log_level: str = "warning",
) -> None:
    """Serve the REST API with uvicorn (uvloop + httptools). Logs go to stderr as JSON lines,
    or plain text on a terminal (`TRAINYARD_LOG_FORMAT`), with one access line per request."""
    import uvicorn

    from app.core.logs import logging_config
    from app.core.services import database_url, redis_url

    # Resolve embedded services once here, so uvicorn's worker processes share them.
    settings = _settings()
    os.environ["TRAINYARD_DATABASE_URL"] = database_url(settings)
    os.environ["TRAINYARD_REDIS_URL"] = redis_url(settings)
    if workers > 1 and settings.metrics_enabled:
        # One /metrics for all the processes: each writes its samples under one folder
        # (emptied now: files of processes gone would count again).
        from app.observability.prometheus import MULTIPROC_ENV, prepare_multiprocess_dir

        folder = os.environ.get(MULTIPROC_ENV) or settings.home / "prometheus" / f"api-{port}"
        os.environ[MULTIPROC_ENV] = str(prepare_multiprocess_dir(folder))
    uvicorn.run(
        "app.asgi:app",
        host=host,
        port=port,
        workers=workers,
        loop="uvloop",
        http="httptools",
        log_level=log_level,
        log_config=logging_config(log_level),  # applied in each of uvicorn's processes
        access_log=False,  # ours (trainyard.access) has the route, request id and project
        timeout_graceful_shutdown=10,
        # Longer than clients keep an idle connection (httpx and the openai SDKs: 5 s, the
        # same as uvicorn's default): else the server closes one just as a client reuses it,
        # and that request fails with a read error (a harness's finish, say).
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
    )


def worker(
    queues: str = typer.Option("control,gpu", help="Comma-separated queues to consume."),
    pool: str = typer.Option("solo", help="solo or threads: GPU work must not fork after CUDA."),
    concurrency: Annotated[int, typer.Option(min=1)] = 1,
    loglevel: str = "INFO",
) -> None:
    """Run a Celery worker."""
    from app.core.services import database_url, redis_url

    settings = _settings()
    os.environ["TRAINYARD_DATABASE_URL"] = database_url(settings)
    os.environ["TRAINYARD_REDIS_URL"] = redis_url(settings)
    # Progress bars of model downloads and shard writes only clutter a worker's log.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # The worker is its own program: this process becomes it (same pid, same signals).
    os.execv(
        sys.executable,
        [
            sys.executable,
            "-m",
            "workers",
            "worker",
            f"--queues={queues}",
            f"--pool={pool}",
            f"--concurrency={concurrency}",
            f"--loglevel={loglevel}",
            "--without-gossip",
            "--without-mingle",
            f"--hostname=trainyard-{os.getpid()}@%h",
        ],
    )
