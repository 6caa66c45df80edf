#!/usr/bin/env python3
"""Pollers while a run trains (issue 5, scenario 14): 200 concurrent clients polling a run
(GET /runs/{id}, a page of its events, its metric series) for 60 s while the run trains on
the real pipeline and writes its trajectories. Targets: zero errors, GET p99 under 50 ms,
and the training step no more than 10 % slower than without the pollers.

One invocation starts PostgreSQL's bench database (``bench_pollers``), the API under uvicorn,
one Celery worker, and a long run of ``configs/runs/letters.yaml`` on the tiny model. After a
warm-up it measures, on the same run and the same machine: ``--baseline`` s without pollers,
``--duration`` s with them, ``--baseline`` s without again, and compares the median step
time of the middle phase with the mean of the two outer ones, so machine noise weighs on
both sides. With ``--pin`` (the default on machines with 4 CPUs or fewer) the worker, and the
PostgreSQL backends serving it, stay on the first CPU and everything else this script
started (API, its backends, the pollers, the harness) on the others; ``--compare-unpinned``
repeats the three phases without pinning. The results replace the section between the
pollers markers in docs/benchmarks.md; a JSON summary goes to stdout. See bench/README.md.

    .venv/bin/python bench/pollers.py                                  # ~4 min
    .venv/bin/python bench/pollers.py --compare-unpinned               # ~6.5 min
    .venv/bin/python bench/pollers.py --duration 10 --pollers 50 --baseline 10 \\
        --output /tmp/p.md                                             # a quick look

Needs PostgreSQL (trust or password auth; the database bench_pollers is dropped and created,
and dropped again at the end unless --keep) and Redis (db 13, keys under a prefix of their
own). Standard library, httpx, psutil, and the project in .venv.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import collections
import contextlib
import dataclasses
import json
import math
import multiprocessing.connection as mpc
import os
import platform
import random
import re
import subprocess
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

import httpx
import kit
from kit import OUT, BenchError, log
from kit.load import ClientFleet, RawHTTP, TransportError, window_cpu
from kit.machine import (
    loadavg,
    package_versions,
    trainyard_version,
    wait_for_other_load,
    wait_for_quiet,
)
from kit.processes import PYSPY_RATE, Server, pyspy, stop_on_exit
from kit.report import (
    add_output_arg,
    fmt_ms,
    fmt_pct,
    markers,
    quantile,
    report_head,
    utc_now,
    verdict,
    write_section,
    written_by,
)
from kit.stores import PG_REFUSED, bench_query, pg_query, pg_version
from kit.trainyard import add_trainyard_args, model_for
from kit.under_load import (
    Phase,
    RunUnderLoad,
    add_run_under_load_args,
    args_json,
    assign_steps,
    comparison,
    cpu_usage,
    cpus_json,
    idle_phase,
    one_at_a_time,
    phases_json,
    render_cpu,
    render_steps,
    resolve_pin,
    snapshot,
    watch,
)

MARK_START, MARK_END = markers("pollers")
DB_NAME = "bench_pollers"
ENDPOINTS = ("run", "events", "metrics")
ENDPOINT_PATHS = {
    "run": "GET /runs/{id}",
    "events": "GET /runs/{id}/events",
    "metrics": "GET /runs/{id}/metrics",
}
TARGET_P99_MS = 50.0
TARGET_SLOWDOWN = 0.10


# ---------------------------------------------------------------------------- the pollers


@dataclasses.dataclass
class PollerConfig:
    """What one client process runs: ``pollers`` loops sharing one httpx client."""

    base_url: str
    key: str
    run_id: str
    pollers: int
    first_index: int
    connections: int
    interval: float
    ramp: float
    duration: float
    events_limit: int
    metric_names: list[str]
    metrics_window: int
    timeout: float
    seed: int
    client: str  # "raw" (RawHTTP) or "httpx"
    conditional: bool = False  # If-None-Match with the ETag of the URL's last answer


@dataclasses.dataclass
class PollerResult:
    """Every request started inside the window [start, start + duration): its start (s after
    ``start``), endpoint index, latency (ms) and status (0: transport error)."""

    start: float
    end: float
    t: array.array[float]
    endpoint: array.array[int]
    ms: array.array[float]
    status: array.array[int]
    errors: dict[str, int]  # "endpoint: what" -> count
    lag_ms: array.array[float]  # how late each cycle started against its schedule
    cpu_seconds: float  # the client process, user + system, over the window
    wall_seconds: float


async def _poll(cfg: PollerConfig, conn: mpc.Connection) -> PollerResult:
    t_rec: array.array[float] = array.array("d")
    e_rec: array.array[int] = array.array("b")
    ms_rec: array.array[float] = array.array("d")
    s_rec: array.array[int] = array.array("h")
    lag: array.array[float] = array.array("d")
    errors: collections.Counter[str] = collections.Counter()
    # The ETag of each poller's last answer per URL (events and metrics; the run has none).
    tags: list[dict[str, bytes]] = [{} for _ in range(cfg.pollers)]
    shared = (
        httpx.AsyncClient(
            base_url=cfg.base_url,
            headers={"Authorization": f"Bearer {cfg.key}"},
            limits=httpx.Limits(
                max_connections=cfg.connections, max_keepalive_connections=cfg.connections
            ),
            timeout=cfg.timeout,
        )
        if cfg.client == "httpx"
        else None
    )
    conn.send("ready")
    loop = asyncio.get_running_loop()
    start_at: float = await loop.run_in_executor(None, conn.recv)  # time.time() epoch
    ramp_at = start_at - cfg.ramp
    end_at = start_at + cfg.duration

    async def fetch(raw: RawHTTP | None, target: str, tag: bytes) -> tuple[int, bytes, bytes]:
        if raw is not None:
            return await raw.request(target, b"If-None-Match: " + tag + b"\r\n" if tag else b"")
        assert shared is not None
        try:
            r = await shared.get(target, headers={"If-None-Match": tag.decode()} if tag else None)
        except httpx.HTTPError as e:
            raise TransportError(type(e).__name__) from e
        return r.status_code, r.headers.get("etag", "").encode(), r.content

    async def get(raw: RawHTTP | None, n: int, i: int, target: str) -> Any:
        """GET ``target`` (poller ``n``; conditional if ``cfg.conditional``); records it when
        it starts inside the window; the decoded JSON of a 200, else None (a 304 too)."""
        wall = time.time()
        t0 = time.perf_counter()
        mine = tags[n - cfg.first_index]
        try:
            status, tag, body = await fetch(raw, target, mine.get(target, b""))
            if cfg.conditional and tag:
                mine[target] = tag
        except TransportError as e:
            status, body = 0, b""
            if start_at <= wall < end_at:
                errors[f"{ENDPOINTS[i]}: {e}"] += 1
        elapsed = (time.perf_counter() - t0) * 1e3
        if start_at <= wall < end_at:
            t_rec.append(wall - start_at)
            e_rec.append(i)
            ms_rec.append(elapsed)
            s_rec.append(status)
            if status and not answered(status):
                errors[f"{ENDPOINTS[i]}: HTTP {status}"] += 1
        return json.loads(body) if status == 200 else None

    async def poller(n: int) -> None:
        rng = random.Random(cfg.seed * 100_003 + n)
        raw = RawHTTP(cfg.base_url, cfg.key, cfg.timeout) if shared is None else None
        # Staggered starts: spread over one interval (or the ramp for a closed loop).
        spread = cfg.interval if cfg.interval > 0 else max(cfg.ramp, 0.1)
        next_at = ramp_at + rng.random() * spread
        cursor: str | None = None
        step = 0
        run_path = f"/runs/{cfg.run_id}"
        names = [("name", m) for m in cfg.metric_names]
        try:
            while True:
                now = time.time()
                if now >= end_at:
                    return
                if next_at > now:
                    await asyncio.sleep(next_at - now)
                began = time.time()
                if began >= end_at:
                    return
                if start_at <= began and cfg.interval > 0:
                    lag.append((began - next_at) * 1e3)
                run = await get(raw, n, 0, run_path)
                if run is not None:
                    step = int(run.get("step") or 0)
                query: list[tuple[str, str | int]] = [("limit", cfg.events_limit)]
                if cursor:
                    query.append(("after", cursor))
                page = await get(raw, n, 1, f"{run_path}/events?{urllib.parse.urlencode(query)}")
                # Tail the log: move on only past full pages (the rest is re-read, up to a
                # page, until it fills), as a client without its own cursor would.
                if page is not None and page.get("has_more") and page.get("next_cursor"):
                    cursor = page["next_cursor"]
                query = list(names)
                if cfg.metrics_window > 0:
                    query.append(("step_min", max(0, step - cfg.metrics_window + 1)))
                await get(raw, n, 2, f"{run_path}/metrics?{urllib.parse.urlencode(query)}")
                next_at = max(next_at + cfg.interval, time.time()) if cfg.interval > 0 else 0.0
        finally:
            if raw is not None:
                raw.close()

    try:
        cpu_task = asyncio.create_task(window_cpu(start_at, end_at))
        await asyncio.gather(*(poller(cfg.first_index + n) for n in range(cfg.pollers)))
        cpu, wall = await cpu_task
    finally:
        if shared is not None:
            await shared.aclose()
    return PollerResult(
        start=start_at,
        end=end_at,
        t=t_rec,
        endpoint=e_rec,
        ms=ms_rec,
        status=s_rec,
        errors=dict(errors),
        lag_ms=lag,
        cpu_seconds=cpu,
        wall_seconds=wall,
    )


class PollerFleet(ClientFleet):
    """The pollers, spread over ``--client-procs`` client processes."""

    what = "poller process"

    def __init__(
        self,
        args: argparse.Namespace,
        base_url: str,
        key: str,
        run_id: str,
        duration: float,
        *,
        conditional: bool = False,
    ) -> None:
        self.ramp = args.ramp
        n_procs = max(1, min(args.client_procs, args.pollers))
        share, extra = divmod(args.pollers, n_procs)
        conns_share, conns_extra = divmod(args.connections, n_procs)
        configs = []
        first = 0
        for k in range(n_procs):
            n = share + (1 if k < extra else 0)
            configs.append(
                PollerConfig(
                    base_url=base_url,
                    key=key,
                    run_id=run_id,
                    pollers=n,
                    first_index=first,
                    connections=max(1, conns_share + (1 if k < conns_extra else 0)),
                    interval=args.interval,
                    ramp=args.ramp,
                    duration=duration,
                    events_limit=args.events_limit,
                    metric_names=args.metric_names,
                    metrics_window=args.metrics_window,
                    timeout=args.request_timeout,
                    seed=args.seed,
                    client=args.client,
                    conditional=conditional,
                )
            )
            first += n
        super().__init__(_poll, configs)

    def start(self, ready_timeout: float, lead: float | None = None) -> float:
        """Wait until every process is ready; returns the start of the measured window."""
        return super().start(ready_timeout, 0.5 + self.ramp if lead is None else lead)

    def collect(self, timeout: float) -> list[PollerResult]:
        return [PollerResult(**r) for r in super().collect(timeout)]


# ------------------------------------------------------------------------------- the phases


def poller_phase(
    config: str,
    args: argparse.Namespace,
    services: RunUnderLoad,
    run_id: str,
    *,
    name: str = "with pollers",
    duration: float | None = None,
    profile: bool = False,
    conditional: bool = False,
) -> Phase:
    """Pollers for ``duration`` s (default --duration); with ``profile``, py-spy on every API
    worker process for the same window (its raw stacks go to bench/out/); ``conditional``:
    each sends the ETag of its last answer to a URL as ``If-None-Match`` (bench/watchers.py)."""
    assert services.api is not None
    roles = services.roles
    duration = duration or args.duration
    log(
        f"{config}: {name}, {args.pollers} pollers in {args.client_procs} process(es),"
        f" every {args.interval:g} s, {duration:g} s (+{args.ramp:g} s ramp)"
    )
    fleet = PollerFleet(
        args, services.base_url, services.key, run_id, duration, conditional=conditional
    )
    spies: list[subprocess.Popen[bytes]] = []
    try:
        with roles.lock:
            roles.roots["clients"] = fleet.pids
        if services.pinner is not None:
            services.pinner.apply()
        start_at = fleet.start(ready_timeout=args.start_timeout)
        time.sleep(max(0.0, start_at - time.time()))
        if profile:
            spies = start_profilers(services, duration)
        sessions = db_sessions(services)
        a = snapshot(roles)
        end_at = start_at + duration
        seen = watch(end_at, services, run_id)
        b = snapshot(roles)
        results = fleet.collect(timeout=args.request_timeout + 60)
        for spy in spies:
            with contextlib.suppress(subprocess.TimeoutExpired):
                spy.wait(timeout=30)
    finally:
        fleet.kill()
        for spy in spies:
            if spy.poll() is None:
                spy.kill()
                spy.wait()
        with roles.lock:
            roles.roots["clients"] = []
    cpu = cpu_usage(a, b, sum(r.cpu_seconds for r in results))
    return Phase(
        config,
        name,
        start_at,
        end_at,
        cpu,
        loadavg(),
        results,
        db={**db_probe(services, run_id), "sessions_start": sessions},
        overlap=seen,
    )


def probed_idle_phase(
    config: str, name: str, seconds: float, services: RunUnderLoad, run_id: str
) -> Phase:
    """kit.under_load.idle_phase, with the database probe at its end."""
    sessions = db_sessions(services)
    phase = idle_phase(config, name, seconds, services, run_id)
    phase.db = {**db_probe(services, run_id), "sessions_start": sessions}
    return phase


HANDLERS = {"get_run": "run", "list_run_events": "events", "get_run_metrics": "metrics"}


def start_profilers(services: RunUnderLoad, duration: float) -> list[Any]:
    """py-spy on each API worker process (not uvicorn's supervisor), CPU samples only."""
    spy_bin = pyspy()
    roles = services.roles
    assert services.api is not None
    for old in OUT.glob("pollers-profile-api-*"):
        old.unlink()
    spies = []
    for pid in roles.pids("api"):
        if pid == services.api.proc.pid:
            continue
        out = OUT / f"pollers-profile-api-{pid}.txt"
        cmd = [spy_bin, "record", "--pid", str(pid), "--rate", str(PYSPY_RATE), "--format", "raw"]
        cmd += ["--nonblocking", "--duration", str(math.ceil(duration)), "-o", str(out)]
        log_file = open(OUT / f"pollers-profile-api-{pid}.log", "wb")  # noqa: SIM115
        spies.append(subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT))
        log_file.close()
    with roles.lock:  # py-spy runs beside the API: on its CPUs when pinned
        roles.roots["clients"] = [*roles.roots["clients"], *(s.pid for s in spies)]
    return spies


