"""The dashboard at /ui in headless Chromium, on a real API process and a real worker
training the tiny model: what the pages draw is checked against what the API serves."""

from __future__ import annotations

import asyncio
import math
import re
import statistics
import time
import uuid
from typing import Any

import httpx
import pytest

from app.runs.lifecycle.status import RunStatus
from tests.support.api_process import ApiProcess
from tests.support.database import Tenant
from tests.support.llm import ScriptedLLM, completion_of
from tests.support.workers import letters_run
from tests.ui.conftest import Page, Workers

# A run with no checkpoint, no evaluation and no best model kept: steps only.
PLAIN = {"save_steps": 100, "validation_fraction": 0.0, "load_best_model_at_end": False}

pytestmark = pytest.mark.browser


async def _metrics(api: ApiProcess, tenant: Tenant, run_id: str, **params: Any) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=api.url, headers=tenant.headers) as http:
        r = await http.get(f"/runs/{run_id}/metrics", params=params)
    r.raise_for_status()
    return {s["name"]: s["points"] for s in r.json()["series"]}


async def _create(api: ApiProcess, tenant: Tenant, body: dict[str, Any]) -> str:
    async with httpx.AsyncClient(base_url=api.url, headers=tenant.headers, timeout=30) as http:
        r = await http.post("/runs", json=body)
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


async def _get(api: ApiProcess, tenant: Tenant, path: str, **params: Any) -> Any:
    async with httpx.AsyncClient(base_url=api.url, headers=tenant.headers) as http:
        r = await http.get(path, params=params)
    r.raise_for_status()
    return r.json()


async def _cancel(api: ApiProcess, tenant: Tenant, run_id: str) -> None:
    async with httpx.AsyncClient(base_url=api.url, headers=tenant.headers) as http:
        (await http.post(f"/runs/{run_id}/cancel")).raise_for_status()


async def _run(api: ApiProcess, tenant: Tenant, run_id: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=api.url, headers=tenant.headers) as http:
        r = await http.get(f"/runs/{run_id}")
    r.raise_for_status()
    return dict(r.json())


async def _wait_status(
    api: ApiProcess, tenant: Tenant, run_id: str, statuses: set[str], within: float = 300
) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while True:
        run = await _run(api, tenant, run_id)
        if run["status"] in statuses:
            return run
        assert time.monotonic() < deadline, f"run still {run['status']}"
        await asyncio.sleep(0.25)


async def _wait_step(
    api: ApiProcess, tenant: Tenant, run_id: str, step: int, within: float = 300
) -> None:
    """Until the run has finished ``step`` (or ended)."""
    deadline = time.monotonic() + within
    while True:
        run = await _run(api, tenant, run_id)
        if run["step"] >= step or RunStatus(run["status"]).is_terminal:
            return
        assert time.monotonic() < deadline, f"run still at step {run['step']}"
        await asyncio.sleep(0.1)


async def _chart(page: Page, chart: str) -> list[list[float | None]]:
    """What uPlot plots for the chart: its data arrays (x, then one per series)."""
    data = await page.page.evaluate(
        "(id) => window.trainyard.charts[id].data.map((col) => Array.from(col))", chart
    )
    return list(data)


def _points(column: list[float | None], steps: list[float | None]) -> list[tuple[int, float]]:
    return [
        (int(s), float(v))
        for s, v in zip(steps, column, strict=True)
        if s is not None and v is not None
    ]


async def test_a_bad_key_shows_a_sign_in_error(page: Page) -> None:
    await page.page.goto(page.base + "/ui")
    await page.page.fill("#key", "ty_not-a-key")
    await page.page.click("#signin button[type=submit]")
    error = page.page.locator("#signin-error")
    await error.wait_for(state="visible")
    assert "Sign-in failed" in await error.inner_text()
    assert await page.page.evaluate("sessionStorage.getItem('trainyard.key')") is None


async def test_the_header_shows_the_role_and_hides_what_it_does_not_allow(
    page: Page, maker: Any
) -> None:
    """After sign-in the page asks GET /me once: the project and the key's role in the
    header; what a page marks ``data-needs="member"`` or ``"admin"`` is hidden from a key
    whose role does not allow it (the API would answer 403)."""
    from tests.support.database import new_tenant

    admin = await new_tenant(maker)
    for role, shown in (("viewer", []), ("member", ["member"]), ("admin", ["member", "admin"])):
        tenant = admin if role == "admin" else await new_tenant(maker, admin.name, role=role)
        await page.sign_in(tenant.key, "/ui")
        assert await page.page.inner_text("#who") == f"{admin.name} · {role}"
        assert await page.page.evaluate("() => window.trainyard.me.key.role") == role
        visible = await page.page.evaluate(
            """() => ["member", "admin"].filter((needs) => {
                const probe = document.createElement("button");
                probe.dataset.needs = needs;
                document.getElementById("main").append(probe);
                const seen = getComputedStyle(probe).display !== "none";
                probe.remove();
                return seen;
            })"""
        )
        assert visible == shown, role
        await page.page.click("#signout")


