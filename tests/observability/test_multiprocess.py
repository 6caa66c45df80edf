"""Metrics across processes: the API under ``uvicorn --workers 2`` and a real Celery worker
training on the tiny model, all writing to one ``PROMETHEUS_MULTIPROC_DIR``, seen summed in
one scrape."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import multiprocess

from app.observability import prometheus
from tests.support.api_process import api_process
from tests.support.cli import free_port, wait_for
from tests.support.database import Tenant, api, own_database, sessionmaker  # noqa: F401
from tests.support.prometheus import value
from tests.support.runs import wait_for as wait_for_run
from tests.support.workers import letters_run, start_worker, tiny_model  # noqa: F401

REQUESTS = "trainyard_http_requests_total"


async def scraped_steps(client: httpx.AsyncClient) -> float:
    return value((await client.get("/metrics")).text, "trainyard_training_steps_total")


def uvicorn_api(folder: Path, log: Path, **env: str) -> Any:
    """The API under ``uvicorn --workers 2`` with ``folder`` as its multiprocess directory."""
    return api_process(log, {**env, prometheus.MULTIPROC_ENV: str(folder)}, workers=2, uvicorn=True)


def healthz_by_process(folder: Path) -> dict[str, float]:
    """``GET /healthz`` answered per process, read from each process's own file."""
    counts = {}
    for path in folder.glob("counter_*.db"):
        merged = multiprocess.MultiProcessCollector.merge([str(path)], accumulate=True)
        counts[path.stem.removeprefix("counter_")] = sum(
            s.value
            for metric in merged
            for s in metric.samples
            if s.name == REQUESTS and s.labels.get("route") == "/healthz"
        )
    return counts


def test_two_api_processes_are_summed_in_one_scrape(
    service_urls: tuple[str, str], tmp_path: Path
) -> None:
    folder = prometheus.prepare_multiprocess_dir(tmp_path / "prometheus")
    with uvicorn_api(folder, tmp_path / "api.log") as server:
        base = server.url
        sent = 0

        def both_answered() -> bool:
            # A new connection per request: the kernel hands each to either process.
            nonlocal sent
            for _ in range(5):
                assert httpx.get(f"{base}/healthz").status_code == 200
                sent += 1
            per_process = healthz_by_process(folder)
            return len([n for n in per_process.values() if n > 0]) >= 2

        wait_for("both API processes to answer", both_answered, 30, tmp_path / "api.log")

        def all_counted() -> bool:  # each process records its requests a batch at a time
            return sum(healthz_by_process(folder).values()) == sent

        wait_for("every request counted", all_counted, 10, tmp_path / "api.log")
        text = httpx.get(f"{base}/metrics").text  # answered by one of them
        assert value(text, REQUESTS, method="GET", route="/healthz", status="200") == sent
        timed = "trainyard_http_request_duration_seconds_count"
        assert value(text, timed, route="/healthz") == sent


