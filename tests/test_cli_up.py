"""`trainyard up` from an empty folder: embedded PostgreSQL and Redis, API and a worker; a
key from `trainyard keys create` creates, lists, fetches and cancels a run over HTTP with
the `trainyard runs` commands; SIGTERM stops everything it started."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cli(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _servers_under(folder: Path) -> list[psutil.Process]:
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


@pytest.mark.slow
def test_up_serves_the_api_on_embedded_services(tmp_path: Path) -> None:
    home = tmp_path / "proj"
    home.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"TRAINYARD_DATABASE_URL", "TRAINYARD_REDIS_URL", "TRAINYARD_HOME"}
    }
    env.update(
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
        # A worker that stays in `collecting` long enough for the cancel to find it there.
        TRAINYARD_PIPELINE="tests.workers.pipelines:ticking",
        TRAINYARD_HEARTBEAT_SECONDS="0.5",
    )
    port = _free_port()
    log = (tmp_path / "up.log").open("wb")
    up = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "up", "--port", str(port)],
        cwd=home,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert up.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "up.log").read_text()
            time.sleep(0.3)

        made = _cli("keys", "create", "--project", "demo", cwd=home, env=env)
        assert made.returncode == 0, made.stderr
        key = made.stdout.strip().splitlines()[-1]
        assert key.startswith("ty_")

        preset = home / "run.json"
        preset.write_text(
            json.dumps(
                {
                    "model_name": "tiny",
                    "task_description": "say a",
                    "inputs": [{"input_text": "a"}],
                    "max_steps": 50,
                    "reward": {"type": "function", "functions": [{"name": "char_fraction"}]},
                }
            )
        )
        api = ["--api-url", base, "--api-key", key]
        created = _cli("runs", "create", str(preset), "config.tick=5", *api, cwd=home, env=env)
        assert created.returncode == 0, created.stderr
        run = json.loads(created.stdout)
        assert run["status"] == "pending" and run["config"] == {"tick": 5}

        listed = _cli("runs", "list", *api, cwd=home, env=env)
        assert listed.returncode == 0 and run["id"][:8] in listed.stdout
        got = _cli("runs", "get", run["id"], *api, cwd=home, env=env)
        assert json.loads(got.stdout)["id"] == run["id"]

        headers = {"Authorization": f"Bearer {key}"}
        deadline = time.monotonic() + 30
        while (
            httpx.get(f"{base}/runs/{run['id']}", headers=headers).json()["status"] != "collecting"
        ):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        cancelled = _cli("runs", "cancel", run["id"], *api, cwd=home, env=env)
        assert cancelled.returncode == 0, cancelled.stderr
        deadline = time.monotonic() + 10
        while (
            httpx.get(f"{base}/runs/{run['id']}", headers=headers).json()["status"] != "cancelled"
        ):
            assert time.monotonic() < deadline
            time.sleep(0.2)

        bad = _cli("runs", "get", "not-a-uuid", *api, cwd=home, env=env)
        assert bad.returncode == 1 and "422" in bad.stderr
        assert _servers_under(home / ".trainyard")
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(40)
        finally:
            if up.poll() is None:
                os.killpg(up.pid, signal.SIGKILL)
    assert up.returncode == 0, (tmp_path / "up.log").read_text()
    deadline = time.monotonic() + 10
    while _servers_under(home / ".trainyard"):
        assert time.monotonic() < deadline, _servers_under(home / ".trainyard")
        time.sleep(0.2)