def test_assets_are_served_by_the_api_outside_the_openapi_document(
    api_server: ApiProcess,
) -> None:
    index = httpx.get(f"{api_server.url}/ui/runs/00000000-0000-0000-0000-000000000000")
    assert index.status_code == 200 and "text/html" in index.headers["content-type"]
    assert "default-src 'self'" in index.headers["content-security-policy"]
    vendor = httpx.get(f"{api_server.url}/ui/static/vendor/uplot-1.6.32/uPlot.iife.min.js")
    assert vendor.status_code == 200
    assert "immutable" in vendor.headers["cache-control"]
    app = httpx.get(f"{api_server.url}/ui/static/js/app.js")
    assert app.headers["cache-control"] == "no-cache" and app.headers["etag"]
    again = httpx.get(
        f"{api_server.url}/ui/static/js/app.js", headers={"If-None-Match": app.headers["etag"]}
    )
    assert again.status_code == 304
    document = httpx.get(f"{api_server.url}/openapi.json").json()
    assert not [p for p in document["paths"] if p.startswith("/ui")]
    # Every script and style the page names is served (no CDN, nothing left to build).
    for ref in re.findall(r'(?:src|href)="(/ui/static/[^"]+)"', index.text):
        assert httpx.get(api_server.url + ref).status_code == 200, ref


async def test_a_training_run_moves_on_screen_without_reload(
    page: Page, api_server: ApiProcess, tenant: Tenant, workers: Any, tiny_model: Any
) -> None:
    body = letters_run(
        tiny_model,
        max_steps=24,
        trained_model_name="live-letters",
        learning_key="letters",
        grpo={
            "save_steps": 8,
            "eval_steps": 8,
            "validation_fraction": 0.25,
            "eval_metrics": [{"name": "length_target", "args": {"target": 8}}],
        },
    )
    run_id = await _create(api_server, tenant, body)
    await page.sign_in(tenant.key, f"/ui/runs/{run_id}")
    await page.page.evaluate("window.__sameDocument = true")
    status = page.page.locator("#run-status [data-status]")
    first = await status.get_attribute("data-status")
    assert first in {"pending", "generating", "collecting", "scoring", "training"}

    # Some steps drawn while it trains, with no reload (the marker set above survives).
    await page.until("() => window.trainyard.charts['run:reward'].data[0].length >= 3", within=240)
    early = await _chart(page, "run:reward")
    await page.screenshot("run-page-live")
    await page.until(
        "() => document.querySelector('#run-status [data-status]').dataset.status === 'completed'",
        within=300,
    )
    assert await page.page.evaluate("window.__sameDocument === true")
    # The stream delivers the last steps' metrics; wait for the last one to be drawn.
    await page.until("() => window.trainyard.charts['run:reward'].data[0].at(-1) === 24", within=30)
    # The last evaluation (step 24) is logged after step 24's training metrics: its `eval`
    # event (or the stream's `end`) fetches it in a read of its own, which may land later.
    await page.until(
        "() => ['eval_reward', 'eval_metric/length_target'].every("
        "(n) => window.trainyard.run.store.get(n)?.steps.at(-1) === 24)",
        within=30,
    )
    final = await _chart(page, "run:reward")
    assert len(final[0]) > len(early[0])
    assert await page.page.inner_text("#run-step") == "24/24"

    served = await _metrics(api_server, tenant, run_id)
    mean = [(p["step"], p["value"]) for p in served["reward_mean"]]
    std = {p["step"]: p["value"] for p in served["reward_std"]}
    assert _points(final[1], final[0]) == mean
    # The band is mean ± std at every step.
    upper, lower = _points(final[2], final[0]), _points(final[3], final[0])
    assert [s for s, _ in upper] == [s for s, _ in lower] == [s for s, _ in mean]
    assert [v for _, v in upper] == pytest.approx([v + std[s] for s, v in mean])
    assert [v for _, v in lower] == pytest.approx([v - std[s] for s, v in mean])
    for chart, name in [
        ("run:loss", "loss"),
        ("run:step_seconds", "step_seconds"),
        ("run:completion_length", "completions/mean_length"),
        ("run:eval_reward", "eval_reward"),
        ("run:entropy", "entropy"),
    ]:
        data = await _chart(page, chart)
        assert _points(data[1], data[0]) == [(p["step"], p["value"]) for p in served[name]], chart
    # The extra evaluation metric, beside the eval reward on its chart.
    evals = await _chart(page, "run:eval_reward")
    metric = [(p["step"], p["value"]) for p in served["eval_metric/length_target"]]
    assert [step for step, _ in metric] == [0, 8, 16, 24]
    assert _points(evals[2], evals[0]) == metric
    components = await _chart(page, "run:components")
    labels = await page.page.evaluate(
        "window.trainyard.charts['run:components'].series.map((s) => s.label)"
    )
    combined = labels.index("combined (reward_mean)")
    assert _points(components[combined], components[0]) == mean
    # TRL's own mean of its one reward function ("trainyard") is the same number.
    assert [p["value"] for p in served["rewards/trainyard/mean"]] == pytest.approx(
        [v for _, v in mean]
    )
    # Drawn, not only handed over: the reward line left pixels on the canvas.
    painted = await page.page.evaluate(
        """() => {
            const c = document.querySelector('[data-chart="run:reward"] canvas');
            const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let blue = 0;
            for (let i = 0; i < px.length; i += 4)
                if (px[i + 2] > 180 && px[i] < 120 && px[i + 3] > 200) blue++;
            return blue;
        }"""
    )
    assert painted > 100
    # The timeline, checkpoints and the worker came over the stream too.
    assert await page.page.locator("#events [data-type=step]").count() == 24
    assert await page.page.locator("#checkpoints tbody tr").count() >= 1
    assert (await page.page.inner_text("#run-worker")).strip() not in {"", "–"}
    # The head may read `completed` from the run before the stream delivers its last batch
    # (the terminal status event and `end`): wait for the stream to end on it.
    await page.until(
        "() => document.querySelector('#live-state').textContent === 'ended (completed)'",
        within=30,
    )
    await page.screenshot("run-page")

    # The runs list shows it with its sparkline, found by its filters.
    await page.page.goto(page.base + "/ui?learning_key=letters")
    row = page.page.locator(f"tr[data-run='{run_id}']")
    await row.wait_for()
    assert "24/24" in await row.inner_text()
    spark = row.locator("svg.sparkline")
    await spark.wait_for()
    assert await spark.get_attribute("data-points") == str(len(mean))
    assert float(await spark.get_attribute("data-last") or "nan") == pytest.approx(mean[-1][1])
    await page.screenshot("runs-list")


