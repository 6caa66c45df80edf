"""Teacher runs end to end: a run with a ``teacher`` block created over HTTP is driven by a
Celery worker through TRL's GRPO on the tiny model (the teacher), with a second tiny model
as its student (CPU): probes stored with the inputs, every rollout's baseline, probe,
guidance and enhanced answer stored and served, the teaching reward exactly the formula's,
the ``teacher/...`` metrics at every step, and a worker killed mid-run resumed with one row
per rollout."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text

from app import training_data as td
from app.events.models import RunEvent
from app.metrics.models import MetricPoint
from app.trajectories.models import Trajectory
from tests.support.runs import series, trajectory_keys, wait_for
from tests.support.workers import letter_rows, letters_run
from workers.rewards.teaching import teaching_reward

METRICS = {
    "teacher/student_accuracy",
    "teacher/baseline_accuracy",
    "teacher/delta",
    "teacher/improvement_rate",
    "teacher/degradation_rate",
    "teacher/guidance_length",
    "teacher/token_efficiency",
}


@pytest.fixture(scope="session")
def student_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny model, in a folder of its own: the student."""
    from workers.ml.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-student")


def teacher_run(teacher_model: Path, student: Path, **overrides: Any) -> dict[str, Any]:
    """The letters run as a teacher run: the tiny teacher's guidance is rewarded by how many
    letters a the tiny student then writes."""
    body = letters_run(
        teacher_model,
        max_steps=3,
        rollouts_per_group=4,
        teacher={"student_model": str(student), "max_probe_tokens": 8, "max_tokens": 12},
        grpo={"max_completion_length": 12, "save_steps": 2, "validation_fraction": 0.0},
    )
    for key, value in overrides.items():
        if key == "grpo":
            body[key] = {**body[key], **value}
        else:
            body[key] = value
    return body


async def _trajectories(maker: Any, run_id: str) -> list[Trajectory]:
    async with maker() as s:
        return list(
            (
                await s.execute(
                    select(Trajectory)
                    .where(Trajectory.run_id == uuid.UUID(run_id))
                    .order_by(Trajectory.step, Trajectory.group_index, Trajectory.rollout_index)
                )
            ).scalars()
        )


async def _events(maker: Any, run_id: str, type_: str) -> list[RunEvent]:
    async with maker() as s:
        return list(
            (
                await s.execute(
                    select(RunEvent).where(
                        RunEvent.run_id == uuid.UUID(run_id), RunEvent.type == type_
                    )
                )
            ).scalars()
        )


def _check_stored(t: Trajectory, probe_limit: int | None = 8) -> None:
    """One rollout of a teacher run: its guidance, the student's two answers and the reward
    the formula gives them (``probe_limit``: max_probe_tokens, where the student keeps it)."""
    teacher = t.reward_breakdown["teacher"]
    assert t.messages[-1]["role"] == "assistant"
    assert teacher["guidance"] == t.messages[-1]["content"]
    # Priced by the tokens the teacher generated (at most max_completion_length).
    assert teacher["guidance_tokens"] == t.meta["completion_tokens"] <= 12
    assert teacher["task"] in t.messages[-2]["content"]  # the teacher's prompt holds the task
    probe = teacher["probe"]
    assert set(probe) >= {
        "capability_level",
        "confidence_score",
        "identified_gaps",
        "probe_tokens",
        "answer",
        "form",
        "self_assessed",
    }
    assert 0 <= probe["capability_level"] <= 1 and probe["probe_tokens"] >= 0
    if probe_limit is not None:
        assert probe["probe_tokens"] <= probe_limit
    assert probe["form"] in ("walkthrough", "hints", "verification")
    baseline, enhanced = teacher["baseline"], teacher["enhanced"]
    assert isinstance(baseline["answer"], str) and isinstance(enhanced["answer"], str)
    assert 0 <= baseline["score"] <= 1 and 0 <= enhanced["score"] <= 1
    # char_fraction of 'a': the scores are the run's own reward of the student's answers.
    for answer in (baseline, enhanced):
        text_ = answer["answer"]
        assert answer["score"] == pytest.approx(text_.count("a") / len(text_) if text_ else 0.0)
    expected = teaching_reward(baseline["score"], enhanced["score"], teacher["guidance_tokens"])
    assert t.reward == pytest.approx(expected.reward)
    assert teacher["reward"] == pytest.approx(expected.as_dict())


