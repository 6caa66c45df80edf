"""The API in a process of its own, on a free port of 127.0.0.1: for tests that need a real
server (a browser, a generated client, streams that stay open, several uvicorn workers, an
API to kill and restart)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from tests.support import ROOT
from tests.support.cli import free_port, wait_for
from tests.support.database import OwnDatabase


class ApiProcess:
    """``trainyard api`` (or ``uvicorn app.asgi:app`` with ``uvicorn=True``: the ASGI app as
    a deployment serves it) with ``env`` over this process's environment. Started in a
    session of its own, so :meth:`kill` and :meth:`stop` reach every uvicorn worker."""

    def __init__(
        self,
        log: Path,
        env: dict[str, str],
        *,
        workers: int = 1,
        uvicorn: bool = False,
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.env = {**os.environ, **env, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self.argv: Sequence[str] = (
            [sys.executable, "-m", "uvicorn", "app.asgi:app", "--log-level", "warning"]
            if uvicorn
            else [sys.executable, "-m", "app.cli", "api"]
        )
        self.argv = [*self.argv, "--host", "127.0.0.1", "--port", str(self.port)]
        if workers > 1:
            self.argv = [*self.argv, "--workers", str(workers)]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, within: float = 60) -> None:
        """Start it (again, after :meth:`kill`) and return once ``/readyz`` answers 200."""
        self.proc = subprocess.Popen(
            self.argv,
            cwd=ROOT,
            env=self.env,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        proc = self.proc

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"the API exited:\n{self.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
            return False

        wait_for("the API", ready, within, self.log)

    def kill(self) -> None:
        """SIGKILL, the whole group: every open connection drops mid-way."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(15)

    def stop(self) -> None:
        """SIGTERM (uvicorn's graceful shutdown), then SIGKILL after 20 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()


@contextlib.contextmanager
def api_process(log: Path, env: dict[str, str], **options: object) -> Iterator[ApiProcess]:
    """An :class:`ApiProcess` started, then stopped however the block ends."""
    api = ApiProcess(log, env, **options)  # type: ignore[arg-type]
    try:
        api.start()
        yield api
    finally:
        api.stop()


@pytest.fixture
def api_server(own_database: OwnDatabase, tmp_path: Path) -> Iterator[ApiProcess]:
    """The API in a process of its own on the test's database: what harnesses talk to."""
    with api_process(tmp_path / "api.log", own_database.env()) as server:
        yield server