def _ruler_judge(body: dict[str, Any]) -> dict[str, Any]:
    """Scores each trajectory by its share of letters a, explaining the count."""
    user = body["messages"][-1]["content"]
    scores = []
    for tid, text in re.findall(r'<trajectory id="(\w+)">\n(.*?)\n</trajectory>', user, re.S):
        answer = re.sub(r"<[^>]+>", "", text).strip()
        fraction = answer.count("a") / len(answer) if answer else 0.0
        scores.append(
            {
                "trajectory_id": tid,
                "explanation": f"{answer.count('a')} letters a of {len(answer)}",
                "score": round(fraction, 4),
            }
        )
    return {"scores": scores}


def _advantages(rewards: list[float], scale: str) -> list[float]:
    """TRL's group-relative advantage (GRPOTrainer, scale_rewards "group")."""
    assert scale == "group"
    mean = statistics.fmean(rewards)
    std = statistics.stdev(rewards)
    return [(r - mean) / (std + 1e-4) for r in rewards]


async def test_the_trajectory_viewer_shows_a_group_with_the_judges_explanations(
    page: Page,
    api_server: ApiProcess,
    tenant: Tenant,
    workers: Any,
    tiny_model: Any,
    judge: ScriptedLLM,
) -> None:
    judge.handle(_ruler_judge)
    body = letters_run(
        tiny_model,
        max_steps=3,
        trained_model_name="ruler-letters",
        reward={"type": "ruler", "judge": judge.endpoint("judge-small")},
        grpo=PLAIN,
    )
    run_id = await _create(api_server, tenant, body)
    done = await _wait_status(api_server, tenant, run_id, {"completed", "failed"})
    assert done["status"] == "completed", done["error"]
    rows = (await _get(api_server, tenant, f"/runs/{run_id}/trajectories", step=2, limit=200))[
        "data"
    ]
    group = sorted((t for t in rows if t["group_index"] == 1), key=lambda t: t["rollout_index"])
    assert len(group) == 8

    await page.sign_in(tenant.key, f"/ui/runs/{run_id}/trajectories?step=2&group=1")
    columns = page.page.locator("#rollouts article.rollout")
    assert await columns.count() == 8
    expected = _advantages([t["reward"] for t in group], "group")
    shown = await page.page.evaluate("window.trainyard.viewer.rollouts")
    assert [r["rollout_index"] for r in shown] == list(range(8))
    assert [r["reward"] for r in shown] == [t["reward"] for t in group]
    assert [r["advantage"] for r in shown] == pytest.approx(expected, abs=1e-9)
    for i, t in enumerate(group):
        column = columns.nth(i)
        explanation = t["reward_breakdown"]["ruler"]["explanation"]
        assert explanation.endswith(" letters a of " + str(len(_answer(t))))
        assert explanation in await column.locator(".ruler .explanation").inner_text()
        answer = t["messages"][-1]["content"]
        assert answer.strip() in (await column.locator(".role-assistant .content").inner_text())
        assert await column.locator(".advantage").inner_text() == _fmt(expected[i])
    await page.screenshot("trajectory-viewer")

    # The reward filter keeps the advantages (they are the group's) and dims what is out
    # of range.
    top = max(t["reward"] for t in group)
    await page.page.fill("#min-reward", str(top))
    await page.page.click("#viewer-filters button[type=submit]")
    dimmed = page.page.locator("#rollouts article.filtered-out")
    assert await dimmed.count() == sum(1 for t in group if t["reward"] < top)
    shown = await page.page.evaluate("window.trainyard.viewer.rollouts")
    assert [r["advantage"] for r in shown] == pytest.approx(expected, abs=1e-9)


