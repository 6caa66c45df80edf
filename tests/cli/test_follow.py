"""The commands that watch and read runs (`runs follow|events|compare`, `trajectories
list|show|export`, `keys list`), run as a user runs them: real ``trainyard`` processes, with
nothing exported, against a real ``trainyard up`` (API and a worker whose ``ticking``
pipeline walks the real phases without training) on a database of the module's own. And
the stream reader behind `runs follow` (app/cli/follow.py) against a real API process."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from app.cli.follow import Event, stream_events
from tests.support.api_process import api_process
from tests.support.cli import TICKING, Up, cli, scratch, user_env
from tests.support.database import Maker, OwnDatabase, database_of_its_own, new_tenant, sessions_on
from tests.support.events import append_events, event_ids
from tests.support.runs import run_body
from tests.support.workers import FAST


@dataclass
class Service:
    up: Up
    url: str
    key: str
    key_id: str
    env: dict[str, str]  # a user's: only TRAINYARD_HOME, where `up` left its state
    cwd: Path

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        answer = httpx.request(
            method, f"{self.url}{path}", headers={"Authorization": f"Bearer {self.key}"}, **kwargs
        )
        return answer.raise_for_status().json()

    def run(self, **fields: Any) -> str:
        """A new run of the ticking pipeline; its id."""
        fields = {"max_steps": 2, "config": {"tick": 0.05}, **fields}
        body = run_body(rollouts_per_group=2, grpo={"groups_per_step": 2}, **fields)
        return str(self.api("POST", "/runs", json=body)["id"])

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return cli(*args, cwd=self.cwd, env=self.env)


@pytest.fixture(scope="module")
def service(module_database: OwnDatabase) -> Iterator[Service]:
    """`trainyard up` on the module's own database and broker prefix (its worker must see
    no other test's runs), with the ticking pipeline and short lease timings."""
    with scratch() as folder:
        env = user_env(
            folder / "user",
            **FAST,
            **module_database.env(),
            TRAINYARD_HOME=str(folder / "home"),
        )
        assert env["TRAINYARD_PIPELINE"] == TICKING
        up = Up(folder, env, folder / "up.log")
        try:
            state = up.start()
            # The user's second terminal: no URL, no key, only where `up` keeps its state.
            user = user_env(folder / "user", TRAINYARD_HOME=str(folder / "home"))
            yield Service(up, state["api_url"], state["api_key"], state["api_key_id"], user, folder)
        finally:
            up.stop()


class Following:
    """`trainyard runs follow RUN --json` in the background, its lines read as they come."""

    def __init__(self, service: Service, run_id: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "runs", "follow", run_id, "--json"],
            cwd=service.cwd,
            env=service.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.events: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def until(self, wanted: Any, within: float = 30) -> dict[str, Any]:
        """The first event from now on for which ``wanted(event)`` holds."""
        while True:
            line = self.lines.get(timeout=within)
            assert line is not None, f"follow ended first: {self.proc.wait()} {self.stderr()}"
            event = json.loads(line)
            self.events.append(event)
            if wanted(event):
                return dict(event)

    def wait(self) -> int:
        code = self.proc.wait(60)
        while (line := self.lines.get(timeout=10)) is not None:
            self.events.append(json.loads(line))
        return code

    def stderr(self) -> str:
        assert self.proc.stderr is not None
        return self.proc.stderr.read()


def _moved_to(status: str) -> Any:
    return lambda e: e["type"] == "status" and e["data"].get("to") == status


@pytest.mark.slow
def test_follow_a_run_to_completion_then_again_at_once(service: Service) -> None:
    run_id = service.run(max_steps=3)
    done = service.cli("runs", "follow", run_id)
    assert done.returncode == 0, (done.stdout, done.stderr)
    lines = done.stdout.splitlines()
    assert lines[-1] == f"run {run_id} completed at step 3"
    # The final frame: status, the full bar, the reward curve, and the last events.
    assert "completed" in lines[0] and "3/3" in lines[0]
    # The ticking pipeline records reward_mean = step / steps at steps 0, 1 and 2.
    assert any(line.strip().startswith("reward 0.667") for line in lines)
    assert "training → completed" in lines[-2]
    assert len([line for line in lines if "status" in line.split()]) == 5

    # A finished run: its events at once, each a JSON line, and the same exit status.
    again = service.cli("runs", "follow", run_id, "--json")
    assert again.returncode == 0, again.stderr
    events = [json.loads(line) for line in again.stdout.splitlines()]
    page = service.api("GET", f"/runs/{run_id}/events", params={"limit": 200})
    assert [e["id"] for e in events] == [e["id"] for e in page["data"]]
    assert events[-1]["data"]["to"] == "completed"


