"""The Responses API on each episode's endpoint: ``POST /gateway/episodes/{id}/v1/responses``.

Chosen over Anthropic's Messages because the harnesses the gateway is for speak it by default:
the OpenAI Agents SDK's ``OpenAIResponsesModel`` and the ``openai`` SDKs' ``responses``
resource (Codex too), while an Anthropic-only harness is rarer in training code than one on
either ``openai`` API.

A Responses request is translated to the Chat Completions request it means (``instructions``
and ``input`` items to messages, function tools to tools, ``max_output_tokens`` to
``max_tokens``), answered and recorded as one (app/gateway/openai_api.py), and its answer shaped
as a Response: a ``message`` item with the text, then one ``function_call`` item per tool call.
Echoed back as input, those items become the same assistant message again, so a multi-turn
episode stays one token-exact sequence. The gateway keeps no conversation state: a request that
names one (``previous_response_id``, ``conversation``) is refused; send the whole conversation as
``input``, as the Agents SDK does by default. Text content only.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from app.core import jsontext
from app.core.limits import MAX_CALL_MESSAGES, MAX_CALL_TOOLS
from app.gateway.service import Answered


class Unsupported(ValueError):
    """A request the gateway does not serve: a 400 naming ``param``."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class ResponsesRequest(BaseModel):
    """The Responses parameters the gateway reads; others are accepted and recorded."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    # A string or a list of input items, checked by chat_request (a union's errors would
    # name its branches, not the parameter).
    input: Any
    instructions: Any = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_CALL_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_output_tokens: int | None = Field(default=None, ge=1)
    metadata: dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None


# Fields of a Responses request that its Chat Completions translation says another way.
_TRANSLATED = {
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "max_output_tokens",
    "stream",
    "stream_options",
}


def chat_request(body: ResponsesRequest) -> dict[str, Any]:
    """The Chat Completions request ``body`` means (what the engine answers and the call
    records); :class:`Unsupported` for what it cannot mean."""
    for param in ("previous_response_id", "conversation"):
        if getattr(body, param) is not None:
            raise Unsupported(
                param,
                "the gateway keeps no conversation state; send the whole conversation as input",
            )
    messages: list[dict[str, Any]] = []
    if isinstance(body.instructions, str):
        messages.append({"role": "system", "content": body.instructions})
    elif body.instructions is not None:
        messages += _messages(body.instructions, "instructions")
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        messages += _messages(body.input, "input")
    asked = body.model_dump(exclude_none=True, exclude=_TRANSLATED)
    asked["messages"] = messages
    if body.max_output_tokens is not None:
        asked["max_tokens"] = body.max_output_tokens
    if body.tools and body.tool_choice != "none":
        asked["tools"] = [_tool(tool, f"tools.{i}") for i, tool in enumerate(body.tools)]
    if isinstance(body.tool_choice, dict) and body.tool_choice.get("type") == "function":
        asked["tool_choice"] = {
            "type": "function",
            "function": {"name": body.tool_choice.get("name")},
        }
    elif body.tool_choice is not None:
        asked["tool_choice"] = body.tool_choice
    return asked


def _messages(items: Any, where: str) -> list[dict[str, Any]]:
    """Input items as chat messages: a ``function_call`` joins the assistant message before
    it (one model turn is a message item, then its function calls), a
    ``function_call_output`` is a tool message."""
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_CALL_MESSAGES:
        raise Unsupported(where, f"must be a string or a list of 1 to {MAX_CALL_MESSAGES} items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        param = f"{where}.{i}"
        if not isinstance(item, dict):
            raise Unsupported(param, "an input item is an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise Unsupported(f"{param}.role", f"unknown role {role!r}")
            out.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            arguments = item.get("arguments")
            call = {
                "id": str(item.get("call_id") or ""),
                "type": "function",
                "function": {
                    "name": str(item.get("name") or ""),
                    "arguments": arguments if isinstance(arguments, str) else "{}",
                },
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": str(item.get("call_id") or ""),
                    "content": _text(item.get("output"), f"{param}.output"),
                }
            )
        else:
            raise Unsupported(
                f"{param}.type",
                f"input items of type {kind!r} are not served (message, function_call, "
                "function_call_output)",
            )
    return out


def _text(content: Any, param: str) -> str:
    """A message's content as text: a string, or text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise Unsupported(param, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            texts.append(str(part.get("text") or ""))
        elif kind == "refusal":
            texts.append(str(part.get("refusal") or ""))
        else:
            raise Unsupported(f"{param}.{j}.type", f"content parts of type {kind!r}: text only")
    return "".join(texts)


