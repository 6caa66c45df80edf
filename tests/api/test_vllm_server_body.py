"""``grpo.engine: vllm-server`` at POST /runs: one URL or a list, served back as given;
what cannot work is a 422 naming the field."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.database import Tenant
from tests.support.runs import run_body

LORA = {"r": 8}
SERVERS = ["http://gpu-a:8000", "http://gpu-b:8000/v1"]


@pytest.mark.parametrize(
    "grpo",
    [
        {"engine": "vllm-server", "vllm_server_url": "http://trl-serve:8000"},
        {"engine": "vllm-server", "vllm_server_url": SERVERS, "lora": LORA},
    ],
)
async def test_one_url_or_several_are_served_back_as_given(
    client: httpx.AsyncClient, tenant: Tenant, grpo: dict[str, Any]
) -> None:
    r = await client.post("/runs", json=run_body(grpo=grpo), headers=tenant.headers)
    assert r.status_code == 202, r.text
    served = r.json()["grpo"]
    assert served["vllm_server_url"] == grpo["vllm_server_url"]
    assert (served["vllm_server_timeout_s"], served["vllm_server_max_retries"]) == (120, 3)


@pytest.mark.parametrize(
    ("overrides", "field", "why"),
    [
        ({"grpo": {"engine": "vllm-server"}}, "body.grpo", "needs vllm_servers or vllm_server_url"),
        (
            {
                "grpo": {
                    "engine": "vllm-server",
                    "vllm_server_url": SERVERS,
                    "num_vllm_servers": 2,
                    "lora": LORA,
                }
            },
            "body.grpo",
            "num_vllm_servers is for vLLM servers Ray places for the run",
        ),
        (
            {"grpo": {"engine": "vllm-server", "vllm_server_url": SERVERS}},
            "body.grpo",
            "one `trl vllm-serve` server",
        ),
        (
            {"grpo": {"engine": "vllm-server", "vllm_server_url": [], "lora": LORA}},
            "body.grpo.vllm_server_url",
            "",
        ),
        (
            {"grpo": {"engine": "vllm-server", "vllm_server_url": ["ftp://x"], "lora": LORA}},
            "body.grpo.vllm_server_url",
            "",
        ),
        (
            {
                "grpo": {"engine": "vllm-server", "vllm_server_url": SERVERS, "lora": LORA},
                "sft": {
                    "examples": [
                        {
                            "messages": [
                                {"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "a"},
                            ]
                        }
                    ]
                },
            },
            "body",
            "with sft the adapter would be trained on other weights",
        ),
        (
            {
                "grpo": {
                    "engine": "vllm-server",
                    "vllm_server_url": "http://x",
                    "vllm_server_timeout_s": 0,
                }
            },
            "body.grpo.vllm_server_timeout_s",
            "",
        ),
    ],
)
async def test_bad_vllm_server_bodies_are_422_naming_the_field(
    client: httpx.AsyncClient, tenant: Tenant, overrides: dict[str, Any], field: str, why: str
) -> None:
    r = await client.post("/runs", json=run_body(**overrides), headers=tenant.headers)
    assert r.status_code == 422, r.text
    errors = r.json()["errors"]
    assert [e["field"] for e in errors][:1] == [field], errors
    assert why in errors[0]["message"], errors
