"""The dashboard's run page: first render of a run with 2,400 steps (target ≤ 500 ms, server
and browser time both measured) and how long a step's commit takes to reach its chart
(target ≤ 1 s).

    .venv/bin/python bench/dashboard.py [--steps 2400] [--renders 7] [--commits 10]

Setup: a database of its own (``bench_dashboard``), the API (``trainyard api``, JSON logs),
and for a moment one worker: it trains one step of configs/runs/letters.yaml on the tiny
model, and the names of that run's metric series (``GET /runs/{id}/metrics``: TRL's logged
values, ``reward_mean``/``reward_std``/…, ``reward/<function>``, ``step_seconds``, …) are
the names the worker records; then it is stopped. One run is created over HTTP and given,
through SQL, what 2,400 steps of the real pipeline leave: ``metric_points`` for those names
(and ``eval_reward`` every 100 steps), and the run's events (per step a ``step`` event and
its three ``status`` events); the run is then ``training`` at step 2,400 of 3,000 under a
lease named ``bench``.

First render: Debian's chromium (headless, through Playwright with ``executable_path``),
a fresh browser context each time (nothing cached), the key in sessionStorage, then
``/ui/runs/{id}``. Browser time is the page's own ``trainyard:run:rendered`` mark (the
charts have their 2,400 points, checkpoints and inputs are shown) on the Navigation
Timing clock, i.e. from the start of the navigation; also the time to DOMContentLoaded.
Server time is the sum and the slowest of the API's own access-log durations
(``duration_ms``) for the requests that render needed (run, metrics, checkpoints, inputs).

Commit to chart: with the page open, each step is committed exactly as the worker commits
it (``app.runs.lifecycle.step_moves.step_finished`` under the run's lease: its metrics, summary and
``step`` event in one statement), after putting the run back in ``training`` as the
trainer would. The latency is from just after the commit returns to the page's
``trainyard:step-drawn:<step>`` mark (the chart's setData done), both on this machine's
clock.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import kit
from kit import OUT, log
from kit.machine import machine_description, trainyard_version, wait_for_quiet
from kit.processes import stop_on_exit
from kit.report import command_line, markers, utc_now, write_section
from kit.trainyard import LETTERS, Trainyard, add_trainyard_args, model_for, preset_run

from app.core.pg import connect_kwargs, init_connection
from app.runs.lifecycle import step_moves
from app.runs.lifecycle.state import Fence
from tests.support.browser import launch

MARK_START, MARK_END = markers("dashboard")
FIRST_RENDER_TARGET_MS = 500.0
COMMIT_TARGET_MS = 1000.0
RENDER_ROUTES = (
    "/runs/{run_id}",
    "/runs/{run_id}/metrics",
    "/runs/{run_id}/checkpoints",
    "/runs/{run_id}/inputs",
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=2400, help="steps of metrics the run has")
    p.add_argument("--renders", type=int, default=7, help="first renders measured")
    p.add_argument("--commits", type=int, default=10, help="step commits measured")
    p.add_argument(
        "--output",
        type=Path,
        default=OUT / "dashboard.md",
        help="markdown file whose dashboard section is replaced (docs/benchmarks.md to publish)",
    )
    add_trainyard_args(
        p,
        databases="bench_dashboard",
        redis_db=15,
        broker_prefix="bench-dashboard:",
        settle_timeout=60.0,
        start_timeout=120.0,
    )
    return p.parse_args()


def recorded_names(args: argparse.Namespace, ty: Trainyard, home: Path) -> list[str]:
    """The metric names the worker records at a step: one step of configs/runs/letters.yaml
    trained on the tiny model by a worker started for it and stopped after, and its series
    read back (``GET /runs/{id}/metrics``)."""
    model = model_for(args, home)
    worker = ty.start_worker(timeout=args.start_timeout)
    run = ty.create_run(preset_run(LETTERS, model, steps=1, save_steps=2, name="bench-names"))
    ty.wait_for_run(run["id"], every=0.5, timeout=600.0)  # imports TRL, loads the model
    worker.stop()
    names = sorted(ty.metrics(run["id"]))
    log(f"the worker records {len(names)} series a step: {', '.join(names)}")
    return names


def step_values(names: list[str], step: int, rng: random.Random) -> dict[str, float]:
    """A value for each of ``names``, the ones the page draws shaped as a run's are."""
    progress = step / 3000
    mean = 0.2 + 0.6 * progress + rng.gauss(0, 0.02)
    std = 0.15 + rng.gauss(0, 0.01)
    values = {name: rng.random() for name in names}
    shaped = {
        "reward": mean,
        "reward_mean": mean,
        "reward_std": std,
        "reward_min": mean - 2 * std,
        "reward_max": mean + 2 * std,
        "loss": rng.gauss(0, 0.05),
        "kl": abs(rng.gauss(0.01, 0.005)),
        "entropy": 3 - 2 * progress,
        "step_seconds": 0.4 + rng.random() * 0.1,
        "rewards/trainyard/mean": mean,
    }
    values.update((k, v) for k, v in shaped.items() if k in values)
    return values


