"""Each episode's OpenAI-compatible endpoint: ``/gateway/episodes/{id}/v1``.

``POST …/chat/completions`` and ``POST …/responses`` (the Responses API, translated to the
Chat Completions request it means: app/gateway/responses_api.py), streamed or not, and
``GET …/models``, as the official SDKs call them, with the episode's token as the API key.
Every answer comes from the run's policy on its engine, through the worker that holds the
run (app/gateway/wire.py), and is recorded, with the engine's token ids, before it is sent.
Errors are OpenAI's error object (``{"error": {"message", "type", "param", "code"}}``), so
the SDKs raise their own exceptions; these routes are OpenAI's, not in /openapi.json.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from redis.exceptions import RedisError

from app.core import jsontext
from app.core.domain import Conflict, NotFound
from app.core.limits import MAX_CALL_MESSAGES, MAX_CALL_TOOLS
from app.gateway import responses_api, service, tokens
from app.observability import prometheus

router = APIRouter(prefix="/gateway/episodes/{episode_id}/v1", include_in_schema=False)

#: The longest a call waits for the policy beyond the episode's deadline guard.
MAX_CALL_SECONDS = 600.0


class ChatRequest(BaseModel):
    """The Chat Completions parameters the gateway reads; others are accepted and kept."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_CALL_MESSAGES)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_CALL_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(default=None, ge=1, le=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None


def openai_error(
    status: int, message: str, *, type_: str, code: str | None = None, param: str | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": param, "code": code}},
        status_code=status,
    )


def _token(request: Request, episode_id: uuid.UUID) -> str | JSONResponse:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    parsed = tokens.parse(value.strip()) if scheme.lower() == "bearer" else None
    if parsed is None:
        return openai_error(
            401,
            "Use the episode's token (tye_…) as the API key.",
            type_="authentication_error",
            code="invalid_api_key",
        )
    named, digest = parsed
    if named != episode_id:
        return openai_error(404, "Episode not found.", type_="not_found_error", code="not_found")
    return digest


def _domain_error(exc: Exception) -> JSONResponse:
    if isinstance(exc, NotFound):
        return openai_error(404, str(exc), type_="not_found_error", code="not_found")
    return openai_error(409, str(exc), type_="conflict_error", code="episode_not_open")


@router.get("/models")
async def models(episode_id: uuid.UUID, request: Request) -> Response:
    digest = _token(request, episode_id)
    if isinstance(digest, JSONResponse):
        return digest
    row = await request.app.state.pg.fetchrow(
        """SELECT r.model_name, extract(epoch FROM r.created_at)::bigint AS created
             FROM episodes e JOIN runs r ON r.id = e.run_id
            WHERE e.id = $1 AND e.token_hash = $2""",
        episode_id,
        digest,
    )
    if row is None:
        return openai_error(404, "Episode not found.", type_="not_found_error", code="not_found")
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": row["model_name"],
                    "object": "model",
                    "created": row["created"],
                    "owned_by": "trainyard",
                }
            ],
        }
    )


def _bad_request(message: str, param: str | None) -> JSONResponse:
    return openai_error(400, message, type_="invalid_request_error", param=param)


def _invalid(exc: ValidationError) -> JSONResponse:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    return _bad_request(f"{param}: {first['msg']}", param)


async def answer(
    request: Request, episode_id: uuid.UUID, digest: str, asked: dict[str, Any], started: float
) -> service.Answered | JSONResponse:
    """Check the token's claim, have the run's worker answer ``asked`` (a Chat Completions
    request; the worker numbers the claim's calls and holds them to max_calls) and record
    it: the answer, or OpenAI's error for the client."""
    pg = request.app.state.pg
    claims: service.Claims = request.app.state.claims
    try:
        claim = await claims.open(pg, episode_id, digest)
    except (NotFound, Conflict) as exc:
        return _domain_error(exc)
    call_id = uuid.uuid4()
    seconds = min(MAX_CALL_SECONDS, claim.seconds_left)
    try:
        reply = await request.app.state.gateway.ask(
            claim.run_id,
            {
                "kind": "call",
                "call_id": str(call_id),
                "episode_id": str(episode_id),
                "phase": claim.phase,
                "step": claim.step,
                "issue": claim.issued,
                "slot": claim.slot,
                "sent_at": time.time(),  # the worker's wait for its engine starts here
                "request": asked,
            },
            seconds,
            still_open=lambda: claims.recheck(pg, episode_id, digest),
        )
    except (NotFound, Conflict) as exc:  # the claim went while the call waited
        return _domain_error(exc)
    except RedisError as exc:  # the broker is down: the SDKs retry a 503
        return openai_error(
            503,
            f"The gateway cannot reach its broker now ({type(exc).__name__}); retry.",
            type_="server_error",
            code="broker_unavailable",
        )
    if reply is None:
        return openai_error(
            504,
            "The policy did not answer before the episode's deadline (is a worker training "
            "the run?).",
            type_="timeout_error",
            code="policy_timeout",
        )
    if not reply.get("ok"):
        status = int(reply.get("status", 500))
        if status == 409:  # the claim made its max_calls, its episode ended or its step is over
            return openai_error(
                409, str(reply.get("message")), type_="conflict_error", code="episode_not_open"
            )
        return openai_error(
            status,
            str(reply.get("message", "the engine failed")),
            type_="invalid_request_error" if status < 500 else "server_error",
        )
    message = _message(reply["message"], call_id)
    finish = "tool_calls" if message.get("tool_calls") else reply["finish_reason"]
    usage = {
        "prompt_tokens": len(reply["prompt_ids"]),
        "completion_tokens": len(reply["completion_ids"]),
        "total_tokens": len(reply["prompt_ids"]) + len(reply["completion_ids"]),
    }
    latency_ms = (time.monotonic() - started) * 1000
    prometheus.GATEWAY_CALL_SECONDS.labels("total").observe(latency_ms / 1000)
    for part in ("queued", "generation"):
        prometheus.GATEWAY_CALL_SECONDS.labels(part).observe(
            float(reply.get(f"{part}_ms") or 0.0) / 1000
        )
    prometheus.GATEWAY_TOKENS.labels("prompt").inc(usage["prompt_tokens"])
    prometheus.GATEWAY_TOKENS.labels("completion").inc(usage["completion_tokens"])
    try:
        await service.record_call(
            pg,
            claims,
            call_id=call_id,
            episode_id=episode_id,
            token_hash=digest,
            claim=claim,
            seq=int(reply["seq"]),  # the worker numbers the claim's calls
            request=asked,
            reply=reply,
            response={"message": message, "finish_reason": finish, "usage": usage},
            latency_ms=latency_ms,
        )
    except (NotFound, Conflict) as exc:  # the claim was taken back while the policy answered
        return _domain_error(exc)
    return service.Answered(
        call_id, message, finish, usage, int(reply["policy_version"]), episode_id
    )