async def test_teacher_run_completes_with_every_field_and_metric_stored_and_served(
    client, tenant, sessionmaker, own_database, start_worker, tiny_model, student_model, worker_home
) -> None:
    start_worker(**worker_home)
    # One of the 4 inputs held out: evaluations are scored by the student too.
    body = teacher_run(tiny_model, student_model, grpo={"validation_fraction": 0.25})
    created = await client.post("/runs", json=body, headers=tenant.headers)
    assert created.status_code == 202, created.text
    run = created.json()
    assert run["teacher"]["student_model"] == str(student_model)
    assert run["teacher"]["reward"] == {
        "improvement": 1.0,
        "efficiency": 1.0,
        "efficiency_tokens": 200,
        "safety_penalty": 2.0,
    }
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=240
    )
    assert done.status == "completed", done.error
    assert done.step == 3

    # Every input was probed once, before the first step, and keeps its probe.
    async with sessionmaker() as s:
        probes = (
            await s.execute(
                text("SELECT input_text, teacher FROM task_inputs WHERE run_id = :id"),
                {"id": uuid.UUID(run["id"])},
            )
        ).all()
    assert len(probes) == 4
    for input_text, record in probes:
        assert record["task"] == input_text
        assert input_text in record["teacher_prompt"]
        assert set(record) == {"task", "baseline", "probe", "teacher_prompt"}
    assert len(await _events(sessionmaker, run["id"], "teacher")) == 1

    # Every rollout, with its guidance, baseline, probe and enhanced answer.
    rows = await _trajectories(sessionmaker, run["id"])
    assert await trajectory_keys(sessionmaker, run["id"]) == letter_rows(3, groups=2, rollouts=4)
    for t in rows:
        _check_stored(t)

    # Every step's teacher metrics, consistent with its rollouts.
    async with sessionmaker() as s:
        points = (
            await s.execute(
                select(MetricPoint.step, MetricPoint.name, MetricPoint.value).where(
                    MetricPoint.run_id == uuid.UUID(run["id"]),
                    MetricPoint.name.like("teacher/%"),
                )
            )
        ).all()
    by_step: dict[int, dict[str, float]] = {}
    for step, name, value in points:
        by_step.setdefault(step, {})[name] = value
    assert sorted(by_step) == [1, 2, 3]
    for step, values in by_step.items():
        assert set(values) == METRICS
        ts = [t.reward_breakdown["teacher"] for t in rows if t.step == step]
        deltas = [x["enhanced"]["score"] - x["baseline"]["score"] for x in ts]
        assert values["teacher/delta"] == pytest.approx(sum(deltas) / len(deltas))
        assert values["teacher/delta"] == pytest.approx(
            values["teacher/student_accuracy"] - values["teacher/baseline_accuracy"]
        )
        assert values["teacher/improvement_rate"] == pytest.approx(
            sum(d > 0 for d in deltas) / len(deltas)
        )
        assert values["teacher/degradation_rate"] == pytest.approx(
            sum(d < 0 for d in deltas) / len(deltas)
        )
        assert values["teacher/guidance_length"] == pytest.approx(
            sum(x["guidance_tokens"] for x in ts) / len(ts)
        )
    rewards = await series(sessionmaker, run["id"], "reward_mean")
    assert [step for step, _ in rewards] == [1, 2, 3]
    # The base model's evaluation (step 0), at the checkpoint of step 2 and at the end.
    evaluated = await series(sessionmaker, run["id"], "eval_teacher/delta")
    assert [step for step, _ in evaluated] == [0, 2, 3]

    # Served by the API and by the library as stored.
    page = await client.get(f"/runs/{run['id']}/trajectories", headers=tenant.headers)
    assert page.status_code == 200, page.text
    served = page.json()["data"]
    assert len(served) == len(rows)
    stored = {(t.step, t.group_index, t.rollout_index): t.reward_breakdown for t in rows}
    for item in served:
        key = (item["step"], item["group_index"], item["rollout_index"])
        assert item["reward_breakdown"]["teacher"] == stored[key]["teacher"]
    library = await td.get_training_trajectories_async(own_database.url, run_ids=[run["id"]])
    assert len(library) == len(rows)
    assert all(
        r.reward_breakdown is not None
        and r.reward_breakdown["teacher"]
        == stored[(r.step, r.group_index, r.rollout_index)]["teacher"]
        for r in library
    )


