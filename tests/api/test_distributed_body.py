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
    local = {
        "num_processes": 1,
        "accelerate_config": "ddp",
        "launcher": "local",
        "num_nodes": 1,
        "gpus_per_process": None,
        "cpus_per_process": 1,
    }
    assert r.json()["grpo"]["distributed"] == local
    for spec in (
        {**local, "num_processes": 4, "accelerate_config": "zero3-offload"},
        # On a Ray cluster: 4 nodes of 4 ranks, one GPU and 8 CPUs each.
        {**local, "launcher": "ray", "num_processes": 16, "num_nodes": 4, "gpus_per_process": 1}
        | {"cpus_per_process": 8},
        # One rank, on the cluster rather than in the worker.
        {**local, "launcher": "ray"},
    ):
        grpo = {"groups_per_step": 2, "distributed": spec}
        body = run_body(rollouts_per_group=16, grpo=grpo)
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
            "trains in the worker's process",
        ),
        (
            {
                "teacher": {"student_model": "/models/student"},
                "grpo": {"distributed": {"launcher": "ray"}},
            },
            "body.teacher",
            "trains in the worker's process",
        ),
        (
            {"grpo": {"distributed": {"num_processes": 2, "num_nodes": 2}}},
            "body.grpo.distributed",
            "num_nodes: Ray only",
        ),
        (
            {"grpo": {"distributed": {"num_processes": 128}}},
            "body.grpo.distributed",
            "at most 64 on one machine; more need launcher: ray",
        ),
        (
            {"grpo": {"distributed": {"launcher": "ray", "num_processes": 3, "num_nodes": 2}}},
            "body.grpo.distributed",
            "num_processes (3) must split evenly over num_nodes (2)",
        ),
        (
            {"grpo": {"distributed": {"launcher": "ray", "cpus_per_process": 0}}},
            "body.grpo.distributed.cpus_per_process",
            "",
        ),
        (
            {"grpo": {"distributed": {"launcher": "k8s"}}},
            "body.grpo.distributed.launcher",
            "",
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
