"""Agent episodes in the training data: stored as the workers store them (prompt, then every
completion message: tool calls, tool results, the final answer), served as stored and as the
document says, round-tripped through JSON Lines exactly, turned into RL records whose
completion is the whole episode, and filtered by how many tool calls they made."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from typing import Any

import asyncpg
import httpx
import jsonschema_rs
import pytest

from app import training_data as td
from app.core.pg import connect_kwargs, init_connection
from app.training_data.jsonl import JsonlImportError, parse_lines
from app.training_data.records import TrainingTrajectory
from tests.support import ROOT
from tests.support.database import Tenant
from tests.support.runs import Maker, create_run

PROMPT = [
    {"role": "system", "content": "Use the tools, then answer with the number."},
    {"role": "user", "content": "What is (6 * 7) / 0?"},
]


def _episode(calls: int) -> list[dict[str, Any]]:
    """An episode of ``calls`` tool calls (the last one failing), then the answer."""
    messages: list[dict[str, Any]] = []
    for i in range(calls):
        failing = i == calls - 1
        messages.append(
            {
                "role": "assistant",
                "content": "" if i else None,
                "tool_calls": [
                    {
                        "id": f"call_{i}",
                        "type": "function",
                        "function": {
                            "name": "divide" if failing else "multiply",
                            # Both forms: TRL's object, OpenAI's JSON string.
                            "arguments": {"a": 42, "b": 0} if failing else '{"a": 6, "b": 7}',
                        },
                    }
                ],
            }
        )
        messages.append(
            {
                "role": "tool",
                "tool_call_id": f"call_{i}",
                "name": "divide" if failing else "multiply",
                "content": "error: division by zero" if failing else "42",
                "error": "ZeroDivisionError: division by zero" if failing else None,
                "duration_ms": 0.25,
                "truncated": False,
            }
        )
    messages.append({"role": "assistant", "content": "undefined"})
    return messages


def _metadata(calls: int) -> dict[str, Any]:
    return {
        "engine": "transformers",
        "completion_tokens": 40,
        "turns": calls + 1,
        "tool_calls": calls,
        "tool_errors": 1 if calls else 0,
        "trained_tokens": 30,
        "masked_tokens": 10,
    }


async def _store(
    db_url: str, run_id: uuid.UUID, rows: list[tuple[list[dict[str, Any]], dict[str, Any]]]
) -> None:
    """Rollouts of one group at step 1, written as the workers write them."""
    conn = await asyncpg.connect(**connect_kwargs(db_url))
    try:
        await init_connection(conn)
        await conn.executemany(
            """
            INSERT INTO trajectories (id, run_id, project_id, learning_key, step, group_index,
                                      rollout_index, messages, reward, metadata)
            SELECT gen_random_uuid(), id, project_id, learning_key, 1, 0, $2, $3, $4, $5
              FROM runs WHERE id = $1
            """,
            [
                (run_id, i, messages, 0.25 * i, metadata)
                for i, (messages, metadata) in enumerate(rows)
            ],
        )
    finally:
        await conn.close()


# Tool calls per rollout: a single turn (no metadata.tool_calls at all), then 1, 2 and 3
# calls, and one whose metadata holds something that is no number.
SINGLE_TURN = ([*PROMPT, {"role": "assistant", "content": "42"}], {"engine": "transformers"})
ROWS = [
    SINGLE_TURN,
    *[([*PROMPT, *_episode(n)], _metadata(n)) for n in (1, 2, 3)],
    ([*PROMPT, *_episode(1)], {**_metadata(1), "tool_calls": "many"}),
]


@pytest.fixture
async def run_id(sessionmaker: Maker, tenant: Tenant, service_urls: tuple[str, str]) -> uuid.UUID:
    run = await create_run(sessionmaker, project_id=tenant.project_id)
    await _store(service_urls[0], run.id, ROWS)
    return run.id


async def _by_rollout(db_url: str, run_id: uuid.UUID, **filters: Any) -> list[TrainingTrajectory]:
    rows = await td.get_training_trajectories_async(db_url, run_ids=[run_id], **filters)
    return sorted(rows, key=lambda t: t.rollout_index)


def _record(messages: list[Any]) -> TrainingTrajectory:
    ids = uuid.uuid4()
    return TrainingTrajectory(
        id=ids,
        run_id=ids,
        project_id=ids,
        learning_key=None,
        step=0,
        group_index=0,
        rollout_index=0,
        task_input_id=None,
        reward=1.0,
        created_at=datetime.now(UTC),
        messages=messages,
    )


def test_prompt_episode_and_completion_of_a_record() -> None:
    t = _record([*PROMPT, *_episode(2)])
    assert t.prompt == PROMPT
    assert t.episode == _episode(2)
    assert t.completion == "undefined"
    single = _record(SINGLE_TURN[0])
    assert single.prompt == PROMPT and single.episode == [SINGLE_TURN[0][-1]]
    assert single.completion == "42"
    cut_short = _record([*PROMPT, *_episode(1)[:-1]])  # ended on a tool result
    assert cut_short.completion is None and len(cut_short.episode) == 2
    assert _record(PROMPT).episode == [] and _record(PROMPT).prompt == PROMPT


async def test_rl_records_complete_with_the_whole_episode(
    run_id: uuid.UUID, service_urls: tuple[str, str]
) -> None:
    rows = await _by_rollout(service_urls[0], run_id)
    records = td.to_rl_records(rows)
    assert [r["prompt"] for r in records] == [PROMPT] * len(ROWS)
    assert records[0]["completion"] == [{"role": "assistant", "content": "42"}]
    assert records[2]["completion"] == _episode(2)
    assert records[2]["completion"][0]["tool_calls"][0]["function"]["arguments"] == (
        '{"a": 6, "b": 7}'
    )


async def test_jsonl_round_trips_an_episode_exactly(
    run_id: uuid.UUID, tenant: Tenant, service_urls: tuple[str, str]
) -> None:
    db = service_urls[0]
    out = io.StringIO()
    assert await td.export_jsonl_async(db, out, run_ids=[run_id]) == len(ROWS)
    result = await td.import_jsonl_async(db, out.getvalue().splitlines(), project=tenant.project_id)
    (new_run,) = result.run_ids.values()
    again = io.StringIO()
    await td.export_jsonl_async(db, again, run_ids=[new_run])

    def kept(text: str) -> list[tuple[int, Any, Any, Any]]:
        lines = [json.loads(line) for line in text.splitlines()]
        return sorted(
            (x["rollout_index"], x["messages"], x["metadata"], x["reward"]) for x in lines
        )

    assert kept(again.getvalue()) == kept(out.getvalue())
    assert [m for _, m, _, _ in kept(again.getvalue())] == [messages for messages, _ in ROWS]


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ({"messages": [{"role": "tool"}]}, "content"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "assistant"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": ""}}]}]},
            "messages.0.tool_calls.0.function",
        ),
    ],
)
def test_jsonl_import_checks_tool_messages(line: dict[str, Any], why: str) -> None:
    with pytest.raises(JsonlImportError, match=why):
        parse_lines([json.dumps(line)])


async def test_min_tool_calls_in_the_library(
    run_id: uuid.UUID, service_urls: tuple[str, str]
) -> None:
    db = service_urls[0]
    # A row that does not say how many calls it made (a single turn, an import, a count that
    # is no number) made none.
    for least, rollouts in [(0, [0, 1, 2, 3, 4]), (1, [1, 2, 3]), (2, [2, 3]), (4, [])]:
        rows = await _by_rollout(db, run_id, min_tool_calls=least)
        assert [t.rollout_index for t in rows] == rollouts, least
        count = await td.count_training_trajectories_async(
            db, run_ids=[run_id], min_tool_calls=least
        )
        assert count == len(rollouts)
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(td.TrainingDataError, match="min_tool_calls"):
            await td.get_training_trajectories_async(db, min_tool_calls=bad)


async def test_min_tool_calls_over_http(
    client: httpx.AsyncClient, tenant: Tenant, run_id: uuid.UUID
) -> None:
    params = {"run_id": str(run_id), "min_tool_calls": 2}
    listed = {**params, "order": "oldest"}
    r = await client.get("/trajectories", params=listed, headers=tenant.headers)
    assert r.status_code == 200, r.text
    assert sorted(t["metadata"]["tool_calls"] for t in r.json()["data"]) == [2, 3]
    r = await client.get("/trajectories/count", params=params, headers=tenant.headers)
    assert r.json() == {"count": 2}
    r = await client.get("/trajectories/export", params=params, headers=tenant.headers)
    assert len(r.text.splitlines()) == 2
    for bad in ("-1", "1.5", "x", str(2**31)):
        r = await client.get(
            "/trajectories", params={"min_tool_calls": bad}, headers=tenant.headers
        )
        assert r.status_code == 422, r.text
        assert r.json()["errors"][0]["field"] == "query.min_tool_calls"


async def test_episodes_are_served_as_stored_and_as_documented(
    client: httpx.AsyncClient, tenant: Tenant, run_id: uuid.UUID, service_urls: tuple[str, str]
) -> None:
    doc = (await client.get("/openapi.json")).json()
    schema = doc["paths"]["/runs/{run_id}/trajectories"]["get"]["responses"]["200"]["content"][
        "application/json"
    ]["schema"]
    validator = jsonschema_rs.Draft202012Validator(
        {**schema, "components": doc["components"]}, validate_formats=True
    )
    r = await client.get(f"/runs/{run_id}/trajectories", headers=tenant.headers)
    assert r.status_code == 200, r.text
    page = r.json()
    errors = [e.message for e in validator.iter_errors(page)]
    assert not errors, errors[:5]
    assert [t["messages"] for t in page["data"]] == [messages for messages, _ in ROWS]
    # A row written around the API, not a message the document describes, still answers.
    conn = await asyncpg.connect(**connect_kwargs(service_urls[0]))
    try:
        await init_connection(conn)
        await conn.execute(
            """
            INSERT INTO trajectories (id, run_id, project_id, step, group_index, rollout_index,
                                      messages)
            SELECT gen_random_uuid(), id, project_id, 2, 0, 0, $2 FROM runs WHERE id = $1
            """,
            run_id,
            [{"role": "function", "content": 7}, "not even an object"],
        )
    finally:
        await conn.close()
    r = await client.get(f"/runs/{run_id}/trajectories", params={"step": 2}, headers=tenant.headers)
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["messages"] == [
        {"role": "function", "content": 7},
        "not even an object",
    ]


def test_hf_dataset_of_episodes(
    run_id: uuid.UUID, service_urls: tuple[str, str], tmp_path: Any
) -> None:
    ds = td.to_hf_dataset(service_urls[0], batch_size=2, run_ids=[run_id], cache_dir=str(tmp_path))
    assert len(ds) == len(ROWS)
    by_rollout = {row["rollout_index"]: row for row in ds}
    assert by_rollout[0]["completion"][0]["content"] == "42"
    assert [m["role"] for m in by_rollout[2]["completion"]] == [
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    # Both forms of arguments survive Arrow, as do the tool messages' own keys.
    calls = [c for m in by_rollout[3]["completion"] for c in m.get("tool_calls") or []]
    assert [c["function"]["arguments"] for c in calls] == [
        '{"a": 6, "b": 7}',
        '{"a": 6, "b": 7}',
        {"a": 42, "b": 0},
    ]
    assert by_rollout[3]["completion"] == _episode(3)


def test_min_tool_calls_from_the_cli(run_id: uuid.UUID, service_urls: tuple[str, str]) -> None:
    """`trainyard data export --min-tool-calls`, as a user types it, on the same rows."""
    env = {**os.environ, "TRAINYARD_DATABASE_URL": service_urls[0], "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "data",
            "export",
            "-",
            "--run-id",
            str(run_id),
            "--min-tool-calls",
            "2",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert sorted(t["rollout_index"] for t in lines) == [2, 3]
    assert all(t["metadata"]["tool_calls"] >= 2 for t in lines)
