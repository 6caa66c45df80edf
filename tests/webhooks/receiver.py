"""A real webhook receiver: an HTTP server on a local port that verifies every request's
Standard Webhooks signature with the ``standardwebhooks`` package, as a customer's would.

Each request is recorded (path, webhook-id, whether its signature verified, the parsed
body, the Host header) before it is answered, so once a delivery pass has returned, what it
sent is here. The port is chosen before the server starts, so a test can point a webhook at
it while nothing listens (the receiver "down") and start it later.
"""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from standardwebhooks import Webhook, WebhookVerificationError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Received:
    path: str
    webhook_id: str
    verified: bool
    body: dict[str, Any] | None
    answered: int
    host: str = ""  # the Host header


@dataclass
class Receiver:
    port: int = field(default_factory=free_port)
    #: The signing secret of each path's webhook (set once the webhook is created).
    secrets: dict[str, str] = field(default_factory=dict)
    #: Answers to give before answering 204 (500, 302 …), consumed in order.
    answers: list[int] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def acknowledged(self) -> list[Received]:
        """The requests answered 2xx: the ones a sender counts as delivered."""
        return [r for r in self.received if 200 <= r.answered < 300]

    def _handle(self, handler: BaseHTTPRequestHandler) -> int:
        body = handler.rfile.read(int(handler.headers.get("content-length", 0)))
        headers = {k: v for k, v in handler.headers.items()}
        secret = self.secrets.get(handler.path)
        parsed: dict[str, Any] | None = None
        verified = False
        if secret is not None:
            try:
                parsed = Webhook(secret).verify(body, headers)
                verified = True
            except WebhookVerificationError:
                parsed = json.loads(body)
        with self._lock:
            answer = self.answers.pop(0) if self.answers else 204
            if not verified:
                answer = 401
            self.received.append(
                Received(
                    handler.path,
                    headers.get("webhook-id", ""),
                    verified,
                    parsed,
                    answer,
                    handler.headers.get("host", ""),
                )
            )
        return answer

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                status = receiver._handle(self)
                self.send_response(status)
                if 300 <= status < 400:
                    self.send_header("location", receiver.url("/elsewhere"))
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
