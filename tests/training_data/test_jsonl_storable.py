"""A trajectory line PostgreSQL cannot store, or the API could not serve back, is a bad line
named by number and field, not a failure halfway through the import."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.core.limits import MAX_JSON_DEPTH
from app.training_data.jsonl import JsonlImportError, parse_lines


def nest(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = {"a": value}
    return value


def line(**fields: Any) -> str:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize(
    ("raw", "where", "why"),
    [
        (line(metadata=nest(MAX_JSON_DEPTH + 1)), "metadata", "levels deep"),
        (line(reward_breakdown={"k": nest(MAX_JSON_DEPTH)}), "reward_breakdown", "levels deep"),
        (line(metadata={"k": "a\u0000"}), "metadata", "NUL"),
        (line(messages=[{"role": "user", "content": "a\u0000"}]), "messages.0.content", "NUL"),
        (
            line(
                messages=[
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"function": {"name": "f", "arguments": nest(MAX_JSON_DEPTH + 1)}}
                        ],
                    }
                ]
            ),
            "messages.0.tool_calls.0.function.arguments",
            "levels deep",
        ),
        (  # keys a message does not name are free-form JSON, under the same rules
            line(messages=[{"role": "assistant", "annotations": [nest(MAX_JSON_DEPTH)]}]),
            "messages.0",
            "levels deep",
        ),
        (line(learning_key="k\u0000"), "learning_key", "NUL"),
        (line().replace('"hi"}]', '"hi"}], "reward": NaN'), "reward", "finite"),
        (line(metadata={"x": 1}).replace("1}", "Infinity}"), "metadata", ""),
    ],
)
def test_unstorable_lines_are_named(raw: str, where: str, why: str) -> None:
    with pytest.raises(JsonlImportError) as caught:
        parse_lines([raw])
    [(number, message)] = caught.value.lines
    assert number == 1 and message.startswith(where), message
    assert why in message


def test_storable_lines_pass() -> None:
    [(_, parsed)] = parse_lines([line(metadata=nest(MAX_JSON_DEPTH), reward=0.5)])
    assert parsed.metadata == nest(MAX_JSON_DEPTH) and parsed.reward == 0.5
