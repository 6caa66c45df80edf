"""The real pipeline end to end: a run created over HTTP is driven by a Celery worker
through TRL's GRPO on the tiny model (CPU), with everything persisted."""

from __future__ import annotations

import statistics
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from app.checkpoints.models import Checkpoint
from app.events.models import RunEvent
from app.metrics.models import MetricPoint
from app.trajectories.models import Trajectory
from tests.support.runs import get_run, series, trajectory_keys, wait_for
from tests.support.workers import letter_rows, letters_run


async def _count(maker: Any, model: Any, run_id: str, *where: Any) -> int:
    async with maker() as s:
        return int(
            await s.scalar(
                select(func.count())
                .select_from(model)
                .where(model.run_id == uuid.UUID(run_id), *where)
            )
        )


async def test_run_trains_to_completion_learns_and_keeps_everything(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home
) -> None:
    start_worker(**worker_home)
    run = (await client.post("/runs", json=letters_run(tiny_model), headers=tenant.headers)).json()
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=240
    )
    assert done.status == "completed", done.error
    assert done.step == 60

    # Every step: its 16 trajectories with rewards, its metrics, its event.
    assert await trajectory_keys(sessionmaker, run["id"]) == letter_rows(60)
    assert await _count(sessionmaker, Trajectory, run["id"], Trajectory.reward.is_(None)) == 0
    rewards = await series(sessionmaker, run["id"], "reward_mean")
    async with sessionmaker() as s:
        names = set(
            (
                await s.execute(
                    select(MetricPoint.name).where(MetricPoint.run_id == uuid.UUID(run["id"]))
                )
            ).scalars()
        )
        steps = (
            (
                await s.execute(
                    select(RunEvent.data["step"].as_integer()).where(
                        RunEvent.run_id == uuid.UUID(run["id"]), RunEvent.type == "step"
                    )
                )
            )
            .scalars()
            .all()
        )
        ckpts = (
            (await s.execute(select(Checkpoint).where(Checkpoint.run_id == uuid.UUID(run["id"]))))
            .scalars()
            .all()
        )
    assert [step for step, _ in rewards] == list(range(1, 61))
    assert {
        "loss",
        "reward_std",
        "reward_min",
        "reward_max",
        "step_seconds",
        "tokens_per_second",
        "entropy",
        "completions/mean_length",
        "groups_dropped",
    } <= names
    assert sorted(steps) == list(range(1, 61))
    values = [v for _, v in rewards]
    assert statistics.fmean(values[-10:]) - statistics.fmean(values[:10]) >= 0.3, values

    # Checkpoints every 20 steps plus the final model, all on disk.
    assert sorted((c.step, c.is_final) for c in ckpts) == [
        (20, False),
        (40, False),
        (60, False),
        (60, True),
    ]
    final = next(c for c in ckpts if c.is_final)
    assert (Path(final.path) / "model.safetensors").is_file()
    assert Path(final.path).name == "tiny-letters"
    assert all(Path(c.path, "optimizer.pt").is_file() for c in ckpts if not c.is_final)

    # The summary says what a user wants to know first.
    r = await client.get(f"/runs/{run['id']}", headers=tenant.headers)
    metrics = r.json()["metrics"]
    assert metrics["step"] == 60 and metrics["total_trajectories"] == 960
    assert metrics["avg_reward"] > metrics["reward_first"]
    page = (
        await client.get(
            f"/runs/{run['id']}/trajectories",
            params={"step": 60, "limit": 2},
            headers=tenant.headers,
        )
    ).json()
    message = page["data"][0]["messages"]
    assert [m["role"] for m in message] == ["user", "assistant"]
    assert (
        page["data"][0]["reward_breakdown"]["functions"]["char_fraction"]
        == page["data"][0]["reward"]
    )


async def test_lora_run_saves_an_adapter(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home
) -> None:
    start_worker(**worker_home)
    body = letters_run(
        tiny_model, max_steps=6, grpo={"lora": {"r": 8, "alpha": 16}, "save_steps": 100}
    )
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=180
    )
    assert done.status == "completed", done.error
    async with sessionmaker() as s:
        final = (
            await s.execute(
                select(Checkpoint).where(
                    Checkpoint.run_id == uuid.UUID(run["id"]), Checkpoint.is_final
                )
            )
        ).scalar_one()
    assert (Path(final.path) / "adapter_config.json").is_file()
    assert (Path(final.path) / "adapter_model.safetensors").is_file()
    assert not (Path(final.path) / "model.safetensors").exists()


