"""A run's ``teacher`` block (app/runs/spec/teacher.py) at POST /runs: stored with its defaults
and served back; each of the reference's limits a 422 naming the field."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from app.runs.spec.teacher import (
    DEFAULT_BASELINE_TEMPLATE,
    DEFAULT_DIAGNOSTIC_TEMPLATE,
    DEFAULT_TEACHER_TEMPLATE,
    DEFAULT_WITH_TEACHING_TEMPLATE,
)
from tests.support.database import Tenant
from tests.support.runs import run_body

DEFAULTS = {
    "max_probe_tokens": 500,
    "max_tokens": 512,
    "guidance_max_tokens": None,
    "student_endpoint": None,
    "student_baseline_template": DEFAULT_BASELINE_TEMPLATE,
    "student_diagnostic_template": DEFAULT_DIAGNOSTIC_TEMPLATE,
    "teacher_adaptive_template": DEFAULT_TEACHER_TEMPLATE,
    "student_with_teaching_template": DEFAULT_WITH_TEACHING_TEMPLATE,
    "student_system_prompt": None,
    "reward": {
        "improvement": 1.0,
        "efficiency": 1.0,
        "efficiency_tokens": 200,
        "safety_penalty": 2.0,
    },
}
ENDPOINT = {"base_url": "http://student:8000/v1", "model": "student-8b"}


async def _create(client: httpx.AsyncClient, tenant: Tenant, teacher: Any) -> httpx.Response:
    return await client.post("/runs", json=run_body(teacher=teacher), headers=tenant.headers)


async def test_a_teacher_block_is_stored_with_its_defaults_and_served(
    client: httpx.AsyncClient, tenant: Tenant
) -> None:
    r = await _create(client, tenant, {"student_model": "/models/student"})
    assert r.status_code == 202, r.text
    expected = {**DEFAULTS, "student_model": "/models/student"}
    assert r.json()["teacher"] == expected
    got = await client.get(f"/runs/{r.json()['id']}", headers=tenant.headers)
    assert got.json()["teacher"] == expected
    # Also where the run is read through the ORM (app.runs.models.Run): lists and actions.
    listed = await client.get("/runs", headers=tenant.headers)
    assert [run["teacher"] for run in listed.json()["data"]] == [expected]
    cancelled = await client.post(f"/runs/{r.json()['id']}/cancel", headers=tenant.headers)
    assert cancelled.json()["teacher"] == expected


async def test_an_endpoint_student_and_own_weights_are_kept(
    client: httpx.AsyncClient, tenant: Tenant
) -> None:
    teacher = {
        "student_endpoint": ENDPOINT,
        "max_probe_tokens": 50,
        "guidance_max_tokens": 150,
        "reward": {"improvement": 0.5, "efficiency": 0.25, "safety_penalty": 1.0},
        "teacher_adaptive_template": "Task: {task}. Probe: {probe}. {form}",
    }
    r = await _create(client, tenant, teacher)
    assert r.status_code == 202, r.text
    served = r.json()["teacher"]
    assert served["student_model"] is None
    assert served["student_endpoint"] == {
        **ENDPOINT,
        "endpoint": None,
        "api_key_env": None,
        "timeout_s": 60.0,
        "max_concurrency": 8,
        "max_retries": 2,
        "max_tokens": 1024,
    }
    assert served["reward"] == {
        "improvement": 0.5,
        "efficiency": 0.25,
        "efficiency_tokens": 200,
        "safety_penalty": 1.0,
    }
    assert served["max_probe_tokens"] == 50 and served["guidance_max_tokens"] == 150


async def test_a_plain_run_has_no_teacher(client: httpx.AsyncClient, tenant: Tenant) -> None:
    r = await client.post("/runs", json=run_body(), headers=tenant.headers)
    assert r.status_code == 202, r.text
    assert r.json()["teacher"] is None


STUDENT = {"student_model": "/models/student"}


@pytest.mark.parametrize(
    ("teacher", "field", "why"),
    [
        ({}, "body.teacher", "exactly one"),
        ({**STUDENT, "student_endpoint": ENDPOINT}, "body.teacher", "exactly one"),
        (
            {"student_endpoint": {**ENDPOINT, "base_url": "student:8000"}},
            "body.teacher.student_endpoint.base_url",
            "https?://",
        ),
        ({"student_model": ""}, "body.teacher.student_model", "at least 1"),
        ({**STUDENT, "max_probe_tokens": 0}, "body.teacher.max_probe_tokens", "1"),
        ({**STUDENT, "max_tokens": 0}, "body.teacher.max_tokens", "1"),
        ({**STUDENT, "max_tokens": -5}, "body.teacher.max_tokens", "1"),
        ({**STUDENT, "guidance_max_tokens": 9}, "body.teacher.guidance_max_tokens", "10"),
        ({**STUDENT, "reward": {"improvement": 1.5}}, "body.teacher.reward.improvement", "1"),
        ({**STUDENT, "reward": {"efficiency": -0.1}}, "body.teacher.reward.efficiency", "0"),
        (
            {**STUDENT, "reward": {"efficiency_tokens": 0}},
            "body.teacher.reward.efficiency_tokens",
            "1",
        ),
        (
            {**STUDENT, "reward": {"safety_penalty": -2}},
            "body.teacher.reward.safety_penalty",
            "0",
        ),
        (
            {**STUDENT, "teacher_adaptive_template": "Teach {task} to {student}"},
            "body.teacher.teacher_adaptive_template",
            "student",
        ),
        (
            {**STUDENT, "student_with_teaching_template": "{task} alone"},
            "body.teacher.student_with_teaching_template",
            "{guidance}",
        ),
        (
            {**STUDENT, "student_baseline_template": "{task"},
            "body.teacher.student_baseline_template",
            "format",
        ),
        (
            {**STUDENT, "student_diagnostic_template": ""},
            "body.teacher.student_diagnostic_template",
            "1",
        ),
        ({**STUDENT, "probe_tokens": 5}, "body.teacher.probe_tokens", "unknown"),
    ],
)
async def test_bad_teacher_bodies_are_422_naming_the_field(
    client: httpx.AsyncClient, tenant: Tenant, teacher: Any, field: str, why: str
) -> None:
    r = await _create(client, tenant, teacher)
    assert r.status_code == 422, r.text
    errors = r.json()["errors"]
    assert [e["field"] for e in errors] == [field], errors
    assert why in errors[0]["message"], errors


async def test_an_empty_task_is_422_naming_it(client: httpx.AsyncClient, tenant: Tenant) -> None:
    body = run_body(teacher=STUDENT, task_description="")
    r = await client.post("/runs", json=body, headers=tenant.headers)
    assert r.status_code == 422, r.text
    assert [e["field"] for e in r.json()["errors"]] == ["body.task_description"]