def _answer(t: dict[str, Any]) -> str:
    return str(t["messages"][-1]["content"]).strip()


def _fmt(value: float) -> str:
    """What dom.js fmtNumber shows for a float."""
    if value == 0 or float(value).is_integer():
        return str(int(value))
    if abs(value) < 1e-3 or abs(value) >= 1e5:
        mantissa, exponent = f"{value:.2e}".split("e")
        return f"{mantissa}e{int(exponent):+d}"
    return f"{value:.3f}"


async def test_another_projects_run_is_not_reachable(
    page: Page, api_server: ApiProcess, tenant: Tenant, other_tenant: Tenant, tiny_model: Any
) -> None:
    theirs = await _create(api_server, tenant, letters_run(tiny_model, trained_model_name="theirs"))
    # Not trained (the worker is for the other tests): a cancelled run is a run all the same.
    await _cancel(api_server, tenant, theirs)
    await page.sign_in(other_tenant.key, f"/ui/runs/{theirs}")
    missing = page.page.locator("#not-found")
    await missing.wait_for()
    assert "Not found" in await missing.inner_text()
    await page.page.goto(page.base + f"/ui/runs/{theirs}/trajectories")
    await missing.wait_for()
    await page.page.goto(page.base + "/ui")
    await page.page.locator("#runs tbody tr").first.wait_for()
    assert await page.page.locator(f"tr[data-run='{theirs}']").count() == 0


async def test_comparison_overlays_reward_curves_and_marks_differences(
    page: Page, api_server: ApiProcess, tenant: Tenant, workers: Any, tiny_model: Any
) -> None:
    grpo = PLAIN
    ids = [
        await _create(
            api_server,
            tenant,
            letters_run(
                tiny_model, max_steps=4, learning_rate=lr, trained_model_name=f"lr-{i}", grpo=grpo
            ),
        )
        for i, lr in enumerate([5e-3, 1e-2])
    ]
    for run_id in ids:
        done = await _wait_status(api_server, tenant, run_id, {"completed", "failed"})
        assert done["status"] == "completed", done["error"]
    await page.sign_in(tenant.key, "/ui")
    for run_id in ids:
        await page.page.check(f"tr[data-run='{run_id}'] input.pick")
    await page.page.click("#compare-picked")
    await page.until("() => window.trainyard.charts['compare:reward']")
    data = await _chart(page, "compare:reward")
    assert len(data) == 3
    for column, run_id in zip(data[1:], ids, strict=True):
        served = (await _metrics(api_server, tenant, run_id, name="reward_mean"))["reward_mean"]
        assert _points(column, data[0]) == [(p["step"], p["value"]) for p in served]
    differs = page.page.locator("#compare-config tr.differs")
    keys = {await differs.nth(i).get_attribute("data-key") for i in range(await differs.count())}
    assert {"learning_rate", "trained_model_name"} <= keys
    assert "grpo.beta" not in keys
    assert await page.page.locator("#compare-config tr.same[data-key='grpo.beta']").count() == 1
    await page.screenshot("comparison")


def _rim_judge(body: dict[str, Any]) -> dict[str, Any]:
    """Each RIM judge scores the share of letters a, and says which judge and temperature
    it was."""
    name = re.search(r"You are the (\w+) judge", body["messages"][0]["content"])
    assert name is not None
    answer = completion_of(body)
    fraction = answer.count("a") / len(answer) if answer else 0.0
    return {
        "rationale": f"{name.group(1)} judge at T={body['temperature']}: "
        f"{answer.count('a')} letters a",
        "score": round(fraction, 4),
        "uncertainty": 0.1,
        "flags": {"contradiction": False, "safety_violation": False, "gaming": False},
    }


