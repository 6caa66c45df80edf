"""Request body size limit, enforced before the body is read into memory.

A declared ``Content-Length`` over the limit is refused at once; a chunked body is counted
as it streams and cut off at the limit. Either way the answer is a 413 problem.

One limit covers every route (``max_body_bytes``) except the few that take uploads, which
name their own, larger one by method and exact path (``POST /datasets``); such a route
still checks what it reads against its own rules.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.core.errors import PROBLEM_JSON


class BodySizeLimit:
    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        routes: Mapping[tuple[str, str], int] | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        # (method, path) → that route's limit, in place of max_bytes.
        self.routes = dict(routes or {})

    def limit_for(self, scope: Scope) -> int:
        if not self.routes:
            return self.max_bytes
        path: str = scope.get("path", "")
        root: str = scope.get("root_path", "")
        if root and path.startswith(root):  # mounted under a prefix: match the app's own path
            path = path[len(root) :]
        return self.routes.get((scope.get("method", ""), path), self.max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = self.limit_for(scope)
        declared: int | None = None
        chunked = False
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > max_bytes:
                    await self._refuse(scope, send, max_bytes)
                    return
            elif name == b"transfer-encoding":
                chunked = True
        if not chunked and scope.get("http_version") in ("1.0", "1.1"):
            # HTTP/1's framing ends the body at the declared length (no length, no body):
            # only a chunked body needs counting, and no other request pays for it.
            await self.app(scope, receive, send)
            return
        seen = 0
        started = False
        refused = False

        async def limited_receive() -> Message:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > max_bytes:
                    # Answer now and make the app see a client that went away; whatever it
                    # sends afterwards is dropped.
                    refused = True
                    if not started:
                        await self._refuse(scope, send, max_bytes)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, limited_receive, guarded_send)

    async def _refuse(self, scope: Scope, send: Send, max_bytes: int) -> None:
        body = json.dumps(
            {
                "type": "about:blank",
                "title": "Content Too Large",
                "status": 413,
                "detail": f"Request bodies are limited to {max_bytes} bytes.",
                "instance": scope.get("path"),
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", PROBLEM_JSON.encode()),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


# --- limits on what a request may hold ----------------------------------------------------

# How deep a free-form JSON field (a run's config, an input's context, a reward function's
# args, a trajectory's metadata) may nest. pydantic's serializer gives up at 255 levels, and
# an answer must hold the field with the page and the run around it: what is accepted must
# be servable, so the API refuses deeper bodies with a 422 (app.core.storable).
MAX_JSON_DEPTH = 32
# How deep a stored value is served as it is: a free-form field at MAX_JSON_DEPTH sits a few
# levels inside its column (reward.functions[0].args), and the column inside a page. Deeper
# parts (rows from before the limit, or written around the API) are replaced by a marker,
# so that no row can break an answer.
MAX_SERVED_DEPTH = 2 * MAX_JSON_DEPTH
# The longest training input (an inline input, a dataset row, a generated input).
MAX_INPUT_CHARS = 32_000
# Rows of one dataset; also the most num_examples a run may ask for.
MAX_DATASET_ROWS = 100_000
# The most messages (or Responses input items) one gateway call and one finished episode may
# hold, and the most tools one call may offer.
MAX_CALL_MESSAGES = 10_000
MAX_CALL_TOOLS = 256
