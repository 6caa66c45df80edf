"""`trainyard demo`: the whole product on one laptop, end to end.

Starts (or reuses) `trainyard up` with embedded services, builds the tiny model, creates a
key and a run over HTTP, follows the run's event stream with a progress bar until it ends,
then prints where the checkpoints are and the reward curve.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from app.core.config_files import apply_overrides, load_preset
from app.core.services import STATE_FILE, Installation, read_state

console = Console(stderr=True)
SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], lo: float = 0.0, hi: float = 1.0) -> str:
    span = (hi - lo) or 1.0
    return "".join(
        SPARK[min(len(SPARK) - 1, max(0, int((v - lo) / span * len(SPARK))))] for v in values
    )


def _cli(*args: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout


def _wait_up(home: Path, up: subprocess.Popen[bytes], timeout: float = 180) -> Installation:
    """The state `up` writes once its API answers and its key exists."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise SystemExit(f"trainyard up exited with {up.returncode}; see its log")
        found = read_state(home / STATE_FILE)
        if found is not None and found.pid == up.pid and found.api_key:
            return found
        time.sleep(0.2)
    raise SystemExit("trainyard up did not start in time; see its log")


def follow(client: httpx.Client, run: dict[str, Any]) -> dict[str, Any]:
    """Follow the run's SSE stream (resuming after drops) until its last event."""
    total = run.get("max_steps") or 0
    last_id: str | None = None
    with Progress(
        TextColumn("[bold]{task.fields[status]:>10}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("reward {task.fields[reward]}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("run", total=total or None, status=run["status"], reward="–")
        while True:
            headers = {"Last-Event-ID": last_id} if last_id else {}
            try:
                with client.stream(
                    "GET", f"/runs/{run['id']}/events/stream", headers=headers, timeout=None
                ) as stream:
                    event = ""
                    for line in stream.iter_lines():
                        if line.startswith("id: "):
                            last_id = line[4:]
                        elif line.startswith("event: "):
                            event = line[7:]
                        elif line.startswith("data: "):
                            data = json.loads(line[6:])
                            if event == "end":
                                return client.get(f"/runs/{run['id']}").raise_for_status().json()
                            if event == "status":
                                progress.update(task, status=data["data"]["to"])
                            elif event == "step":
                                reward = data["data"].get("reward_mean")
                                progress.update(
                                    task,
                                    completed=data["data"]["step"],
                                    reward=f"{reward:.3f}" if reward is not None else "–",
                                )
            except httpx.TransportError:
                time.sleep(1)  # the stream resumes from Last-Event-ID


def run_demo(port: int, preset: Path, overrides: list[str]) -> int:
    home = Path(os.environ.get("TRAINYARD_HOME", ".trainyard")).resolve()
    env = {**os.environ, "TRAINYARD_HOME": str(home)}
    base = f"http://127.0.0.1:{port}"
    model = home / "models" / "tiny-llama"
    if not (model / "config.json").is_file():
        console.print(f"building the tiny model in {model}")
        _cli("tiny-model", str(model), env=env)

    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_file = (logs / "demo-up.log").open("ab")
    console.print(f"starting API and worker (embedded services; log: {log_file.name} in {logs})")
    up = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "up", "--port", str(port)],
        env=env,
        stdout=log_file,
        stderr=subprocess.STDOUT,
    )
    try:
        key = _wait_up(home, up).api_key
        body = apply_overrides(load_preset(preset), [f"model_name={model}", *overrides])
        with httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30
        ) as client:
            created = client.post("/runs", json=body)
            if created.status_code != 202:
                console.print(f"[red]{created.status_code}[/] {created.text}")
                return 1
            run = created.json()
            console.print(f"run [bold]{run['id']}[/] created; following its events")
            run = follow(client, run)
            code = report(client, run)
        console.print(
            "\nthe services stop now; `make up` serves this run again, e.g.\n"
            f"  curl -H 'Authorization: Bearer {key}' "
            f"'{base}/runs/{run['id']}/trajectories?step={run['step']}&limit=2'",
            soft_wrap=True,
        )
        return code
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()
        log_file.close()


def report(client: httpx.Client, run: dict[str, Any]) -> int:
    if run["status"] != "completed":
        console.print(f"[red]run {run['status']}[/]: {run.get('error')}")
        return 1
    metrics = run.get("metrics") or {}
    series = (
        client.get(f"/runs/{run['id']}/metrics", params={"name": "reward_mean"})
        .raise_for_status()
        .json()["series"]
    )
    rewards = [p["value"] for p in series[0]["points"]] if series else []
    checkpoints = client.get(f"/runs/{run['id']}/checkpoints").raise_for_status().json()["data"]
    console.print(f"\n[bold green]completed[/] {run['step']} steps")
    if rewards:
        first, last = rewards[: min(10, len(rewards))], rewards[-min(10, len(rewards)) :]
        console.print(
            f"reward (mean of the first / last 10 steps): {sum(first) / len(first):.3f} → "
            f"{sum(last) / len(last):.3f}"
        )
        console.print(f"reward curve  {sparkline(rewards)}")
    console.print(f"trajectories stored: {metrics.get('total_trajectories')}")
    for ckpt in checkpoints:
        label = "final model" if ckpt["is_final"] else f"checkpoint @ step {ckpt['step']}"
        console.print(f"  {label:>22}: {ckpt['path']}", soft_wrap=True)
    return 0
