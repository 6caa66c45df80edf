"""The SDK's client: the API's REST routes over httpx, each episode's model calls over the
``openai`` SDK (its base URL and key come with the episode)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

TERMINAL = frozenset({"completed", "failed", "cancelled"})
#: The most episodes one claim takes (the API's ``MAX_CLAIM``, app/gateway/schemas.py).
MAX_CLAIM = 64
_RETRY_STATUSES = frozenset({502, 503, 504})


class TrainyardError(Exception):
    """An answer the SDK cannot go on from: the API's problem (``status``, ``problem``)."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        self.status = status
        self.problem = problem
        super().__init__(f"{status}: {problem.get('detail') or problem.get('title') or problem}")


class Client:
    """An API key's view of one Trainyard service (use ``async with``)."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float = 60.0,
        retries: int = 5,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self._http = http or httpx.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=timeout,
            # Connection failures are retried by httpx's transport; answers by _request.
            transport=httpx.AsyncHTTPTransport(retries=retries),
        )
        self._model_http: httpx.AsyncClient | None = None
        self._sync_model_http: httpx.Client | None = None
        self._sync_lock = threading.Lock()

    def model_http(self) -> httpx.AsyncClient:
        """The connection pool every episode's ``AsyncOpenAI`` shares (the openai SDK's
        default client, made once): an ``AsyncOpenAI`` of its own per episode would cost
        about 30 ms of CPU (its SSL context) and a new connection to the gateway each."""
        if self._model_http is None:
            from openai import DefaultAsyncHttpxClient

            self._model_http = DefaultAsyncHttpxClient()
        return self._model_http

    def sync_model_http(self) -> httpx.Client:
        """The blocking connection pool every episode's ``OpenAI`` shares, made once by the
        first thread that asks (an ``httpx.Client`` may be shared between threads)."""
        with self._sync_lock:
            if self._sync_model_http is None:
                from openai import DefaultHttpxClient

                self._sync_model_http = DefaultHttpxClient()
            return self._sync_model_http

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *_: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()
        if self._model_http is not None:
            await self._model_http.aclose()
        if self._sync_model_http is not None:
            self._sync_model_http.close()

    async def _request(
        self, method: str, path: str, *, token: str | None = None, **kwargs: Any
    ) -> Any:
        """The answer's JSON; 502/503/504 and 429 are retried with backoff (Retry-After
        honoured), any other error raises :class:`TrainyardError`."""
        if token is not None:
            kwargs["headers"] = {"Authorization": f"Bearer {token}"}
        delay = 0.5
        for attempt in range(self.retries + 1):
            answer = await self._http.request(method, path, **kwargs)
            retry = answer.status_code in _RETRY_STATUSES or answer.status_code == 429
            if answer.is_success or not retry or attempt == self.retries:
                break
            wait = float(answer.headers.get("Retry-After") or delay)
            await asyncio.sleep(min(wait, 30.0))
            delay = min(delay * 2, 10.0)
        if not answer.is_success:
            try:
                problem = answer.json()
            except json.JSONDecodeError:
                problem = {"detail": answer.text[:500]}
            raise TrainyardError(answer.status_code, problem)
        return answer.json() if answer.content else None

    # -- runs ----------------------------------------------------------------------------------
    async def create_run(self, body: dict[str, Any], *, idempotency_key: str | None = None) -> Run:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        data = await self._request("POST", "/runs", json=body, headers=headers)
        return Run(self, data)

    async def get_run(self, run_id: str) -> Run:
        return Run(self, await self._request("GET", f"/runs/{run_id}"))

    async def list_runs(self, **filters: Any) -> list[Run]:
        page = await self._request("GET", "/runs", params=filters)
        return [Run(self, item) for item in page["data"]]


@dataclass
class Run:
    """A run as last read (``data``); :meth:`refresh` reads it again."""

    client: Client
    data: dict[str, Any]

    @property
    def id(self) -> str:
        return str(self.data["id"])

    @property
    def status(self) -> str:
        return str(self.data["status"])

    async def refresh(self) -> Run:
        self.data = await self.client._request("GET", f"/runs/{self.id}")
        return self

    async def follow(self, every: float = 2.0) -> AsyncIterator[Run]:
        """The run each time it changes, until it ends (conditional GETs: a 304 is free)."""
        etag: str | None = None
        while True:
            headers = {"If-None-Match": etag} if etag else None
            answer = await self.client._http.get(f"/runs/{self.id}", headers=headers)
            if answer.status_code == 200:
                etag = answer.headers.get("ETag")
                self.data = answer.json()
                yield self
                if self.status in TERMINAL:
                    return
            elif answer.status_code != 304:
                raise TrainyardError(answer.status_code, answer.json())
            await asyncio.sleep(every)

    async def episodes(
        self, *, concurrency: int = 8, wait_seconds: float = 20.0
    ) -> AsyncIterator[Episode]:
        """The run's episodes as harnesses should take them: claimed (a long poll) only
        while fewer than ``concurrency`` of those handed out are unfinished, so a slow
        harness never holds more than it plays (claimed :data:`MAX_CLAIM` at a time at
        most). Ends when the run does."""
        free = asyncio.Semaphore(concurrency)
        while True:
            await free.acquire()  # at least one slot before asking
            n = 1
            while n < min(concurrency, MAX_CLAIM) and not free.locked():
                await free.acquire()
                n += 1
            answer = await self.client._request(
                "POST",
                f"/runs/{self.id}/episodes/claim",
                json={"max": n, "wait_seconds": wait_seconds},
            )
            claimed = answer["episodes"]
            for _ in range(n - len(claimed)):
                free.release()
            for item in claimed:
                yield Episode(self.client, item, free)
            if not claimed and answer["run_status"] in TERMINAL:
                return

    async def play(
        self,
        rollout: Callable[[Episode], Awaitable[float | None]],
        *,
        concurrency: int = 8,
    ) -> None:
        """Play every episode with ``rollout`` (``concurrency`` at once) until the run
        ends: its return value is the reward; an exception fails the episode with its text."""
        tasks: set[asyncio.Task[None]] = set()

        async def one(episode: Episode) -> None:
            try:
                reward = await rollout(episode)
            except Exception as exc:  # the harness's failure, reported, never the loop's
                if not episode.ended:
                    await episode.fail(f"{type(exc).__name__}: {exc}")
                return
            if not episode.ended:
                await episode.finish(reward=reward)

        async for episode in self.episodes(concurrency=concurrency):
            task = asyncio.create_task(one(episode))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class Episode:
    """One claimed episode: its input, its OpenAI endpoint, and its finish."""

    client: Client
    data: dict[str, Any]
    _slot: asyncio.Semaphore | None = None
    ended: bool = field(default=False)

    @property
    def id(self) -> str:
        return str(self.data["id"])

    @property
    def input(self) -> dict[str, Any]:
        """``id``, ``text`` and ``context`` of the run's input."""
        return dict(self.data["input"])

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The run's prompt: its system prompt, if any, then the input as the user's turn."""
        return [dict(m) for m in self.data["messages"]]

    @property
    def base_url(self) -> str:
        return str(self.data["base_url"])

    @property
    def token(self) -> str:
        return str(self.data["token"])

    def openai_client(self, **kwargs: Any) -> Any:
        """An ``openai.AsyncOpenAI`` bound to this episode (its base URL, its token), on the
        connection pool its :class:`Client`'s episodes share (``http_client=`` for another)."""
        from openai import AsyncOpenAI

        kwargs.setdefault("http_client", self.client.model_http())
        return AsyncOpenAI(base_url=self.base_url, api_key=self.token, **kwargs)

    def sync_openai_client(self, **kwargs: Any) -> Any:
        """An ``openai.OpenAI`` (blocking, for a harness's threads) bound to this episode, on
        the blocking connection pool its :class:`Client`'s episodes share (``http_client=``
        for another)."""
        from openai import OpenAI

        kwargs.setdefault("http_client", self.client.sync_model_http())
        return OpenAI(base_url=self.base_url, api_key=self.token, **kwargs)

    async def finish(
        self,
        reward: float | None,
        *,
        metrics: dict[str, float] | None = None,
        messages: list[dict[str, Any]] | None = None,
    ) -> None:
        """End the episode with its reward (None: no reward; the rollout is dropped)."""
        body: dict[str, Any] = {"reward": reward, "metrics": metrics or {}}
        if messages is not None:
            body["messages"] = messages
        await self._end("finish", body)

    async def fail(self, error: str) -> None:
        """End the episode as failed: no reward, not handed out again."""
        await self._end("fail", {"error": error[:4000] or "failed"})

    async def _end(self, verb: str, body: dict[str, Any]) -> None:
        try:
            await self.client._request(
                "POST", f"/episodes/{self.id}/{verb}", json=body, token=self.token
            )
        finally:
            self.ended = True
            if self._slot is not None:
                self._slot.release()
                self._slot = None