def stack_part(names: list[str], files: list[str]) -> str:
    """Which part of serving a request a CPU sample of an API worker is in."""
    for name in reversed(names):  # the innermost handler wins
        short = name.rsplit(".", 1)[-1]
        if short in HANDLERS:
            return f"handler: {ENDPOINT_PATHS[HANDLERS[short]]}"
    shorts = {n.rsplit(".", 1)[-1] for n in names}
    if shorts & {"current_principal", "authenticate"}:
        return "API-key check (dependency)"
    if shorts & {"serialize_response", "jsonable_encoder", "_prepare_response_content"}:
        return "response_model validation + JSON (FastAPI, after the handler)"
    if shorts & {"get_read_session", "get_session"}:
        return "database session set-up/teardown (dependency)"
    if shorts & {"solve_dependencies", "request_params_to_args"}:
        return "parameters, other dependencies (FastAPI)"
    if any("/starlette/" in f or "/fastapi/" in f for f in files):
        return "routing, middleware, response (Starlette/FastAPI)"
    if any("/uvicorn/" in f for f in files):
        return "HTTP protocol (uvicorn, httptools)"
    return "event loop, other"


def frame_library(path: str) -> str:
    for key, label in (
        ("/pydantic", "pydantic"),
        ("/sqlalchemy/", "SQLAlchemy"),
        ("/sqlmodel/", "SQLAlchemy"),
        ("/asyncpg/", "asyncpg"),
        ("/fastapi/", "FastAPI"),
        ("/starlette/", "Starlette"),
        ("/uvicorn/", "uvicorn"),
        ("/json/", "json"),
        ("/typing.py", "typing"),
        ("/enum.py", "enum"),
    ):
        if key in path:
            return label
    if path.startswith(("/app/", "/workers/")):
        return "Trainyard (app/)"
    if path.startswith(("/asyncio/", "/multiprocessing/")) or "uvloop" in path:
        return "event loop (uvloop, and the C code it calls)"
    return "other"