async def test_rim_verdicts_are_shown_per_judge_and_sample(
    page: Page,
    api_server: ApiProcess,
    tenant: Tenant,
    workers: Any,
    tiny_model: Any,
    judge: ScriptedLLM,
) -> None:
    judge.reset()
    judge.handle(_rim_judge)
    body = letters_run(
        tiny_model,
        max_steps=2,
        trained_model_name="rim-letters",
        reward={
            "type": "rim",
            "small_model": judge.endpoint("judge-small"),
            "temperatures": [0.2, 0.8],
            "active_judges": {
                "accuracy": True,
                "helpfulness": True,
                "process": False,
                "diagnostic": False,
            },
        },
        grpo=PLAIN,
    )
    run_id = await _create(api_server, tenant, body)
    done = await _wait_status(api_server, tenant, run_id, {"completed", "failed"})
    assert done["status"] == "completed", done["error"]
    rows = (await _get(api_server, tenant, f"/runs/{run_id}/trajectories", step=1, limit=200))[
        "data"
    ]
    group = sorted((t for t in rows if t["group_index"] == 0), key=lambda t: t["rollout_index"])

    await page.sign_in(tenant.key, f"/ui/runs/{run_id}/trajectories?step=1&group=0")
    columns = page.page.locator("#rollouts article.rollout")
    assert await columns.count() == len(group) == 8
    shown = await page.page.evaluate("window.trainyard.viewer.rollouts")
    assert [r["advantage"] for r in shown] == pytest.approx(
        _advantages([t["reward"] for t in group], "group"), abs=1e-9
    )
    first = columns.nth(0)
    judges = first.locator(".rim .rim-judge")
    assert await judges.count() == 2
    text = await first.locator(".rim").inner_text()
    rim = group[0]["reward_breakdown"]["rim"]
    for name in ("accuracy", "helpfulness"):
        for sample in rim["judges"][name]["samples"]:
            assert sample["rationale"] in text  # every sample's rationale, per judge
            assert f"judge-small @ T={sample['temperature']}" in text
    assert _fmt(rim["score"]) in await first.locator(".rim h4 .score").inner_text()
    await page.screenshot("trajectory-viewer-rim")


async def test_an_agent_episode_shows_its_tool_calls_collapsed(
    page: Page, api_server: ApiProcess, tenant: Tenant, maker: Any, tiny_model: Any
) -> None:
    """Episodes are written here through the table's model (an agent run on the CPU needs
    its SFT warm-up first, which tests/workers covers); the page reads them over the API."""
    from app.trajectories.models import Trajectory

    run_id = await _create(api_server, tenant, letters_run(tiny_model, trained_model_name="agent"))
    await _cancel(api_server, tenant, run_id)
    prompt = [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "What is 2 plus 3?"},
    ]

    def episode(answer: str, error: str | None) -> list[dict[str, Any]]:
        call = {
            "id": "call-1",
            "type": "function",
            "function": {"name": "add", "arguments": {"a": 2, "b": 3}},
        }
        result: dict[str, Any] = {
            "role": "tool",
            "tool_call_id": "call-1",
            "name": "add",
            "content": "" if error else "5",
            "duration_ms": 0.4,
        }
        if error:
            result["error"] = error
        return [
            *prompt,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            result,
            {"role": "assistant", "content": answer},
        ]

    async with maker() as s:
        for i, (answer, error, reward) in enumerate(
            [("5", None, 1.0), ("6", "ValueError: b too large", 0.0)]
        ):
            s.add(
                Trajectory(
                    run_id=uuid.UUID(run_id),
                    project_id=tenant.project_id,
                    step=1,
                    group_index=0,
                    rollout_index=i,
                    messages=episode(answer, error),
                    reward=reward,
                    reward_breakdown={"functions": {"exact_match": reward}},
                    meta={"tool_calls": 1, "turns": 2},
                )
            )
        await s.commit()

    await page.sign_in(tenant.key, f"/ui/runs/{run_id}/trajectories?step=1")
    columns = page.page.locator("#rollouts article.rollout")
    assert await columns.count() == 2
    call = columns.nth(0).locator("details.tool-call")
    assert await call.count() == 1
    assert await call.get_attribute("open") is None  # collapsed until clicked
    assert "add(" in await call.locator("summary").inner_text()
    await call.locator("summary").click()
    assert '"a": 2' in await call.locator("pre").inner_text()
    failed = columns.nth(1).locator("details.tool-result.failed")
    assert await failed.count() == 1
    await failed.locator("summary").click()
    assert "ValueError: b too large" in await failed.inner_text()
    assert await columns.nth(0).locator("details.tool-result.failed").count() == 0
    # Two rewards 1 and 0: advantages ±(0.5 / (std + 1e-4)) with the sample std 0.7071.
    shown = await page.page.evaluate("window.trainyard.viewer.rollouts")
    a = 0.5 / (statistics.stdev([1.0, 0.0]) + 1e-4)
    assert [r["advantage"] for r in shown] == pytest.approx([a, -a])
    assert "What is 2 plus 3?" in (await page.page.locator("#prompt").text_content() or "")
    await page.screenshot("trajectory-viewer-agent")


