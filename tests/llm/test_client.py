"""ChatClient against the scripted server: requests, retries, structured answers, check()."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from tests.support.llm import Reply, ScriptedLLM, free_port
from workers.llm import (
    AnswerRejected,
    ChatClient,
    Endpoint,
    LLMAnswerError,
    LLMCallError,
    LLMUnavailable,
)

SCHEMA = {
    "type": "object",
    "properties": {"value": {"type": "integer"}},
    "required": ["value"],
    "additionalProperties": False,
}


class Answer(BaseModel):
    value: int


def client(llm: ScriptedLLM, **overrides: Any) -> ChatClient:
    return ChatClient(Endpoint.from_spec(llm.endpoint(**overrides)), backoff_s=0)


def ask(c: ChatClient, **kwargs: object) -> Answer:
    return c.structured(
        [{"role": "user", "content": "hi"}],
        name="answer",
        schema=SCHEMA,
        model=Answer,
        **kwargs,  # type: ignore[arg-type]
    )


def test_structured_request_and_answer(llm: ScriptedLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_JUDGE_KEY", "sekret")
    llm.script({"value": 7})
    with client(llm, api_key_env="TEST_JUDGE_KEY", max_tokens=99) as c:
        assert ask(c, temperature=0.3, seed=5) == Answer(value=7)
    (body,) = llm.requests
    assert body["model"] == "judge-small"
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["temperature"] == 0.3
    assert body["max_tokens"] == 99
    assert body["seed"] == 5
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
    }
    assert llm.headers[0]["authorization"] == "Bearer sekret"


def test_no_key_no_authorization_header(llm: ScriptedLLM) -> None:
    llm.script({"value": 1})
    with client(llm) as c:
        ask(c)
    assert "authorization" not in llm.headers[0]


@pytest.mark.parametrize(
    "content",
    [
        '```json\n{"value": 3}\n```',
        'Here you go: {"value": 3}. Anything else?',
        '{"value": 3, "note": "line\nbreak\x02"}',
        '{"value": "3"}',  # lax: a numeric string is a number
        '{"value": 3, "extra": {"nested": [1, 2',  # cut off after the field we need
    ],
)
def test_lenient_answers(llm: ScriptedLLM, content: str) -> None:
    llm.script(content)
    with client(llm, max_retries=0) as c:
        assert ask(c).value == 3


def test_bad_answers_are_retried_then_typed_error(llm: ScriptedLLM) -> None:
    llm.script("not json at all", '{"value": "three"}', '{"other": 1}')
    with client(llm, max_retries=2) as c, pytest.raises(LLMAnswerError) as err:
        ask(c)
    assert len(llm.requests) == 3
    message = str(err.value)
    assert "after 3 attempts" in message
    assert "no JSON object" in message and "value" in message


def test_bad_answer_then_good_one(llm: ScriptedLLM) -> None:
    llm.script('{"value": ', {"value": 4})
    with client(llm, max_retries=1) as c:
        assert ask(c).value == 4
    assert len(llm.requests) == 2


def test_validate_hook_rejections_are_retried(llm: ScriptedLLM) -> None:
    def odd(answer: Answer) -> None:
        if answer.value % 2 == 0:
            raise AnswerRejected(f"{answer.value} is even")

    llm.script({"value": 2}, {"value": 5})
    with client(llm, max_retries=1) as c:
        assert ask(c, validate=odd).value == 5
    llm.reset()
    llm.script({"value": 2}, {"value": 4})
    with client(llm, max_retries=1) as c, pytest.raises(LLMAnswerError, match="4 is even"):
        ask(c, validate=odd)


@pytest.mark.parametrize("status", [500, 502, 503, 429, 408])
def test_transient_http_errors_are_retried(llm: ScriptedLLM, status: int) -> None:
    llm.script(Reply(status=status), Reply(status=status), {"value": 1})
    with client(llm, max_retries=2) as c:
        assert ask(c).value == 1
    assert len(llm.requests) == 3


def test_transient_errors_exhaust_the_retries(llm: ScriptedLLM) -> None:
    llm.script(*[Reply(status=500)] * 3)
    with client(llm, max_retries=2) as c, pytest.raises(LLMCallError, match="HTTP 500"):
        ask(c)
    assert len(llm.requests) == 3


def test_client_errors_are_not_retried(llm: ScriptedLLM) -> None:
    llm.script(Reply(status=400, body={"error": "model 'nope' does not exist"}))
    with client(llm, max_retries=3) as c, pytest.raises(LLMCallError, match=r"HTTP 400.*nope"):
        ask(c)
    assert len(llm.requests) == 1


def test_retry_after_is_honoured(llm: ScriptedLLM) -> None:
    slept: list[float] = []
    llm.script(Reply(status=429, headers={"Retry-After": "2"}), {"value": 1})
    ep = Endpoint.from_spec(llm.endpoint())
    with ChatClient(ep, backoff_s=0, sleep=slept.append) as c:
        assert ask(c).value == 1
    assert slept == [2.0]


def test_backoff_grows(llm: ScriptedLLM) -> None:
    slept: list[float] = []
    llm.script(Reply(status=500), Reply(status=500), Reply(status=500), {"value": 1})
    ep = Endpoint.from_spec(llm.endpoint(max_retries=3))
    with ChatClient(ep, backoff_s=1.0, sleep=slept.append) as c:
        assert ask(c).value == 1
    assert len(slept) == 3
    # base * 2**attempt, jittered by a factor in [0.5, 1.5)
    for attempt, delay in enumerate(slept):
        assert 0.5 * 2**attempt <= delay < 1.5 * 2**attempt


def test_malformed_response_body_is_retried(llm: ScriptedLLM) -> None:
    llm.script(Reply(body={"choices": []}), Reply(body={"nope": 1}), {"value": 1})
    with client(llm, max_retries=2) as c:
        assert ask(c).value == 1


def test_slow_answer_times_out_and_is_retried(llm: ScriptedLLM) -> None:
    llm.script(Reply(content={"value": 1}, delay=2.0), {"value": 2})
    with client(llm, timeout_s=0.3, max_retries=1) as c:
        assert ask(c).value == 2  # the retry's answer: the slow one was given up on
    assert len(llm.requests) == 2
    # The retry reached the server while it still held back the first answer: the client
    # gave up at its timeout rather than after the 2 s delay.
    assert llm.max_in_flight == 2


def test_slow_answers_exhaust_the_retries(llm: ScriptedLLM) -> None:
    llm.script(Reply(content={"value": 1}, delay=2.0), Reply(content={"value": 1}, delay=2.0))
    with (
        client(llm, timeout_s=0.2, max_retries=1) as c,
        pytest.raises(LLMCallError, match=r"timed out after 0\.2s"),
    ):
        ask(c)


def test_chat_returns_plain_text(llm: ScriptedLLM) -> None:
    llm.script(Reply(status=503), "hello there")
    with client(llm, max_retries=1) as c:
        assert c.chat([{"role": "user", "content": "hi"}]) == "hello there"
    assert "response_format" not in llm.requests[-1]


def test_unset_key_variable_fails_calls_clearly(
    llm: ScriptedLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TEST_MISSING_KEY", raising=False)
    with (
        client(llm, api_key_env="TEST_MISSING_KEY") as c,
        pytest.raises(LLMUnavailable, match="TEST_MISSING_KEY is not set"),
    ):
        ask(c)
    assert llm.requests == []


# -- check() -------------------------------------------------------------------------------


def test_check_passes(llm: ScriptedLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_JUDGE_KEY", "k")
    with client(llm, api_key_env="TEST_JUDGE_KEY") as c:
        c.check()
    llm.models = None  # a server without /models is taken as reachable
    with client(llm) as c:
        c.check()
    assert llm.requests == []  # check() spends no chat call


def test_check_unreachable() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    ep = Endpoint(base_url=url, model="m", timeout_s=2)
    with ChatClient(ep) as c, pytest.raises(LLMUnavailable, match=f"endpoint {url} is unreachable"):
        c.check()


def test_check_key_variable_unset(llm: ScriptedLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TEST_MISSING_KEY", raising=False)
    with (
        client(llm, api_key_env="TEST_MISSING_KEY") as c,
        pytest.raises(LLMUnavailable, match=r"API key variable TEST_MISSING_KEY is not set"),
    ):
        c.check()


def test_check_key_rejected(llm: ScriptedLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_JUDGE_KEY", "wrong")
    llm.models_status = 401
    with (
        client(llm, api_key_env="TEST_JUDGE_KEY") as c,
        pytest.raises(LLMUnavailable, match="rejected the API key from TEST_JUDGE_KEY"),
    ):
        c.check()
    with client(llm) as c, pytest.raises(LLMUnavailable, match="api_key_env is unset"):
        c.check()


def test_check_model_not_served(llm: ScriptedLLM) -> None:
    with (
        client(llm, model="other") as c,
        pytest.raises(LLMUnavailable, match=r"does not serve the model 'other'.*judge-small"),
    ):
        c.check()
    llm.models = ["llama3:latest"]  # Ollama's names
    with client(llm, model="llama3") as c:
        c.check()


def test_check_server_error(llm: ScriptedLLM) -> None:
    llm.models_status = 503
    with client(llm) as c, pytest.raises(LLMUnavailable, match="HTTP 503"):
        c.check()


def test_chat_shares_the_retry_budget_and_its_verdicts(llm: ScriptedLLM) -> None:
    llm.script(Reply(status=503), Reply(status=502))
    with client(llm, max_retries=1) as c, pytest.raises(LLMCallError) as err:
        c.chat([{"role": "user", "content": "hi"}])
    assert len(llm.requests) == 2
    assert "HTTP 502" in str(err.value) and "after 2 attempts: HTTP 503" in str(err.value)
    llm.reset()
    llm.script(Reply(status=404, body={"error": "no such model"}))
    with client(llm, max_retries=3) as c, pytest.raises(LLMCallError, match="HTTP 404"):
        c.chat([{"role": "user", "content": "hi"}])
    assert len(llm.requests) == 1