def profile_summary(paths: list[Path]) -> dict[str, Any]:
    """CPU seconds of the API workers by part of the request and by the library of the
    innermost Python frame, from py-spy's raw output."""
    parts: collections.Counter[str] = collections.Counter()
    libs: collections.Counter[str] = collections.Counter()
    frame_re = re.compile(r"^(.*) \((.*?)(?::\d+)?\)$")
    for path in paths:
        with contextlib.suppress(OSError):
            for line in path.read_text(errors="replace").splitlines():
                stack, _, count = line.rpartition(" ")
                if not count.isdigit():
                    continue
                frames = [frame_re.match(f) for f in stack.split(";")]
                names = [m.group(1) for m in frames if m]
                # py-spy names files relative to their sys.path entry: sqlalchemy/orm/…
                files = ["/" + m.group(2).lstrip("/") for m in frames if m]
                if not names:
                    continue
                parts[stack_part(names, files)] += int(count)
                libs[frame_library(files[-1])] += int(count)
    return {
        "seconds": sum(parts.values()) / PYSPY_RATE,
        "parts": {k: v / PYSPY_RATE for k, v in parts.most_common()},
        "libraries": {k: v / PYSPY_RATE for k, v in libs.most_common()},
        "files": [p.name for p in paths],
    }


# ----------------------------------------------------------------------------- statistics


def answered(status: int) -> bool:
    """A 2xx, or the 304 of a conditional GET."""
    return 200 <= status < 300 or status == 304


def latency_stats(results: list[PollerResult]) -> dict[str, dict[str, float]]:
    """Per endpoint and overall: requests, req/s, p50/p95/p99/max (ms), errors, 304s."""
    per: dict[str, list[float]] = {e: [] for e in ENDPOINTS}
    errs: dict[str, int] = dict.fromkeys(ENDPOINTS, 0)
    not_modified: dict[str, int] = dict.fromkeys(ENDPOINTS, 0)
    for r in results:
        for i, ms, status in zip(r.endpoint, r.ms, r.status, strict=True):
            if status:  # a response (errors among them); transport errors have no latency
                per[ENDPOINTS[i]].append(ms)
            if not answered(status):
                errs[ENDPOINTS[i]] += 1
            elif status == 304:
                not_modified[ENDPOINTS[i]] += 1
    seconds = max((r.end - r.start for r in results), default=1.0)
    out: dict[str, dict[str, float]] = {}
    for name, values in [*per.items(), ("all", [v for vs in per.values() for v in vs])]:
        errors = sum(errs.values()) if name == "all" else errs[name]
        n304 = sum(not_modified.values()) if name == "all" else not_modified[name]
        out[name] = {
            "not_modified": n304,
            "requests": len(values),
            "rps": len(values) / seconds,
            "p50": quantile(values, 0.50),
            "p95": quantile(values, 0.95),
            "p99": quantile(values, 0.99),
            "max": max(values) if values else float("nan"),
            "errors": errors,
        }
    return out


