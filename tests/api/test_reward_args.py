"""A built-in reward's args are checked at POST /runs against the one registry of built-ins
(app.runs.spec.rewards.BUILTIN_REWARDS), and the document says which args each takes."""

from __future__ import annotations

import pytest

from app.runs.spec.rewards import BUILTIN_REWARDS
from tests.support.runs import run_body

FIELD = "body.reward.function.functions[0].args"


def _function(name: str, **fields: object) -> dict[str, object]:
    return {"type": "function", "functions": [{"name": name, **fields}]}


@pytest.mark.parametrize(
    ("function", "why"),
    [
        (_function("regex"), "pattern"),  # required, and args omitted
        (_function("regex", args={"pattern": "(unclosed"}), "regular expression"),
        (_function("char_fraction", args={"chr": "a"}), "chr"),  # a typo is not ignored
        (_function("length_target", args={"target": 0}), "target"),
        (_function("exact_match", args={"case_sensitive": "maybe"}), "case_sensitive"),
    ],
)
async def test_bad_builtin_args_are_422_naming_the_field(client, tenant, function, why) -> None:
    r = await client.post("/runs", json=run_body(reward=function), headers=tenant.headers)
    assert r.status_code == 422, r.text
    [error] = r.json()["errors"]
    assert error["field"] == FIELD and why in error["message"], error


async def test_good_builtin_and_user_args_are_stored_as_given(client, tenant) -> None:
    reward = {
        "type": "function",
        "functions": [
            {"name": "regex", "args": {"pattern": r"^a+$", "full_match": True}},
            {"name": "exact_match"},
            {"name": "tests.rewards.test_functions:double_length", "args": {"anything": [1]}},
        ],
    }
    r = await client.post("/runs", json=run_body(reward=reward), headers=tenant.headers)
    assert r.status_code == 202, r.text
    stored = r.json()["reward"]["functions"]
    assert [f["args"] for f in stored] == [
        {"pattern": r"^a+$", "full_match": True},
        {},
        {"anything": [1]},
    ]


async def test_the_document_lists_each_builtins_args(client) -> None:
    spec = (await client.get("/openapi.json")).json()
    # The checks by case, as if/then/else: {name: its check, None: any other name}.
    schema = spec["components"]["schemas"]["RewardFunction-Input"]
    named = {}
    while "if" in schema:
        named[schema["if"]["properties"]["name"]["const"]] = schema["then"]
        schema = schema["else"]
    named[None] = schema
    assert set(BUILTIN_REWARDS) <= set(named)
    regex = named["regex"]
    assert regex["required"] == ["args"]
    assert regex["properties"]["args"]["required"] == ["pattern"]
    assert regex["properties"]["args"]["properties"]["pattern"]["format"] == "regex"
    assert named["char_fraction"]["properties"]["args"]["additionalProperties"] is False
    assert named[None]["properties"]["name"]["pattern"].startswith("^[A-Za-z_]")
