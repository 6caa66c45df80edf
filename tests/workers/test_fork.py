"""Forks: a run started from another run's checkpoint trains from its weights (real TRL on
the tiny model), a full fine-tune's folder as it is, a LoRA adapter merged into its base."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from tests.support.runs import events, series, wait_for
from tests.support.workers import letters_run


async def _completed(sessionmaker: Any, run_id: str) -> Any:
    done = await wait_for(
        sessionmaker, run_id, lambda r: r.status in {"completed", "failed"}, within=300
    )
    assert done.status == "completed", done.error
    return done


async def test_a_fork_starts_where_its_parent_left_off(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home
) -> None:
    start_worker(**worker_home)
    body = letters_run(tiny_model, max_steps=40, grpo={"save_steps": 40})
    parent = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    await _completed(sessionmaker, parent["id"])

    fork_body = letters_run(
        tiny_model, max_steps=10, from_checkpoint={"run_id": parent["id"], "step": 40}
    )
    created = await client.post("/runs", json=fork_body, headers=tenant.headers)
    assert created.status_code == 202, created.text
    fork = created.json()
    assert (fork["parent_run_id"], fork["parent_step"]) == (parent["id"], 40)
    await _completed(sessionmaker, fork["id"])
    (started,) = [e for e in await events(sessionmaker, fork["id"]) if e.type == "fork"]
    assert started.data["step"] == 40 and "checkpoint-40" in started.data["model"]
    # The parent learned to say "a" over 40 steps; the fork begins there, not at the base.
    parent_first = [v for _, v in await series(sessionmaker, parent["id"], "reward_mean")][:10]
    fork_first = [v for _, v in await series(sessionmaker, fork["id"], "reward_mean")][:10]
    assert statistics.fmean(fork_first) - statistics.fmean(parent_first) >= 0.2, (
        parent_first,
        fork_first,
    )


async def test_a_fork_of_a_lora_run_merges_the_adapter_into_its_base(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home, tmp_path: Path
) -> None:
    start_worker(**worker_home, TRAINYARD_ARTIFACTS_DIR=str(tmp_path / "artifacts"))
    lora = {"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}}
    body = letters_run(tiny_model, max_steps=4, grpo={"save_steps": 2, **lora})
    parent = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    await _completed(sessionmaker, parent["id"])
    fork_body = letters_run(
        tiny_model, max_steps=2, grpo=lora, from_checkpoint={"run_id": parent["id"], "step": 2}
    )
    fork = (await client.post("/runs", json=fork_body, headers=tenant.headers)).json()
    await _completed(sessionmaker, fork["id"])
    merged = tmp_path / "artifacts" / fork["id"] / "fork-model"
    assert (merged / "config.json").is_file() and (merged / "model.safetensors").is_file()
    assert not (merged / "adapter_config.json").exists()
