"""Broken judges, on a real worker training the tiny model against a judge served over HTTP
(tests/support/llm.py): a judge that hangs, answers 500s or answers garbage is bounded by its
timeout, its groups are dropped and counted; a judge broken for whole steps fails the run
with the reason after ``grpo.max_dropped_steps`` of them, instead of training on nothing."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.llm import Reply, ScriptedLLM
from tests.support.runs import series, trajectory_keys, wait_for
from tests.support.workers import letter_rows, letters_run

pytestmark = pytest.mark.chaos


def _judge_like_char_fraction(body: dict[str, Any]) -> dict[str, Any]:
    user = body["messages"][-1]["content"]
    scores = [
        {"trajectory_id": tid, "explanation": "counted", "score": text.count("a") / 16}
        for tid, text in re.findall(r'<trajectory id="(\w+)">\n(.*?)\n</trajectory>', user, re.S)
    ]
    return {"scores": scores}


BROKEN = {
    "hangs": Reply(content={"scores": []}, delay=30),  # far past the judge's 1 s timeout
    "answers 500": Reply(status=500),
    "answers garbage": Reply(content="the rollouts are all lovely"),
}
REASONS = {"hangs": "timed out", "answers 500": "500", "answers garbage": "no JSON object found"}


def _ruler_run(model: Path, llm: ScriptedLLM, **grpo: Any) -> dict[str, Any]:
    judge = llm.endpoint("judge-small", timeout_s=1.0, max_retries=0)
    return letters_run(
        model,
        max_steps=4,
        reward={"type": "ruler", "judge": judge},
        grpo={"save_steps": 100, **grpo},
    )


@pytest.mark.parametrize("fault", list(BROKEN))
async def test_a_judge_broken_for_whole_steps_fails_the_run_with_the_reason(
    fault: str,
    client: Any,
    tenant: Any,
    sessionmaker: Any,
    start_worker: Any,
    tiny_model: Path,
    worker_home: dict[str, str],
    llm: ScriptedLLM,
) -> None:
    broken = BROKEN[fault]
    llm.handle(lambda body: broken)
    start_worker(**worker_home, TRAINYARD_LEASE_TTL_SECONDS="10")
    body = _ruler_run(tiny_model, llm, max_dropped_steps=2)
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=180
    )
    assert done.status == "failed"
    assert "every group of the last 2 steps was dropped" in (done.error or ""), done.error
    assert REASONS[fault] in (done.error or "")
    # Both steps' rollouts are stored, each once, with no reward and the judge's error.
    assert await trajectory_keys(sessionmaker, run["id"]) == letter_rows(2)
    page = await client.get(f"/runs/{run['id']}/trajectories", headers=tenant.headers)
    for trajectory in page.json()["data"]:
        assert trajectory["reward"] is None
        assert trajectory["reward_breakdown"]["ruler"]["dropped"] is True


async def test_dropped_groups_are_counted_and_the_run_goes_on(
    client: Any,
    tenant: Any,
    sessionmaker: Any,
    start_worker: Any,
    tiny_model: Path,
    worker_home: dict[str, str],
    llm: ScriptedLLM,
) -> None:
    """The first step's two groups meet a hanging judge and a 500: that step trains on
    nothing and says so (groups_dropped); the judge answers from then on."""
    llm.script(BROKEN["hangs"], BROKEN["answers 500"])
    llm.handle(_judge_like_char_fraction)
    start_worker(**worker_home, TRAINYARD_LEASE_TTL_SECONDS="10")
    body = _ruler_run(tiny_model, llm, max_dropped_steps=2)
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=180
    )
    assert done.status == "completed", done.error
    assert await trajectory_keys(sessionmaker, run["id"]) == letter_rows(4)
    dropped = dict(await series(sessionmaker, run["id"], "groups_dropped"))
    assert dropped == {1: 2.0, 2: 0.0, 3: 0.0, 4: 0.0}