async def fill(db_url: str, run_id: str, steps: int, names: list[str]) -> None:
    """Metric points and events of ``steps`` steps, and the run in training at the last."""
    rng = random.Random(7)
    points: list[tuple[Any, ...]] = []
    events: list[tuple[Any, ...]] = []
    rid = uuid.UUID(run_id)
    for step in range(1, steps + 1):
        for name, value in step_values(names, step, rng).items():
            points.append((rid, step, name, float(value)))
        if step % 100 == 0:
            points.append((rid, step, "eval_reward", 0.2 + 0.5 * step / 3000))
        for to in ("collecting", "scoring", "training"):
            events.append((rid, "status", "info", f"step {step}: {to}", json.dumps({"to": to})))
        events.append((rid, "step", "info", f"step {step}/3000 done", json.dumps({"step": step})))
    conn = await asyncpg.connect(**connect_kwargs(db_url))
    try:
        async with conn.transaction():
            await conn.copy_records_to_table(
                "metric_points", records=points, columns=["run_id", "step", "name", "value"]
            )
            await conn.executemany(
                "INSERT INTO run_events (run_id, type, level, message, data)"
                " VALUES ($1, $2, $3, $4, $5::jsonb)",
                events,
            )
            await conn.execute(
                "UPDATE runs SET status = 'training', step = $2, attempt = 1,"
                " lease_owner = 'bench', lease_expires_at = now() + interval '1 hour',"
                " started_at = now() - interval '20 minutes' WHERE id = $1",
                rid,
                steps,
            )
    finally:
        await conn.close()
    log(f"inserted {len(points)} metric points and {len(events)} events")


def size_of(path: Path) -> int:
    return path.stat().st_size


def access_lines(log_path: Path, start: int) -> list[dict[str, Any]]:
    """The API's JSON access lines written since byte ``start`` of its log."""
    lines = []
    with log_path.open("rb") as f:
        f.seek(start)
        for raw in f.read().decode(errors="replace").splitlines():
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if isinstance(line, dict) and "duration_ms" in line and "route" in line:
                lines.append(line)
    return lines


async def first_renders(
    browser: Any, base: str, key: str, run_id: str, log_path: Path, n: int
) -> list[dict[str, float]]:
    out = []
    for i in range(n):
        context = await browser.new_context(viewport={"width": 1440, "height": 1000})
        await context.add_init_script(f"sessionStorage.setItem('trainyard.key', {key!r})")
        page = await context.new_page()
        offset = size_of(log_path)
        await page.goto(f"{base}/ui/runs/{run_id}")
        deadline = time.monotonic() + 60
        while not await page.evaluate("() => window.trainyard && window.trainyard.ready"):
            if time.monotonic() > deadline:
                raise RuntimeError("the run page never rendered")
            await asyncio.sleep(0.02)
        timing = await page.evaluate(
            """() => {
                const nav = performance.getEntriesByType('navigation')[0];
                const mark = (n) => performance.getEntriesByName(n)[0]?.startTime ?? null;
                const u = window.trainyard.charts['run:reward'];
                return {
                    rendered: mark('trainyard:run:rendered'),
                    charts: mark('trainyard:run:charts'),
                    dom: nav.domContentLoadedEventEnd,
                    html: nav.responseEnd,
                    points: u.data[0].length,
                };
            }"""
        )
        await asyncio.sleep(0.3)  # the access lines of the last answers
        lines = [
            line
            for line in access_lines(log_path, offset)
            if line["route"] in RENDER_ROUTES and line.get("method") == "GET"
        ]
        server = [float(line["duration_ms"]) for line in lines]
        metrics_ms = [
            float(line["duration_ms"]) for line in lines if line["route"].endswith("/metrics")
        ]
        row = {
            "browser_ms": float(timing["rendered"]),
            "charts_ms": float(timing["charts"]),
            "dom_ms": float(timing["dom"]),
            "server_sum_ms": sum(server),
            "server_max_ms": max(server) if server else math.nan,
            "metrics_ms": max(metrics_ms) if metrics_ms else math.nan,
            "requests": float(len(server)),
            "points": float(timing["points"]),
        }
        log(
            f"render {i + 1}/{n}: browser {row['browser_ms']:.0f} ms, server "
            f"{row['server_sum_ms']:.1f} ms in {len(server)} requests"
        )
        out.append(row)
        await context.close()
    return out


