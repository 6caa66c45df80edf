"""``grpo.distributed`` at POST /runs: stored with its defaults and served back; a split the
ranks cannot share, and runs that train in one process, are 422s naming the field."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.database import Tenant
from tests.support.runs import run_body

CALCULATOR = {"type": "python", "factory": "calculator"}


async def test_defaults_to_one_process_and_is_served_as_given(
    client: httpx.AsyncClient, tenant: Tenant
) -> None:
    r = await client.post("/runs", json=run_body(), headers=tenant.headers)
    assert r.status_code == 202, r.text
    assert r.json()["grpo"]["distributed"] == {"num_processes": 1, "accelerate_config": "ddp"}
    spec = {"num_processes": 4, "accelerate_config": "zero3-offload"}
    body = run_body(rollouts_per_group=8, grpo={"groups_per_step": 2, "distributed": spec})
    r = await client.post("/runs", json=body, headers=tenant.headers)
    assert r.status_code == 202, r.text
    assert r.json()["grpo"]["distributed"] == spec


@pytest.mark.parametrize(
    ("overrides", "field", "why"),
    [
        (
            {
                "rollouts_per_group": 3,
                "grpo": {"groups_per_step": 1, "distributed": {"num_processes": 2}},
            },
            "body.grpo",
            "3 rollouts",
        ),
        (
            {
                "rollouts_per_group": 2,
                "grpo": {
                    "groups_per_step": 2,
                    "gradient_accumulation_steps": 2,
                    "distributed": {"num_processes": 4},
                },
            },
            "body.grpo",
            "4 rollouts (groups_per_step x rollouts_per_group) must split evenly over "
            "distributed.num_processes x gradient_accumulation_steps = 8",
        ),
        (
            {"environment": CALCULATOR, "grpo": {"distributed": {"num_processes": 2}}},
            "body.grpo",
            "agent run",
        ),
        (
            {
                "teacher": {"student_model": "/models/student"},
                "grpo": {"distributed": {"num_processes": 2}},
            },
            "body.teacher",
            "one process",
        ),
        (
            {"grpo": {"distributed": {"num_processes": 0}}},
            "body.grpo.distributed.num_processes",
            "",
        ),
        (
            {"grpo": {"distributed": {"accelerate_config": "fsdp"}}},
            "body.grpo.distributed.accelerate_config",
            "",
        ),
        ({"grpo": {"distributed": {"ranks": 2}}}, "body.grpo.distributed.ranks", ""),
    ],
)
async def test_bad_distributed_bodies_are_422_naming_the_field(
    client: httpx.AsyncClient, tenant: Tenant, overrides: dict[str, Any], field: str, why: str
) -> None:
    r = await client.post("/runs", json=run_body(**overrides), headers=tenant.headers)
    assert r.status_code == 422, r.text
    errors = r.json()["errors"]
    assert [e["field"] for e in errors] == [field], errors
    assert why in errors[0]["message"], errors
