"""The Responses API's translation (app/gateway/responses_api.py), checked against the
``openai`` SDK's own types and its stream accumulator: what the gateway answers is what the
SDK reads, and what the SDK echoes back is the conversation the engine answered."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from app.gateway.responses_api import (
    ResponsesRequest,
    Unsupported,
    chat_request,
    events,
    response,
)
from app.gateway.service import Answered

ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
    "strict": True,
}


def answered(content: str | None, calls: int = 0, finish: str = "stop") -> Answered:
    call_id = uuid.uuid4()
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {
                "id": f"call_{call_id.hex[:16]}_{i}",
                "type": "function",
                "function": {"name": "add", "arguments": json.dumps({"a": i})},
            }
            for i in range(calls)
        ]
        finish = "tool_calls"
    usage = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    return Answered(call_id, message, finish, usage, 3, uuid.uuid4())


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "What is 1 plus 2?", **fields})


@pytest.mark.parametrize(("content", "calls"), [("Let me add.", 2), (None, 1), ("3", 0), ("", 0)])
def test_the_output_echoed_back_is_the_answered_message_again(
    content: str | None, calls: int
) -> None:
    """One model turn is a message item and its function calls; as input again, they are the
    one assistant message the engine answered, so the next call continues its tokens."""
    body = request(instructions="Use the tools.", tools=[ADD], max_output_tokens=64)
    call = answered(content, calls)
    answer = Response.model_validate(response(body, call, created=1))  # the SDK's own type
    assert answer.status == "completed" and answer.usage and answer.usage.output_tokens == 5
    assert answer.output_text == (content or "")
    echoed: list[Any] = [
        {"role": "user", "content": "What is 1 plus 2?"},
        *[item.model_dump(exclude_none=True) for item in answer.output],
        *[
            {"type": "function_call_output", "call_id": item.call_id, "output": "3"}
            for item in answer.output
            if item.type == "function_call"
        ],
    ]
    asked = chat_request(request(input=echoed, instructions="Use the tools.", tools=[ADD]))
    assert asked["messages"][0] == {"role": "system", "content": "Use the tools."}
    assert asked["messages"][2] == call.message
    tool_messages = asked["messages"][3:]
    assert [m["tool_call_id"] for m in tool_messages] == [
        c["id"] for c in call.message.get("tool_calls", [])
    ]
    function = {k: v for k, v in ADD.items() if k != "type"}
    assert asked["tools"] == [{"type": "function", "function": function}]


def test_the_request_translates_to_the_chat_request_it_means() -> None:
    asked = chat_request(
        request(
            max_output_tokens=9,
            temperature=0.5,
            tools=[ADD],
            tool_choice={"type": "function", "name": "add"},
            store=False,
            metadata={"k": "v"},
        )
    )
    assert asked == {
        "messages": [{"role": "user", "content": "What is 1 plus 2?"}],
        "max_tokens": 9,
        "temperature": 0.5,
        "tools": [{"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}],
        "tool_choice": {"type": "function", "function": {"name": "add"}},
        "metadata": {"k": "v"},
        "store": False,
    }
    assert "tools" not in chat_request(request(tools=[ADD], tool_choice="none"))
    parts = [
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        }
    ]
    assert chat_request(request(input=parts))["messages"] == [{"role": "user", "content": "ab"}]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"input": []}, "input"),
        ({"input": 7}, "input"),
        ({"instructions": [1]}, "instructions.0"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input.0.role"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"type": "function"}]}, "tools.0.name"),
    ],
)
def test_what_the_gateway_does_not_serve_is_refused_naming_the_parameter(
    fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(Unsupported) as caught:
        chat_request(request(**fields))
    assert caught.value.param == param


@pytest.mark.parametrize(
    ("content", "calls", "finish"), [("Let me add.", 2, "stop"), ("abc", 0, "length")]
)
async def test_the_stream_accumulates_to_the_response_in_the_sdk(
    content: str, calls: int, finish: str
) -> None:
    """The events pass the SDK's types, and its accumulator (what ``responses.stream`` runs)
    builds from them the same Response the non-streamed call answers."""
    call = answered(content, calls, finish)
    whole = response(request(tools=[ADD]), call, created=1)
    parse = TypeAdapter[Any](ResponseStreamEvent).validate_python
    state = ResponseStreamState(input_tools=[ADD], text_format=omit)  # type: ignore[list-item]
    kinds, numbers, text = [], [], ""
    async for raw in events(whole):
        head, data = raw.decode().removesuffix("\n\n").split("\n")
        event = parse(json.loads(data.removeprefix("data: ")))
        assert head == f"event: {event.type}"
        kinds.append(event.type)
        numbers.append(event.sequence_number)
        text += getattr(event, "delta", "") if event.type == "response.output_text.delta" else ""
        state.handle_event(event)
    assert text == content
    assert numbers == list(range(len(kinds)))
    final = "response.completed" if finish == "stop" else "response.incomplete"
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == final
    expected = Response.model_validate(whole)
    if finish == "stop":
        built = state._completed_response
        assert built is not None and built.output_text == content

        def shape(items: list[Any]) -> list[tuple[Any, ...]]:
            return [
                (i.type, i.id, getattr(i, "call_id", 0), getattr(i, "arguments", 0)) for i in items
            ]

        assert shape(built.output) == shape(expected.output)
    else:
        assert (
            expected.incomplete_details
            and expected.incomplete_details.reason == "max_output_tokens"
        )
