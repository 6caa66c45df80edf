"""A small synchronous client for OpenAI-compatible chat endpoints (vLLM, Ollama, OpenAI).

Synchronous on purpose: scorers are called from TRL's training thread, outside any event
loop, and fan out with a thread pool; ``httpx.Client`` is safe to share between threads
and its connection pool is sized to the endpoint's ``max_concurrency``.

One retry budget (``max_retries``) covers everything that may go better the second time:
transport errors and timeouts, 5xx, 408/409/425/429, and answers that do not parse or do not
have the expected shape. A 4xx other than those is a mistake in the request (wrong model
name, context too long) and is not retried. ``_post`` tells the two apart; ``_attempts`` is
the one loop.

The loop is ours, not a library's: httpx's transport retries cover failed connects only,
neither tenacity nor the openai SDK is a dependency, and the budget spans more than HTTP (an
answer that fails its schema or the caller's ``validate`` is tried again the same way, and
``Retry-After`` is honoured).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from workers.llm.parsing import JSONExtractionError, parse_json_object

T = TypeVar("T", bound=BaseModel)
R = TypeVar("R")

_RETRY_STATUS = frozenset({408, 409, 425, 429})
_MAX_BACKOFF_S = 30.0


class LLMError(RuntimeError):
    """Base of this module's errors."""


class LLMUnavailable(LLMError):
    """The endpoint cannot be used at all here (unreachable, key unset, model not served)."""


class LLMCallError(LLMError):
    """The call failed: transport error, timeout or HTTP error, after the retries."""


class LLMAnswerError(LLMError):
    """The endpoint answered, but never with a usable answer, after the retries."""


class AnswerRejected(ValueError):
    """Raised by a caller's ``validate`` hook: the answer parsed but is wrong (retried)."""


@dataclass(frozen=True)
class Endpoint:
    """Where and how to call a model: the fields of ``app.runs.spec.rewards.JudgeEndpoint``."""

    base_url: str
    model: str
    api_key_env: str | None = None
    timeout_s: float = 60.0
    max_concurrency: int = 8
    max_retries: int = 2
    max_tokens: int = 1024

    @classmethod
    def from_spec(cls, spec: Endpoint | Mapping[str, Any] | BaseModel) -> Endpoint:
        """From a JudgeEndpoint or its model_dump; unknown keys are ignored."""
        if isinstance(spec, Endpoint):
            return spec
        data = spec.model_dump() if isinstance(spec, BaseModel) else dict(spec)
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in data.items() if k in names and v is not None})

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/")

    def describe(self) -> str:
        return f"{self.model} at {self.url}"