def slow_seconds(results: list[PollerResult], threshold_ms: float) -> list[tuple[int, int, int]]:
    """Seconds of the window with requests over ``threshold_ms``: (second, slow, all)."""
    slow: collections.Counter[int] = collections.Counter()
    total: collections.Counter[int] = collections.Counter()
    for r in results:
        for t, ms in zip(r.t, r.ms, strict=True):
            total[int(t)] += 1
            if ms > threshold_ms:
                slow[int(t)] += 1
    return sorted((s, slow[s], total[s]) for s in slow)


# ---------------------------------------------------------------------------------- database


def run_lookup_sql(services: RunUnderLoad, run_id: str) -> str:
    """The statement GET /runs/{id} runs (app/runs/repository.py), parameters written out."""
    from app.runs.repository import PUBLIC_COLUMNS

    project = bench_query(services.db_url, f"SELECT project_id FROM runs WHERE id = '{run_id}'")[0]
    return f"SELECT {PUBLIC_COLUMNS} FROM runs WHERE id = '{run_id}' AND project_id = '{project}'"


def db_sessions(services: RunUnderLoad) -> float:
    """Connections opened to the bench database so far (pg_stat_database.sessions)."""
    row = bench_query(
        services.db_url,
        "SELECT sessions FROM pg_stat_database WHERE datname = current_database()",
    )
    return float(row[0]) if row and row[0] is not None else float("nan")


def db_probe(services: RunUnderLoad, run_id: str) -> dict[str, float]:
    """At the end of a phase: what looking the run up costs PostgreSQL now (buffers, ms) and
    the state of the ``runs`` table (dead row versions, autovacuums, HOT updates so far)."""
    plan = "\n".join(
        ln or ""
        for ln in bench_query(
            services.db_url, f"EXPLAIN (ANALYZE, BUFFERS) {run_lookup_sql(services, run_id)}"
        )
    )
    hits = re.search(r"Buffers: shared hit=(\d+)", plan)
    ms = re.search(r"Execution Time: ([\d.]+) ms", plan)
    row = bench_query(
        services.db_url,
        "SELECT json_build_object('dead', n_dead_tup, 'live', n_live_tup, 'upd', n_tup_upd,"
        " 'hot', n_tup_hot_upd, 'autovacuums', autovacuum_count,"
        " 'bytes', pg_relation_size('runs'), 'pkey_bytes', pg_relation_size('runs_pkey'))::text"
        " FROM pg_stat_user_tables WHERE relname = 'runs'",
    )
    stats = json.loads(row[0] or "{}") if row else {}
    return {
        "sessions": db_sessions(services),
        "run_lookup_buffers": float(hits.group(1)) if hits else float("nan"),
        "run_lookup_ms": float(ms.group(1)) if ms else float("nan"),
        **{f"runs_{k}": float(v) for k, v in stats.items()},
    }


def endpoint_costs(
    services: RunUnderLoad, run_id: str, args: argparse.Namespace, n: int
) -> dict[str, dict[str, float]]:
    """Each endpoint alone, one request at a time (keep-alive), once the run has stopped:
    latency without queueing, and the CPU the API and its PostgreSQL backends spend on one
    request (their CPU time over the requests / n)."""
    names: list[tuple[str, str | int]] = [("name", m) for m in args.metric_names]
    step = services.run_state(run_id)[1]
    requests: dict[str, tuple[str, Any]] = {
        "run": (f"/runs/{run_id}", None),
        "events": (f"/runs/{run_id}/events", {"limit": args.events_limit}),
    }
    if args.metrics_window:
        window = [("step_min", max(0, step - args.metrics_window + 1))]
        requests["metrics"] = (f"/runs/{run_id}/metrics", names + window)
    requests["metrics_all"] = (f"/runs/{run_id}/metrics", names)
    out: dict[str, dict[str, float]] = {}
    with services.client() as client:
        for key, (path, params) in requests.items():
            for _ in range(20):  # warm: connection, caches, prepared statements
                client.get(path, params=params).raise_for_status()
            out[key], statuses = one_at_a_time(
                services.roles, n, lambda path=path, params=params: client.get(path, params=params)
            )
            if set(statuses) != {200}:
                raise BenchError(f"GET {path} answered {dict(statuses)}")
    return out


def explain(services: RunUnderLoad, run_id: str, args: argparse.Namespace) -> dict[str, Any]:
    """EXPLAIN ANALYZE of what each endpoint asks PostgreSQL, on the measured run's rows."""
    names = ", ".join("'" + n.replace("'", "''") + "'" for n in args.metric_names)
    step_min = max(0, services.run_state(run_id)[1] - args.metrics_window + 1)
    queries = {
        "run": run_lookup_sql(services, run_id),
        "events": (
            f"SELECT * FROM run_events WHERE run_id = '{run_id}' AND id > 0 ORDER BY id LIMIT 51"
        ),
        "metrics": (
            "SELECT name, step, value FROM metric_points"
            f" WHERE run_id = '{run_id}' AND name IN ({names}) AND step >= {step_min}"
            " ORDER BY name, step LIMIT 100000"
        ),
        "metrics_all": (
            "SELECT name, step, value FROM metric_points"
            f" WHERE run_id = '{run_id}' AND name IN ({names}) ORDER BY name, step LIMIT 100000"
        ),
    }
    if not args.metrics_window:
        del queries["metrics"]
    out: dict[str, Any] = {}
    for key, sql in queries.items():
        plan = [
            ln or "" for ln in bench_query(services.db_url, f"EXPLAIN (ANALYZE, BUFFERS) {sql}")
        ]
        text = "\n".join(plan)
        m = re.search(r"Execution Time: ([\d.]+) ms", text)
        idx = re.findall(
            r"(?:Index (?:Only )?Scan (?:Backward )?using|Bitmap Index Scan on) (\w+)", text
        )
        out[key] = {
            "sql": sql,
            "plan": plan,
            "execution_ms": float(m.group(1)) if m else float("nan"),
            "indexes": sorted(set(idx)),
            "seq_scan": "Seq Scan" in text,
        }
    rows = bench_query(
        services.db_url,
        "SELECT json_build_object("
        f"'events', (SELECT count(*) FROM run_events WHERE run_id = '{run_id}'),"
        f"'metric_points', (SELECT count(*) FROM metric_points WHERE run_id = '{run_id}'),"
        f"'series_points', (SELECT count(*) FROM metric_points WHERE run_id = '{run_id}'"
        f" AND name IN ({names})),"
        f"'trajectories', (SELECT count(*) FROM trajectories WHERE run_id = '{run_id}'))::text",
    )
    out["rows"] = json.loads(rows[0] or "{}") if rows else {}
    return out


# ------------------------------------------------------------------------------------ report