async def test_a_gateway_episode_shows_its_calls_with_trained_and_masked_tokens(
    page: Page, api_server: ApiProcess, tenant: Tenant, maker: Any, tiny_model: Any
) -> None:
    """A gateway episode's rows written through the tables' models (tests/gateway trains
    real ones); the page reads its calls over the API when the episode is opened."""
    from app.gateway import wire
    from app.gateway.models import Episode, EpisodeCall
    from app.trajectories.models import Trajectory

    run_id = await _create(api_server, tenant, letters_run(tiny_model, trained_model_name="gw"))
    await _cancel(api_server, tenant, run_id)
    run = uuid.UUID(run_id)
    prompt = [{"role": "user", "content": "What is 2 plus 3?"}]
    episode = Episode(
        run_id=run,
        step=1,
        slot=0,
        group_index=0,
        rollout_index=0,
        prompt=prompt,
        status="finished",
        attempt=1,
        issued=1,
        calls=2,
        reward=1.0,
    )
    async with maker() as s:
        s.add(episode)
        await s.flush()
        for seq, (prompt_n, completion_n) in enumerate([(20, 6), (31, 3)], start=1):
            s.add(
                EpisodeCall(
                    episode_id=episode.id,
                    run_id=run,
                    issue=1,
                    seq=seq,
                    policy_version=3,
                    request={"messages": prompt},
                    response={"finish_reason": "tool_calls" if seq == 1 else "stop"},
                    prompt_ids=wire.pack_ids(list(range(prompt_n))),
                    completion_ids=wire.pack_ids(list(range(completion_n))),
                    logprobs=wire.pack_floats([-0.1] * completion_n),
                    latency_ms=12.5,
                    generation_ms=10.0,
                )
            )
        s.add(
            Trajectory(
                run_id=run,
                project_id=tenant.project_id,
                step=1,
                group_index=0,
                rollout_index=0,
                messages=[*prompt, {"role": "assistant", "content": "5"}],
                reward=1.0,
                meta={
                    "episode_id": str(episode.id),
                    "calls": 2,
                    "sequence": "one",
                    "trained_calls": 2,
                    "trained_tokens": 9,
                    "masked_tokens": 5,
                    "policy_version": 3,
                },
            )
        )
        await s.commit()

    await page.sign_in(tenant.key, f"/ui/runs/{run_id}/trajectories?step=1")
    panel = page.page.locator("#rollouts article.rollout details.episode")
    summary = await panel.locator("summary").inner_text()
    assert "2 calls" in summary and "v3" in summary
    assert "9 trained" in summary and "5 masked" in summary
    await panel.locator("summary").click()
    rows = panel.locator("table.calls tbody tr")
    await rows.first.wait_for()
    assert await rows.count() == 2
    first, second = await rows.nth(0).inner_text(), await rows.nth(1).inner_text()
    assert "20 prompt" in first and "\t6\t" in first and "v3" in first
    assert "+5" in second and "stop" in second  # 31 - (20 + 6) new tokens: masked
    await page.screenshot("trajectory-viewer-gateway")


async def test_the_stream_resumes_after_a_drop_with_every_event_once(
    page: Page, api_server: ApiProcess, tenant: Tenant, workers: Any, tiny_model: Any
) -> None:
    """The API killed mid-run: the page reconnects with Last-Event-ID (fetch, not
    EventSource) and ends with every event of the run once, in order."""
    body = letters_run(
        tiny_model,
        max_steps=16,
        trained_model_name="dropped",
        grpo=PLAIN,
    )
    run_id = await _create(api_server, tenant, body)
    await page.sign_in(tenant.key, f"/ui/runs/{run_id}")
    await page.until("() => window.trainyard.charts['run:reward'].data[0].length >= 2", within=240)
    await asyncio.to_thread(api_server.kill)
    await page.until("() => window.trainyard.run.stream.reconnects >= 1", within=30)
    await asyncio.to_thread(api_server.start)
    await page.until(
        "() => document.getElementById('live-state').dataset.state === 'ended'", within=300
    )
    shown = await page.page.evaluate(
        "[...document.querySelectorAll('#events [data-id]')].map((e) => Number(e.dataset.id))"
    )
    served = [e["id"] for e in await _events(api_server, tenant, run_id)]
    assert shown == sorted(shown, reverse=True)  # newest first, no repeats
    assert sorted(shown) == served  # none missing
    # The last step's read may still be on its way when the stream ends.
    await page.until("() => window.trainyard.charts['run:reward'].data[0].at(-1) === 16")
    data = await _chart(page, "run:reward")
    assert data[0] == list(range(1, 17))