async def test_step_and_rollout_counters_move_during_a_real_run(
    own_database: Any,  # noqa: F811
    make_tenant: Any,
    sessionmaker: Any,  # noqa: F811
    start_worker: Any,  # noqa: F811
    tiny_model: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The issue's "done when": /metrics of the API (2 processes) during a real run on the
    tiny model shows the worker's step and rollout counters moving."""
    folder = prometheus.prepare_multiprocess_dir(tmp_path / "prometheus")
    worker_port = free_port()
    start_worker(
        TRAINYARD_PIPELINE="workers.pipeline:run_pipeline",
        TRAINYARD_HOME=str(tmp_path / "home"),
        TRAINYARD_WORKER_METRICS_PORT=str(worker_port),
        **{prometheus.MULTIPROC_ENV: str(folder)},
    )
    tenant: Tenant = await make_tenant()
    body = letters_run(tiny_model, max_steps=2000, grpo={"save_steps": 10_000})
    per_step = body["grpo"]["groups_per_step"] * body["rollouts_per_group"]
    with uvicorn_api(folder, tmp_path / "api.log", **own_database.env()) as server:
        async with httpx.AsyncClient(base_url=server.url, headers=tenant.headers) as client:
            run = (await client.post("/runs", json=body)).json()
            seen = [await scraped_steps(client)]
            deadline = time.monotonic() + 180  # only turns a hang into a failure
            while seen[-1] < 3:
                assert time.monotonic() < deadline, (tmp_path / "api.log").read_text()[-3000:]
                await asyncio.sleep(0.1)
                seen.append(await scraped_steps(client))
            assert seen == sorted(seen)  # counters only move up
            # 2000 steps: the run is still going while its counters moved.
            assert (await client.get(f"/runs/{run['id']}")).json()["status"] not in {
                "completed",
                "failed",
                "cancelled",
            }
            assert (await client.post(f"/runs/{run['id']}/cancel")).status_code == 200
            done = await wait_for_run(
                sessionmaker, run["id"], lambda r: r.status == "cancelled", within=60
            )
            text = (await client.get("/metrics")).text
        # The worker's own port serves the same merged values.
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{worker_port}") as worker:
            own = (await worker.get("/metrics")).text
    steps = value(text, "trainyard_training_steps_total")
    # Counted at each step's end; the run's step is stored a moment later, so a cancel
    # can land between the two for the last step.
    assert done.step >= 3 and steps in {done.step, done.step + 1}
    assert value(text, "trainyard_rollouts_total") == steps * per_step
    assert value(text, "trainyard_step_duration_seconds_count") == steps
    assert value(text, "trainyard_completion_tokens_total") > 0
    assert value(text, REQUESTS, route="/runs", method="POST", status="202") == 1
    assert value(own, "trainyard_training_steps_total") == steps


def test_the_scrapes_merge_exposes_what_the_librarys_does(tmp_path: Path) -> None:
    """The scrape's own merge of the process files (one pass, keys parsed once and kept
    between scrapes) and its text format give exactly the library's exposition, for every
    kind of file and gauge mode, and follow the values as they change."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    from app.observability.prometheus import _MergingCollector

    def write(pid: int, step: float) -> None:
        files = {
            typ: MmapedDict(str(tmp_path / f"{typ}_{pid}.db"))
            for typ in ("counter", "histogram", "summary")
        }
        for route in ("/runs", "/runs/{run_id}"):
            key = mmap_key("req", "req_total", ["route"], [route], "Requests.")
            files["counter"].write_value(key, 3 * step + pid, 0)
            # Bounds out of order, as a process writes them when first observed.
            for le, count in (("1.0", 2), ("+Inf", 3), ("0.1", 1)):
                bucket = mmap_key("lat", "lat_bucket", ["route", "le"], [route, le], "Latency.")
                files["histogram"].write_value(bucket, step + count, 0)
            total = mmap_key("lat", "lat_sum", ["route"], [route], "Latency.")
            files["histogram"].write_value(total, 0.5 * step, 0)
        for part in ("count", "sum"):
            key = mmap_key("size", f"size_{part}", ["kind"], ["json"], "Sizes.")
            files["summary"].write_value(key, step * pid, 0)
        for mode in ("all", "liveall", "min", "max", "livesum", "mostrecent", "livemostrecent"):
            gauge = MmapedDict(str(tmp_path / f"gauge_{mode}_{pid}.db"))
            for queue in ("gpu", "control"):
                key = mmap_key(mode, mode, ["queue"], [queue], f"A {mode} gauge.")
                # A later process wins "most recent" on even steps, an earlier one on odd.
                at = pid * step if step % 2 == 0 else (1000 - pid) * step
                spread = {"min": (5, 1, 9), "max": (5, 9, 1)}.get(mode, (pid, pid, pid))
                gauge.write_value(key, step * spread[pid - 101] + len(queue), at)
            files[mode] = gauge
        for mapped in files.values():
            mapped.close()

    ours, theirs = CollectorRegistry(), CollectorRegistry()
    _MergingCollector(ours, path=str(tmp_path))
    multiprocess.MultiProcessCollector(theirs, path=str(tmp_path))
    for step in (1.0, 2.0, 5.0):  # the second and third scrapes use the cached keys
        for pid in (101, 102, 103):
            write(pid, step)
        assert prometheus._TextFormat()(ours) == generate_latest(theirs)
        text = generate_latest(ours).decode()
        assert f'req_total{{route="/runs"}} {3 * 3 * step + 306}' in text
        assert f'lat_bucket{{le="1.0",route="/runs"}} {3 * (2 * step + 3)}' in text
        assert f'lat_count{{route="/runs"}} {3 * (3 * step + 6)}' in text
        newest = 103 if step % 2 == 0 else 101
        assert f'mostrecent{{queue="gpu"}} {step * newest + 3}' in text
        assert f'min{{queue="gpu"}} {step + 3}' in text
        assert f'max{{queue="gpu"}} {step * 9 + 3}' in text
        assert f'livesum{{queue="gpu"}} {step * (101 + 102 + 103) + 9}' in text
