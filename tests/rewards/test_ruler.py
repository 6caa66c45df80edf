"""RULER against the scripted judge: mapping, retries, drops, prompts, endpoint choice."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from app.core.settings import Settings
from tests.support.llm import Reply, ScriptedLLM, free_port
from workers.llm import LLMUnavailable
from workers.rewards import Group, Rollout, make_scorer
from workers.rewards.ruler import DEFAULT_RUBRIC, RulerScorer
from workers.rewards.transcript import shared_prefix

SYSTEM = {"role": "system", "content": "You are terse."}
TRAJECTORY = re.compile(
    r'<trajectory id="(\w+)">\n<message role="assistant">\n(.*?)\n</message>\n</trajectory>',
    re.DOTALL,
)


def group(index: int, completions: list[str], context: dict[str, Any] | None = None) -> Group:
    prompt = [SYSTEM, {"role": "user", "content": f"question {index}"}]
    return Group(
        index=index,
        input_text=f"question {index}",
        context=context,
        rollouts=[Rollout(prompt, c) for c in completions],
    )


def trajectories(body: dict[str, Any]) -> dict[str, str]:
    """id -> completion, as the judge was shown them."""
    return dict(TRAJECTORY.findall(body["messages"][-1]["content"]))


def fair_judge(body: dict[str, Any]) -> dict[str, Any]:
    """Scores each trajectory by the number in its text ("s=0.7"), answering in reverse."""
    shown = trajectories(body)
    scores = [
        {
            "trajectory_id": tid,
            "explanation": f"saw {text}",
            "score": float(text.split("=")[1]),
        }
        for tid, text in shown.items()
    ]
    return {"scores": scores[::-1]}


def scorer(llm: ScriptedLLM, **judge: Any) -> RulerScorer:
    spec = {"type": "ruler", "judge": llm.endpoint(**judge), "temperature": 0.25}
    return RulerScorer(spec, settings=Settings(), backoff_s=0)


def test_scores_map_to_the_right_rollouts(llm: ScriptedLLM) -> None:
    llm.handle(fair_judge)
    groups = [group(0, ["s=0.1", "s=0.9", "s=0.5"]), group(1, ["s=0.3", "s=0.0"])]
    rows = scorer(llm).score(groups)
    assert [[s.reward for s in row] for row in rows] == [[0.1, 0.9, 0.5], [0.3, 0.0]]
    assert rows[0][1].breakdown == {
        "ruler": {"score": 0.9, "explanation": "saw s=0.9", "judge": "judge-small"}
    }
    assert len(llm.requests) == 2  # one call per group
    assert {r["temperature"] for r in llm.requests} == {0.25}


def test_judge_prompt_sends_the_shared_prefix_once(llm: ScriptedLLM) -> None:
    llm.handle(fair_judge)
    scorer(llm).score([group(0, ["s=0.1", "s=0.2", "s=0.3"], context={"answer": "42"})])
    (body,) = llm.requests
    system, user = body["messages"]
    assert DEFAULT_RUBRIC in system["content"]
    content = user["content"]
    assert content.count("question 0") == 1 and content.count("You are terse.") == 1
    assert content.index("<context>") < content.index('<trajectory id="1">')
    assert trajectories(body) == {"1": "s=0.1", "2": "s=0.2", "3": "s=0.3"}
    assert '"answer": "42"' in content  # the reference goes to the judge
    schema = body["response_format"]["json_schema"]
    assert schema["strict"] is True
    item = schema["schema"]["properties"]["scores"]["items"]
    assert item["properties"]["trajectory_id"]["enum"] == ["1", "2", "3"]


def test_custom_rubric(llm: ScriptedLLM) -> None:
    llm.handle(fair_judge)
    spec = {"type": "ruler", "judge": llm.endpoint(), "rubric": "Shorter is better."}
    RulerScorer(spec, settings=Settings(), backoff_s=0).score([group(0, ["s=1", "s=0"])])
    system = llm.requests[0]["messages"][0]["content"]
    assert "Shorter is better." in system and DEFAULT_RUBRIC not in system


def test_identical_rollouts_each_show_their_answer(llm: ScriptedLLM) -> None:
    llm.handle(fair_judge)
    rows = scorer(llm).score([group(0, ["s=0.5", "s=0.5"])])
    assert [s.reward for s in rows[0]] == [0.5, 0.5]
    assert trajectories(llm.requests[0]) == {"1": "s=0.5", "2": "s=0.5"}


def test_shared_prefix_stops_where_conversations_differ() -> None:
    a = [SYSTEM, {"role": "user", "content": "x"}, {"role": "assistant", "content": "1"}]
    b = [SYSTEM, {"role": "user", "content": "y"}, {"role": "assistant", "content": "2"}]
    assert shared_prefix([a, b]) == 1
    assert shared_prefix([a, a]) == 2  # each keeps at least its last message
    assert shared_prefix([]) == 0


@pytest.mark.parametrize(
    "bad",
    [
        {"scores": [{"trajectory_id": "1", "explanation": "", "score": 0.5}]},  # too few
        {
            "scores": [
                {"trajectory_id": "1", "explanation": "", "score": 0.5},
                {"trajectory_id": "7", "explanation": "", "score": 0.5},
            ]
        },  # unknown id
        {
            "scores": [
                {"trajectory_id": "1", "explanation": "", "score": 0.5},
                {"trajectory_id": "1", "explanation": "", "score": 0.6},
            ]
        },  # repeated id
        {
            "scores": [
                {"trajectory_id": "1", "explanation": "", "score": 5},
                {"trajectory_id": "2", "explanation": "", "score": 0.6},
            ]
        },  # out of range
        "I think trajectory 1 is better.",
        '{"scores": [{"trajectory_id": "1", "explanation": "fine", "score": 0.4}, {"traj',
    ],
)
def test_bad_answer_is_retried(llm: ScriptedLLM, bad: Any) -> None:
    llm.script(bad)
    llm.handle(fair_judge)
    rows = scorer(llm, max_retries=1).score([group(0, ["s=0.2", "s=0.8"])])
    assert [s.reward for s in rows[0]] == [0.2, 0.8]
    assert len(llm.requests) == 2


def test_lenient_answers_need_no_retry(llm: ScriptedLLM) -> None:
    answer = {
        "scores": [
            {"trajectory_id": 1, "explanation": "first\nline\x01", "score": 0.25},
            {"trajectory_id": "2", "explanation": "second", "score": "0.75"},
        ]
    }
    llm.script("```json\n" + json.dumps(answer) + "\n```")
    rows = scorer(llm, max_retries=0).score([group(0, ["a", "b"])])
    assert [s.reward for s in rows[0]] == [0.25, 0.75]
    assert rows[0][0].breakdown["ruler"]["explanation"] == "first\nline\x01"


def test_group_dropped_after_retries_others_scored(llm: ScriptedLLM) -> None:
    def judge(body: dict[str, Any]) -> Any:
        if "question 1" in body["messages"][-1]["content"]:
            return {"scores": []}  # never the right count
        return fair_judge(body)

    llm.handle(judge)
    ruler = scorer(llm, max_retries=2)
    groups = [group(0, ["s=0.4", "s=0.6"]), group(1, ["s=0.1", "s=0.2"]), group(2, ["s=1"])]
    rows = ruler.score(groups)
    assert [[s.reward for s in row] for row in rows] == [[0.4, 0.6], [None, None], [1.0]]
    assert rows[1][0].breakdown["ruler"]["dropped"] is True
    assert "expected one score for each of the ids" in rows[1][0].breakdown["ruler"]["error"]
    assert ruler.dropped_groups == 1
    bad_calls = [r for r in llm.requests if "question 1" in r["messages"][-1]["content"]]
    assert len(bad_calls) == 3  # 1 + max_retries
    ruler.score([group(1, ["s=0.1", "s=0.2"])])
    assert ruler.dropped_groups == 2  # counted over the scorer's life


def test_server_errors_drop_the_group_not_the_run(llm: ScriptedLLM) -> None:
    llm.handle(lambda body: Reply(status=500))
    ruler = scorer(llm, max_retries=1)
    rows = ruler.score([group(0, ["s=0.1", "s=0.2"])])
    assert [s.reward for s in rows[0]] == [None, None]
    assert "HTTP 500" in rows[0][0].breakdown["ruler"]["error"]
    assert len(llm.requests) == 2


def test_timeouts_drop_the_group(llm: ScriptedLLM) -> None:
    llm.handle(lambda body: Reply(content=fair_judge(body), delay=1.0))
    rows = scorer(llm, timeout_s=0.2, max_retries=0).score([group(0, ["s=0.1"])])
    assert rows[0][0].reward is None
    assert "timed out" in rows[0][0].breakdown["ruler"]["error"]


def test_groups_are_judged_concurrently_up_to_the_limit(llm: ScriptedLLM) -> None:
    llm.handle(lambda body: Reply(content=fair_judge(body), delay=0.3))
    groups = [group(i, ["s=0.5", "s=0.1"]) for i in range(5)]
    rows = scorer(llm, max_concurrency=2).score(groups)
    assert all([s.reward for s in row] == [0.5, 0.1] for row in rows)
    assert llm.max_in_flight == 2
    llm.reset()
    llm.handle(lambda body: Reply(content=fair_judge(body), delay=0.3))
    scorer(llm, max_concurrency=8).score(groups)
    assert llm.max_in_flight == 5


def test_empty_inputs(llm: ScriptedLLM) -> None:
    assert scorer(llm).score([]) == []
    assert scorer(llm).score([group(0, [])]) == [[]]
    assert llm.requests == []


# -- the endpoint: the run's judge or the workers' default --------------------------------


def test_default_judge_from_settings(llm: ScriptedLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_DEFAULT_JUDGE_KEY", "dk")
    settings = Settings(
        judge_base_url=llm.base_url,
        judge_model="judge-large",
        judge_api_key_env="TEST_DEFAULT_JUDGE_KEY",
    )
    llm.handle(fair_judge)
    ruler = RulerScorer({"type": "ruler"}, settings=settings, backoff_s=0)
    ruler.check()
    rows = ruler.score([group(0, ["s=0.3", "s=0.7"])])
    assert [s.reward for s in rows[0]] == [0.3, 0.7]
    assert llm.requests[0]["model"] == "judge-large"
    assert llm.headers[0]["authorization"] == "Bearer dk"


def test_run_judge_wins_over_the_default(llm: ScriptedLLM) -> None:
    settings = Settings(judge_base_url="http://elsewhere.invalid/v1", judge_model="x")
    llm.handle(fair_judge)
    spec = {"type": "ruler", "judge": llm.endpoint("judge-small")}
    RulerScorer(spec, settings=settings, backoff_s=0).score([group(0, ["s=1"])])
    assert llm.requests[0]["model"] == "judge-small"


def test_check_without_any_judge() -> None:
    ruler = RulerScorer({"type": "ruler"}, settings=Settings(judge_base_url=None, judge_model=None))
    with pytest.raises(LLMUnavailable, match="TRAINYARD_JUDGE_BASE_URL and TRAINYARD_JUDGE_MODEL"):
        ruler.check()
    half = RulerScorer(
        {"type": "ruler"}, settings=Settings(judge_base_url="http://h/v1", judge_model=None)
    )
    with pytest.raises(LLMUnavailable, match=r"\(TRAINYARD_JUDGE_MODEL unset\)"):
        half.check()


def test_check_unreachable_judge() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    ruler = RulerScorer(
        {"type": "ruler", "judge": {"base_url": url, "model": "m", "timeout_s": 2}},
        settings=Settings(),
    )
    with pytest.raises(LLMUnavailable, match=f"endpoint {re.escape(url)} is unreachable"):
        ruler.check()


def test_check_key_variable_unset(llm: ScriptedLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TEST_MISSING_KEY", raising=False)
    ruler = scorer(llm, api_key_env="TEST_MISSING_KEY")
    with pytest.raises(LLMUnavailable, match="TEST_MISSING_KEY is not set"):
        ruler.check()


def test_make_scorer_dispatch(llm: ScriptedLLM) -> None:
    from workers.rewards.rim import RimScorer

    assert isinstance(make_scorer({"type": "ruler", "judge": llm.endpoint()}), RulerScorer)
    assert isinstance(make_scorer({"type": "rim", "small_model": llm.endpoint()}), RimScorer)
    with pytest.raises(ValueError, match="unknown reward type 'nope'"):
        make_scorer({"type": "nope"})