async def test_the_charts_miss_no_step_when_reads_straddle_commits(
    page: Page, api_server: ApiProcess, tenant: Tenant, workers: Any, tiny_model: Any
) -> None:
    """Every other metrics read the page makes is held until the run has finished two more
    steps, so reads answer from moments steps apart (as chunks of a many-named read, or a
    slow proxy, do): the charts still end with every step once."""
    body = letters_run(
        tiny_model,
        max_steps=8,
        trained_model_name="straddled",
        grpo=PLAIN,
    )
    run_id = await _create(api_server, tenant, body)
    reads = 0

    async def hold(route: Any) -> None:
        nonlocal reads
        reads += 1
        if reads % 2 == 0:
            run = await _run(api_server, tenant, run_id)
            await _wait_step(api_server, tenant, run_id, min(run["step"] + 2, 8))
        await route.continue_()

    await page.page.route(re.compile(rf"/runs/{run_id}/metrics\?"), hold)
    await page.sign_in(tenant.key, f"/ui/runs/{run_id}")
    await page.until(
        "() => document.getElementById('live-state').dataset.state === 'ended'", within=300
    )
    await page.until("() => window.trainyard.charts['run:reward'].data[0].at(-1) === 8")
    data = await _chart(page, "run:reward")
    served = (await _metrics(api_server, tenant, run_id, name="reward_mean"))["reward_mean"]
    assert reads >= 4  # the first read and at least one held read after it
    assert _points(data[1], data[0]) == [(p["step"], p["value"]) for p in served]
    assert data[0] == list(range(1, 9))


_STEP_SECONDS = """() => {
  const s = window.trainyard.run.store.get("step_seconds");
  return s ? Object.fromEntries(s.steps.map((step, i) => [step, s.values[i]])) : {};
}"""


async def test_steps_a_resumed_attempt_does_again_replace_what_the_charts_held(
    page: Page, api_server: ApiProcess, tenant: Tenant, workers: Workers, tiny_model: Any
) -> None:
    """The worker SIGKILLed after the page has drawn steps past a checkpoint: the next
    attempt resumes from that checkpoint and does those steps again, replacing their points
    (a step's seconds never repeat), and the page ends with the new attempt's values, not
    the ones it had drawn."""
    body = letters_run(
        tiny_model, max_steps=30, trained_model_name="redone", grpo={**PLAIN, "save_steps": 5}
    )
    run_id = await _create(api_server, tenant, body)
    await page.sign_in(tenant.key, f"/ui/runs/{run_id}")
    await page.until(
        "() => (window.trainyard.run.store.get('step_seconds')?.steps.at(-1) ?? 0) >= 7",
        within=240,
    )
    await asyncio.to_thread(workers.kill)
    # What the killed attempt committed, all drawn: the page's charts before the next one.
    # It resumes from the last checkpoint and does the steps after it again (none when the
    # kill came just after a checkpoint).
    old = (await _metrics(api_server, tenant, run_id, name="step_seconds"))["step_seconds"]
    last = old[-1]["step"]
    await page.until(
        f"() => window.trainyard.run.store.get('step_seconds').steps.at(-1) === {last}"
    )
    drawn = await page.page.evaluate(_STEP_SECONDS)
    async with httpx.AsyncClient(base_url=api_server.url, headers=tenant.headers) as http:
        saved = (await http.get(f"/runs/{run_id}/checkpoints")).json()["data"]
    resumed_from = max((c["step"] for c in saved), default=0)
    await asyncio.to_thread(workers.start)
    await page.until(
        "() => document.getElementById('live-state').dataset.state === 'ended'", within=300
    )
    done = await _run(api_server, tenant, run_id)
    assert (done["status"], done["attempt"]) == ("completed", 2), done
    await page.until("() => window.trainyard.run.store.get('step_seconds').steps.at(-1) === 30")
    shown = await page.page.evaluate(_STEP_SECONDS)
    served = (await _metrics(api_server, tenant, run_id, name="step_seconds"))["step_seconds"]
    assert [(int(k), v) for k, v in shown.items()] == [(p["step"], p["value"]) for p in served]
    # The steps after the checkpoint were drawn anew (a step's seconds never repeat).
    redone = [int(step) for step, value in drawn.items() if shown[step] != value]
    assert redone == list(range(resumed_from + 1, last + 1)), (resumed_from, drawn, shown)