@pytest.mark.chaos  # a process killed: the chaos tier (make test-chaos)
async def test_worker_killed_in_training_is_replaced_and_resumes_from_its_checkpoint(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home
) -> None:
    first = start_worker(**worker_home)
    body = letters_run(tiny_model, max_steps=30, grpo={"save_steps": 10})
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    # The training phase of a tiny-model step lasts tens of milliseconds: poll fast.
    await wait_for(
        sessionmaker,
        run["id"],
        lambda r: r.status == "training" and 12 <= r.step < 25,
        within=180,
        every=0.005,
    )
    first.kill()  # SIGKILL while training; the checkpoint at step 10 is the last complete one
    start_worker(**worker_home)
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=240
    )
    assert done.status == "completed", done.error
    assert done.attempt == 2
    assert await trajectory_keys(sessionmaker, run["id"]) == letter_rows(30)
    async with sessionmaker() as s:
        resumed = (
            (
                await s.execute(
                    select(RunEvent).where(
                        RunEvent.run_id == uuid.UUID(run["id"]), RunEvent.type == "resume"
                    )
                )
            )
            .scalars()
            .all()
        )
    assert len(resumed) == 1 and "step 10" in resumed[0].message
    steps = [step for step, _ in await series(sessionmaker, run["id"], "reward_mean")]
    assert steps == list(range(1, 31))


async def test_cancel_during_collecting_ends_within_a_heartbeat(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home
) -> None:
    start_worker(**worker_home)
    body = letters_run(tiny_model, max_steps=2000, grpo={"save_steps": 10_000})
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    await wait_for(
        sessionmaker, run["id"], lambda r: r.status == "collecting" and r.step >= 2, within=180
    )
    r = await client.post(f"/runs/{run['id']}/cancel", headers=tenant.headers)
    assert r.status_code == 200
    # 2000 steps of ~0.1 s: only a cancel seen mid-run ends it within the deadline.
    done = await wait_for(sessionmaker, run["id"], lambda r: r.status == "cancelled", within=60)
    assert done.lease_owner is None and 2 <= done.step < 2000
    # Every step it finished kept all its rows; the one in progress at most its own, and
    # nothing after it was started.
    rows = await trajectory_keys(sessionmaker, run["id"])
    finished = letter_rows(done.step)
    assert rows[: len(finished)] == finished
    assert {s for s, _, _ in rows[len(finished) :]} <= {done.step + 1}


async def test_unusable_model_fails_at_once_saying_why(
    client, tenant, sessionmaker, start_worker, tmp_path, worker_home
) -> None:
    start_worker(**worker_home)
    body = letters_run(tmp_path / "no-such-model")
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    done = await wait_for(sessionmaker, run["id"], lambda r: r.status == "failed", within=60)
    assert "no-such-model" in (done.error or "") and "cannot be loaded" in (done.error or "")
    assert done.step == 0
    assert (await get_run(sessionmaker, run["id"])).completed_at is not None


async def test_evaluation_tracks_the_base_model_and_keeps_the_best_checkpoint(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home
) -> None:
    start_worker(**worker_home)
    inputs = [{"input_text": t} for t in ["Say something.", "Sing.", "Shout.", "Write a word."]]
    inputs += [{"input_text": t, "split": "validation"} for t in ["Whisper.", "Hum."]]
    body = letters_run(
        tiny_model, max_steps=20, inputs=inputs, grpo={"save_steps": 10, "eval_steps": 10}
    )
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=240
    )
    assert done.status == "completed", done.error
    evals = await series(sessionmaker, run["id"], "eval_reward")
    async with sessionmaker() as s:
        final = (
            await s.execute(
                select(Checkpoint).where(
                    Checkpoint.run_id == uuid.UUID(run["id"]), Checkpoint.is_final
                )
            )
        ).scalar_one()
    assert [step for step, _ in evals] == [0, 10, 20]
    summary = done.metrics or {}
    base, last = evals[0][1], evals[-1][1]
    assert summary["eval_reward_base"] == pytest.approx(base)
    assert summary["eval_improvement"] == pytest.approx(last - base)
    assert summary["eval_reward_best"] == pytest.approx(max(v for _, v in evals[1:] + evals[:1]))
    assert summary["eval_best_step"] in {10, 20}
    assert final.metrics["eval_best_step"] == summary["eval_best_step"]
    # Validation inputs are never trained on.
    assert await _count(sessionmaker, Trajectory, run["id"]) == 20 * 2 * 8
    page = (
        await client.get(
            f"/runs/{run['id']}/inputs", params={"split": "validation"}, headers=tenant.headers
        )
    ).json()
    assert {i["input_text"] for i in page["data"]} == {"Whisper.", "Hum."}