def _tool(tool: dict[str, Any], param: str) -> dict[str, Any]:
    """A function tool as Chat Completions says it: its fields under ``function``, so the
    same function renders the same prompt through either API."""
    if tool.get("type") != "function":
        raise Unsupported(f"{param}.type", f"tools of type {tool.get('type')!r}: functions only")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise Unsupported(f"{param}.name", "a function tool needs a name")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def response(body: ResponsesRequest, answered: Answered, *, created: int) -> dict[str, Any]:
    """The answered call as a Response object."""
    content = answered.message.get("content") or ""
    calls = answered.message.get("tool_calls") or []
    status = "incomplete" if answered.finish == "length" else "completed"
    output: list[dict[str, Any]] = []
    if content or not calls:
        part: dict[str, Any] = {
            "type": "output_text",
            "text": content,
            "annotations": [],
            "logprobs": [],
        }
        output.append(
            {
                "type": "message",
                "id": f"msg_{answered.call_id.hex}",
                "status": status,
                "role": "assistant",
                "content": [part],
            }
        )
    for i, call in enumerate(calls):
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{answered.call_id.hex}_{i}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    usage = answered.usage
    extra = body.model_extra or {}
    return {
        "id": f"resp_{answered.call_id.hex}",
        "object": "response",
        "created_at": created,
        "completed_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions,
        "model": body.model or "policy",
        "output": output,
        "parallel_tool_calls": True
        if body.parallel_tool_calls is None
        else body.parallel_tool_calls,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "previous_response_id": None,
        "metadata": body.metadata or {},
        "text": extra.get("text") or {"format": {"type": "text"}},
        "truncation": "disabled",
        "store": False,  # nothing to fetch back by id: the call is the episode's record
        "background": False,
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
        "trainyard": answered.extension,
    }


async def events(response: dict[str, Any]) -> AsyncIterator[bytes]:
    """The Response as the Responses stream sends one: created, in progress, each output
    item (a message's text part and its text; a function call's arguments), then completed
    (or incomplete, at the token limit)."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> bytes:
        data = jsontext.dumpb({"type": kind, "sequence_number": next(numbers), **fields})
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    started = {
        **response,
        "status": "in_progress",
        "output": [],
        "usage": None,
        "completed_at": None,
        "incomplete_details": None,
    }
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    for index, item in enumerate(response["output"]):
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            part = item["content"][0]
            yield event(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "content": []},
            )
            yield event(
                "response.content_part.added", **where, content_index=0, part={**part, "text": ""}
            )
            if part["text"]:
                yield event(
                    "response.output_text.delta",
                    **where,
                    content_index=0,
                    delta=part["text"],
                    logprobs=[],
                )
            yield event(
                "response.output_text.done",
                **where,
                content_index=0,
                text=part["text"],
                logprobs=[],
            )
            yield event("response.content_part.done", **where, content_index=0, part=part)
        else:
            yield event(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "arguments": ""},
            )
            yield event("response.function_call_arguments.delta", **where, delta=item["arguments"])
            yield event(
                "response.function_call_arguments.done",
                **where,
                name=item["name"],
                arguments=item["arguments"],
            )
        yield event("response.output_item.done", output_index=index, item=item)
    final = "response.completed" if response["status"] == "completed" else "response.incomplete"
    yield event(final, response=response)