async def _events(api: ApiProcess, tenant: Tenant, run_id: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    after = None
    while True:
        params = {"limit": 200, **({"after": after} if after else {})}
        page = await _get(api, tenant, f"/runs/{run_id}/events", **params)
        out += page["data"]
        if not page["has_more"]:
            return out
        after = page["next_cursor"]


async def test_the_pages_advantages_are_trls(page: Page, tenant: Tenant) -> None:
    """grpo.js against TRL 1.16's own arithmetic (its nanstd, torch's nanmean) for each
    scale_rewards, a dropped group (NaN rewards) included."""
    import torch
    from trl.trainer.utils import nanstd

    groups = [[0.1, 0.5, 0.5, 0.9], [0.0, 0.0, 1.0, 0.25], [None, None, None, None]]

    def trl(scale: str) -> list[list[float]]:
        rewards = torch.tensor([[math.nan if r is None else r for r in g] for g in groups])
        mean = torch.nanmean(rewards, dim=1, keepdim=True)
        if scale == "batch":
            std = nanstd(rewards.flatten()).expand_as(rewards)
        else:
            std = nanstd(rewards, dim=1).unsqueeze(1).expand_as(rewards)
        advantages = rewards - mean
        if scale != "none":
            advantages = advantages / (std + 1e-4)
        # TRL forces an unscorable completion's advantage to 0.
        return torch.nan_to_num(advantages, nan=0.0).tolist()

    await page.sign_in(tenant.key, "/ui")
    for scale in ("group", "batch", "none"):
        shown = await page.page.evaluate(
            """async ([groups, scale]) => {
                const { advantages } = await import('/ui/static/js/grpo.js');
                const all = groups.flat();
                return groups.map((g) => advantages(g, scale, all));
            }""",
            [groups, scale],
        )
        expected = trl(scale)
        for got, want in zip(shown, expected, strict=True):
            assert got == pytest.approx(want, abs=1e-6), scale


async def test_the_runs_list_pages_by_cursor_and_filters(page: Page, maker: Any) -> None:
    from tests.support.database import new_tenant
    from tests.support.runs import create_run

    owner = await new_tenant(maker)
    for i in range(27):
        status = RunStatus.COMPLETED if i % 3 else RunStatus.FAILED
        await create_run(maker, project_id=owner.project_id, status=status)
    await page.sign_in(owner.key, "/ui")
    rows = page.page.locator("#runs tbody tr[data-run]")
    assert await rows.count() == 25
    first = await rows.first.get_attribute("data-run")
    await page.page.click("#next-page")
    await page.until("() => document.querySelectorAll('#runs tbody tr[data-run]').length === 2")
    assert await page.page.is_disabled("#next-page")
    await page.page.click("#prev-page")
    await page.until("() => document.querySelectorAll('#runs tbody tr[data-run]').length === 25")
    assert await rows.first.get_attribute("data-run") == first
    await page.page.select_option("#filter-status", "failed")
    await page.page.click("#filters button[type=submit]")
    await page.until("() => document.querySelectorAll('#runs tbody tr[data-run]').length === 9")
    statuses = await page.page.eval_on_selector_all(
        "#runs tbody [data-status]", "(els) => els.map((e) => e.dataset.status)"
    )
    assert set(statuses) == {"failed"}
    assert "status=failed" in page.page.url


async def test_an_async_runs_page_charts_staleness_generation_and_the_correction(
    page: Page, maker: Any
) -> None:
    import asyncpg

    from app.core.pg import connect_kwargs
    from tests.support.database import new_tenant
    from tests.support.runs import create_run

    owner = await new_tenant(maker)
    grpo = {"engine": "vllm-server", "lora": {"r": 8}, "async_rollouts": {"max_staleness": 1}}
    run = await create_run(
        maker, project_id=owner.project_id, status=RunStatus.COMPLETED, grpo=grpo, step=3
    )
    plain = await create_run(maker, project_id=owner.project_id, status=RunStatus.COMPLETED)
    series = {
        "async/staleness": [0, 1, 1],
        "async/generation_seconds": [2.5, 2.25, 2.0],
        "async/wait_seconds": [2.5, 0.0, 0.5],
        "step_seconds": [4.0, 3.5, 3.75],
        "sampling/importance_sampling_ratio/mean": [1.0, 0.98, 1.01],
        "sampling/importance_sampling_ratio/min": [0.9, 0.5, 0.75],
        "sampling/importance_sampling_ratio/max": [1.1, 2.0, 1.5],
    }
    conn = await asyncpg.connect(
        **connect_kwargs(maker.kw["bind"].url.render_as_string(hide_password=False))
    )
    try:
        await conn.executemany(
            "INSERT INTO metric_points (run_id, step, name, value) VALUES ($1, $2, $3, $4)",
            [
                (run.id, step, name, value)
                for name, values in series.items()
                for step, value in enumerate(values, start=1)
            ],
        )
    finally:
        await conn.close()
    await page.sign_in(owner.key, f"/ui/runs/{run.id}")
    charts = {
        "run:async_staleness": ["async/staleness"],
        "run:async_time": ["async/generation_seconds", "async/wait_seconds", "step_seconds"],
        "run:importance_sampling": [
            "sampling/importance_sampling_ratio/mean",
            "sampling/importance_sampling_ratio/min",
            "sampling/importance_sampling_ratio/max",
        ],
    }
    for chart, names in charts.items():
        await page.until(
            f"() => window.trainyard.charts['{chart}']?.data[0].length === 3", within=30
        )
        data = await _chart(page, chart)
        for i, name in enumerate(names, start=1):
            assert _points(data[i], data[0]) == list(enumerate(series[name], start=1)), name
    # A synchronous run has none of them.
    await page.page.goto(page.base + f"/ui/runs/{plain.id}")
    await page.until("() => window.trainyard?.charts?.['run:reward'] !== undefined", within=30)
    assert await page.page.evaluate("window.trainyard.charts['run:async_staleness']") is None
