"""A run's ``sft`` warm-up (app.runs.spec.sft) at POST /runs: examples or a query, stored with
their defaults (messages exactly as given) and served back; each mistake a 422 naming the
field."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from tests.support.database import Tenant
from tests.support.runs import run_body

SFT_DEFAULTS = {
    "epochs": 1,
    "learning_rate": 2e-5,
    "max_seq_length": 1024,
    "packing": False,
    "batch_size": 4,
}
EPISODE = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "What is 6 times 7?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "name": "multiply", "content": "42"},
    {"role": "assistant", "content": "42"},
]


async def _create(client: httpx.AsyncClient, tenant: Tenant, sft: Any) -> httpx.Response:
    return await client.post("/runs", json=run_body(sft=sft), headers=tenant.headers)


async def test_examples_are_stored_as_given_and_served(
    client: httpx.AsyncClient, tenant: Tenant
) -> None:
    openai_style = {
        "role": "assistant",
        "tool_calls": [{"function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}],
    }
    examples = [
        {"messages": EPISODE},
        {"messages": [{"role": "user", "content": "1+2"}, openai_style]},
    ]
    r = await _create(client, tenant, {"examples": examples, "epochs": 3, "packing": True})
    assert r.status_code == 202, r.text
    expected = {**SFT_DEFAULTS, "epochs": 3, "packing": True, "examples": examples, "query": None}
    assert r.json()["sft"] == expected
    got = await client.get(f"/runs/{r.json()['id']}", headers=tenant.headers)
    assert got.json()["sft"] == expected


async def test_a_query_is_stored_with_its_defaults(
    client: httpx.AsyncClient, tenant: Tenant
) -> None:
    run = str(uuid.uuid4())
    r = await _create(client, tenant, {"query": {"run_ids": [run], "min_reward": 0.5}})
    assert r.status_code == 202, r.text
    assert r.json()["sft"] == {
        **SFT_DEFAULTS,
        "examples": None,
        "query": {"learning_key": None, "run_ids": [run], "min_reward": 0.5, "limit": 1000},
    }
    r = await _create(client, tenant, {"query": {"learning_key": "math"}, "learning_rate": 1e-4})
    assert r.status_code == 202, r.text
    assert r.json()["sft"]["query"]["learning_key"] == "math"


USER = {"role": "user", "content": "hi"}
ANSWER = {"role": "assistant", "content": "hello"}


@pytest.mark.parametrize(
    ("sft", "field", "why"),
    [
        ({}, "body.sft", "exactly one"),
        (
            {"examples": [{"messages": [USER, ANSWER]}], "query": {"learning_key": "k"}},
            "body.sft",
            "exactly one",
        ),
        ({"examples": []}, "body.sft.examples", "at least 1"),
        ({"examples": [{"messages": [USER]}]}, "body.sft.examples[0].messages", "assistant"),
        ({"query": {"min_reward": 0.5}}, "body.sft.query", "learning_key or run_ids"),
        ({"query": {"learning_key": "k", "limit": 0}}, "body.sft.query.limit", "1"),
        ({"query": {"learning_key": "k", "limit": 100_001}}, "body.sft.query.limit", "100000"),
        (
            {"query": {"run_ids": [str(uuid.uuid4()) for _ in range(101)]}},
            "body.sft.query.run_ids",
            "100",
        ),
        ({"query": {"run_ids": ["nope"]}}, "body.sft.query.run_ids[0]", "UUID"),
        ({"query": {"learning_key": "k"}, "epochs": 0}, "body.sft.epochs", "1"),
        ({"query": {"learning_key": "k"}, "epochs": 101}, "body.sft.epochs", "100"),
        ({"query": {"learning_key": "k"}, "learning_rate": 1}, "body.sft.learning_rate", "1"),
        ({"query": {"learning_key": "k"}, "learning_rate": 0}, "body.sft.learning_rate", "0"),
        ({"query": {"learning_key": "k"}, "max_seq_length": 15}, "body.sft.max_seq_length", "16"),
        ({"query": {"learning_key": "k"}, "batch_size": 1025}, "body.sft.batch_size", "1024"),
        ({"query": {"learning_key": "k"}, "lr": 1}, "body.sft.lr", "unknown"),
        (
            {"examples": [{"messages": [{"role": "robot", "content": "x"}, ANSWER]}]},
            "body.sft.examples[0].messages[0].role",
            "system",
        ),
        (
            {"examples": [{"messages": [USER, ANSWER, {"role": "tool"}]}]},
            "body.sft.examples[0].messages[2]",
            "content",
        ),
        (
            {
                "examples": [
                    {
                        "messages": [
                            {**USER, "tool_calls": [{"function": {"name": "a", "arguments": {}}}]},
                            ANSWER,
                        ]
                    }
                ]
            },
            "body.sft.examples[0].messages[0]",
            "assistant",
        ),
        (
            {
                "examples": [
                    {"messages": [USER, {**ANSWER, "tool_calls": [{"function": {"name": "a"}}]}]}
                ]
            },
            "body.sft.examples[0].messages[1].tool_calls[0].function.arguments",
            "required",
        ),
        (
            {"examples": [{"messages": [USER, {**ANSWER, "extra": "nul\u0000"}]}]},
            "body.sft.examples[0].messages[1]",
            "NUL",
        ),
    ],
)
async def test_bad_sft_bodies_are_422_naming_the_field(
    client: httpx.AsyncClient, tenant: Tenant, sft: Any, field: str, why: str
) -> None:
    r = await _create(client, tenant, sft)
    assert r.status_code == 422, r.text
    errors = r.json()["errors"]
    assert [e["field"] for e in errors] == [field], errors
    assert why in errors[0]["message"], errors
