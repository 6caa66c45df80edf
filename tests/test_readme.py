"""The README's status paragraph against the run schema: what it says exists is there, and
what it calls "Not yet" is still refused by the API.

The status once listed a vLLM server and several ranks per run as "Not yet" long after both
shipped. Here every "Not yet" item must come with a run body that shows the gap (the API
refuses it, for that reason): when the gap closes, the body is accepted and this test fails
until the README stops calling it missing.
"""

from __future__ import annotations

import re
import uuid
from typing import Any, get_args

import pytest
from pydantic import ValidationError

from app.runs.spec.body import RunCreate
from app.runs.spec.grpo import GrpoSettings
from app.runs.spec.rewards import BUILTIN_REWARDS
from tests.support import ROOT

BASE = {"model_name": "m", "task_description": "t"}


def status() -> str:
    """The README's status paragraph as one line of text, without its quote markers."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("> **Status.**")
    paragraph = readme[start : readme.index("\n\n", start)]
    return " ".join(line.removeprefix(">").strip() for line in paragraph.splitlines())


def split_not_yet(text: str) -> tuple[str, list[str]]:
    """What the status claims, and the items of its closing "Not yet:" sentence, each
    without its parenthetical remarks."""
    claims, _, rest = text.partition("Not yet:")
    assert rest, 'the status has no "Not yet:" sentence'
    items, depth, current = [], 0, ""
    for char in rest.strip().removesuffix("."):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    items.append(current)
    return claims, [" ".join(without_parentheses(item).split()) for item in items]


def without_parentheses(text: str) -> str:
    while True:
        shorter = re.sub(r"\([^()]*\)", "", text)
        if shorter == text:
            return text
        text = shorter


# Each "Not yet" item: a body that asks for it, and where and why the API refuses it.
GAPS: dict[str, tuple[dict[str, Any], tuple[str | int, ...], str]] = {
    "an SFT warm-up from an uploaded dataset": (
        {"sft": {"dataset_id": str(uuid.uuid4())}},
        ("sft", "dataset_id"),
        "Extra inputs are not permitted",
    ),
    "an agent run on several ranks": (
        {
            "environment": {"type": "tools", "tools": ["add"]},
            "grpo": {"distributed": {"num_processes": 2}},
        },
        ("grpo",),
        "an agent run (environment) trains in the worker's process",
    ),
    "asynchronous rollouts for an agent run in TRL's tool loop": (
        {
            "environment": {"type": "tools", "tools": ["add"]},
            "grpo": {
                "engine": "vllm-server",
                "vllm_server_url": "http://gpu-a:8000",
                "lora": {"r": 8},
                "async_rollouts": {},
            },
        },
        ("grpo",),
        "async_rollouts is for single-turn and gateway runs",
    ),
}


def test_every_not_yet_item_is_a_known_gap() -> None:
    _, items = split_not_yet(status())
    unknown = [item for item in items if item not in GAPS]
    assert not unknown, (
        f"the README calls {unknown} 'Not yet': add each to GAPS in {__name__} with a run "
        "body the API refuses for that reason, or take it out of the status"
    )


@pytest.mark.parametrize("gap", sorted(GAPS))
def test_each_gap_is_still_refused_by_the_api(gap: str) -> None:
    extra, where, reason = GAPS[gap]
    try:
        RunCreate.model_validate({**BASE, **extra})
    except ValidationError as exc:
        found = [(e["loc"], e["msg"]) for e in exc.errors()]
        assert any(loc == where and reason in msg for loc, msg in found), found
    else:
        pytest.fail(f"the API accepts {gap!r}: the README's status must stop calling it 'Not yet'")


def test_every_rollout_engine_is_named_and_none_is_called_missing() -> None:
    claims, items = split_not_yet(status())
    not_yet = " ".join(items).lower()
    engines = get_args(GrpoSettings.model_fields["engine"].annotation)
    assert "vllm-server" in engines  # the one the README once called missing
    for engine in engines:
        assert f"`{engine}`" in claims, f"the status does not name grpo.engine {engine!r}"
        for words in {engine, engine.replace("-", " ")}:
            assert words not in not_yet, f"the status calls {engine!r} 'Not yet'"


def test_several_ranks_per_run_are_named() -> None:
    claims, _ = split_not_yet(status())
    assert "distributed" in GrpoSettings.model_fields
    assert "`grpo.distributed`" in claims
    RunCreate.model_validate({**BASE, "grpo": {"distributed": {"num_processes": 2}}})


def test_the_reward_functions_named_are_built_in() -> None:
    claims, _ = split_not_yet(status())
    listed = claims[claims.index("programmatic functions (") :]
    listed = listed[: listed.index(")")]
    names = set(re.findall(r"`([a-z_]+)`", listed))
    assert names and names <= set(BUILTIN_REWARDS), names - set(BUILTIN_REWARDS)
