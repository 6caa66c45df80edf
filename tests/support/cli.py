"""Running the ``trainyard`` command as a user does: real processes, embedded services in a
folder of the test's own, and a HOME of its own (so ``~/.trainyard`` is the test's too)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.support import ROOT

# A worker pipeline that stays in `collecting` for as long as a test needs it there.
TICKING = "tests.support.pipelines:ticking"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    """A temporary folder for embedded services, outside pytest's: each pytest session makes
    /tmp/pytest-of-USER private again when it starts (other sessions run in parallel), and
    PostgreSQL, run as a user of its own when we are root, must keep reaching its data."""
    path = Path(tempfile.mkdtemp(prefix="trainyard-test-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def user_env(user_home: Path, **extra: str) -> dict[str, str]:
    """The environment of a user who has set nothing: no TRAINYARD_* URLs, no home."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TRAINYARD_") and k not in {"HOME", "XDG_STATE_HOME"}
    }
    user_home.mkdir(parents=True, exist_ok=True)
    env.update(HOME=str(user_home), PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **extra)
    return env


def cli(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def servers_under(folder: Path) -> list[psutil.Process]:
    """Live processes working in ``folder`` (embedded PostgreSQL and Redis do)."""
    found = []
    for proc in psutil.process_iter(["name", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if Path(proc.cwd()).is_relative_to(folder):
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def wait_for(what: str, probe: Any, timeout: float, log: Path | None = None) -> Any:
    """Poll ``probe`` until it returns something truthy; fail saying ``what`` (and the log)."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            tail = log.read_text()[-4000:] if log is not None and log.exists() else ""
            raise AssertionError(f"timed out waiting for {what}\n{tail}")
        time.sleep(0.1)


@dataclass
class Up:
    """A ``trainyard up`` started in ``cwd`` with its log in ``log``."""

    cwd: Path
    env: dict[str, str]
    log: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def home(self) -> Path:
        return Path(self.env.get("TRAINYARD_HOME", self.cwd / ".trainyard"))

    @property
    def state_file(self) -> Path:
        return self.home / "up.json"

    def start(self) -> dict[str, Any]:
        """Start it and return its state once it has written one (the API answers by then)."""
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "app.cli", "up", "--port", str(self.port)],
                cwd=self.cwd,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return wait_for("trainyard up to write its state", self._ready, 120, self.log)

    def _ready(self) -> dict[str, Any] | None:
        assert self.proc is not None
        assert self.proc.poll() is None, self.log.read_text()
        return self.state(running=True)

    def state(self, *, running: bool) -> dict[str, Any] | None:
        try:
            state = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return None
        assert self.proc is not None
        if running and state.get("pid") != self.proc.pid:
            return None
        return dict(state)

    def output(self) -> str:
        return self.log.read_text()

    def ready(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> int:
        """SIGTERM, as Ctrl-C would; its exit status (killed after 60 s if it hangs)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