@router.post("/chat/completions")
async def chat_completions(episode_id: uuid.UUID, request: Request) -> Response:
    started = time.monotonic()
    digest = _token(request, episode_id)
    if isinstance(digest, JSONResponse):
        return digest
    try:
        body = ChatRequest.model_validate_json(await request.body())
    except ValidationError as exc:
        return _invalid(exc)
    asked = body.model_dump(exclude_none=True, exclude={"stream", "stream_options"})
    if body.tool_choice == "none":
        asked.pop("tools", None)
    answered = await answer(request, episode_id, digest, asked, started)
    if isinstance(answered, JSONResponse):
        return answered
    created = int(time.time())
    model = body.model or "policy"
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(
            _chunks(answered, created, model, include_usage),
            media_type="text/event-stream",
            headers=answered.headers,
        )
    return Response(
        jsontext.dumpb(
            {
                "id": f"chatcmpl-{answered.call_id.hex}",
                "object": "chat.completion",
                "created": created,
                "model": model,
                "system_fingerprint": f"policy-{answered.policy_version}",
                "choices": [
                    {
                        "index": 0,
                        "message": answered.message,
                        "finish_reason": answered.finish,
                        "logprobs": None,
                    }
                ],
                "usage": answered.usage,
                "trainyard": answered.extension,
            }
        ),
        media_type="application/json",
        headers=answered.headers,
    )


@router.post("/responses")
async def responses(episode_id: uuid.UUID, request: Request) -> Response:
    """The Responses API, as the Chat Completions request it translates to
    (app/gateway/responses_api.py)."""
    started = time.monotonic()
    digest = _token(request, episode_id)
    if isinstance(digest, JSONResponse):
        return digest
    try:
        body = responses_api.ResponsesRequest.model_validate_json(await request.body())
        asked = responses_api.chat_request(body)
    except ValidationError as exc:
        return _invalid(exc)
    except responses_api.Unsupported as exc:
        return _bad_request(str(exc), exc.param)
    answered = await answer(request, episode_id, digest, asked, started)
    if isinstance(answered, JSONResponse):
        return answered
    response = responses_api.response(body, answered, created=int(time.time()))
    if body.stream:
        return StreamingResponse(
            responses_api.events(response),
            media_type="text/event-stream",
            headers=answered.headers,
        )
    return Response(
        jsontext.dumpb(response), media_type="application/json", headers=answered.headers
    )


def _message(parsed: dict[str, Any], call_id: uuid.UUID) -> dict[str, Any]:
    """The engine's parsed answer as OpenAI's assistant message."""
    calls = [
        {
            "id": f"call_{call_id.hex[:16]}_{i}",
            "type": "function",
            "function": {
                "name": c["name"],
                "arguments": c["arguments"]
                if isinstance(c["arguments"], str)
                else json.dumps(c["arguments"]),
            },
        }
        for i, c in enumerate(parsed.get("tool_calls") or [])
    ]
    message: dict[str, Any] = {"role": "assistant", "content": parsed.get("content") or None}
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return message


def _chunk(call_id: uuid.UUID, created: int, model: str, choices: list[Any], **extra: Any) -> bytes:
    body = {
        "id": f"chatcmpl-{call_id.hex}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
        **extra,
    }
    return b"data: " + jsontext.dumpb(body) + b"\n\n"


async def _chunks(
    answered: service.Answered, created: int, model: str, include_usage: bool
) -> AsyncIterator[bytes]:
    """The recorded answer as ``chat.completion.chunk`` events: the role, the content, each
    tool call, the finish reason, then (with ``include_usage``) the usage."""
    call_id, message = answered.call_id, answered.message

    def choice(
        delta: dict[str, Any], reason: Literal["stop", "length", "tool_calls"] | None = None
    ) -> list[Any]:
        return [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]

    yield _chunk(call_id, created, model, choice({"role": "assistant", "content": ""}))
    if message.get("content"):
        yield _chunk(call_id, created, model, choice({"content": message["content"]}))
    for i, call in enumerate(message.get("tool_calls") or []):
        yield _chunk(call_id, created, model, choice({"tool_calls": [{"index": i, **call}]}))
    yield _chunk(
        call_id,
        created,
        model,
        choice({}, answered.finish),  # type: ignore[arg-type]
        trainyard=answered.extension,
    )
    if include_usage:
        yield _chunk(call_id, created, model, [], usage=answered.usage)
    yield b"data: [DONE]\n\n"