@pytest.mark.slow
def test_follow_of_a_failed_run_prints_its_error_and_exits_1(service: Service) -> None:
    run_id = service.run(config={"tick": "soon"})  # the ticking pipeline cannot read it
    done = service.cli("runs", "follow", run_id)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stderr.splitlines() == [
        f"error: run {run_id} failed: ValueError: could not convert string to float: 'soon'"
    ]
    as_json = service.cli("runs", "follow", run_id, "--json")
    assert as_json.returncode == 1 and "ValueError" in as_json.stderr
    last = json.loads(as_json.stdout.splitlines()[-1])
    assert last["data"]["to"] == "failed" and "ValueError" in last["data"]["error"]


@pytest.mark.slow
def test_follow_ends_2_on_a_cancel_and_3_on_a_pause(service: Service) -> None:
    # Cancelled while it stalls in collecting.
    run_id = service.run(config={"tick": 0.05, "stall_in": "collecting"})
    following = Following(service, run_id)
    following.until(_moved_to("collecting"))
    service.api("POST", f"/runs/{run_id}/cancel")
    assert following.wait() == 2, following.stderr()
    assert following.events[-1]["data"]["to"] == "cancelled"
    assert service.cli("runs", "follow", run_id).returncode == 2

    # Paused at its next step boundary: follow stops there, since the run waits for a person.
    run_id = service.run(max_steps=50, config={"tick": 0.1})
    following = Following(service, run_id)
    following.until(_moved_to("collecting"))
    service.api("POST", f"/runs/{run_id}/pause")
    assert following.wait() == 3, following.stderr()
    assert following.events[-1]["data"]["to"] == "paused"
    human = service.cli("runs", "follow", run_id)
    assert human.returncode == 3
    assert human.stdout.splitlines()[-1].endswith(f"`trainyard runs resume {run_id}` continues it")

    # Resumed, the pause is its past: a new follow goes past it to the run's end.
    service.api("POST", f"/runs/{run_id}/resume")
    following = Following(service, run_id)
    following.until(lambda e: e["type"] == "status" and e["data"].get("from") == "paused")
    following.until(_moved_to("collecting"))
    service.api("POST", f"/runs/{run_id}/cancel")
    assert following.wait() == 2, following.stderr()


@pytest.mark.slow
def test_follow_resumes_after_the_api_dies_without_losing_or_repeating_events(
    service: Service,
) -> None:
    run_id = service.run(max_steps=4, config={"tick": 0.3})
    following = Following(service, run_id)
    following.until(_moved_to("collecting"))
    state = json.loads(service.up.state_file.read_text())
    os.killpg(state["children"]["api"], signal.SIGKILL)  # `up` restarts it after a second
    assert following.wait() == 0, following.stderr()
    page = service.api("GET", f"/runs/{run_id}/events", params={"limit": 200})
    assert [e["id"] for e in following.events] == [e["id"] for e in page["data"]]
    assert following.events[-1]["data"]["to"] == "completed"


@pytest.mark.slow
def test_runs_events_pages(service: Service) -> None:
    run_id = service.run()
    assert service.cli("runs", "follow", run_id).returncode == 0
    first = service.cli("runs", "events", run_id, "--limit", "2")
    assert first.returncode == 0, first.stderr
    rows = first.stdout.splitlines()
    assert len(rows) == 2 and rows[0].split()[2:] == ["created", "run", "created"]
    cursor = first.stderr.split("--after ")[1].strip()
    rest = json.loads(service.cli("runs", "events", run_id, "--after", cursor, "--json").stdout)
    ids = [int(row.split()[0]) for row in rows] + [e["id"] for e in rest["data"]]
    whole = service.api("GET", f"/runs/{run_id}/events", params={"limit": 200})["data"]
    assert ids == [e["id"] for e in whole] and rest["has_more"] is False