@pytest.mark.chaos  # a process killed: the chaos tier (make test-chaos)
async def test_teacher_run_killed_mid_step_resumes_with_one_row_per_rollout(
    client, tenant, sessionmaker, start_worker, tiny_model, student_model, worker_home
) -> None:
    first = start_worker(**worker_home)
    body = teacher_run(tiny_model, student_model, max_steps=8)
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    await wait_for(
        sessionmaker,
        run["id"],
        lambda r: r.status in {"collecting", "scoring", "training"} and 3 <= r.step < 6,
        within=180,
        every=0.005,
    )
    first.kill()  # SIGKILL mid-step; the checkpoint at step 2 or 4 is the last complete one
    start_worker(**worker_home)
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=240
    )
    assert done.status == "completed", done.error
    assert done.attempt == 2
    assert await trajectory_keys(sessionmaker, run["id"]) == letter_rows(8, groups=2, rollouts=4)
    for t in await _trajectories(sessionmaker, run["id"]):
        _check_stored(t)
    resumed = await _events(sessionmaker, run["id"], "resume")
    assert len(resumed) == 1
    # The student was probed once: the resumed attempt read the stored probes.
    assert len(await _events(sessionmaker, run["id"], "teacher")) == 1
    steps = [step for step, _ in await series(sessionmaker, run["id"], "teacher/delta")]
    assert steps == list(range(1, 9))


async def test_unusable_student_fails_at_once_saying_why(
    client, tenant, sessionmaker, start_worker, tiny_model, tmp_path, worker_home
) -> None:
    start_worker(**worker_home)
    body = teacher_run(tiny_model, tmp_path / "no-such-student")
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    done = await wait_for(sessionmaker, run["id"], lambda r: r.status == "failed", within=60)
    assert "teacher.student_model" in (done.error or "")
    assert "no-such-student" in (done.error or "")
    assert done.step == 0


def _scripted_student(body: dict[str, Any]) -> str:
    """A student that assesses itself (capability 0.5: hints), answers 'bbbb' alone and
    'aaaa' once it has been taught."""
    prompt = body["messages"][-1]["content"]
    if "CAPABILITY:" in prompt:
        return "A request to write.\nCAPABILITY: 0.5\nCONFIDENCE: 90%\nGAPS: letters, length"
    if "A teacher's guidance" in prompt:
        return "aaaa"
    return "bbbb"


async def test_an_endpoint_student_is_probed_taught_and_rewarded_over_http(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home, llm
) -> None:
    llm.handle(_scripted_student)
    start_worker(**worker_home)
    body = teacher_run(
        tiny_model,
        tiny_model,
        max_steps=2,
        teacher={"student_endpoint": llm.endpoint("judge-small"), "max_tokens": 16},
    )
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=240
    )
    assert done.status == "completed", done.error
    rows = await _trajectories(sessionmaker, run["id"])
    assert len(rows) == 2 * 2 * 4
    for t in rows:
        _check_stored(t, probe_limit=None)  # the scripted server does not count tokens
        teacher = t.reward_breakdown["teacher"]
        assert teacher["probe"]["self_assessed"] is True
        assert teacher["probe"]["capability_level"] == 0.5
        assert teacher["probe"]["confidence_score"] == pytest.approx(0.9)
        assert teacher["probe"]["identified_gaps"] == ["letters", "length"]
        assert teacher["probe"]["form"] == "hints"
        assert "hints and scaffolding" in t.messages[-2]["content"]
        assert teacher["baseline"] == {"answer": "bbbb", "tokens": 1, "score": 0.0}
        assert teacher["enhanced"] == {"answer": "aaaa", "tokens": 1, "score": 1.0}
        assert t.reward == pytest.approx(1.0 + max(0.0, 1 - teacher["guidance_tokens"] / 200))
    improvement = await series(sessionmaker, run["id"], "teacher/improvement_rate")
    assert improvement == [(1, 1.0), (2, 1.0)]
    # Each answer was asked of the endpoint: 4 baselines and 4 probes, then 8 per step.
    assert len(llm.requests) == 4 + 4 + 2 * 8
