"""`trainyard demo`: the whole product on one laptop, end to end.

Starts (or reuses) `trainyard up` with embedded services, builds the tiny model, creates a
key and a run over HTTP, follows the run's event stream with a progress bar until it ends,
then prints where the checkpoints are and the reward curve.

`trainyard demo --agent` is the same path with the agent tiny model and an agent preset
(`configs/runs/agent-calculator.yaml`): it also shows the SFT warm-up's loss and, every few
steps, one episode of the step with its tool calls, read back through the public API.
`trainyard demo --gateway` runs the same agent as a gateway run
(`configs/runs/agent-gateway.yaml`), its episodes played by a harness in a process of its own
(`examples/gateway/calculator.py`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import Progress, TaskID

from app.cli.follow import Narrator, buckets, follow, metric_series, sparkline
from app.cli.installation import STATE_FILE, Installation, read_state
from app.core.config_files import apply_overrides, load_preset

console = Console(stderr=True)


@dataclass(frozen=True)
class Flavour:
    """What tells the two demos apart; everything else is one path."""

    preset: Path  # the default preset (relative: to the current folder, the checkout)
    model: str  # the tiny model's folder under <home>/models
    tiny_model_args: tuple[str, ...]  # what `trainyard tiny-model` needs to build it
    agent: bool
    harness: Path | None = None  # a gateway run's harness, started in a process of its own


PLAIN = Flavour(Path("configs/runs/letters.yaml"), "tiny-llama", (), agent=False)
AGENT = Flavour(
    Path("configs/runs/agent-calculator.yaml"), "tiny-llama-tools", ("--tools",), agent=True
)
GATEWAY = Flavour(
    Path("configs/runs/agent-gateway.yaml"),
    "tiny-llama-tools",
    ("--tools",),
    agent=True,
    harness=Path("examples/gateway/calculator.py"),
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


def _short(text: str, limit: int = 40) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _call(call: dict[str, Any]) -> str:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):  # OpenAI's form: a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return f"{function.get('name')}({_short(arguments)})"
    if not isinstance(arguments, dict):
        arguments = {}
    shown = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in arguments.items())
    return f"{function.get('name')}({shown})"


def episode_line(step: int, trajectory: dict[str, Any]) -> str:
    """One episode as a line: the question, each tool call with its result, the answer and
    the reward, e.g. ``step 12  What is 3 times 4?  → multiply(a=3, b=4) = 12  → "12"
    reward 1.0``."""
    messages: list[dict[str, Any]] = trajectory.get("messages") or []
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    before = messages if first is None else messages[:first]
    question = next((m.get("content") or "" for m in reversed(before) if m["role"] == "user"), "")
    tool = [m for m in messages if m.get("role") == "tool" and m.get("tool_call_id")]
    results = {m["tool_call_id"]: m for m in tool}
    parts = [f"step {step:<3}", _short(question)]
    answer = ""
    for message in messages[first:] if first is not None else []:
        if message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or []:
            result = results.get(call.get("id"))
            if result is None:
                shown = "(no result)"
            elif result.get("error") is not None:
                shown = f"error: {_short(str(result['error']))}"
            else:
                shown = _short(str(result.get("content") or ""))
            parts.append(f"→ {_call(call)} = {shown}")
        answer = message.get("content") or ""
    parts.append(f"→ {json.dumps(_short(answer), ensure_ascii=False)}")
    reward = trajectory.get("reward")
    parts.append(f"reward {reward:.1f}" if isinstance(reward, int | float) else "reward –")
    return "  ".join(parts)


class AgentNarrator(Narrator):
    """Tells an agent run: the SFT warm-up's loss (live on the bar, then its curve), and
    every ``every`` steps one episode of the step, fetched from
    ``GET /runs/{id}/trajectories?step=N``, so what is shown is what the service stored."""

    def __init__(self, client: httpx.Client, run: dict[str, Any]) -> None:
        self.client = client
        self.run_id = str(run["id"])
        self.every = max(1, (run.get("max_steps") or 0) // 20)
        self.warming = False

    def event(self, progress: Progress, task: TaskID, event: str, data: dict[str, Any]) -> None:
        if event == "status":
            moved = data["data"]
            if moved.get("to") == "warming_up":
                self.warming = True
                progress.console.print(
                    data.get("message") or "SFT warm-up", markup=False, soft_wrap=True
                )
            elif self.warming and moved.get("from") == "warming_up":
                self.warming = False
                progress.update(task, note="")
                self._warm_up_done(progress)
        elif event == "step":
            step = int(data["data"]["step"])
            if step == 1 or step % self.every == 0:
                self._show_episode(progress, step, data["data"].get("reward_mean"))

    def idle(self, progress: Progress, task: TaskID) -> None:
        if self.warming:
            loss = metric_series(self.client, self.run_id, "sft/loss")
            if loss:
                progress.update(task, note=f"sft loss {loss[-1]:.3f} (step {len(loss)})")

    def _warm_up_done(self, progress: Progress) -> None:
        loss = metric_series(self.client, self.run_id, "sft/loss")
        if loss:
            progress.console.print(
                f"SFT warm-up: {len(loss)} steps, loss {loss[0]:.3f} → {loss[-1]:.3f}  "
                f"{sparkline(buckets(loss, 40), 0.0, max(loss))}",
                markup=False,
                soft_wrap=True,
            )

    def _show_episode(self, progress: Progress, step: int, mean: float | None) -> None:
        """The step's first episode (group 0, rollout 0): a sample, not the best one, so
        the step's mean reward is shown beside it."""
        page = (
            self.client.get(f"/runs/{self.run_id}/trajectories", params={"step": step, "limit": 1})
            .raise_for_status()
            .json()["data"]
        )
        if page:
            line = episode_line(step, page[0])
            if mean is not None:
                line += f"  (step mean {mean:.2f})"
            progress.console.print(line, markup=False, highlight=False, soft_wrap=True)


