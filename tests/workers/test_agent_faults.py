"""Untrusted tools and dying processes in agent runs, on real workers: a tool that hangs,
raises or floods, an MCP server killed under a run, a worker killed mid-episode and
mid-warm-up. Each leaves the run alive (or resumable) with every episode recorded."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from app.trajectories.models import Trajectory
from tests.support import ROOT
from tests.support.mcp_server import server_processes
from tests.support.runs import events, trajectory_keys, wait_for
from tests.support.workers import addition_run, agent_run, letter_rows

FAULTY = "tests.support.agent_tools"


async def _trajectories(maker: Any, run_id: str) -> list[Trajectory]:
    async with maker() as s:
        return list(
            (
                await s.execute(
                    select(Trajectory)
                    .where(Trajectory.run_id == uuid.UUID(run_id))
                    .order_by(Trajectory.step, Trajectory.group_index, Trajectory.rollout_index)
                )
            ).scalars()
        )


def _tool_messages(rows: list[Trajectory]) -> list[dict[str, Any]]:
    return [m for t in rows for m in t.messages if m.get("role") == "tool"]


async def test_a_hanging_a_raising_and_a_flooding_tool_leave_the_run_alive(
    client, tenant, sessionmaker, start_worker, tool_model, worker_home
) -> None:
    tools = [f"{FAULTY}:slow_add", f"{FAULTY}:broken_add", f"{FAULTY}:flood_add", "add"]
    body = addition_run(
        tool_model,
        ["slow_add", "broken_add", "flood_add", "add"],
        environment={
            "type": "tools",
            "tools": tools,
            "tool_timeout_seconds": 0.5,
            "max_tool_output_chars": 100,
        },
        reward={"type": "function", "functions": [{"name": "exact_match"}]},
    )
    worker = start_worker(**worker_home)
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    assert "id" in run, run
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=300
    )
    assert done.status == "completed", done.error
    assert worker.proc.poll() is None, "the worker survived its tools"

    rows = await _trajectories(sessionmaker, run["id"])
    assert [(t.step, t.group_index, t.rollout_index) for t in rows] == letter_rows(2, groups=1)
    results = _tool_messages(rows)
    by_name: dict[str, list[dict[str, Any]]] = {}
    for m in results:
        by_name.setdefault(m["name"], []).append(m)
    assert set(by_name) >= {"slow_add", "broken_add", "flood_add", "add"}, set(by_name)

    for slow in by_name["slow_add"]:  # cut off at its deadline, not after its 30 s
        assert slow["error"] == "the tool did not answer within 0.5 s", slow
        assert 500 <= slow["duration_ms"] < 5000, slow
    for broken in by_name["broken_add"]:  # the exception, as TRL shows it to the model
        assert broken["error"] == "the adder is broken", broken
        assert broken["content"] == "{'error': 'the adder is broken'}", broken
    for flood in by_name["flood_add"]:  # 10 MB cut to 100 characters, marked
        assert flood["truncated"] is True and flood["error"] is None, flood
        assert flood["content"].startswith(flood["content"][:100])
        assert len(flood["content"]) < 200 and "output truncated" in flood["content"]
    assert all(m["error"] is None and not m["truncated"] for m in by_name["add"])
    counts = [t.meta for t in rows if t.meta.get("tool_calls")]
    assert counts and all(c["tool_errors"] >= 1 for c in counts if c["tool_calls"] == 4)


async def _kill_the_server(worker_pid: int) -> int:
    for _ in range(200):
        servers = server_processes(worker_pid)
        if servers:
            os.kill(servers[0].pid, signal.SIGKILL)
            return servers[0].pid
        await asyncio.sleep(0.05)
    raise AssertionError("the worker runs no MCP server")


@pytest.mark.chaos  # a process killed: the chaos tier (make test-chaos)
async def test_an_mcp_server_killed_mid_run_is_restarted_once_then_its_episodes_fail(
    client, tenant, sessionmaker, start_worker, tool_model, worker_home
) -> None:
    body = addition_run(
        tool_model,
        ["add"],
        max_steps=12,
        environment={
            "type": "mcp",
            "command": [sys.executable, "-m", "tests.support.mcp_server"],
            "env": {"PYTHONPATH": str(ROOT)},
            "tools": ["add"],
            "tool_timeout_seconds": 5,
        },
        reward={
            "type": "function",
            "functions": [{"name": "length_target", "args": {"target": 3}}],
        },
        # Every step after the second kill drops all its episodes: by default the run would
        # fail after 3 of them (grpo.max_dropped_steps, tests/chaos/test_judge_faults.py);
        # this test is about the episodes, so it lets the run go on to its end.
        grpo={"max_dropped_steps": 100},
    )
    worker = start_worker(**worker_home)
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    assert "id" in run, run
    await wait_for(sessionmaker, run["id"], lambda r: r.step >= 2, within=300)
    first = await _kill_the_server(worker.proc.pid)
    await wait_for(sessionmaker, run["id"], lambda r: r.step >= 5, within=120)
    second = await _kill_the_server(worker.proc.pid)
    assert second != first, "the server was restarted after the first kill"
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=300
    )
    assert done.status == "completed", done.error

    rows = await _trajectories(sessionmaker, run["id"])
    assert [(t.step, t.group_index, t.rollout_index) for t in rows] == letter_rows(12, groups=1)
    # After the first kill the restarted server answered; after the second every episode
    # that reached a tool is failed with the reason and is not trained on.
    answered = [t for t in rows if 2 < t.step < 5 and t.meta.get("tool_calls")]
    assert answered and all("episode_error" not in t.meta for t in answered)
    failed = [t for t in rows if t.meta.get("episode_error")]
    assert failed, "episodes after the second kill are recorded as failed"
    assert all(t.step >= 5 and t.reward is None for t in failed)
    assert all("MCP server is gone" in t.meta["episode_error"] for t in failed)
    assert "restarted once" in failed[0].meta["episode_error"], failed[0].meta
    assert all(t.reward_breakdown.get("episode_error") for t in failed)


@pytest.mark.chaos  # a process killed: the chaos tier (make test-chaos)
async def test_a_worker_killed_mid_warm_up_and_mid_episode_resumes_each_once(
    client, tenant, sessionmaker, own_database, start_worker, tool_model, worker_home, tmp_path
) -> None:
    body = addition_run(
        tool_model,
        ["patient_add"],
        max_steps=6,
        environment={
            "type": "tools",
            "tools": [f"{FAULTY}:patient_add"],
            "tool_timeout_seconds": 5,
        },
        reward={"type": "function", "functions": [{"name": "exact_match"}]},
        sft={"epochs": 60},
        grpo={"save_steps": 2},
    )
    first = start_worker(**worker_home)
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    assert "id" in run, run

    # Killed once the warm-up has a whole checkpoint (its trainer state is the last file
    # written; the kill may land while a later one is half-written, which must be skipped):
    # the next worker resumes the warm-up.
    staging = Path(worker_home["TRAINYARD_HOME"]) / "artifacts" / run["id"] / "sft" / "staging"
    for _ in range(3000):
        if list(staging.glob("checkpoint-*/trainer_state.json")):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the warm-up wrote no checkpoint")
    first.kill()
    second = start_worker(**worker_home)
    # Killed while a step's episodes are being played (each tool call takes 0.3 s).
    await wait_for(
        sessionmaker, run["id"], lambda r: r.status == "collecting" and r.step >= 3, within=300
    )
    second.kill()
    start_worker(**worker_home)
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=300
    )
    assert done.status == "completed", done.error

    assert await trajectory_keys(sessionmaker, run["id"]) == letter_rows(6, groups=1)
    log = await events(sessionmaker, run["id"])
    resumed = [e for e in log if e.type == "sft" and "resumes" in e.message]
    finished = [e for e in log if e.type == "sft" and "done" in e.message]
    assert len(resumed) == 1 and len(finished) == 1, [e.message for e in log]
    statuses = [e.data["to"] for e in log if e.type == "status"]
    assert statuses.count("warming_up") == 1, statuses  # never warmed up again


async def test_an_environment_the_worker_cannot_load_fails_the_run_before_step_1(
    client, tenant, sessionmaker, start_worker, tool_model, tiny_model, worker_home
) -> None:
    """What the API cannot check (an import on the workers, a chat template without tool
    calls or that TRL cannot train a warm-up on) fails the run at once, saying why, before
    any warm-up or step."""
    start_worker(**worker_home)
    reward = {"type": "function", "functions": [{"name": "exact_match"}]}
    missing = addition_run(
        tool_model,
        ["nowhere"],
        {"type": "tools", "tools": ["tests.support.nowhere:tool"]},
        reward=reward,
    )
    untemplated = addition_run(
        tiny_model, ["add"], {"type": "tools", "tools": ["add"]}, reward=reward
    )
    # The plain tiny model's template has no tool calls and no training variant TRL knows.
    untrainable = agent_run(tiny_model, environment=None, reward=reward)
    expected = {
        "cannot be imported on this worker": missing,
        "cannot render tool calls": untemplated,
        "cannot be trained with an SFT warm-up": untrainable,
    }
    for reason, body in expected.items():
        run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
        done = await wait_for(
            sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=120
        )
        assert done.status == "failed" and reason in (done.error or ""), done.error
        assert done.step == 0 and await trajectory_keys(sessionmaker, run["id"]) == []
        walk = [e.data["to"] for e in await events(sessionmaker, run["id"]) if e.type == "status"]
        assert "warming_up" not in walk, walk
