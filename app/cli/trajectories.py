"""``trainyard trajectories``: list a run's trajectories, show one (messages, tool calls and
results), and export the project's as JSON Lines, over HTTP; the export's options are
app/cli/export_options.py's, shared with ``trainyard data export``."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from app.cli.common import CliError, Json, err, print_json, shown, table
from app.cli.export_options import ExportOptions, export_options
from app.cli.http import After, Api, ApiKey, ApiUrl, problem_line

trajectories_app = typer.Typer(
    no_args_is_help=True, help="A run's trajectories and the project's training data (over HTTP)."
)


def _tool_calls(trajectory: dict[str, Any]) -> int:
    """The episode's tool calls: what the workers count in ``metadata.tool_calls``, else the
    calls its messages hold (an imported row may have no metadata)."""
    counted = (trajectory.get("metadata") or {}).get("tool_calls")
    if isinstance(counted, int):
        return counted
    messages = trajectory.get("messages") or []
    return sum(len(m.get("tool_calls") or []) for m in messages if isinstance(m, dict))


def _answer(trajectory: dict[str, Any]) -> str:
    messages = trajectory.get("messages") or []
    last = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
    return shown(str((last or {}).get("content") or ""), 50)


@trajectories_app.command("list")
def trajectories_list(
    run_id: str,
    step: Annotated[int | None, typer.Option(min=0)] = None,
    min_reward: Annotated[float | None, typer.Option(help="Inclusive.")] = None,
    max_reward: Annotated[float | None, typer.Option(help="Inclusive.")] = None,
    min_tool_calls: Annotated[
        int | None, typer.Option(min=0, help="Agent episodes with at least this many tool calls.")
    ] = None,
    limit: Annotated[int, typer.Option(min=1)] = 20,
    after: After = None,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
    as_json: Json = False,
) -> None:
    """A run's trajectories by step, group and rollout (the whole page with --json)."""
    params = {
        "step": step,
        "min_reward": min_reward,
        "max_reward": max_reward,
        "min_tool_calls": min_tool_calls,
        "limit": limit,
        "after": after,
    }
    page = Api(api_url, api_key).call(
        "GET",
        f"/runs/{run_id}/trajectories",
        params={k: v for k, v in params.items() if v is not None},
    )
    if as_json:
        print_json(page)
        return
    rows = [
        [
            t["id"],
            str(t["step"]),
            str(t["group_index"]),
            str(t["rollout_index"]),
            f"{t['reward']:.3f}" if t["reward"] is not None else "-",
            str(_tool_calls(t)),
            _answer(t),
        ]
        for t in page["data"]
    ]
    headers = ["id", "step", "group", "rollout", "reward", "tools", "answer"]
    print(table(headers, rows), flush=True)
    if page.get("has_more"):
        err.print(f"[dim]more: --after {page['next_cursor']}", highlight=False)


def message_lines(message: dict[str, Any]) -> list[str]:
    """One message for reading: its role, its content, each tool call with its arguments,
    and a tool result's error, duration and truncation."""
    role = str(message.get("role") or "?")
    head = f"[{role}]"
    if message.get("name"):
        head += f" {message['name']}"
    if message.get("tool_call_id"):
        head += f" (answers {message['tool_call_id']})"
    notes = []
    if message.get("error") is not None:
        notes.append(f"error: {' '.join(str(message['error']).split())}")
    if message.get("duration_ms") is not None:
        notes.append(f"{message['duration_ms']} ms")
    if message.get("truncated"):
        notes.append("truncated")
    if notes:
        head += "  " + ", ".join(notes)
    lines = [head]
    content = message.get("content")
    if content:
        text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
        lines += [f"  {line}" for line in text.splitlines()]
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        said = f"  → call {function.get('name')}({arguments})"
        lines.append(said + (f"  id {call['id']}" if call.get("id") else ""))
    return lines


@trajectories_app.command("show")
def trajectories_show(
    trajectory_id: str, api_url: ApiUrl = None, api_key: ApiKey = None, as_json: Json = False
) -> None:
    """One trajectory: where it came from, its reward (and breakdown), then its messages,
    tool calls and tool results included."""
    t = Api(api_url, api_key).call("GET", f"/trajectories/{trajectory_id}")
    if as_json:
        print_json(t)
        return
    reward = f"{t['reward']:.3f}" if t["reward"] is not None else "-"
    print(f"trajectory {t['id']}")
    print(f"run {t['run_id']}  step {t['step']}  group {t['group_index']}  ", end="")
    print(f"rollout {t['rollout_index']}  reward {reward}")
    if t.get("reward_breakdown"):
        print("reward breakdown: " + json.dumps(t["reward_breakdown"], ensure_ascii=False))
    if t.get("metadata"):
        print("metadata: " + json.dumps(t["metadata"], ensure_ascii=False))
    for message in t.get("messages") or []:
        print()
        print("\n".join(message_lines(message)))
    sys.stdout.flush()


@trajectories_app.command("export")
@export_options
def trajectories_export(
    output: Annotated[Path, typer.Argument(help="JSONL file to write ('-' for stdout).")],
    options: ExportOptions,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Export the key's project's trajectories matching the filters as JSON Lines, through
    the API (`GET /trajectories/export`), written as it streams."""
    api = Api(api_url, api_key)
    written = 0
    with api.problems(), api.client() as client:
        query = options.query()
        with client.stream("GET", "/trajectories/export", params=query, timeout=None) as answer:
            if answer.status_code >= 400:
                answer.read()
                raise CliError(problem_line(answer))
            to_stdout = str(output) == "-"
            sink = contextlib.nullcontext(sys.stdout) if to_stdout else output.open("w")
            with sink as out:
                for line in answer.iter_lines():
                    if line:
                        out.write(line + "\n")
                        written += 1
                out.flush()
    err.print(f"{written} trajectories exported")
