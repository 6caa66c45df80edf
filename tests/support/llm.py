"""A scripted OpenAI-compatible server: a real HTTP server on 127.0.0.1, answers by script.

Tests say what each chat call answers (exact JSON, fenced or cut-off JSON, 500s, slow
answers), either as a queue consumed in order or as a function of the request (for
concurrent calls, whose order is not fixed), and read back every request it received.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route


@dataclass
class Reply:
    """One scripted answer: assistant ``content`` (a dict is sent as its JSON), or an
    HTTP ``status`` other than 200, or a raw ``body``; after ``delay`` seconds."""

    content: str | dict[str, Any] | None = None
    status: int = 200
    body: Any = None
    delay: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


Handler = Callable[[dict[str, Any]], "Reply | str | dict[str, Any]"]


class ScriptedLLM:
    def __init__(self) -> None:
        self.base_url = ""
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._generation = getattr(self, "_generation", 0) + 1  # late answers: ignored
            self.queue: deque[Reply | str | dict[str, Any]] = deque()
            self.handler: Handler | None = None
            self.requests: list[dict[str, Any]] = []
            self.headers: list[dict[str, str]] = []
            self.models: list[str] | None = ["judge-small", "judge-large", "gen"]
            self.models_status = 200
            self.in_flight = 0
            self.max_in_flight = 0  # the most chat calls answered at once

    def script(self, *replies: Reply | str | dict[str, Any]) -> None:
        """Answers for the next calls, in order (before the handler is asked)."""
        with self._lock:
            self.queue.extend(replies)

    def handle(self, handler: Handler) -> None:
        """Answers every call not covered by the queue from the request body."""
        self.handler = handler

    def _next(self, body: dict[str, Any]) -> Reply:
        with self._lock:
            reply = self.queue.popleft() if self.queue else None
        if reply is None:
            if self.handler is None:
                return Reply(status=599, body={"error": "nothing scripted for this call"})
            reply = self.handler(body)
        if isinstance(reply, Reply):
            return reply
        return Reply(content=reply)

    # -- the app ---------------------------------------------------------------------------

    async def _chat(self, request: Request) -> Response:
        body = await request.json()
        with self._lock:
            self.requests.append(body)
            self.headers.append(dict(request.headers))
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            generation = self._generation
        try:
            reply = self._next(body)
            if reply.delay:
                await asyncio.sleep(reply.delay)
        finally:
            with self._lock:
                if generation == self._generation:
                    self.in_flight -= 1
        if reply.body is not None:
            return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)
        if reply.status != 200:
            return PlainTextResponse(
                f"scripted {reply.status}", status_code=reply.status, headers=reply.headers
            )
        content = reply.content
        text = json.dumps(content) if isinstance(content, dict) else content
        return JSONResponse(
            {
                "id": "chatcmpl-test",
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                    }
                ],
            }
        )

    async def _models(self, request: Request) -> Response:
        if self.models is None:
            return PlainTextResponse("not found", status_code=404)
        if self.models_status != 200:
            return PlainTextResponse("no", status_code=self.models_status)
        return JSONResponse(
            {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]}
        )

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
            ]
        )

    # -- conveniences for tests --------------------------------------------------------------

    def endpoint(self, model: str = "judge-small", **overrides: Any) -> dict[str, Any]:
        """A JudgeEndpoint dict pointing here."""
        return {"base_url": self.base_url, "model": model, **overrides}

    def schema_names(self) -> list[str]:
        return [r["response_format"]["json_schema"]["name"] for r in self.requests]


def serve(llm: ScriptedLLM) -> Iterator[ScriptedLLM]:
    """Runs ``llm`` under uvicorn in a background thread on a free port of 127.0.0.1."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(llm.app(), log_level="warning", lifespan="off", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the scripted LLM server did not start")
        time.sleep(0.01)
    llm.base_url = f"http://127.0.0.1:{port}/v1"
    try:
        yield llm
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def ruler_by_share_of_a(body: dict[str, Any]) -> dict[str, Any]:
    """A RULER judge's answer (a :meth:`ScriptedLLM.handle` handler): every trajectory of the
    group scored by its answer's share of the letter 'a'."""
    import re

    user = body["messages"][-1]["content"]
    scores = []
    for tid, text in re.findall(r'<trajectory id="(\w+)">\n(.*?)\n</trajectory>', user, re.S):
        answer = re.sub(r"<[^>]+>", "", text).strip()
        fraction = answer.count("a") / len(answer) if answer else 0.0
        scores.append({"trajectory_id": tid, "explanation": "a share", "score": fraction})
    return {"scores": scores}


@pytest.fixture(scope="session")
def llm_server() -> Iterator[ScriptedLLM]:
    yield from serve(ScriptedLLM())


@pytest.fixture
def llm(llm_server: ScriptedLLM) -> Iterator[ScriptedLLM]:
    """The session's scripted server, with an empty script and history."""
    llm_server.reset()
    yield llm_server
    llm_server.reset()


def free_port() -> int:
    """A port nothing listens on (bound, then released), for unreachable endpoints."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def completion_of(body: dict[str, Any]) -> str:
    """The text between <response> tags of a RIM judge request (which rollout it is)."""
    user = body["messages"][-1]["content"]
    return user.split("<response>\n", 1)[1].split("\n</response>", 1)[0]
