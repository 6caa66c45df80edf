"""``grpo.async_rollouts`` at POST /runs: accepted for single-turn LoRA runs on vLLM servers
in one process, served back with its defaults; every other run is a 422 saying why."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from app.runs.spec.grpo import GrpoSettings
from tests.support.database import Tenant
from tests.support.runs import run_body

SERVER = {"engine": "vllm-server", "vllm_server_url": "http://gpu-a:8000", "lora": {"r": 8}}


async def test_an_async_lora_run_on_servers_is_accepted_with_its_defaults(
    client: httpx.AsyncClient, tenant: Tenant
) -> None:
    body = run_body(grpo={**SERVER, "async_rollouts": {}})
    r = await client.post("/runs", json=body, headers=tenant.headers)
    assert r.status_code == 202, r.text
    assert r.json()["grpo"]["async_rollouts"] == {
        "max_staleness": 1,
        "importance_sampling": "token_truncate",
        "importance_sampling_clip_max": 3.0,
        "importance_sampling_clip_min": None,
    }
    plain = await client.post("/runs", json=run_body(grpo=SERVER), headers=tenant.headers)
    assert plain.json()["grpo"]["async_rollouts"] is None


@pytest.mark.parametrize(
    ("overrides", "field", "why"),
    [
        ({"grpo": {"async_rollouts": {}}}, "body.grpo", "needs engine 'vllm-server' with lora"),
        (
            {"grpo": {"engine": "vllm-colocate", "lora": {"r": 8}, "async_rollouts": {}}},
            "body.grpo",
            "nothing to overlap",
        ),
        (
            {"grpo": {**SERVER, "lora": None, "async_rollouts": {}}},
            "body.grpo",
            "a full fine-tune's weights",
        ),
        (
            {
                "grpo": {
                    **SERVER,
                    "async_rollouts": {},
                    "distributed": {"num_processes": 2},
                    "groups_per_step": 2,
                }
            },
            "body.grpo",
            "in one process for now",
        ),
        (
            {
                "grpo": {**SERVER, "async_rollouts": {}},
                "environment": {"type": "tools", "tools": ["add"]},
            },
            "body.grpo",
            "a tool, python or MCP environment's episodes",
        ),
        (
            {"grpo": {**SERVER, "async_rollouts": {"max_staleness": 9}}},
            "body.grpo.async_rollouts.max_staleness",
            "",
        ),
        (
            {"grpo": {**SERVER, "async_rollouts": {"importance_sampling": "always"}}},
            "body.grpo.async_rollouts.importance_sampling",
            "",
        ),
    ],
)
async def test_runs_that_cannot_generate_ahead_are_422_naming_the_field(
    client: httpx.AsyncClient, tenant: Tenant, overrides: dict[str, Any], field: str, why: str
) -> None:
    r = await client.post("/runs", json=run_body(**overrides), headers=tenant.headers)
    assert r.status_code == 422, r.text
    errors = r.json()["errors"]
    assert [e["field"] for e in errors][:1] == [field], errors
    assert why in errors[0]["message"], errors


def test_trls_correction_follows_the_settings() -> None:
    def arguments(ahead: dict[str, Any] | None) -> dict[str, Any]:
        grpo = GrpoSettings.model_validate({**SERVER, "async_rollouts": ahead})
        return grpo.trl_arguments(
            output_dir="/tmp/x",
            num_generations=4,
            learning_rate=1e-5,
            max_steps=3,
            run_name="r",
            cuda=False,
            evaluate=False,
        )

    on = arguments({"importance_sampling": "sequence_mask", "importance_sampling_clip_min": 0.5})
    assert (
        on["vllm_importance_sampling_correction"],
        on["vllm_importance_sampling_mode"],
        on["vllm_importance_sampling_clip_max"],
        on["vllm_importance_sampling_clip_min"],
    ) == (True, "sequence_mask", 3.0, 0.5)
    assert arguments({})["vllm_importance_sampling_mode"] == "token_truncate"
    assert not arguments({"importance_sampling": None})["vllm_importance_sampling_correction"]
    assert "vllm_importance_sampling_correction" not in arguments(None)