# What the run page does on every step of a 10,000-step run with 10 series: merge the new
# point into its store, align the columns, setData, and let uPlot draw (its redraw runs in a
# microtask; a zero timeout lets it finish).
SMOOTHNESS_JS = """async ({steps, series, updates}) => {
    const { Chart, MetricStore, align } = await import('/ui/static/js/charts.js');
    const names = Array.from({length: series}, (_, j) => 's' + j);
    const chart = new Chart('bench:smooth', 'bench', names.map((label) => ({label})));
    document.getElementById('main').prepend(chart.el);
    chart.resize();
    const store = new MetricStore();
    const fill = {};
    for (const [j, name] of names.entries()) {
        const xs = Array.from({length: steps}, (_, i) => i + 1);
        fill[name] = {steps: xs, values: xs.map((x) => Math.sin(x / 97 + j) + j)};
    }
    const flush = () => new Promise((resolve) => setTimeout(resolve, 0));
    let t = performance.now();
    store.merge(fill);
    chart.setData(align(names.map((n) => store.get(n))));
    await flush();
    const first = performance.now() - t;
    const each = [];
    for (let k = 1; k <= updates; k++) {
        const step = steps + k;
        const fresh = {};
        for (const [j, name] of names.entries())
            fresh[name] = {steps: [step], values: [Math.sin(step / 97 + j) + j]};
        t = performance.now();
        store.merge(fresh);
        chart.setData(align(names.map((n) => store.get(n))));
        await flush();
        each.push(performance.now() - t);
    }
    const drawn = chart.u.data[0].length;
    chart.destroy();
    return {first, each, drawn};
}"""


async def commits(
    browser: Any,
    base: str,
    key: str,
    run_id: str,
    db_url: str,
    steps: int,
    n: int,
    names: list[str],
) -> tuple[list[float], dict[str, Any]]:
    context = await browser.new_context(viewport={"width": 1440, "height": 1000})
    await context.add_init_script(f"sessionStorage.setItem('trainyard.key', {key!r})")
    page = await context.new_page()
    await page.goto(f"{base}/ui/runs/{run_id}")
    deadline = time.monotonic() + 60
    live = "() => window.trainyard?.ready && document.getElementById('live-state')?.dataset.state"
    while await page.evaluate(live) != "live":
        if time.monotonic() > deadline:
            raise RuntimeError("the run page never followed the stream")
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)  # the stream's replay of the old events is over
    conn = await asyncpg.connect(**connect_kwargs(db_url))
    await init_connection(conn)
    rng = random.Random(11)
    latencies = []
    rid = uuid.UUID(run_id)
    try:
        for k in range(1, n + 1):
            step = steps + k
            await conn.execute("UPDATE runs SET status = 'training' WHERE id = $1", rid)
            values = step_values(names, step, rng)
            await step_moves.step_finished(
                conn,
                rid,
                Fence(owner="bench", attempt=1),
                step,
                0,
                metrics=values,
                summary={"step": step, "avg_reward": values["reward_mean"]},
                last=False,
                event=f"step {step}/3000 done: reward {values['reward_mean']:.3f}",
                ttl_seconds=3600,
            )
            committed = time.time() * 1000
            mark = f"trainyard:step-drawn:{step}"
            deadline = time.monotonic() + 10
            drawn = None
            while drawn is None:
                drawn = await page.evaluate(
                    "(name) => { const m = performance.getEntriesByName(name)[0];"
                    " return m ? performance.timeOrigin + m.startTime : null; }",
                    mark,
                )
                if drawn is None:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"step {step} never reached the chart")
                    await asyncio.sleep(0.005)
            latencies.append(float(drawn) - committed)
            log(f"step {step}: commit to chart {latencies[-1]:.0f} ms")
            await asyncio.sleep(0.5 + rng.random() * 0.5)
        smooth = await page.evaluate(SMOOTHNESS_JS, {"steps": 10_000, "series": 10, "updates": 30})
    finally:
        await conn.close()
        await context.close()
    assert smooth["drawn"] == 10_030, smooth["drawn"]
    return latencies, smooth