def render_latency(stats: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    rows = [
        "| endpoint | requests | req/s | p50 | p95 | p99 | max | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    names = {
        "run": "`GET /runs/{id}`",
        "events": f"`GET /runs/{{id}}/events?limit={args.events_limit}&after=…`",
        "metrics": "`GET /runs/{id}/metrics?"
        + "&".join(f"name={n}" for n in args.metric_names)
        + ("&step_min=…`" if args.metrics_window else "`"),
        "all": "all",
    }
    for key, s in stats.items():
        label = names[key] if key != "all" else "**all**"
        rows.append(
            f"| {label} | {s['requests']:.0f} | {s['rps']:.0f} | {fmt_ms(s['p50'])} |"
            f" {fmt_ms(s['p95'])} | {fmt_ms(s['p99'])} | {fmt_ms(s['max'])} |"
            f" {s['errors']:.0f} |"
        )
    return "\n".join(rows)


def render_db_probe(phases: list[Phase]) -> str:
    rows = [
        "| end of phase | run lookup: buffers | run lookup: time | `runs` dead row versions |"
        " `runs` updates (HOT) | autovacuums of `runs` | connections opened in the phase |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in phases:
        d = collections.defaultdict(lambda: float("nan"), p.db)
        if not p.db:
            continue
        hot_pct = 100 * d["runs_hot"] / d["runs_upd"] if d["runs_upd"] else float("nan")
        rows.append(
            f"| {p.name} | {d['run_lookup_buffers']:.0f} | {d['run_lookup_ms']:.2f} ms |"
            f" {d['runs_dead']:.0f} | {d['runs_upd']:.0f} ({fmt_pct(hot_pct)}) |"
            f" {d['runs_autovacuums']:.0f} | {d['sessions'] - d['sessions_start']:.0f} |"
        )
    return "\n".join(rows)


def render_costs(
    costs: dict[str, dict[str, float]], args: argparse.Namespace, final_step: int
) -> list[str]:
    if not costs:
        return []
    labels = {
        **ENDPOINT_PATHS,
        "metrics": f"GET /runs/{{id}}/metrics, last {args.metrics_window} steps",
        "metrics_all": f"GET /runs/{{id}}/metrics, whole series ({final_step} steps)",
    }
    lines = [
        f"Each endpoint alone after the run stopped at step {final_step} ({args.cost_requests}"
        " requests one at a time; the pollers' queries, with the first events page, which is"
        " full): latency without queueing, and the CPU one request costs the API process and"
        " its PostgreSQL backend:",
        "",
        "| endpoint | p50 | p99 | API CPU / request | PostgreSQL CPU / request | response |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for key, c in costs.items():
        lines.append(
            f"| {labels[key]} | {fmt_ms(c['p50_ms'])} | {fmt_ms(c['p99_ms'])} |"
            f" {c['api_cpu_ms']:.2f} ms | {c['pg_cpu_ms']:.2f} ms | {c['bytes'] / 1024:.1f} KiB |"
        )
    polled = "metrics" if "metrics" in costs else "metrics_all"
    cycle = sum(costs[k]["api_cpu_ms"] + costs[k]["pg_cpu_ms"] for k in ("run", "events", polled))
    if cycle > 0 and args.interval > 0:
        lines += [
            "",
            f"One poller's cycle (the three GETs as polled) costs {cycle:.1f} ms of CPU (API +"
            f" PostgreSQL), so one core serves about {1000 / cycle * args.interval:.0f} pollers"
            f" polling every {args.interval:g} s, and {args.pollers} pollers need about"
            f" {args.pollers * cycle / 1000 / args.interval:.1f} cores, before the client's own"
            " CPU and with no headroom for queueing.",
        ]
    return [*lines, ""]


def render_profile(profile: dict[str, Any], args: argparse.Namespace) -> list[str]:
    if not profile:
        return []
    total = profile["seconds"] or 1.0
    lat = profile["latency"]
    lines = [
        "### Where the API's CPU goes",
        "",
        f"`--profile`: {args.profile_seconds:g} s more of the same pollers ({profile['config']})"
        f" with py-spy sampling every API worker process at {PYSPY_RATE} Hz (CPU samples only;"
        f" {profile['seconds']:.1f} CPU-seconds sampled; the API used"
        f" {fmt_pct(profile['api_cpu_pct'])} of a core; {lat['rps']:.0f} req/s, p50"
        f" {fmt_ms(lat['p50'])}, p99 {fmt_ms(lat['p99'])} with the profiler attached, not in the"
        " tables above). Raw stacks: `bench/out/pollers-profile-api-*.txt`.",
        "",
        "| part of the request | share of the API's CPU |",
        "|---|---:|",
    ]
    for k, v in profile["parts"].items():
        lines.append(f"| {k} | {100 * v / total:.0f}% |")
    lines += ["", "| innermost Python frame in | share |", "|---|---:|"]
    for k, v in profile["libraries"].items():
        lines.append(f"| {k} | {100 * v / total:.0f}% |")
    return [*lines, ""]


def render_explain(db: dict[str, Any]) -> list[str]:
    rows = db.get("rows", {})
    lines = [
        f"At the end of the run it had {rows.get('events', '?')} events,"
        f" {rows.get('metric_points', '?')} metric points ({rows.get('series_points', '?')} in"
        f" the polled series) and {rows.get('trajectories', '?')} trajectories."
        " `EXPLAIN (ANALYZE, BUFFERS)` of what each endpoint asks (the statements of"
        " `app/runs/repository.py`, `app/events/service.py` and `app/metrics/service.py`,"
        " written out):",
        "",
        "| endpoint | index | execution |",
        "|---|---|---:|",
    ]
    labels = {
        **ENDPOINT_PATHS,
        "metrics": "GET /runs/{id}/metrics (`step_min`)",
        "metrics_all": "GET /runs/{id}/metrics (whole series)",
    }
    for key in labels:
        e = db.get(key)
        if not e:
            continue
        idx = ", ".join(f"`{i}`" for i in e["indexes"]) or (
            "**seq scan**" if e["seq_scan"] else "-"
        )
        lines.append(f"| {labels[key]} | {idx} | {e['execution_ms']:.2f} ms |")
    return lines


def config_results(phases: list[Phase], args: argparse.Namespace) -> dict[str, Any]:
    polls = [r for p in phases for r in p.clients]
    stats = latency_stats(polls)
    cmp_ = comparison(phases)
    lag = [v for r in polls for v in r.lag_ms]
    during = next(p for p in phases if p.name == "with pollers")
    served = stats["all"]["requests"] or 1
    window = during.end - during.start
    return {
        "offered_rps": 3 * args.pollers / args.interval if args.interval > 0 else float("nan"),
        "api_cpu_pct": during.cpu.get("api", float("nan")),
        "pg_api_cpu_pct": during.cpu.get("pg_api", float("nan")),
        "api_cpu_ms_per_request": during.cpu.get("api", float("nan")) / 100 * window / served * 1e3,
        "pg_cpu_ms_per_request": during.cpu.get("pg_api", float("nan"))
        / 100
        * window
        / served
        * 1e3,
        "latency": stats,
        "comparison": cmp_,
        "errors": {k: v for r in polls for k, v in r.errors.items()},
        "schedule_lag_ms": {"p50": quantile(lag, 0.5), "p99": quantile(lag, 0.99)},
        "client_cpu_pct": during.cpu.get("clients", float("nan")),
        "slow_seconds": slow_seconds(polls, TARGET_P99_MS),
        "targets": {
            "zero_errors": stats["all"]["errors"] == 0,
            "p99_under_50ms": all(stats[k]["p99"] < TARGET_P99_MS for k in stats),
            "step_within_10pct": cmp_["slowdown"] <= TARGET_SLOWDOWN,
        },
    }


def render_config(
    label: str, phases: list[Phase], res: dict[str, Any], args: argparse.Namespace
) -> list[str]:
    stats = res["latency"]
    c = res["comparison"]
    n_cpus = len(os.sched_getaffinity(0))
    errors = res["errors"]
    slow = res["slow_seconds"]
    lines = [
        f"### {label}",
        "",
        f"Pollers ({args.duration:g} s, {stats['all']['requests']:.0f} requests,"
        f" {stats['all']['rps']:.0f} req/s; client CPU {fmt_pct(res['client_cpu_pct'])} of a"
        f" core; cycles started {fmt_ms(res['schedule_lag_ms']['p50'])} late in the median,"
        f" {fmt_ms(res['schedule_lag_ms']['p99'])} at p99):",
        "",
        render_latency(stats, args),
        "",
        "Offered "
        + (
            f"{res['offered_rps']:.0f} req/s ({args.pollers} pollers × 3 GETs every"
            f" {args.interval:g} s)"
            if args.interval > 0
            else "as much as the pollers could (closed loops)"
        )
        + f", served {stats['all']['rps']:.0f} req/s. The API's processes used"
        f" {fmt_pct(res['api_cpu_pct'])} of a core ({res['api_cpu_ms_per_request']:.1f} ms of"
        f" CPU per request served), its PostgreSQL backends {fmt_pct(res['pg_api_cpu_pct'])}"
        f" ({res['pg_cpu_ms_per_request']:.1f} ms).",
        "",
    ]
    if errors:
        lines += ["Errors: " + ", ".join(f"{k} × {v}" for k, v in sorted(errors.items())), ""]
    if slow:
        worst = sorted(slow, key=lambda s: -s[1])[:5]
        lines += [
            f"Requests over {TARGET_P99_MS:.0f} ms came in {len(slow)} of the"
            f" {args.duration:.0f} seconds; the worst: "
            + ", ".join(f"second {s} ({n} of {t})" for s, n, t in worst)
            + ".",
            "",
        ]
    lines += [
        "Training step time (the run's `step_seconds` metric, on_step_begin → the step's log"
        " in the worker; a step counts in a phase when it began and ended inside it):",
        "",
        render_steps(phases),
        "",
        f"With pollers the median step took {fmt_ms(c['with_median_s'] * 1e3)} against"
        f" {fmt_ms(c['baseline_median_s'] * 1e3)} (mean of before and after):"
        f" **{c['slowdown'] * 100:+.1f}%**. Before → after drift (noise):"
        f" {c['drift'] * 100:+.1f}%.",
        "",
        "CPU, % of one core over each phase (`everything else`: PostgreSQL's shared processes,"
        " Redis, and whatever else ran on the machine):",
        "",
        render_cpu(phases, n_cpus, "pollers"),
        "",
        "PostgreSQL at the end of each phase (`EXPLAIN (ANALYZE, BUFFERS)` of the statement"
        " `GET /runs/{id}` runs; `pg_stat_user_tables`, whose counters lag by up to a few"
        " seconds; connections: `pg_stat_database.sessions`, of which the harness's own checks"
        " are one every 2 s):",
        "",
        render_db_probe(phases),
        "",
    ]
    return lines


def render_section(
    args: argparse.Namespace,
    configs: dict[str, list[Phase]],
    results: dict[str, dict[str, Any]],
    db: dict[str, Any],
    versions: dict[str, str],
    started: str,
    cpus: tuple[set[int], set[int]] | None,
    others: list[str],
    settings: dict[str, str],
    profile: dict[str, Any],
) -> str:
    primary = next(iter(configs))
    res = results[primary]
    t = res["targets"]
    stats = res["latency"]
    c = res["comparison"]
    pin_line = (
        f"`--pin`: the worker and the PostgreSQL backends serving it on CPU"
        f" {','.join(map(str, sorted(cpus[0])))}; the API, its backends, the pollers and the"
        f" harness on CPU {','.join(map(str, sorted(cpus[1])))} (`sched_setaffinity` on every"
        " thread, re-applied every 0.5 s). PostgreSQL's shared processes, Redis and other"
        " processes float."
        if cpus
        else "no pinning: every process may run on every CPU."
    )
    metrics_desc = (
        f"the last {args.metrics_window} steps (`step_min` from the step the run answered)"
        if args.metrics_window
        else "the whole series so far"
    )
    parts = [
        MARK_START,
        "## Pollers while a run trains",
        "",
        written_by("pollers.py", " Issue 5, scenario 14."),
        "",
        *report_head("pollers.py", started=started, versions=versions),
        f"- Services: `trainyard api --workers {args.api_workers}` (uvicorn), one"
        f" `trainyard worker --pool solo` with `OMP_NUM_THREADS={args.torch_threads or 'default'}`,"
        f" fresh database `{DB_NAME}`; settings: "
        + ", ".join(f"`{k}={v}`" for k, v in settings.items())
        + ".",
        f"- Run: `configs/runs/letters.yaml` on the tiny Llama, real pipeline (TRL GRPO,"
        " function reward `char_fraction`, every rollout stored as a trajectory with its"
        " reward, metrics and a `step` event per step), no checkpoints or evaluation; a fresh"
        " run per configuration, measured from its second step plus"
        f" {args.warmup:g} s of warm-up, cancelled after its phases.",
        f"- Pollers: {args.pollers} in {args.client_procs} client process(es) (asyncio, uvloop; "
        + (
            "`--client raw`: a minimal HTTP/1.1 client on asyncio streams, one keep-alive"
            " connection per poller"
            if args.client == "raw"
            else f"httpx, {args.connections} keep-alive connections shared"
        )
        + f"). Every {args.interval:g} s each"
        f" one GETs the run, a page of its events (`limit={args.events_limit}`, following"
        " `next_cursor` past full pages: a tail of the log) and the metric series"
        f" {', '.join(f'`{n}`' for n in args.metric_names)} ({metrics_desc}), one after the"
        f" other; starts staggered over the first interval, {args.ramp:g} s of ramp not"
        " recorded. Errors: non-2xx answers and transport errors (time-out"
        f" {args.request_timeout:g} s). Percentiles by nearest rank over every request.",
        f"- Phases, per configuration: {args.baseline:g} s without pollers, {args.duration:g} s"
        f" with, {args.baseline:g} s without; the step-time comparison is the median of the"
        " middle phase against the mean of the medians of the outer two.",
        f"- CPUs: {pin_line}",
        f"- PostgreSQL: `max_connections` {args.server_max_connections}, autovacuum"
        f" `{args.server_autovacuum}` on this server; "
        + (
            f"`VACUUM (ANALYZE)` of `{DB_NAME}` after each warm-up, as autovacuum would have"
            " done by then (without it the planner plans for the empty tables of a fresh"
            " database)."
            if args.vacuum_analyze
            else "no `VACUUM`/`ANALYZE` by the script (`--no-vacuum-analyze`)."
        ),
    ]
    if PG_REFUSED:
        parts.append(
            f"- **PostgreSQL refused {sum(PG_REFUSED.values())} of the harness's own"
            " connections** (`too many clients`): the API's pools held the rest."
        )
    if others:
        parts.append(
            "- **Other load during the measurement**: "
            + "; ".join(others)
            + " (see the `everything else` column)."
        )
    p99s = ", ".join(f"{k} {fmt_ms(stats[k]['p99'])}" for k in ENDPOINTS)
    parts += [
        "",
        f"### Targets ({primary})",
        "",
        "| target | result | |",
        "|---|---|---|",
        f"| zero errors | {stats['all']['errors']:.0f} of {stats['all']['requests']:.0f}"
        f" requests | {verdict(t['zero_errors'])} |",
        f"| GET p99 under {TARGET_P99_MS:.0f} ms | {fmt_ms(stats['all']['p99'])} overall"
        f" ({p99s}) | {verdict(t['p99_under_50ms'])} |",
        f"| training step ≤ {TARGET_SLOWDOWN * 100:.0f}% slower | {c['slowdown'] * 100:+.1f}%"
        f" (median {fmt_ms(c['with_median_s'] * 1e3)} vs {fmt_ms(c['baseline_median_s'] * 1e3)};"
        f" noise: before → after {c['drift'] * 100:+.1f}%)"
        f" | {verdict(t['step_within_10pct'])} |",
    ]
    for label in list(configs)[1:]:
        o = results[label]
        ot = o["targets"]
        parts.append(
            f"| ({label}) | errors {o['latency']['all']['errors']:.0f}, p99"
            f" {fmt_ms(o['latency']['all']['p99'])}, step"
            f" {o['comparison']['slowdown'] * 100:+.1f}% |"
            f" {', '.join(verdict(v) for v in ot.values())} |"
        )
    parts.append("")
    for label, phases in configs.items():
        parts += render_config(label.capitalize(), phases, results[label], args)
    parts += [
        "### Cost per request, and the database",
        "",
        *render_costs(db.get("costs", {}), args, int(db.get("final_step", 0))),
        *render_explain(db),
        "",
        *render_profile(profile, args),
    ]
    parts += ["### What this shows and what it does not", "", *caveats(args, cpus), "", MARK_END]
    return "\n".join(parts) + "\n"


def caveats(args: argparse.Namespace, cpus: tuple[set[int], set[int]] | None) -> list[str]:
    lines = [
        "- Everything shares one small machine: the API, PostgreSQL, Redis, the pollers and"
        " the training worker. In a deployment the worker has a GPU host of its own and the"
        " database a machine of its own; here the tiny model makes a step cost tens of"
        " milliseconds of CPU, so anything beside the worker shows in its step time.",
    ]
    if cpus:
        lines.append(
            "- Pinned, the worker (and the backends that write its steps) keep a CPU to"
            " themselves, as on a worker host of their own. The comparison then shows what"
            " the pollers cost the training through what is still shared — PostgreSQL's"
            " WAL, locks and buffers, its shared processes, Redis, the kernel, the memory"
            " bus — and not the CPU contention of a 2-core box. It does not show a database"
            " server under load from many runs and dashboards at once, nor the API on a"
            " machine of its own: the API, its backends and the pollers share one CPU, so"
            " the latencies are those of a single-core API server, client included. Pinning"
            " does not isolate what the two vCPUs may share on the host (caches, memory"
            " bandwidth, perhaps one physical core), and backends PostgreSQL forks meanwhile"
            " run anywhere for up to 0.5 s before they are pinned."
        )
    if "unpinned" in args.configs:
        lines.append(
            "- Unpinned, the scheduler spreads everything over all CPUs, and the training"
            " step pays for the API's and the pollers' CPU directly: a measure of this"
            " machine, not of the service."
        )
    lines += [
        "- Noise: the step time drifts between the two outer phases by the percentage given"
        " under each step table; a difference smaller than that drift is not a finding.",
        "- The pollers poll every"
        f" {args.interval:g} s, like dashboards; `--interval 0` makes each a closed loop"
        " (a saturation test, whose latency is the queue the pollers themselves build)."
        " Offered more than the API serves, an open loop of pollers queues without bound:"
        " the latency then says how far beyond capacity the load is, not how fast a request"
        " is (see the cost of each request alone).",
    ]
    if args.metrics_window:
        lines.append(
            f"- The pollers read the last {args.metrics_window} steps of each series; a client"
            " that reads the whole series every time costs what the `whole series` row says,"
            " growing with the run (`--metrics-window 0` measures that)."
        )
    return lines


# ------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Concurrent pollers on a training run: API latency and the training's "
        "step time with and without them.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--duration", type=float, default=60.0, help="seconds with pollers")
    p.add_argument("--pollers", type=int, default=200, help="concurrent pollers")
    add_run_under_load_args(p, load="pollers", baseline=40.0)
    p.add_argument(
        "--interval",
        type=float,
        default=1.0,
        help="seconds between the starts of a poller's cycles (0: a closed loop)",
    )
    p.add_argument(
        "--ramp", type=float, default=2.0, help="seconds of polling before the recorded window"
    )
    p.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="client processes the pollers are spread over",
    )
    p.add_argument(
        "--client",
        choices=["raw", "httpx"],
        default="raw",
        help="raw: a minimal keep-alive HTTP/1.1 client on asyncio streams, one connection per"
        " poller; httpx: one httpx.AsyncClient shared by the pollers of a process",
    )
    p.add_argument(
        "--connections",
        type=int,
        help="with --client httpx, connections shared by the pollers (default: one each)",
    )
    p.add_argument("--events-limit", type=int, default=50, help="events page size")
    p.add_argument(
        "--metric-names",
        default="reward_mean,loss",
        help="metric series each poller asks for (comma-separated)",
    )
    p.add_argument(
        "--metrics-window",
        type=int,
        default=50,
        help="ask for the last N steps of each series (step_min; 0: the whole series)",
    )
    p.add_argument("--request-timeout", type=float, default=10.0, help="httpx time-out, s")
    p.add_argument("--api-workers", type=int, default=2, help="uvicorn worker processes")
    p.add_argument(
        "--compare-unpinned",
        action="store_true",
        help="with --pin, measure the three phases again without pinning",
    )
    add_trainyard_args(
        p,
        databases=f"database {DB_NAME} is",
        redis_db=13,
        broker_prefix="bench-pollers:",
        settle_timeout=30.0,
        start_timeout=180.0,
    )
    add_output_arg(p, "pollers")
    p.add_argument("--seed", type=int, default=0, help="pollers' start offsets")
    p.add_argument(
        "--profile",
        action="store_true",
        help="after the measurement, pollers once more with py-spy on the API workers: where"
        " the API's CPU goes (not in the targets)",
    )
    p.add_argument("--profile-seconds", type=float, default=20.0, help="length of that phase")
    p.add_argument(
        "--cost-requests",
        type=int,
        default=300,
        help="requests per endpoint for the one-at-a-time cost measurement at the end",
    )
    args = p.parse_args(argv)
    if args.pollers < 1 or args.duration <= 0 or args.baseline <= 0 or args.client_procs < 1:
        p.error("--pollers, --duration, --baseline and --client-procs must be positive")
    args.connections = args.connections or args.pollers
    args.server_autovacuum = "?"  # read from the server in main()
    args.server_max_connections = "?"
    args.metric_names = [n.strip() for n in args.metric_names.split(",") if n.strip()]
    resolve_pin(p, args)
    if args.compare_unpinned and not args.pin:
        p.error("--compare-unpinned goes with --pin")
    args.configs = ["pinned", "unpinned"] if args.compare_unpinned else []
    if not args.configs:
        args.configs = ["pinned" if args.pin else "unpinned"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    started = utc_now()
    home = Path(tempfile.mkdtemp(prefix="trainyard-pollers-"))
    servers: list[Server] = []
    services = RunUnderLoad(args, servers, home, name="pollers", db_name=DB_NAME)
    configs: dict[str, list[Phase]] = {}
    results: dict[str, dict[str, Any]] = {}
    db: dict[str, Any] = {}
    versions: dict[str, str] = {"Trainyard": trainyard_version()}
    others: list[str] = []
    run_ids: dict[str, str] = {}
    settings: dict[str, str] = {}
    profile: dict[str, Any] = {}
    try:
        with stop_on_exit(servers):
            versions["PostgreSQL"] = pg_version(args.pg_url)
            args.server_autovacuum = pg_query(args.pg_url, "SHOW autovacuum")[0] or "?"
            args.server_max_connections = pg_query(args.pg_url, "SHOW max_connections")[0]
            versions.update(
                package_versions("torch", "transformers", "trl", "uvicorn", "fastapi", "httpx")
            )
            versions["Python"] = platform.python_version()
            wait_for_other_load(args.wait_others, "before starting")
            wait_for_quiet(args.settle_timeout)
            model = model_for(args, home)
            services.start(
                project="bench-pollers", api_workers=args.api_workers, timeout=args.start_timeout
            )
            for n, config in enumerate(args.configs):
                # A fresh run per configuration (and attempt): the series the pollers read,
                # and the run row's dead versions, are as old in each.
                run_id, phases = services.measure(
                    config,
                    model,
                    lambda run_id, config=config: [
                        probed_idle_phase(config, "before", args.baseline, services, run_id),
                        poller_phase(config, args, services, run_id),
                        probed_idle_phase(config, "after", args.baseline, services, run_id),
                    ],
                )
                run_ids[config] = run_id
                configs[config] = phases
                others += [
                    f"{config}, {p.name}: {', '.join(sorted(p.overlap))}"
                    for p in phases
                    if p.overlap
                ]
                if args.profile and n == 0:
                    ph = poller_phase(
                        config,
                        args,
                        services,
                        run_id,
                        name="profiled",
                        duration=args.profile_seconds,
                        profile=True,
                    )
                    profile = profile_summary(sorted(OUT.glob("pollers-profile-api-*.txt")))
                    profile.update(
                        config=config,
                        latency=latency_stats(ph.clients)["all"],
                        api_cpu_pct=ph.cpu["api"],
                    )
                status = services.cancel_and_wait(run_id)
                log(f"{config}: run {run_id} {status}")
                assign_steps(phases, services.step_seconds(run_id), services.step_events(run_id))
                if n == 0:
                    db = explain(services, run_id, args)
                    log("each endpoint alone, one request at a time")
                    db["costs"] = endpoint_costs(services, run_id, args, args.cost_requests)
                    db["final_step"] = services.run_state(run_id)[1]
            settings = {
                "TRAINYARD_DB_POOL_SIZE": services.env.get(
                    "TRAINYARD_DB_POOL_SIZE", "10 (default)"
                ),
                **services.settings(),
            }
    finally:
        services.close()

    for label, phases in configs.items():
        results[label] = config_results(phases, args)
    section = render_section(
        args, configs, results, db, versions, started, services.cpus, others, settings, profile
    )
    write_section(args.output, section, MARK_START, MARK_END)
    summary = {
        "started": started,
        "run_ids": run_ids,
        "args": args_json(args),
        "versions": versions,
        "cpus": cpus_json(services.cpus),
        "other_load": others,
        "results": {
            label: {**res, "phases": phases_json(configs[label])} for label, res in results.items()
        },
        "database": {
            k: ({kk: vv for kk, vv in v.items() if kk != "plan"} if isinstance(v, dict) else v)
            for k, v in db.items()
        },
        "profile": profile,
        "output": str(args.output),
    }
    (OUT / "pollers.json").write_text(json.dumps({**summary, "database": db}, indent=2) + "\n")
    print(json.dumps(summary, indent=2, default=str))
    primary = results[next(iter(results))]["targets"]
    log(
        f"wrote {args.output} (section {MARK_START} … {MARK_END}); targets: "
        + ", ".join(f"{k} {'pass' if v else 'FAIL'}" for k, v in primary.items())
    )
    return 0


if __name__ == "__main__":
    kit.run(main)