def run_demo(port: int, preset: Path | None, overrides: list[str], flavour: Flavour = PLAIN) -> int:
    preset = preset or flavour.preset
    if not preset.is_file():
        console.print(f"[red]no preset at {preset}[/]: run the demo from the checkout")
        return 2
    home = Path(os.environ.get("TRAINYARD_HOME", ".trainyard")).resolve()
    env = {**os.environ, "TRAINYARD_HOME": str(home)}
    base = f"http://127.0.0.1:{port}"
    model = home / "models" / flavour.model
    if not (model / "config.json").is_file():
        console.print(f"building the tiny model in {model}")
        _cli("tiny-model", str(model), *flavour.tiny_model_args, env=env)

    log_path = home / "logs" / "demo-up.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_file = log_path.open("ab")
    # soft_wrap: the path stays on one line, whole, for copying (rich would break it).
    console.print(
        f"starting API and worker (embedded services); log: {log_path}",
        soft_wrap=True,
        markup=False,
        highlight=False,
    )
    up = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "up", "--port", str(port)],
        env=env,
        stdout=log_file,
        stderr=subprocess.STDOUT,
    )
    harness: subprocess.Popen[bytes] | None = None
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
            if flavour.harness is not None:
                harness_log = home / "logs" / "demo-harness.log"
                console.print(
                    f"its harness plays every episode in a process of its own: "
                    f"{flavour.harness}; log: {harness_log}",
                    soft_wrap=True,
                    markup=False,
                    highlight=False,
                )
                argv = [sys.executable, str(flavour.harness), "--url", base, "--key", str(key)]
                harness = subprocess.Popen(
                    [*argv, "--run", str(run["id"])],
                    env=env,
                    stdout=harness_log.open("ab"),
                    stderr=subprocess.STDOUT,
                )
            narrator = AgentNarrator(client, run) if flavour.agent else None
            run = follow(client, run, narrator, console=console)
            code = report(client, run)
        console.print(
            "\nthe services stop now; `make up` serves this run again, e.g.\n"
            f"  curl -H 'Authorization: Bearer {key}' "
            f"'{base}/runs/{run['id']}/trajectories?step={run['step']}&limit=2'",
            soft_wrap=True,
        )
        return code
    finally:
        if harness is not None and harness.poll() is None:
            harness.terminate()
            try:
                harness.wait(10)
            except subprocess.TimeoutExpired:
                harness.kill()
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
    rewards = metric_series(client, str(run["id"]), "reward_mean")
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
