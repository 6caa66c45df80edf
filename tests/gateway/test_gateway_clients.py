"""The gateway as the official clients use it: the ``openai`` npm package (a TypeScript-world
harness over plain HTTP), and the blocking Python ``OpenAI`` client with tools after an SFT
warm-up, its tool calls parsed as TRL parses them."""

from __future__ import annotations

import asyncio
import http.server
import itertools
import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import trainyard
from openai import OpenAI
from sqlalchemy import text

from tests.gateway.test_gateway_run import gateway_run
from tests.support import ROOT
from tests.support.runs import wait_for

pytestmark = pytest.mark.gateway

JS = Path(__file__).parent / "js"


def _npm_ci() -> None:
    stamp = JS / "node_modules" / ".package-lock.json"
    if not stamp.exists() or (JS / "package-lock.json").stat().st_mtime > stamp.stat().st_mtime:
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=JS, check=True
        )


async def test_the_openai_npm_package_plays_a_run(
    tenant, sessionmaker, start_worker, tiny_model, worker_home, api_server, tmp_path
) -> None:
    await asyncio.to_thread(_npm_ci)
    start_worker(**worker_home)
    async with trainyard.Client(api_server.url, tenant.key) as ty:
        run = await ty.create_run(gateway_run(tiny_model, max_steps=2, grpo={"groups_per_step": 1}))
    harness = await asyncio.create_subprocess_exec(
        "node",
        str(JS / "harness.mjs"),
        api_server.url,
        tenant.key,
        run.id,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(harness.communicate(), 300)
    lines = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    assert harness.returncode == 0 and lines[-1] == {"played": 8}, out.decode()[-3000:]
    for line in lines[:-1]:
        assert line["first"]["completion_tokens"] >= 1
        assert line["streamed"]["prompt_tokens"] > line["first"]["prompt_tokens"]
        assert line["models"] == [str(tiny_model)]
        assert line["refused"] == "400 BadRequestError"
    done = await wait_for(sessionmaker, run.id, lambda r: r.status in {"completed", "failed"}, 60)
    assert done.status == "completed", done.error


AGENT_GATEWAY = ROOT / "configs" / "runs" / "agent-gateway.yaml"
EXAMPLES = ROOT / "examples" / "gateway"
SDK = ROOT / "sdk" / "python"


def tool_round(episode: trainyard.Episode, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """One call with tools on the blocking client, and what it answered."""
    client = episode.sync_openai_client()
    answer = client.chat.completions.create(model="policy", messages=episode.messages, tools=tools)
    return answer.choices[0].model_dump()


async def test_tool_calls_come_back_parsed_to_the_blocking_client(
    tenant, sessionmaker, start_worker, tool_model, worker_home, api_server
) -> None:
    from app.core.config_files import load_preset

    body = {**load_preset(AGENT_GATEWAY), "model_name": str(tool_model), "max_steps": 1}
    body["grpo"] = {**body["grpo"], "groups_per_step": 1}
    tools = body["environment"]["tools"]
    names = {t["function"]["name"] for t in tools}
    start_worker(**worker_home)
    async with trainyard.Client(api_server.url, tenant.key) as ty:
        run = await ty.create_run(body)
        choices: list[dict[str, Any]] = []
        async for episode in run.episodes(concurrency=8):
            choices.append(await asyncio.to_thread(tool_round, episode, tools))
            await episode.finish(reward=0.0)
            if len(choices) == 8:
                break
        done = await wait_for(
            sessionmaker, run.id, lambda r: r.status in {"completed", "failed"}, 300
        )
    assert done.status == "completed", done.error
    # After the warm-up the model calls its tools: each call parsed, as OpenAI shapes it.
    calls = [c for choice in choices for c in choice["message"].get("tool_calls") or []]
    assert len(calls) >= 4, choices
    for choice in choices:
        if choice["message"].get("tool_calls"):
            assert choice["finish_reason"] == "tool_calls"
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] in names
        assert set(json.loads(call["function"]["arguments"])) <= {"a", "b"}


async def responses_round(
    episode: trainyard.Episode, tools: list[dict[str, Any]], played: list[Any]
) -> float:
    """Two calls on the Responses API, as the Agents SDK makes them: the input with tools;
    then the whole conversation again, the first output items echoed and each function call
    answered (or a user turn), streamed. Both Responses go to ``played``."""
    client = episode.openai_client()
    first = await client.responses.create(model="policy", input=episode.messages, tools=tools)
    answers: list[Any] = [
        {"type": "function_call_output", "call_id": item.call_id, "output": "42"}
        for item in first.output
        if item.type == "function_call"
    ] or [{"role": "user", "content": "Again."}]
    echoed = [item.model_dump(exclude_none=True) for item in first.output]
    stream = await client.responses.create(
        model="policy", input=[*episode.messages, *echoed, *answers], tools=tools, stream=True
    )
    final = None
    async for event in stream:
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    played.append((first, final))
    return 0.0


async def test_the_responses_api_plays_tool_calls_token_exact(
    tenant, sessionmaker, start_worker, tool_model, worker_home, api_server
) -> None:
    """The Responses API on the ``openai`` SDK: function calls come back as output items,
    and echoed back with their outputs they continue the engine's tokens exactly."""
    from app.core.config_files import load_preset

    body = {**load_preset(AGENT_GATEWAY), "model_name": str(tool_model), "max_steps": 1}
    body["grpo"] = {**body["grpo"], "groups_per_step": 1}
    tools = [{"type": "function", **t["function"]} for t in body["environment"]["tools"]]
    start_worker(**worker_home)
    async with trainyard.Client(api_server.url, tenant.key) as ty:
        run = await ty.create_run(body)
        played: list[Any] = []
        await asyncio.wait_for(
            run.play(lambda episode: responses_round(episode, tools, played), concurrency=8), 300
        )
        await run.refresh()
    assert run.status == "completed", run.data.get("error")
    async with httpx.AsyncClient(base_url=api_server.url, headers=tenant.headers) as http:
        listed = (await http.get(f"/runs/{run.id}/episodes", params={"limit": 50})).json()
    assert len(played) == 8, [e["error"] for e in listed["data"]]
    called = [item for first, _ in played for item in first.output if item.type == "function_call"]
    assert len(called) >= 4, [first.output for first, _ in played]
    for item in called:
        assert item.call_id.startswith("call_") and item.name in {t["name"] for t in tools}
    assert all(final is not None and final.id.startswith("resp_") for _, final in played)
    async with httpx.AsyncClient(base_url=api_server.url, headers=tenant.headers) as http:
        for episode in listed["data"]:
            detail = (
                await http.get(f"/episodes/{episode['id']}", params={"tokens": "true"})
            ).json()
            first, second = detail["call_log"]
            sampled = first["prompt_ids"] + first["completion_ids"]
            assert second["prompt_ids"][: len(sampled)] == sampled, episode["id"]
            assert second["request"]["messages"][-1]["role"] in {"tool", "user"}


AGENTS = Path(__file__).parent / "agents"


def _agents_python() -> Path:
    """A venv of the harness's own with the OpenAI Agents SDK and the Trainyard SDK, as a
    user installs them (the Agents SDK's dependencies are not the server's)."""
    venv = AGENTS / ".venv"
    stamp = venv / ".installed"
    requirements = AGENTS / "requirements.txt"
    if not stamp.exists() or requirements.stat().st_mtime > stamp.stat().st_mtime:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run(
            [venv / "bin" / "python", "-m", "pip", "install", "-q", "-r", requirements, SDK],
            check=True,
        )
        stamp.touch()
    return venv / "bin" / "python"


async def test_an_openai_agents_sdk_agent_trains_through_the_responses_api(
    tenant, sessionmaker, start_worker, tool_model, worker_home, api_server
) -> None:
    """examples/gateway/agents_calculator.py: an unmodified Agents SDK agent, its model the
    episode's endpoint (OpenAIResponsesModel), plays every episode of a gateway run through
    the Responses API. (Against the SDK's own tool schemas, twice as long as the preset's, the
    tiny model rarely writes a well-formed call; a tool round through the Responses API is
    test_the_responses_api_plays_tool_calls_token_exact's. Any round here must continue the
    engine's tokens too.)"""
    from app.core.config_files import load_preset

    python = await asyncio.to_thread(_agents_python)
    example = EXAMPLES / "agents_calculator.py"
    env = {**os.environ, "PYTHONPATH": str(SDK / "src")}  # the SDK as it is in this tree
    printed = await asyncio.to_thread(
        subprocess.run,
        [python, example, "--print-tools"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    body = {**load_preset(AGENT_GATEWAY), "model_name": str(tool_model), "max_steps": 2}
    body["grpo"] = {**body["grpo"], "groups_per_step": 1}
    body["environment"] = {**body["environment"], "tools": json.loads(printed.stdout)}
    start_worker(**worker_home)
    async with trainyard.Client(api_server.url, tenant.key) as ty:
        run = await ty.create_run(body)
    harness = await asyncio.create_subprocess_exec(
        python,
        example,
        *("--url", api_server.url, "--key", tenant.key, "--run", run.id, "--concurrency", "8"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
    )
    out, _ = await asyncio.wait_for(harness.communicate(), 300)
    assert harness.returncode == 0, out.decode()[-3000:]
    done = await wait_for(sessionmaker, run.id, lambda r: r.status in {"completed", "failed"}, 60)
    assert done.status == "completed", done.error
    async with sessionmaker() as s:
        episodes = (
            await s.execute(
                text(
                    "SELECT e.id, e.status, count(c.id) AS calls FROM episodes e "
                    "LEFT JOIN episode_calls c ON c.episode_id = e.id "
                    "WHERE e.run_id = :r GROUP BY e.id"
                ),
                {"r": uuid.UUID(run.id)},
            )
        ).all()
    assert sorted(e.status for e in episodes) == ["finished"] * 16, out.decode()[-3000:]
    assert api_server.log.read_text().count("/v1/responses") >= 16  # the SDK's default API
    rounds = [e for e in episodes if e.calls >= 2]  # a tool called, its result sent back
    async with httpx.AsyncClient(base_url=api_server.url, headers=tenant.headers) as http:
        for episode in rounds:
            calls = (await http.get(f"/episodes/{episode.id}", params={"tokens": "true"})).json()[
                "call_log"
            ]
            for before, after in itertools.pairwise(calls):
                sampled = before["prompt_ids"] + before["completion_ids"]
                assert after["prompt_ids"][: len(sampled)] == sampled, episode.id
                assert after["request"]["messages"][-1]["role"] == "tool"


class PushHarness(http.server.ThreadingHTTPServer):
    """A push-mode harness: each POST is an episode, played on the blocking ``OpenAI``
    client through its base URL; the answer is the finish (one episode fails on purpose)."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), PushHandler)
        self.played: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/episodes"


class PushHandler(http.server.BaseHTTPRequestHandler):
    server: PushHarness

    def do_POST(self) -> None:
        episode = json.loads(self.rfile.read(int(self.headers["content-length"])))
        client = OpenAI(base_url=episode["base_url"], api_key=episode["token"], max_retries=0)
        answer = client.chat.completions.create(model="policy", messages=episode["messages"])
        text = answer.choices[0].message.content or ""
        with self.server.lock:
            self.server.played.append(episode)
            first = len(self.server.played) == 1
        outcome: dict[str, Any] = (
            {"error": "the sandbox crashed"}
            if first
            else {"reward": text.count("a") / max(1, len(text)), "metrics": {"chars": len(text)}}
        )
        body = json.dumps(outcome).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


async def test_push_mode_hands_every_episode_to_the_harness(
    tenant, sessionmaker, start_worker, tiny_model, worker_home, api_server
) -> None:
    harness = PushHarness()
    threading.Thread(target=harness.serve_forever, daemon=True).start()
    try:
        start_worker(**worker_home, TRAINYARD_PUBLIC_URL=api_server.url)
        body = gateway_run(tiny_model, max_steps=2, grpo={"groups_per_step": 1})
        body["environment"]["harness_url"] = harness.url
        async with trainyard.Client(api_server.url, tenant.key) as ty:
            run = await ty.create_run(body)
        done = await wait_for(
            sessionmaker, run.id, lambda r: r.status in {"completed", "failed"}, 300
        )
    finally:
        harness.shutdown()
    assert done.status == "completed", done.error
    assert len(harness.played) == 8  # every episode, pushed once: no claim by anyone else
    assert {e["step"] for e in harness.played} == {1, 2}
    assert all(e["token"].startswith("tye_") for e in harness.played)
    async with sessionmaker() as s:
        rows = (
            await s.execute(
                text("SELECT status, error, metrics FROM episodes WHERE run_id = :r"),
                {"r": uuid.UUID(run.id)},
            )
        ).all()
    assert sorted(r.status for r in rows) == ["failed"] + ["finished"] * 7
    assert next(r.error for r in rows if r.status == "failed") == "the sandbox crashed"
    assert all("chars" in r.metrics for r in rows if r.status == "finished")