def render_section(
    args: argparse.Namespace,
    renders: list[dict[str, float]],
    lat: list[float],
    smooth: dict[str, Any],
    names: list[str],
) -> str:
    def med(name: str) -> float:
        return statistics.median(r[name] for r in renders)

    def worst(name: str) -> float:
        return max(r[name] for r in renders)

    browser_ok = worst("browser_ms") <= FIRST_RENDER_TARGET_MS
    lat_ok = max(lat) <= COMMIT_TARGET_MS
    rows = [
        ("browser: navigation start → run page rendered", med("browser_ms"), worst("browser_ms")),
        ("browser: navigation start → charts drawn", med("charts_ms"), worst("charts_ms")),
        ("browser: navigation start → DOMContentLoaded", med("dom_ms"), worst("dom_ms")),
        ("server: the render's API requests, summed", med("server_sum_ms"), worst("server_sum_ms")),
        ("server: slowest of them", med("server_max_ms"), worst("server_max_ms")),
        ("server: GET /runs/{id}/metrics", med("metrics_ms"), worst("metrics_ms")),
    ]
    table = "\n".join(f"| {what} | {m:.1f} | {w:.1f} |" for what, m, w in rows)
    return f"""{MARK_START}
### Dashboard: the run page (`bench/dashboard.py`)

{utc_now()}, {machine_description()}, Trainyard {trainyard_version()}:
`{command_line("dashboard.py")}`

A run with {args.steps:,} steps of metrics ({int(renders[0]["points"]):,} points per chart,
{len(names) + 1} series stored per step), first render in a fresh Chromium context,
{len(renders)} times; {int(statistics.median(r["requests"] for r in renders))} API requests
per render (median; they run in parallel, so their sum exceeds the wall time).

| first render (ms) | median | worst |
|---|---|---|
{table}

Target ≤ {FIRST_RENDER_TARGET_MS:.0f} ms: **{"met" if browser_ok else "missed"}** (on the
worst browser time, which contains the server's).

A step's commit (`step_moves.step_finished`, as the worker commits it) to its point on the
chart, {len(lat)} steps: median {statistics.median(lat):.0f} ms, worst {max(lat):.0f} ms.
Target ≤ {COMMIT_TARGET_MS:.0f} ms: **{"met" if lat_ok else "missed"}**.

Smoothness: one chart of 10 series × 10,000 steps (what the run page does per step: merge
the point, align the columns, `setData`, uPlot's redraw): first draw
{smooth["first"]:.0f} ms, then per new step median {statistics.median(smooth["each"]):.1f} ms,
worst {max(smooth["each"]):.1f} ms over {len(smooth["each"])} steps (a frame is 16.7 ms).
{MARK_END}
"""


async def measure(
    args: argparse.Namespace, ty: Trainyard, run_id: str, names: list[str]
) -> tuple[list[dict[str, float]], list[float], dict[str, Any]]:
    from playwright.async_api import async_playwright

    assert ty.api is not None
    api = ty.api
    await fill(ty.db_url, run_id, args.steps, names)
    await asyncio.to_thread(wait_for_quiet, args.settle_timeout)
    async with async_playwright() as p:
        browser = await launch(p)
        try:
            # One unmeasured render: the API's first requests warm its pools and caches.
            await first_renders(browser, api.base_url, ty.key, run_id, api.log_path, 1)
            renders = await first_renders(
                browser, api.base_url, ty.key, run_id, api.log_path, args.renders
            )
            latencies, smooth = await commits(
                browser, api.base_url, ty.key, run_id, ty.db_url, args.steps, args.commits, names
            )
        finally:
            await browser.close()
    return renders, latencies, smooth


def main() -> int:
    args = parse_args()
    servers: list[Any] = []
    home = Path(tempfile.mkdtemp(prefix="bench-dashboard-"))
    with stop_on_exit(servers):
        ty = Trainyard(
            args,
            name="dashboard",
            db_name="bench_dashboard",
            servers=servers,
            home=home,
            env={"TRAINYARD_LOG_FORMAT": "json", "TRAINYARD_RATE_LIMIT_PER_SECOND": "0"},
        )
        ty.prepare()
        ty.start_api(timeout=args.start_timeout)
        names = recorded_names(args, ty, home)
        run = ty.create_run(
            {
                "model_name": "tiny-llama",
                "task_description": "benchmark run",
                "trained_model_name": "bench-dashboard",
                "max_steps": 3000,
                "inputs": [{"input_text": f"input {i}"} for i in range(40)],
                "reward": {"type": "function", "functions": [{"name": "char_fraction"}]},
            }
        )
        renders, latencies, smooth = asyncio.run(measure(args, ty, run["id"], names))
    section = render_section(args, renders, latencies, smooth, names)
    print(section)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "dashboard.json").write_text(
        json.dumps(
            {
                "metric_names": names,
                "renders": renders,
                "commit_to_chart_ms": latencies,
                "smoothness": smooth,
            },
            indent=2,
        )
    )
    write_section(args.output, section, MARK_START, MARK_END)
    log(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    kit.run(main)
