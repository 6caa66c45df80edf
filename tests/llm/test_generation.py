"""Input generation against the scripted server: batches, dedup, retries, system prompt."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.support.llm import Reply, ScriptedLLM, free_port
from workers.generation import InputGenerationError, generate_inputs, normalise

TASK = "Answer arithmetic questions with a single number."


def asked_count(body: dict[str, Any]) -> int:
    match = re.search(r"Write (\d+) new", body["messages"][-1]["content"])
    assert match, body
    return int(match.group(1))


def items(*texts: str) -> dict[str, Any]:
    return {"inputs": [{"input_text": t} for t in texts]}


class Counter:
    """Answers input calls with fresh questions (q0, q1, ...), as many as asked for."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, body: dict[str, Any]) -> Any:
        name = body["response_format"]["json_schema"]["name"]
        if name == "system_prompt":
            return {"system_prompt": "  You answer with one number.  "}
        out = []
        for _ in range(asked_count(body)):
            out.append(f"What is {self.n} + 1?")
            self.n += 1
        return items(*out)


def test_batches_system_prompt_and_seeds(llm: ScriptedLLM) -> None:
    llm.handle(Counter())
    result = generate_inputs(
        llm.endpoint("gen"), TASK, 25, need_system_prompt=True, seed=100, backoff_s=0
    )
    assert [i["input_text"] for i in result.inputs] == [f"What is {n} + 1?" for n in range(25)]
    assert all(i["context"] is None for i in result.inputs)
    assert result.system_prompt == "You answer with one number."
    assert llm.schema_names() == ["system_prompt", *["training_inputs"] * 3]
    assert [asked_count(b) for b in llm.requests[1:]] == [10, 10, 5]
    assert [b["seed"] for b in llm.requests] == [100, 101, 102, 103]
    assert TASK in llm.requests[1]["messages"][0]["content"]
    # Later calls are shown what exists, to look elsewhere.
    assert "exist already" not in llm.requests[1]["messages"][0]["content"]
    assert "What is 9 + 1?" in llm.requests[2]["messages"][0]["content"]
    assert result.calls == 3 and result.bad_answers == 0 and result.duplicates == 0


def test_no_system_prompt_unless_asked(llm: ScriptedLLM) -> None:
    llm.handle(Counter())
    result = generate_inputs(llm.endpoint("gen"), TASK, 3, need_system_prompt=False, seed=0)
    assert result.system_prompt is None
    assert llm.schema_names() == ["training_inputs"]


def test_deduplicates_on_normalised_text(llm: ScriptedLLM) -> None:
    llm.script(
        items("What is 2+2?", "what is 2+2", "  WHAT  IS 2+2 ?!", "What is 3+3?", "", "   "),
        items("What is 3+3", "What is 4+4?"),
        items("What is 5+5?"),
    )
    result = generate_inputs(
        llm.endpoint("gen"), TASK, 4, need_system_prompt=False, seed=0, backoff_s=0
    )
    assert [i["input_text"] for i in result.inputs] == [
        "What is 2+2?",
        "What is 3+3?",
        "What is 4+4?",
        "What is 5+5?",
    ]
    assert result.duplicates == 3


def test_normalise() -> None:
    assert normalise("  Ｗhat  is\n2+2 ?! ") == normalise("what is 2+2") == "what is 2+2"
    assert normalise("...") == ""


def test_stops_at_num_examples(llm: ScriptedLLM) -> None:
    llm.script(items("a1", "a2", "a3", "a4", "a5"))
    result = generate_inputs(llm.endpoint("gen"), TASK, 3, need_system_prompt=False, seed=0)
    assert [i["input_text"] for i in result.inputs] == ["a1", "a2", "a3"]
    assert len(llm.requests) == 1


def test_bad_answers_are_retried(llm: ScriptedLLM) -> None:
    llm.script(
        "Sure, here are some inputs!",  # retried by the client
        '```json\n{"inputs": [{"input_text": "q1"}, {"input_text": "q2"}]}\n```',
        '{"inputs": [{"input_text": "q3"}, {"input_t',  # cut off: q3 kept
    )
    result = generate_inputs(
        llm.endpoint("gen", max_retries=1), TASK, 3, need_system_prompt=False, seed=0, backoff_s=0
    )
    assert [i["input_text"] for i in result.inputs] == ["q1", "q2", "q3"]
    assert result.bad_answers == 0 and len(llm.requests) == 3


def test_a_call_that_never_answers_well_costs_one_attempt(llm: ScriptedLLM) -> None:
    llm.script("nope", "still nope", items("q1", "q2"))
    result = generate_inputs(
        llm.endpoint("gen", max_retries=1), TASK, 2, need_system_prompt=False, seed=0, backoff_s=0
    )
    assert [i["input_text"] for i in result.inputs] == ["q1", "q2"]
    assert result.bad_answers == 1 and result.calls == 2


def test_returns_fewer_when_above_the_minimum(llm: ScriptedLLM) -> None:
    llm.handle(lambda body: items("a", "b", "c", "d", "e", "f"))
    result = generate_inputs(
        llm.endpoint("gen"), TASK, 10, need_system_prompt=False, seed=0, max_calls=4
    )
    assert len(result.inputs) == 6
    assert result.calls == 4 and result.duplicates == 18


def test_fails_clearly_below_the_minimum(llm: ScriptedLLM) -> None:
    llm.handle(lambda body: items("same", "Same."))
    with pytest.raises(InputGenerationError) as err:
        generate_inputs(llm.endpoint("gen"), TASK, 10, need_system_prompt=False, seed=0)
    message = str(err.value)
    assert "generated only 1 distinct inputs of the 10 asked for (at least 5 needed)" in message
    assert "in 5 calls" in message  # 2 * 1 batch + 3
    assert "duplicates" in message


def test_unreachable_endpoint_fails_at_once() -> None:
    endpoint = {"base_url": f"http://127.0.0.1:{free_port()}/v1", "model": "m", "max_retries": 0}
    with pytest.raises(InputGenerationError, match="ConnectError"):
        generate_inputs(endpoint, TASK, 5, need_system_prompt=False, seed=0)


def test_http_errors_fail_at_once(llm: ScriptedLLM) -> None:
    llm.handle(lambda body: Reply(status=500))
    with pytest.raises(InputGenerationError, match="HTTP 500"):
        generate_inputs(
            llm.endpoint("gen", max_retries=1),
            TASK,
            5,
            need_system_prompt=False,
            seed=0,
            backoff_s=0,
        )
    assert len(llm.requests) == 2


def test_key_variable_unset(llm: ScriptedLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TEST_MISSING_KEY", raising=False)
    with pytest.raises(InputGenerationError, match="TEST_MISSING_KEY is not set"):
        generate_inputs(
            llm.endpoint("gen", api_key_env="TEST_MISSING_KEY"),
            TASK,
            5,
            need_system_prompt=False,
            seed=0,
        )


def test_empty_system_prompt_is_retried_then_fails(llm: ScriptedLLM) -> None:
    llm.script({"system_prompt": "   "}, {"system_prompt": "Be exact."})
    llm.handle(Counter())
    result = generate_inputs(
        llm.endpoint("gen", max_retries=1), TASK, 1, need_system_prompt=True, seed=0, backoff_s=0
    )
    assert result.system_prompt == "Be exact."
    llm.reset()
    llm.handle(lambda body: {"system_prompt": ""})
    with pytest.raises(InputGenerationError, match="could not generate a system prompt"):
        generate_inputs(
            llm.endpoint("gen", max_retries=1),
            TASK,
            1,
            need_system_prompt=True,
            seed=0,
            backoff_s=0,
        )