async def test_pause_checkpoints_at_the_step_boundary_and_resume_continues_there(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home
) -> None:
    start_worker(**worker_home)
    body = letters_run(tiny_model, max_steps=30, grpo={"save_steps": 1000})
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    await wait_for(sessionmaker, run["id"], lambda r: r.step >= 5, within=180)
    r = await client.post(f"/runs/{run['id']}/pause", headers=tenant.headers)
    assert r.status_code == 200
    paused = await wait_for(sessionmaker, run["id"], lambda r: r.status == "paused", within=30)
    assert paused.lease_owner is None and 5 <= paused.step < 30
    async with sessionmaker() as s:
        saved = (
            (await s.execute(select(Checkpoint).where(Checkpoint.run_id == uuid.UUID(run["id"]))))
            .scalars()
            .all()
        )
    # No save_steps boundary was reached: the pause itself wrote the checkpoint.
    assert [c.step for c in saved] == [paused.step]

    r = await client.post(f"/runs/{run['id']}/resume", headers=tenant.headers)
    assert r.json()["status"] == "pending"
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=180
    )
    assert done.status == "completed", done.error
    assert await trajectory_keys(sessionmaker, run["id"]) == letter_rows(30)
    async with sessionmaker() as s:
        resumed = (
            (
                await s.execute(
                    select(RunEvent.data["step"].as_integer()).where(
                        RunEvent.run_id == uuid.UUID(run["id"]), RunEvent.type == "resume"
                    )
                )
            )
            .scalars()
            .all()
        )
    assert resumed == [paused.step]


def _scripted_llm(body: dict[str, Any]) -> dict[str, Any]:
    """Writes inputs and a system prompt on request, and judges like char_fraction would:
    each trajectory's score is the share of 'a' in its answer."""
    import re

    name = body["response_format"]["json_schema"]["name"]
    if name == "system_prompt":
        return {"system_prompt": "Answer with the letter a, as often as you can."}
    if name == "training_inputs":
        _scripted_llm.calls += 1  # type: ignore[attr-defined]
        n = _scripted_llm.calls  # type: ignore[attr-defined]
        return {"inputs": [{"input_text": f"Request {n}.{i}"} for i in range(4)]}
    user = body["messages"][-1]["content"]
    scores = []
    for tid, text in re.findall(r'<trajectory id="(\w+)">\n(.*?)\n</trajectory>', user, re.S):
        answer = re.sub(r"<[^>]+>", "", text).strip()
        fraction = answer.count("a") / len(answer) if answer else 0.0
        scores.append({"trajectory_id": tid, "explanation": f"{fraction:.2f} a", "score": fraction})
    return {"scores": scores}


_scripted_llm.calls = 0  # type: ignore[attr-defined]


async def test_generated_inputs_and_a_ruler_judge_over_http(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home, llm
) -> None:
    llm.handle(_scripted_llm)
    start_worker(**worker_home)
    body = letters_run(
        tiny_model,
        max_steps=12,
        inputs=None,
        num_examples=8,
        generator=llm.endpoint("gen"),
        reward={"type": "ruler", "judge": llm.endpoint("judge-small")},
        grpo={"save_steps": 100, "validation_fraction": 0.25, "eval_steps": 100},
    )
    del body["inputs"]
    created = await client.post("/runs", json=body, headers=tenant.headers)
    assert created.status_code == 202, created.text
    run = created.json()
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=240
    )
    assert done.status == "completed", done.error
    assert done.system_prompt == "Answer with the letter a, as often as you can."
    inputs = (await client.get(f"/runs/{run['id']}/inputs", headers=tenant.headers)).json()
    assert len(inputs["data"]) == 8
    assert {i["split"] for i in inputs["data"]} == {"train", "validation"}
    page = (
        await client.get(
            f"/runs/{run['id']}/trajectories",
            params={"step": 12, "limit": 3},
            headers=tenant.headers,
        )
    ).json()
    first = page["data"][0]
    assert first["messages"][0] == {"role": "system", "content": done.system_prompt}
    assert first["reward_breakdown"]["ruler"]["explanation"].endswith(" a")
    assert first["reward"] == pytest.approx(first["reward_breakdown"]["ruler"]["score"])
    # The judge saw every group of every training step once (plus base/final evaluations).
    assert llm.schema_names().count("ruler_scores") >= 12 * 2


async def test_ruler_run_without_a_judge_fails_before_any_step(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home
) -> None:
    start_worker(**worker_home)
    body = letters_run(tiny_model, reward={"type": "ruler"})
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    done = await wait_for(sessionmaker, run["id"], lambda r: r.status == "failed", within=60)
    assert "TRAINYARD_JUDGE_BASE_URL" in (done.error or "") and done.step == 0


async def test_vllm_engine_on_a_worker_without_vllm_fails_at_once(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home
) -> None:
    start_worker(**worker_home)  # the main venv has no vLLM (the slow tier's has)
    body = letters_run(tiny_model, grpo={"engine": "vllm-colocate"})
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    done = await wait_for(sessionmaker, run["id"], lambda r: r.status == "failed", within=60)
    assert "needs vLLM on the worker" in (done.error or "") and done.step == 0
