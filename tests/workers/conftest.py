"""Real Celery worker processes (``trainyard worker``) for lease and reconciler tests,
running the small pipeline in ``tests/workers/pipelines.py`` with short lease timings."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.llm.fake_server import llm, llm_server  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parents[2]

FAST = {
    "TRAINYARD_PIPELINE": "tests.workers.pipelines:ticking",
    "TRAINYARD_LEASE_TTL_SECONDS": "1.5",
    "TRAINYARD_HEARTBEAT_SECONDS": "0.25",
    "TRAINYARD_REAPER_INTERVAL_SECONDS": "0.3",
    "TRAINYARD_REDISPATCH_SECONDS": "1.0",
    "TRAINYARD_MAX_ATTEMPTS": "3",
}


class Worker:
    def __init__(self, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.proc = proc
        self.log = log

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (a prefork parent and its children)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.proc.wait(15)


@pytest.fixture
def start_worker(service_urls: tuple[str, str], tmp_path: Path) -> Iterator[Any]:
    started: list[Worker] = []

    def _start(
        *, pool: str = "solo", wait: bool = True, python: str = sys.executable, **env: str
    ) -> Worker:
        log = tmp_path / f"worker-{len(started)}.log"
        environ = {**os.environ, **FAST, **env, "PYTHONUNBUFFERED": "1"}
        environ["PYTHONPATH"] = str(ROOT)
        proc = subprocess.Popen(
            [python, "-m", "app.cli", "worker", "--pool", pool, "--loglevel", "INFO"],
            cwd=ROOT,
            env=environ,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        worker = Worker(proc, log)
        started.append(worker)
        if wait:
            deadline = time.monotonic() + 60
            while " ready." not in worker.output():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker did not start:\n{worker.output()}")
                time.sleep(0.1)
        return worker

    yield _start
    for worker in started:
        if worker.proc.poll() is None:
            worker.kill(signal.SIGKILL)


@pytest.fixture(autouse=True)
async def idle_system(sessionmaker: Any, service_urls: tuple[str, str]) -> None:
    """Start each worker test with no live run and an empty queue: runs left pending by
    other tests would otherwise be picked up (correctly!) by these workers first."""
    import redis
    from sqlalchemy import update

    from app.core.settings import get_settings
    from app.runs.models import Run
    from app.runs.status import TERMINAL

    async with sessionmaker() as s:
        await s.execute(
            update(Run)
            .where(Run.status.not_in([t.value for t in TERMINAL]))
            .values(status="cancelled", lease_owner=None, lease_expires_at=None)
        )
        await s.commit()
    client = redis.Redis.from_url(service_urls[1].replace("redis+socket://", "unix://"))
    prefix = get_settings().broker_prefix
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workers.ml.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture
def worker_home(tmp_path: Path) -> dict[str, str]:
    return {
        "TRAINYARD_PIPELINE": "workers.pipeline:run_pipeline",
        "TRAINYARD_HOME": str(tmp_path / "home"),
    }
