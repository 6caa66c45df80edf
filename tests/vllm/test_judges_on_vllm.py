"""RULER, RIM and input generation against a real vLLM server whose model knows nothing:
every answer is a malformed attempt at the schema. Nothing may raise or crash a run;
groups are dropped and counted, input generation fails with a reason."""

from __future__ import annotations

from typing import Any

import pytest

from workers.generation import InputGenerationError, generate_inputs
from workers.rewards.base import Group, Rollout
from workers.rewards.rim import RimScorer
from workers.rewards.ruler import RulerScorer


def _groups(n: int = 2) -> list[Group]:
    prompt = [{"role": "user", "content": "Say the letter a."}]
    return [
        Group(
            i,
            "Say the letter a.",
            {"answer": "a"},
            [Rollout(prompt, "a"), Rollout(prompt, "aaaa"), Rollout(prompt, "b")],
        )
        for i in range(n)
    ]


def _well_formed(scores: list[list[Any]], groups: list[Group]) -> None:
    assert [len(row) for row in scores] == [len(g.rollouts) for g in groups]
    for row in scores:
        rewards = [s.reward for s in row]
        # A group is scored whole or dropped whole.
        assert all(r is None for r in rewards) or all(0 <= r <= 1 for r in rewards)


def test_ruler_survives_a_real_servers_malformed_answers(vllm_server) -> None:
    scorer = RulerScorer({"type": "ruler", "judge": vllm_server}, backoff_s=0.05)
    scorer.check()
    groups = _groups()
    scores = scorer.score(groups)
    _well_formed(scores, groups)
    dropped = sum(1 for row in scores if row[0].reward is None)
    assert scorer.dropped_groups == dropped
    for row in scores:
        if row[0].reward is None:
            assert row[0].breakdown["ruler"]["dropped"] is True
            assert row[0].breakdown["ruler"]["error"]


def test_rim_survives_a_real_servers_malformed_answers(vllm_server) -> None:
    scorer = RimScorer(
        {
            "type": "rim",
            "small_model": vllm_server,
            "temperatures": [0.2, 0.8],
            "active_judges": {
                "accuracy": True,
                "helpfulness": True,
                "process": False,
                "diagnostic": False,
            },
        },
        backoff_s=0.05,
    )
    scorer.check()
    groups = _groups(1)
    scores = scorer.score(groups)
    _well_formed(scores, groups)
    rim = scores[0][0].breakdown["rim"]
    assert set(rim["judges"]) == {"accuracy", "helpfulness"}


def test_input_generation_gives_inputs_or_a_clear_reason(vllm_server) -> None:
    try:
        result = generate_inputs(
            vllm_server,
            "Ask short questions about the alphabet.",
            4,
            need_system_prompt=False,
            seed=0,
            backoff_s=0.05,
            max_calls=3,
        )
    except InputGenerationError as exc:
        assert "tiny at http://127.0.0.1" in str(exc)
    else:
        assert 2 <= len(result.inputs) <= 4
        assert len({i["input_text"] for i in result.inputs}) == len(result.inputs)


@pytest.mark.parametrize("kind", ["bad endpoint"])
def test_check_names_an_unreachable_judge(kind: str, vllm_server) -> None:
    from workers.llm import LLMUnavailable

    bad = {**vllm_server, "model": "no-such-model"}
    with pytest.raises(LLMUnavailable, match="no-such-model"):
        RulerScorer({"type": "ruler", "judge": bad}, backoff_s=0.05).check()
