"""20 steps of a real small model on a GPU with vLLM colocated, then the same on 2 ranks
(one per GPU), then on ranks a Ray cluster of this machine places. Skipped without CUDA
(tests/gpu/conftest.py says why)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.runs import get_run, series, trajectory_keys, wait_for
from tests.support.workers import letter_rows, letters_run

pytestmark = pytest.mark.gpu

VLLM = {
    "engine": "vllm-colocate",
    "vllm_gpu_memory_utilization": 0.3,
    "bf16": True,
    "max_completion_length": 32,
    "save_steps": 10,
}


async def _train(client: Any, tenant: Any, sessionmaker: Any, model: Path, grpo: dict) -> str:
    body = letters_run(model, max_steps=20, learning_rate=1e-5, grpo={**VLLM, **grpo})
    created = await client.post("/runs", json=body, headers=tenant.headers)
    assert created.status_code == 202, created.text
    run_id = created.json()["id"]
    done = await wait_for(
        sessionmaker, run_id, lambda r: r.status in {"completed", "failed"}, within=1200
    )
    assert done.status == "completed", done.error
    assert await trajectory_keys(sessionmaker, run_id) == letter_rows(20)
    assert len(await series(sessionmaker, run_id, "reward_mean")) == 20
    return run_id


async def test_twenty_steps_with_vllm_colocated(
    client, tenant, sessionmaker, start_worker, worker_home, gpu_model
) -> None:
    start_worker(**worker_home, TRAINYARD_LEASE_TTL_SECONDS="30")
    run_id = await _train(client, tenant, sessionmaker, gpu_model, {})
    assert (await get_run(sessionmaker, run_id)).failures == 0


async def test_twenty_steps_on_two_ranks(
    client, tenant, sessionmaker, start_worker, worker_home, gpu_model, gpus
) -> None:
    if gpus < 2:
        pytest.skip(f"2 ranks need 2 GPUs; this machine has {gpus}")
    start_worker(**worker_home, TRAINYARD_LEASE_TTL_SECONDS="30")
    await _train(client, tenant, sessionmaker, gpu_model, {"distributed": {"num_processes": 2}})


async def test_twenty_steps_on_ranks_ray_places_on_the_gpus(
    client, tenant, sessionmaker, start_worker, worker_home, gpu_model, gpus
) -> None:
    """A one-node Ray cluster of this machine's GPUs: the ranks get theirs from Ray (its
    CUDA_VISIBLE_DEVICES on the actor), one per rank, 2 ranks where there are 2 GPUs."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 4, "num_gpus": gpus, "include_dashboard": False},
    )
    try:
        ranks = min(gpus, 2)
        start_worker(
            **worker_home,
            TRAINYARD_LEASE_TTL_SECONDS="30",
            TRAINYARD_RAY_ADDRESS=str(cluster.address),
        )
        ray = {"launcher": "ray", "num_processes": ranks, "gpus_per_process": 1}
        await _train(client, tenant, sessionmaker, gpu_model, {"distributed": ray})
    finally:
        cluster.shutdown()