class ChatClient:
    """Chat completions against one endpoint; close it (or use ``with``) when done."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        backoff_s: float = 0.5,
        sleep: Callable[[float], None] = time.sleep,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.backoff_s = backoff_s
        self._sleep = sleep
        limits = httpx.Limits(
            max_connections=endpoint.max_concurrency,
            max_keepalive_connections=endpoint.max_concurrency,
        )
        self._http = httpx.Client(
            timeout=httpx.Timeout(endpoint.timeout_s), limits=limits, transport=transport
        )

    def __enter__(self) -> ChatClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- configuration -------------------------------------------------------------------

    def headers(self) -> dict[str, str]:
        """Request headers; raises LLMUnavailable when the key's variable is unset."""
        env = self.endpoint.api_key_env
        if not env:
            return {}
        key = os.environ.get(env)
        if not key:
            raise LLMUnavailable(
                f"endpoint {self.endpoint.describe()}: the API key variable {env} is not set "
                "on this worker"
            )
        return {"Authorization": f"Bearer {key}"}

    def check(self) -> list[dict[str, Any]]:
        """Fail with the reason unless the endpoint answers and serves the model (any, when
        the endpoint names none); the models it lists.

        Asks ``GET /models`` (every OpenAI-compatible server has it): a refused connection,
        a timeout, 401/403 or a 5xx fail; a model list that lacks the model fails with the
        served names; a server without ``/models`` (404) is taken as reachable.
        """
        ep = self.endpoint
        headers = self.headers()
        try:
            response = self._http.get(f"{ep.url}/models", headers=headers)
        except httpx.HTTPError as exc:
            raise LLMUnavailable(
                f"endpoint {ep.url} is unreachable: {type(exc).__name__}: {exc}"
            ) from exc
        if response.status_code in (401, 403):
            why = (
                f"rejected the API key from {ep.api_key_env}"
                if ep.api_key_env
                else "wants an API key and none is configured (api_key_env is unset)"
            )
            raise LLMUnavailable(f"endpoint {ep.url} {why}: HTTP {response.status_code}")
        if response.status_code == 404:
            return []
        if response.status_code >= 400:
            raise LLMUnavailable(
                f"endpoint {ep.url} answered GET /models with HTTP {response.status_code}: "
                f"{response.text[:200]}"
            )
        try:
            listed = [dict(m) for m in response.json()["data"]]
            served = [str(m["id"]) for m in listed]
        except (ValueError, KeyError, TypeError):
            return []  # not a model list we understand; the endpoint answers, that is enough
        if served and ep.model and ep.model not in served and f"{ep.model}:latest" not in served:
            raise LLMUnavailable(
                f"endpoint {ep.url} does not serve the model {ep.model!r} "
                f"(it serves: {', '.join(served[:20])})"
            )
        return listed

    # -- calls ---------------------------------------------------------------------------

    def chat(
        self,
        messages: list[dict[str, str]],
        *,
        temperature: float = 0.0,
        max_tokens: int | None = None,
        response_format: dict[str, Any] | None = None,
        seed: int | None = None,
    ) -> str:
        """The assistant's text, retrying transport errors, 5xx and 429."""
        body = self._body(messages, temperature, max_tokens, response_format, seed)
        return self._attempts("/chat/completions", body, _chat_content(str))

    def structured(
        self,
        messages: list[dict[str, str]],
        *,
        name: str,
        schema: dict[str, Any],
        model: type[T],
        temperature: float = 0.0,
        max_tokens: int | None = None,
        seed: int | None = None,
        validate: Callable[[T], None] | None = None,
    ) -> T:
        """An answer under a JSON schema, parsed leniently and validated as ``model``.

        ``validate`` may raise AnswerRejected for answers that have the right shape but are
        wrong (e.g. unknown ids); they are retried like unparseable ones. Raises
        LLMCallError when the last attempt failed in transport, LLMAnswerError when it
        answered badly.
        """
        response_format = {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True},
        }
        body = self._body(messages, temperature, max_tokens, response_format, seed)

        def parse(text: str) -> T:
            value = model.model_validate(parse_json_object(text))
            if validate is not None:
                validate(value)
            return value

        return self._attempts("/chat/completions", body, _chat_content(parse))

    # -- internals -----------------------------------------------------------------------

    def post(self, path: str, body: dict[str, Any], parse: Callable[[Any], R]) -> R:
        """``parse`` of the JSON answer to ``POST <base_url><path>``, within the endpoint's
        retry budget (``parse`` raises AnswerRejected for an answer to ask again for): the
        other calls of OpenAI-compatible servers (vLLM's completions, its LoRA adapters),
        with the same timeouts, retries and errors as chat."""
        return self._attempts(path, body, parse)

    def _attempts(self, path: str, body: dict[str, Any], parse: Callable[[Any], R]) -> R:
        """``parse`` of the answer, within the endpoint's retry budget.

        Raises LLMCallError when the last attempt failed in transport, LLMAnswerError when
        it answered badly; the message lists every attempt's problem.
        """
        attempts = self.endpoint.max_retries + 1
        problems: list[str] = []
        for attempt in range(attempts):
            retry_after: float | None = None
            try:
                return parse(self._post(path, body))
            except _Retryable as exc:
                problems.append(str(exc))
                retry_after = exc.retry_after
                kind: type[LLMError] = LLMCallError
            except (JSONExtractionError, ValidationError, AnswerRejected) as exc:
                problems.append(_short(exc))
                kind = LLMAnswerError
            if attempt + 1 < attempts:
                self._backoff(attempt, retry_after)
        raise kind(
            f"{self.endpoint.describe()}: {problems[-1]} "
            f"(after {attempts} attempts: {'; '.join(problems)})"
        )

    def _body(
        self,
        messages: list[dict[str, str]],
        temperature: float,
        max_tokens: int | None,
        response_format: dict[str, Any] | None,
        seed: int | None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.endpoint.model,
            "messages": messages,
            "temperature": temperature,
            "max_tokens": max_tokens or self.endpoint.max_tokens,
        }
        if response_format is not None:
            body["response_format"] = response_format
        if seed is not None:
            body["seed"] = seed
        return body

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        """One call, its JSON answer (its text, if it is not JSON); raises _Retryable for what
        may pass next time, LLMCallError otherwise."""
        try:
            response = self._http.post(
                f"{self.endpoint.url}{path}", json=body, headers=self.headers()
            )
        except httpx.TimeoutException as exc:
            raise _Retryable(f"timed out after {self.endpoint.timeout_s}s") from exc
        except httpx.HTTPError as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
        status = response.status_code
        if status >= 500 or status in _RETRY_STATUS:
            raise _Retryable(
                f"HTTP {status}: {response.text[:200]}", _retry_after(response.headers)
            )
        if status >= 400:
            raise LLMCallError(f"{self.endpoint.describe()}: HTTP {status}: {response.text[:500]}")
        if "json" not in response.headers.get("content-type", ""):
            return response.text  # vLLM's LoRA endpoints answer in plain text
        try:
            return response.json()
        except ValueError as exc:
            raise _Retryable(f"malformed response body: {response.text[:200]}") from exc

    def _backoff(self, attempt: int, retry_after: float | None) -> None:
        if self.backoff_s <= 0 and retry_after is None:
            return
        delay = self.backoff_s * 2**attempt * (0.5 + random.random())
        if retry_after is not None:
            delay = max(delay, retry_after)
        self._sleep(min(delay, _MAX_BACKOFF_S))


def _chat_content(parse: Callable[[str], R]) -> Callable[[Any], R]:
    """``parse`` of a chat completion's text."""

    def parse_answer(answer: Any) -> R:
        try:
            choice = answer["choices"][0]
            content = choice["message"].get("content")
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise _Retryable(f"malformed response body: {str(answer)[:200]}") from exc
        if not isinstance(content, str):
            raise _Retryable(f"no text in the answer (finish_reason {choice.get('finish_reason')})")
        return parse(content)

    return parse_answer


class _Retryable(Exception):
    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def _retry_after(headers: httpx.Headers) -> float | None:
    try:
        value = float(headers.get("retry-after", ""))
    except ValueError:
        return None
    return value if value >= 0 else None


def _short(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "answer"
        return f"bad answer shape at {where}: {first['msg']} ({exc.error_count()} errors)"
    return str(exc)[:300]