@pytest.mark.slow
def test_keys_list_shows_keys_but_never_a_secret(service: Service) -> None:
    made = cli(
        "keys", "create", "--project", "listed", "--name", "ci", "--json",
        cwd=service.cwd, env=service.env,
    )  # fmt: skip
    key = json.loads(made.stdout)
    service.cli("keys", "revoke", key["id"])
    listed = service.cli("keys", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    keys = {k["id"]: k for k in json.loads(listed.stdout)}
    assert keys[service.key_id]["project"] == "default"
    assert keys[service.key_id]["prefix"] == service.key[:10]
    assert keys[key["id"]]["name"] == "ci" and keys[key["id"]]["revoked_at"] is not None
    assert set(keys[key["id"]]) == {
        "id", "project", "name", "role", "prefix", "created_at", "last_used_at", "revoked_at",
    }  # fmt: skip
    # `up`'s key is its user's: admin; a key made without --role is a member.
    assert keys[service.key_id]["role"] == "admin" and keys[key["id"]]["role"] == "member"
    human = service.cli("keys", "list", "--project", "listed")
    assert human.returncode == 0 and key["id"] in human.stdout
    assert service.key_id not in human.stdout
    for output in (listed.stdout, human.stdout):
        assert service.key not in output and key["key"] not in output


def _episode() -> dict[str, Any]:
    """An agent's episode, as `trainyard data import` takes it."""
    call = {
        "id": "call-1",
        "type": "function",
        "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}},
    }
    return {
        "step": 7,
        "reward": 1.0,
        "metadata": {"tool_calls": 1},
        "messages": [
            {"role": "user", "content": "What is 3 times 4?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call-1", "name": "multiply", "content": "12"},
            {"role": "assistant", "content": "12"},
        ],
    }


@pytest.mark.slow
def test_trajectories_list_show_and_export(service: Service) -> None:
    run_id = service.run()  # 2 steps x 2 groups x 2 rollouts
    assert service.cli("runs", "follow", run_id).returncode == 0
    page = json.loads(service.cli("trajectories", "list", run_id, "--step", "1", "--json").stdout)
    assert [(t["step"], t["group_index"], t["rollout_index"]) for t in page["data"]] == [
        (1, g, r) for g in range(2) for r in range(2)
    ]
    human = service.cli("trajectories", "list", run_id, "--min-reward", "0.1", "--limit", "1")
    rows = human.stdout.splitlines()
    assert rows[0].split() == ["id", "step", "group", "rollout", "reward", "tools", "answer"]
    assert rows[1].split()[1:6] == ["0", "0", "1", "0.100", "0"] and "--after" in human.stderr

    # An agent episode, imported into the key's project: its tool call and result shown.
    episode = service.cwd / "episode.jsonl"
    episode.write_text(json.dumps(_episode()) + "\n")
    imported = service.cli("data", "import", str(episode), "--project", "default", "--json")
    agent_run = next(iter(json.loads(imported.stdout)["run_ids"].values()))
    found = json.loads(
        service.cli("trajectories", "list", agent_run, "--min-tool-calls", "1", "--json").stdout
    )["data"]
    shown = service.cli("trajectories", "show", found[0]["id"])
    assert shown.returncode == 0, shown.stderr
    assert f"run {agent_run}  step 7  group 0  rollout 0  reward 1.000" in shown.stdout
    text = shown.stdout
    assert (
        text.index("[user]\n  What is 3 times 4?")
        < text.index('→ call multiply({"a": 3, "b": 4})  id call-1')
        < text.index("[tool] multiply (answers call-1)\n  12")
        < text.index("[assistant]\n  12")
    )
    assert json.loads(service.cli("trajectories", "show", found[0]["id"], "--json").stdout) == (
        service.api("GET", f"/trajectories/{found[0]['id']}")
    )

    out = service.cwd / "out.jsonl"
    exported = service.cli("trajectories", "export", str(out), "--run-id", run_id, "--step", "0")
    assert exported.returncode == 0, exported.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 4 and {t["run_id"] for t in lines} == {run_id}
    assert "4 trajectories exported" in exported.stderr
    bad = service.cli("trajectories", "export", "-", "--min-reward", "2", "--max-reward", "1")
    assert bad.returncode == 1 and "422" in bad.stderr and "min_reward" in bad.stderr


@pytest.mark.slow
def test_runs_compare_marks_what_differs(service: Service) -> None:
    one = service.run(learning_rate=1e-4)
    two = service.run(learning_rate=3e-4, max_steps=3)
    for run_id in (one, two):
        assert service.cli("runs", "follow", run_id).returncode == 0
    table = service.cli("runs", "compare", one, two)
    assert table.returncode == 0, table.stderr
    rows = [line.split() for line in table.stdout.splitlines()]
    assert rows[0] == ["field", one, two]
    assert ["*", "learning_rate", "0.0001", "0.0003"] in rows
    assert ["*", "max_steps", "2", "3"] in rows
    assert not any("model_name" in row for row in rows)  # the same in both: only with --all
    assert ["reward", "last", "0.500", "0.667"] in rows
    assert ["step", "2", "3"] in rows
    every = service.cli("runs", "compare", one, two, "--all").stdout.split()
    assert "model_name" in every and "grpo.groups_per_step" in every
    data = json.loads(service.cli("runs", "compare", one, two, "--json").stdout)
    assert set(data["differs"]) == {"learning_rate", "max_steps"}
    assert [r["reward"]["steps"] for r in data["runs"]] == [2, 3]
    alone = service.cli("runs", "compare", one)
    assert alone.returncode == 2 and "2 to 5 runs" in alone.stderr
    assert uuid.UUID(one)


class _Reader:
    """:func:`app.cli.follow.stream_events` in a thread of its own, as `runs follow` reads."""

    def __init__(self, url: str, headers: dict[str, str], run_id: str) -> None:
        self.events: list[Event] = []
        self._queue: queue.Queue[Event | None] = queue.Queue()
        client = httpx.Client(base_url=url, headers=headers)
        threading.Thread(target=self._read, args=(client, run_id), daemon=True).start()

    def _read(self, client: httpx.Client, run_id: str) -> None:
        try:
            for event in stream_events(client, run_id):
                self._queue.put(event)
        finally:
            self._queue.put(None)

    async def until(self, wanted: Callable[[Event], bool]) -> Event:
        """The first event from now on for which ``wanted(event)`` holds."""
        while True:
            event = await asyncio.to_thread(self._queue.get, timeout=30)
            assert event is not None, "the stream ended first"
            self.events.append(event)
            if wanted(event):
                return event


async def _append(maker: Maker, run_id: str, message: str) -> None:
    """One event, appended as every writer appends: holding the run's row lock."""
    async with maker() as s, s.begin():
        await s.execute(text("SELECT 1 FROM runs WHERE id = :id FOR UPDATE"), {"id": run_id})
        await s.execute(
            text(
                "INSERT INTO run_events (run_id, type, level, message, data)"
                " VALUES (:id, 'log', 'info', :message, '{}'::jsonb)"
            ),
            {"id": run_id, "message": message},
        )


async def test_follow_reads_the_api_stream_and_resumes_where_it_dropped(
    service_urls: tuple[str, str], tmp_path: Path
) -> None:
    """The stream of a real API process (no worker: the test writes the events), read as
    `runs follow` reads it: keep-alives; text with line separators other than SSE's (U+2028,
    NEL: httpx's iter_lines split on them) intact; after the API is killed and started
    again, what was written meanwhile, resumed from Last-Event-ID; every event once, in
    order, then the end."""
    async with (
        database_of_its_own(service_urls) as own,
        sessions_on(own.url, pool_size=2) as maker,
    ):
        tenant = await new_tenant(maker)
        env = {**own.env(), "TRAINYARD_SSE_KEEPALIVE_SECONDS": "0.2"}
        with api_process(tmp_path / "api.log", env) as api:
            async with httpx.AsyncClient(base_url=api.url, headers=tenant.headers) as http:
                made = await http.post("/runs", json=run_body())
            assert made.status_code == 202, made.text
            run_id = made.json()["id"]
            reader = _Reader(api.url, tenant.headers, run_id)
            await reader.until(lambda e: e.type == "keep-alive")
            odd = "one\u2028two\x85three"
            await _append(maker, run_id, odd)
            assert (await reader.until(lambda e: e.type == "log")).data["message"] == odd

            api.kill()
            await _append(maker, run_id, "written while the API was down")
            api.start()
            await append_events(maker, uuid.UUID(run_id), 1, end=True)
            assert await reader.until(lambda e: e.type == "end") == Event(
                None, "end", {"status": "cancelled"}
            )
        ids = [int(e.id) for e in reader.events if e.id is not None]
        assert ids == await event_ids(maker, uuid.UUID(run_id))
        messages = [e.data["message"] for e in reader.events if e.type == "log"]
        assert messages == [odd, "written while the API was down", "event 1"]


def test_the_eta_is_the_runs_pace_not_the_replays() -> None:
    """A follow started late gets the run's past events in a burst: the ETA must come from
    when the steps happened (their timestamps), not from how fast they arrived."""
    from datetime import UTC, datetime, timedelta

    from app.cli.follow import _Pace, event_line

    start = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
    pace = _Pace(started=start, last=start + timedelta(seconds=40), step=4)
    assert pace.eta(total=10) == "ETA 0:01:00"  # 10 s a step, 6 steps left
    assert pace.eta(total=4) == "" and _Pace().eta(total=10) == ""
    event = {
        "type": "status",
        "created_at": "2026-12-01T10:00:41+00:00",
        "message": "run failed",
        "data": {"from": "training", "to": "failed", "error": "ValueError:\n  bad"},
    }
    assert event_line(event) == "10:00:41  status   training → failed: run failed (ValueError: bad)"
