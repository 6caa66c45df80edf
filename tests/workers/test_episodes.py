"""workers.pipeline.episodes.build: a rollout of TRL's tool loop made into the stored
episode: call ids paired with their results, each environment record on its tool message,
TRL's own refusals told apart, and the episode's counts."""

from __future__ import annotations

from typing import Any

from workers.environments.safety import CallRecord
from workers.pipeline.episodes import build


def call(name: str, **arguments: Any) -> dict[str, Any]:
    """A tool call as TRL's response parser writes it."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def assistant(content: str = "", *calls: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = list(calls)
    return message


def tool(name: str, content: str) -> dict[str, Any]:
    """A tool message as TRL's loop appends it."""
    return {"role": "tool", "name": name, "content": content}


def test_ids_pairs_records_counts_and_final_answer() -> None:
    completion = [
        assistant("Let me compute.", call("add", a=2, b=3), call("multiply", a=5, b=4)),
        tool("add", "5"),
        tool("multiply", "20"),
        assistant("", call("divide", a=20, b=0)),
        tool("divide", "{'error': 'ZeroDivisionError: cannot divide by zero'}"),
        assistant("The answer is 20."),
    ]
    records = [
        CallRecord("add", 1.23456),
        CallRecord("multiply", 2.0),
        CallRecord("divide", 0.5, error="ZeroDivisionError: cannot divide by zero"),
    ]
    mask = [1] * 30 + [0] * 12 + [1] * 8
    episode = build(completion, records, mask)

    assert episode.final == "The answer is 20."
    assert episode.failure is None
    assert episode.counts == {
        "turns": 3,
        "tool_calls": 3,
        "tool_errors": 1,
        "trained_tokens": 38,
        "masked_tokens": 12,
    }
    assert episode.metadata == episode.counts
    first, add, multiply, second, divide, last = episode.messages
    assert first == {
        "role": "assistant",
        "content": "Let me compute.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "add", "arguments": {"a": 2, "b": 3}},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "multiply", "arguments": {"a": 5, "b": 4}},
            },
        ],
    }
    assert add == {
        "role": "tool",
        "tool_call_id": "call_1",
        "name": "add",
        "content": "5",
        "error": None,
        "duration_ms": 1.235,
        "truncated": False,
    }
    assert multiply["tool_call_id"] == "call_2" and multiply["duration_ms"] == 2.0
    assert second["tool_calls"][0]["id"] == "call_3"
    assert divide["tool_call_id"] == "call_3"
    assert divide["error"] == "ZeroDivisionError: cannot divide by zero"
    assert last == {"role": "assistant", "content": "The answer is 20."}


def test_a_call_trl_refused_has_no_record_and_its_error_from_the_content() -> None:
    completion = [
        assistant("", call("teleport", to="mars"), call("add", a=1, b=1)),
        tool("teleport", "{'error': 'Tool teleport not found.'}"),
        tool("add", "2"),
        assistant("2"),
    ]
    episode = build(completion, [CallRecord("add", 3.0, truncated=True)], None)
    _, refused, add, _ = episode.messages
    assert refused == {
        "role": "tool",
        "tool_call_id": "call_1",
        "name": "teleport",
        "content": "{'error': 'Tool teleport not found.'}",
        "error": "Tool teleport not found.",
    }
    assert add["tool_call_id"] == "call_2" and add["error"] is None
    assert add["duration_ms"] == 3.0 and add["truncated"] is True
    assert episode.counts == {"turns": 2, "tool_calls": 2, "tool_errors": 1}  # no mask: no tokens


def test_an_exception_without_text_is_an_error_with_an_empty_message() -> None:
    """TRL shows ``raise ValueError()`` as ``{'error': ''}``: an error all the same."""
    completion = [
        assistant("", call("explode", reason="")),
        tool("explode", "{'error': ''}"),
        assistant("sorry"),
    ]
    episode = build(completion, [CallRecord("explode", 1.0, error="")], None)
    failed = episode.messages[1]
    assert failed["error"] == "" and failed["duration_ms"] == 1.0
    assert episode.counts["tool_errors"] == 1


def test_tool_text_that_only_looks_like_an_error_is_not_one() -> None:
    completion = [
        assistant("", call("echo")),
        tool("echo", "{'error': 'x', 'also': 1}"),
        assistant("", call("echo")),
        tool("echo", "{'error': not python"),
        assistant("done"),
    ]
    episode = build(completion, [], None)
    assert [m.get("error") for m in episode.messages if m["role"] == "tool"] == [None, None]
    assert episode.counts["tool_errors"] == 0


def test_an_episode_cut_off_mid_call_and_a_failed_environment() -> None:
    completion = [
        assistant("", call("lookup", key="a")),
        tool("lookup", "1"),
        assistant("", call("lookup", key="b")),
    ]
    gone = "the MCP server is gone: it exited with code 3"
    episode = build(completion, [CallRecord("lookup", 1.0)], [1, 1, 0, 1], failure=gone)
    assert episode.final == ""  # the last assistant turn answered nothing
    assert episode.counts == {
        "turns": 2,
        "tool_calls": 1,  # a call without a result is not counted as made
        "tool_errors": 0,
        "trained_tokens": 3,
        "masked_tokens": 1,
    }
    assert episode.metadata == {**episode.counts, "episode_error": gone}


def test_non_text_content_and_other_roles_are_kept() -> None:
    completion = [
        assistant(None, call("add", a=1, b=2)),  # type: ignore[arg-type]
        {"role": "tool", "name": "add", "content": 3},
        {"role": "user", "content": "and?"},
        assistant("3"),
    ]
    episode = build(completion, [CallRecord("add", 1.0)], None)
    assert episode.messages[0]["content"] == ""
    assert episode.messages[1]["content"] == "3"
    assert episode.messages[2] == {"role": "user", "content": "and?"}
    assert episode.final == "3"


def test_a_refused_call_does_not_take_a_later_calls_record() -> None:
    completion = [
        assistant("", {"type": "function", "function": {"name": "add", "arguments": "1, 2"}}),
        tool(
            "add", "{'error': 'workers.tools.add() argument after ** must be a mapping, not str'}"
        ),
        assistant("", call("add", a=1, b=2)),
        tool("add", "3"),
        assistant("3"),
    ]
    episode = build(completion, [CallRecord("add", 7.0)], None)
    refused, ran = (m for m in episode.messages if m["role"] == "tool")
    assert refused["error"] is not None and "duration_ms" not in refused
    assert ran["error"] is None and ran["duration_ms"] == 7.0
    assert episode.counts["tool_errors"] == 1
