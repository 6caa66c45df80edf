"""A number field takes a number and a boolean field a boolean, in every request body
(``RequestModel``, app/core/storable.py): pydantic's lax mode would read ``false`` as 0,
``"0.5"`` as 0.5 and ``1`` as true."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.runs import run_body

PROBLEM = "application/problem+json"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"sft": {"query": {"min_reward": False}}}, "body.sft.query.min_reward"),
        ({"learning_rate": False}, "body.learning_rate"),
        ({"learning_rate": "0.001"}, "body.learning_rate"),
        ({"grpo": {"temperature": "1"}}, "body.grpo.temperature"),
        ({"grpo": {"bf16": 1}}, "body.grpo.bf16"),
        ({"grpo": {"bf16": "true"}}, "body.grpo.bf16"),
    ],
)
async def test_a_boolean_or_text_where_a_number_goes_is_a_422_naming_the_field(
    client: httpx.AsyncClient, tenant: Any, body: dict[str, Any], field: str
) -> None:
    r = await client.post("/runs", json=run_body(**body), headers=tenant.headers)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == PROBLEM
    assert [e["field"] for e in r.json()["errors"]] == [field], r.text
    runs = (await client.get("/runs", headers=tenant.headers)).json()["data"]
    assert runs == []  # nothing was created


async def test_an_integer_is_a_number_and_null_stays_allowed_where_it_was(
    client: httpx.AsyncClient, tenant: Any
) -> None:
    body = run_body(grpo={"temperature": 1, "bf16": False}, max_steps=None)
    r = await client.post("/runs", json=body, headers=tenant.headers)
    assert r.status_code == 202, r.text
    assert r.json()["grpo"]["temperature"] == 1.0
