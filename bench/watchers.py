#!/usr/bin/env python3
"""Watchers while a run trains (issue 15): 1,000 Server-Sent Event subscribers of one run on
one API process (``trainyard api --workers 1``), then 200 pollers sending ``If-None-Match``,
while the run trains on the real pipeline. Targets: every subscriber gets every event id
once (0 lost, 0 repeated), p99 from commit to delivery ≤ 500 ms, the API ≤ 50% of a core,
the training step within 10% of no watchers; the conditional pollers' p99 under 50 ms, and
≤ 0.3 ms of the API's CPU per 304.

One invocation starts its own database (``bench_watchers``), the API, one Celery worker and
a long run of ``configs/runs/letters.yaml`` on the tiny model (bench/pollers.py's services,
run, pinning and CPU accounting: bench/kit/under_load.py). After a warm-up, on the same run: a
phase without load, one with the watchers, one without, one with the conditional pollers,
one without. Each loaded phase's median step time is compared with the mean of the two
phases around it. Then, the run stopped, conditional GETs one at a time: the API's CPU per
304. The results replace the section between the watchers markers in docs/benchmarks.md; a
JSON summary goes to stdout. See bench/README.md.

    .venv/bin/python bench/watchers.py                                 # ~5 min
    .venv/bin/python bench/watchers.py --watchers 100 --duration 10 --baseline 10 \\
        --pollers 20 --output /tmp/w.md                                # a quick look

Each watcher is a raw asyncio HTTP/1.1 client (``asyncio.open_connection``) that parses the
stream with the CLI's parser (app/events/sse.py, which says why not httpx and httpx-sse),
records every event id with its arrival time, and reconnects with ``Last-Event-ID`` when the
stream closes (after the ``retry:`` the server asked for). The commit time of an event is
when the harness's own LISTEN on ``trainyard_run_events`` (a process of its own) received
the notification naming its id: PostgreSQL sends it at commit.

Needs PostgreSQL (the database bench_watchers is dropped and created, and dropped again at
the end unless --keep) and Redis (db 13, keys under a prefix of their own). Standard library,
asyncpg, httpx, psutil, and the project in .venv.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import bisect
import collections
import dataclasses
import itertools
import json
import math
import multiprocessing.connection as mpc
import os
import platform
import random
import resource
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import asyncpg
import kit
import pollers
from kit import OUT, log
from kit.load import ClientFleet, window_cpu
from kit.machine import (
    loadavg,
    package_versions,
    trainyard_version,
    wait_for_other_load,
    wait_for_quiet,
)
from kit.processes import Server, rss_bytes, stop_on_exit
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
from kit.stores import PG_REFUSED, bench_query, pg_version
from kit.trainyard import add_trainyard_args, model_for
from kit.under_load import (
    Phase,
    Roles,
    RunUnderLoad,
    add_run_under_load_args,
    args_json,
    assign_steps,
    compare_steps,
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

from app.events import sse

MARK_START, MARK_END = markers("watchers")
DB_NAME = "bench_watchers"
CHANNEL = "trainyard_run_events"  # app/events/fanout.py; migration 0010 notifies it
TARGET_DELIVERY_P99_MS = 500.0
TARGET_API_CPU_PCT = 50.0
TARGET_SLOWDOWN = 0.10
TARGET_POLL_P99_MS = 50.0
TARGET_304_CPU_MS = 0.3
WATCHERS = "with watchers"
POLLERS = "with conditional pollers"


# ---------------------------------------------------------------------------- the watchers


@dataclasses.dataclass
class WatcherConfig:
    """What one client process runs: ``watchers`` streams of one run."""

    base_url: str
    key: str
    run_id: str
    watchers: int
    after_id: int  # every stream starts after this id (Last-Event-ID)
    ramp: float  # connections spread over this long before the window
    duration: float
    drain: float  # streams stay open this long after the window
    timeout: float  # connecting and the response head
    seed: int


@dataclasses.dataclass
class WatcherResult:
    """Per watcher: every event id it received and when (epoch s, per read), and its
    connections; the process's CPU over the window."""

    start: float
    end: float
    ids: list[array.array[int]]
    times: list[array.array[float]]
    connected: list[float]  # when its first stream answered 200 (nan: never)
    connections: list[int]
    closes: dict[str, int]  # why streams ended and were reopened: reason -> count
    ended: int  # streams that got `event: end` (the run ended)
    cpu_seconds: float
    wall_seconds: float


def _stream_request(cfg: WatcherConfig, last_id: int) -> bytes:
    u = urllib.parse.urlsplit(cfg.base_url)
    return (
        f"GET /runs/{cfg.run_id}/events/stream HTTP/1.1\r\nHost: {u.netloc}\r\n"
        f"Authorization: Bearer {cfg.key}\r\nAccept: text/event-stream\r\n"
        f"Last-Event-ID: {last_id}\r\n\r\n"
    ).encode()


async def _watch(cfg: WatcherConfig, conn: mpc.Connection) -> WatcherResult:
    u = urllib.parse.urlsplit(cfg.base_url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    ids = [array.array("q") for _ in range(cfg.watchers)]
    times = [array.array("d") for _ in range(cfg.watchers)]
    connected = [math.nan] * cfg.watchers
    connections = [0] * cfg.watchers
    closes: collections.Counter[str] = collections.Counter()
    ended = 0
    conn.send("ready")
    loop = asyncio.get_running_loop()
    start_at: float = await loop.run_in_executor(None, conn.recv)  # time.time() epoch
    end_at = start_at + cfg.duration
    stop_at = end_at + cfg.drain

    async def stream(n: int, last_id: int) -> tuple[int, float | None, str]:
        """One stream from ``last_id``: the last id it got, the retry delay the server
        asked for, and why it ended."""
        got, when = ids[n], times[n]
        retry: float | None = None
        closing = "closed by the server"
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), cfg.timeout)
        try:
            writer.write(_stream_request(cfg, last_id))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), cfg.timeout)
            status = int(head.split(b" ", 2)[1])
            if status != 200:
                return last_id, None, f"HTTP {status}"
            connections[n] += 1
            if math.isnan(connected[n]):
                connected[n] = time.time()
            if b"transfer-encoding: chunked" not in head.lower():
                return last_id, None, "not a chunked stream"
            parser = sse.Parser()
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    return last_id, retry, closing
                data = await reader.readexactly(size + 2)
                now = time.time()
                for message in parser.feed(data[:-2]):
                    if message.event == "end":
                        return last_id, None, "end"
                    if message.id is not None:
                        last_id = int(message.id)
                        got.append(last_id)
                        when.append(now)
                    if message.retry is not None:
                        retry = message.retry / 1000
                    if message.comment == sse.TOO_FAR_BEHIND_NOTE:
                        closing = "too far behind (the server's retry hint)"
        finally:
            writer.close()

    async def watcher(n: int) -> None:
        nonlocal ended
        rng = random.Random(cfg.seed * 100_003 + n)
        await asyncio.sleep(max(0.0, start_at - cfg.ramp + rng.random() * cfg.ramp - time.time()))
        last_id = cfg.after_id
        while time.time() < stop_at:
            try:
                last_id, retry, why = await stream(n, last_id)
            except (OSError, EOFError, TimeoutError, ValueError, asyncio.IncompleteReadError) as e:
                retry, why = None, f"error: {type(e).__name__}"
            if why == "end":
                ended += 1
                return
            closes[why] += 1
            await asyncio.sleep(retry if retry is not None else sse.RETRY_MS / 1000)

    cpu_task = asyncio.create_task(window_cpu(start_at, end_at))
    tasks = [asyncio.create_task(watcher(n)) for n in range(cfg.watchers)]
    await asyncio.sleep(max(0.0, stop_at - time.time()))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    cpu, wall = await cpu_task
    return WatcherResult(
        start=start_at,
        end=end_at,
        ids=ids,
        times=times,
        connected=connected,
        connections=connections,
        closes=dict(closes),
        ended=ended,
        cpu_seconds=cpu,
        wall_seconds=wall,
    )


class WatcherFleet(ClientFleet):
    """The watchers, spread over ``--client-procs`` client processes."""

    what = "watcher process"

    def __init__(self, args: argparse.Namespace, services: RunUnderLoad, run_id: str, after: int):
        n_procs = max(1, min(args.client_procs, args.watchers))
        share, extra = divmod(args.watchers, n_procs)
        configs = [
            WatcherConfig(
                base_url=services.base_url,
                key=services.key,
                run_id=run_id,
                watchers=share + (1 if k < extra else 0),
                after_id=after,
                ramp=args.ramp,
                duration=args.duration,
                drain=args.drain,
                timeout=args.request_timeout,
                seed=args.seed * 1000 + k,
            )
            for k in range(n_procs)
        ]
        super().__init__(_watch, configs)

    def collect(self, timeout: float) -> list[WatcherResult]:
        return [WatcherResult(**r) for r in super().collect(timeout)]


# ------------------------------------------------------------------------- the commit clock


@dataclasses.dataclass
class ClockConfig:
    dsn: str


async def _clock(cfg: ClockConfig, conn: mpc.Connection) -> dict[str, Any]:
    """LISTEN on the channel until told to stop; every notification with its arrival time."""
    notes: list[tuple[str, int, int, float]] = []

    def notified(_conn: object, _pid: int, _channel: str, payload: str) -> None:
        now = time.time()
        run, first, last = payload.split(":")
        notes.append((run, int(first), int(last), now))

    pg = await asyncpg.connect(cfg.dsn, server_settings={"application_name": "bench-clock"})
    try:
        await pg.add_listener(CHANNEL, notified)
        conn.send("ready")
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, conn.recv)  # the start time
        await loop.run_in_executor(None, conn.recv)  # "stop"
    finally:
        await pg.close()
    return {"notes": notes}


class CommitClock(ClientFleet):
    """The harness's own LISTEN on ``trainyard_run_events``, in a process of its own (the
    harness's threads do not delay it): a notification's arrival is the commit time of the
    ids it names, as near as a client can see it."""

    what = "LISTEN process"

    def __init__(self, dsn: str) -> None:
        super().__init__(_clock, [ClockConfig(dsn)])

    def stop(self, timeout: float = 30.0) -> list[tuple[str, int, int, float]]:
        self.send("stop")
        notes = self.collect(timeout)[0]["notes"]
        return [(str(r), int(a), int(b), float(t)) for r, a, b, t in notes]


# ------------------------------------------------------------------------------- the phases


class RssSampler(threading.Thread):
    """The API process's resident memory every ``every`` s: (epoch s, bytes)."""

    def __init__(self, roles: Roles, every: float = 0.5) -> None:
        super().__init__(name="rss", daemon=True)
        self.roles = roles
        self.every = every
        self.samples: list[tuple[float, int]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.every):
            with self.roles.lock:
                roots = list(self.roles.roots["api"])
            self.samples.append((time.time(), rss_bytes(*roots)))

    def window(self, start: float, end: float) -> dict[str, float]:
        inside = [b for t, b in self.samples if start <= t <= end]
        if not inside:
            return {"start": math.nan, "end": math.nan, "max": math.nan}
        return {"start": inside[0], "end": inside[-1], "max": max(inside)}

    def stop(self) -> None:
        self.stopping.set()
        if self.is_alive():
            self.join(timeout=5)


def latest_event_id(services: RunUnderLoad, run_id: str) -> int:
    row = bench_query(
        services.db_url, f"SELECT coalesce(max(id), 0) FROM run_events WHERE run_id = '{run_id}'"
    )
    return int(row[0] or 0)


def event_ids(services: RunUnderLoad, run_id: str, after: int) -> list[int]:
    row = bench_query(
        services.db_url,
        "SELECT coalesce(json_agg(id ORDER BY id), '[]')::text FROM run_events"
        f" WHERE run_id = '{run_id}' AND id > {after}",
    )
    return [int(i) for i in json.loads(row[0] or "[]")] if row else []


def watcher_phase(
    config: str, args: argparse.Namespace, services: RunUnderLoad, run_id: str
) -> tuple[Phase, dict[str, Any]]:
    """The watchers for --duration s (after --ramp s of connecting): the phase, and what
    the database and the commit clock say about the span they subscribed to."""
    log(
        f"{config}: {WATCHERS}, {args.watchers} SSE streams in {args.client_procs} process(es),"
        f" {args.duration:g} s (+{args.ramp:g} s connecting, +{args.drain:g} s drain)"
    )
    roles = services.roles
    clock = CommitClock(services.db_url)
    fleet: WatcherFleet | None = None
    try:
        with roles.lock:
            roles.roots["clients"] = clock.pids
        clock.start(ready_timeout=args.start_timeout, lead=0.0)
        after = latest_event_id(services, run_id)  # the clock listens: nothing after is missed
        fleet = WatcherFleet(args, services, run_id, after)
        with roles.lock:
            roles.roots["clients"] = [*clock.pids, *fleet.pids]
        if services.pinner is not None:
            services.pinner.apply()
        start_at = fleet.start(ready_timeout=args.start_timeout, lead=0.5 + args.ramp)
        end_at = start_at + args.duration
        time.sleep(max(0.0, start_at - time.time()))
        a = snapshot(roles)
        seen = watch(end_at, services, run_id)
        b = snapshot(roles)
        load = loadavg()
        results = fleet.collect(timeout=args.drain + args.request_timeout + 120)
        notes = clock.stop()
    finally:
        if fleet is not None:
            fleet.kill()
        clock.kill()
        with roles.lock:
            roles.roots["clients"] = []
    cpu = cpu_usage(a, b, sum(r.cpu_seconds for r in results))
    phase = Phase(config, WATCHERS, start_at, end_at, cpu, load, results, overlap=seen)
    mine = sorted((first, last, t) for run, first, last, t in notes if run == run_id)
    return phase, {"after": after, "notes": mine, "ids": event_ids(services, run_id, after)}


def deliveries(phase: Phase, span: dict[str, Any]) -> dict[str, Any]:
    """Per watcher, what it got against the run's event ids in the database: lost (an id
    committed, as the clock heard it, before the window ended, never received), repeated,
    out of order, unknown (not the run's); and commit-to-delivery latency over every event
    committed inside the window."""
    ids: list[int] = span["ids"]
    known = set(ids)
    notes: list[tuple[int, int, float]] = span["notes"]
    commit: dict[int, float] = {}
    for first, last, t in notes:  # the first notification naming an id: its commit
        lo, hi = bisect.bisect_left(ids, first), bisect.bisect_right(ids, last)
        for i in ids[lo:hi]:
            commit.setdefault(i, t)
    heard = [last for _, last, t in notes if t < phase.end]
    last_expected = max(heard, default=span["after"])
    expected = [i for i in ids if i <= last_expected]
    expected_set = set(expected)
    uncommitted = sum(1 for i in expected if i not in commit)  # no notification named it
    lost: list[int] = []
    repeated: list[int] = []
    unordered: list[int] = []
    unknown: list[int] = []
    received: list[int] = []
    latency: list[float] = []
    worst: list[float] = []  # each watcher's slowest delivery
    closes: collections.Counter[str] = collections.Counter()
    connected: list[float] = []
    connections: list[int] = []
    ended = 0
    for r in phase.clients:
        closes.update(r.closes)
        ended += r.ended
        connected += r.connected
        connections += r.connections
        for got, when in zip(r.ids, r.times, strict=True):
            seen = set(got)
            lost.append(len(expected_set - seen))
            repeated.append(len(got) - len(seen))
            unordered.append(sum(1 for x, y in itertools.pairwise(got) if y <= x))
            unknown.append(len(seen - known))
            received.append(len(seen & expected_set))
            mine = [
                (t - commit[i]) * 1e3
                for i, t in zip(got, when, strict=True)
                if i in commit and phase.start <= commit[i] < phase.end
            ]
            latency += mine
            worst.append(max(mine, default=math.nan))
    late = [c for c in connected if math.isnan(c) or c > phase.start]
    return {
        "watchers": len(lost),
        "span": {
            "after": span["after"],
            "last": last_expected,
            "expected": len(expected),
            "uncommitted": uncommitted,
            "notifications": len(notes),
        },
        "lost_total": sum(lost),
        "lost_max": max(lost, default=0),
        "lost_watchers": sum(1 for n in lost if n),
        "repeated_total": sum(repeated),
        "repeated_max": max(repeated, default=0),
        "repeated_watchers": sum(1 for n in repeated if n),
        "unordered_total": sum(unordered),
        "unknown_total": sum(unknown),
        "received_min": min(received, default=0),
        "latency_ms": {
            "deliveries": len(latency),
            "min": min(latency, default=math.nan),
            "p50": quantile(latency, 0.50),
            "p90": quantile(latency, 0.90),
            "p99": quantile(latency, 0.99),
            "max": max(latency, default=math.nan),
            "worst_watcher_median": quantile([w for w in worst if not math.isnan(w)], 0.5),
        },
        "connected_late": len(late),
        "connections": sum(connections),
        "reconnects": sum(connections) - sum(1 for c in connections if c),
        "closes": dict(closes),
        "ended": ended,
    }


# ----------------------------------------------------------------------------- 304s' cost


COST_PATHS = {
    "events": "GET /runs/{id}/events",
    "metrics": "GET /runs/{id}/metrics",
    "run": "GET /runs/{id}",
    "healthz": "GET /healthz",
}


def not_modified_cost(
    services: RunUnderLoad, run_id: str, args: argparse.Namespace
) -> dict[str, dict[str, float]]:
    """The run stopped: each conditional URL ``--cost-requests`` times one at a time with
    the ETag of its last answer (all 304), then without it (200s, read from the database);
    for reference, ``GET /runs/{id}`` (authenticated, one query) and ``GET /healthz`` (no
    key, no query). The API process's CPU time (and its PostgreSQL backends') over them / N."""
    names = [("name", m) for m in args.metric_names]
    urls = [
        ("events", f"/runs/{run_id}/events?{urllib.parse.urlencode({'limit': args.events_limit})}"),
        ("metrics", f"/runs/{run_id}/metrics?{urllib.parse.urlencode(names)}"),
    ]
    plan = [(k, u, c) for k, u in urls for c in (True, False)]
    plan += [("run", f"/runs/{run_id}", False), ("healthz", "/healthz", False)]
    n = args.cost_requests
    out: dict[str, dict[str, float]] = {}
    with services.client() as client:
        for key, url, conditional in plan:
            for _ in range(20):  # warm: connection, caches, the hub reads the run through
                r = client.get(url)
                r.raise_for_status()
            tag = r.headers.get("etag", "")
            headers = {"If-None-Match": tag} if conditional else {}
            want = 304 if conditional else 200
            cost, statuses = one_at_a_time(
                services.roles, n, lambda url=url, headers=headers: client.get(url, headers=headers)
            )
            out[f"{key}_{want}"] = {
                "requests": float(n),
                "expected": float(statuses[want]),
                **cost,
            }
    return out


# ------------------------------------------------------------------------------------ report


def fmt_mib(b: float) -> str:
    return "n/a" if math.isnan(b) else f"{b / 2**20:.0f} MiB"


def render_section(
    args: argparse.Namespace,
    pargs: argparse.Namespace | None,
    phases: list[Phase],
    res: dict[str, Any],
    versions: dict[str, str],
    started: str,
    cpus: tuple[set[int], set[int]] | None,
    others: list[str],
    settings: dict[str, str],
) -> str:
    d = res["deliveries"]
    lat = d["latency_ms"]
    w = res["watchers_steps"]
    t = res["targets"]
    by = {p.name: p for p in phases}
    wp = by[WATCHERS]
    rss = res["rss"]
    pin_line = (
        f"`--pin`: the worker and the PostgreSQL backends serving it on CPU"
        f" {','.join(map(str, sorted(cpus[0])))}; the API, its backends, the watchers, the"
        f" pollers, the LISTEN process and the harness on CPU"
        f" {','.join(map(str, sorted(cpus[1])))} (as bench/pollers.py does)."
        if cpus
        else "no pinning: every process may run on every CPU."
    )
    lines = [
        MARK_START,
        "## Watchers: live streams and conditional polls while a run trains",
        "",
        written_by(
            "watchers.py", " Issue 15, the watchers benchmark (replacing scenario 14's targets)."
        ),
        "",
        *report_head("watchers.py", started=started, versions=versions),
        "- Services: `trainyard api --workers 1` (one uvicorn process: one event hub, one"
        " LISTEN), one `trainyard worker --pool solo` with"
        f" `OMP_NUM_THREADS={args.torch_threads or 'default'}`, fresh database `{DB_NAME}`;"
        " settings: " + ", ".join(f"`{k}={v}`" for k, v in settings.items()) + ".",
        "- Run: `configs/runs/letters.yaml` on the tiny Llama, real pipeline (as in the"
        " pollers benchmark), no checkpoints or evaluation; measured from its second step plus"
        f" {args.warmup:g} s of warm-up, cancelled after the phases.",
        f"- Watchers: {args.watchers} `GET /runs/{{id}}/events/stream` in {args.client_procs}"
        " client process(es) (asyncio on uvloop, `asyncio.open_connection`, one HTTP/1.1"
        " connection each, the chunked SSE stream parsed by hand), each sending"
        " `Last-Event-ID` = the run's last event id when the phase began; connections spread"
        f" over {args.ramp:g} s before the window, open {args.drain:g} s after it. A stream"
        " that closes is reopened after the `retry:` it asked for, with `Last-Event-ID` = the"
        " last id received.",
        "- Commit time: when the harness's own LISTEN on `trainyard_run_events` (a process of"
        " its own, on the API's CPU) received the notification naming the id; PostgreSQL sends"
        " it at commit, so this is the commit as a client on this machine first sees it."
        " Delivery: when the watcher read the chunk holding the event (one clock,"
        " `time.time()`, same machine), so the watcher's own event loop is in the latency."
        " Every event committed inside the window, for every watcher.",
        "- Lost and repeated: per watcher, against the run's event ids in the database from"
        " its start id to the last id the clock heard before the window ended.",
    ]
    if pargs is not None:
        lines.append(
            f"- Conditional pollers: {pargs.pollers}, bench/pollers.py's pollers (`--client"
            f" raw`) every {pargs.interval:g} s for {pargs.duration:g} s: `GET /runs/{{id}}`,"
            f" a page of its events (`limit={pargs.events_limit}`, tailing `next_cursor`) and"
            f" the series {', '.join(f'`{n}`' for n in pargs.metric_names)}"
            + (
                f" (last {pargs.metrics_window} steps)"
                if pargs.metrics_window
                else " (whole series)"
            )
            + "; each keeps the `ETag` of its last answer per URL and sends it as"
            " `If-None-Match`. `GET /runs/{id}` has no `ETag` and is reported apart."
        )
    lines += [
        f"- Phases: {args.baseline:g} s without load, {args.duration:g} s with the watchers,"
        f" {args.baseline:g} s without"
        + (f", {pargs.duration:g} s with the pollers, {args.baseline:g} s without" if pargs else "")
        + "; each loaded phase's median step against the mean of the medians of the phases"
        " around it.",
        f"- CPUs: {pin_line}",
        f"- Open files: the harness raised its soft `RLIMIT_NOFILE` to {args.nofile} (the API"
        " and the watchers inherit it).",
    ]
    if PG_REFUSED:
        lines.append(
            f"- **PostgreSQL refused {sum(PG_REFUSED.values())} of the harness's own"
            " connections** (`too many clients`)."
        )
    if others:
        lines.append("- **Other load during the measurement**: " + "; ".join(others) + ".")
    lines += [
        "",
        "### Targets",
        "",
        "| target | result | |",
        "|---|---|---|",
        f"| 0 events lost or repeated per watcher | lost {d['lost_total']} (worst watcher"
        f" {d['lost_max']}), repeated {d['repeated_total']} (worst {d['repeated_max']}), out of"
        f" order {d['unordered_total']}; {d['watchers']} watchers × {d['span']['expected']}"
        f" events | {verdict(t['none_lost_or_repeated'])} |",
        f"| commit → delivery p99 ≤ {TARGET_DELIVERY_P99_MS:.0f} ms | p99 {fmt_ms(lat['p99'])}"
        f" (p50 {fmt_ms(lat['p50'])}, max {fmt_ms(lat['max'])}; {lat['deliveries']}"
        f" deliveries) | {verdict(t['delivery_p99'])} |",
        f"| API ≤ {TARGET_API_CPU_PCT:.0f}% of a core with the watchers |"
        f" {fmt_pct(wp.cpu.get('api', math.nan))} | {verdict(t['api_cpu'])} |",
        f"| training step ≤ {TARGET_SLOWDOWN * 100:.0f}% slower with the watchers |"
        f" {w['slowdown'] * 100:+.1f}% (median {fmt_ms(w['with_median_s'] * 1e3)} vs"
        f" {fmt_ms(w['baseline_median_s'] * 1e3)}; noise {w['drift'] * 100:+.1f}%) |"
        f" {verdict(t['step_within_10pct'])} |",
    ]
    if pargs is not None:
        ps = res["pollers_latency"]
        cost = res["not_modified_cost"]
        lines += [
            f"| conditional pollers p99 < {TARGET_POLL_P99_MS:.0f} ms | {fmt_ms(ps['all']['p99'])}"
            f" overall (run {fmt_ms(ps['run']['p99'])}, events {fmt_ms(ps['events']['p99'])},"
            f" metrics {fmt_ms(ps['metrics']['p99'])}); {ps['all']['errors']:.0f} errors |"
            f" {verdict(t['poll_p99'])} |",
            f"| API CPU per 304 ≤ {TARGET_304_CPU_MS} ms | events"
            f" {cost['events_304']['api_cpu_ms']:.3f} ms, metrics"
            f" {cost['metrics_304']['api_cpu_ms']:.3f} ms | {verdict(t['cpu_per_304'])} |",
        ]
    closes = ", ".join(f"{k} × {v}" for k, v in sorted(d["closes"].items())) or "none"
    lines += [
        "",
        "### The watchers",
        "",
        f"Span: event ids {d['span']['after']} (exclusive) to {d['span']['last']},"
        f" {d['span']['expected']} events, named by {d['span']['notifications']}"
        f" notifications ({d['span']['uncommitted']} ids no notification named). Every watcher"
        f" received at least {d['received_min']} of them; ids not of the run:"
        f" {d['unknown_total']}. Connections: {d['connections']} for {d['watchers']} watchers"
        f" ({d['reconnects']} reopened; why streams closed: {closes});"
        f" {d['connected_late']} watchers were not streaming when the window began; streams"
        f" that saw the run end: {d['ended']}.",
        "",
        "| commit → delivery | min | p50 | p90 | p99 | max | median of each watcher's worst |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| {lat['deliveries']} deliveries | {fmt_ms(lat['min'])} | {fmt_ms(lat['p50'])} |"
        f" {fmt_ms(lat['p90'])} | {fmt_ms(lat['p99'])} | {fmt_ms(lat['max'])} |"
        f" {fmt_ms(lat['worst_watcher_median'])} |",
        "",
        f"The API process used {fmt_pct(wp.cpu.get('api', math.nan))} of a core with the"
        f" watchers (its PostgreSQL backends {fmt_pct(wp.cpu.get('pg_api', math.nan))}); the"
        f" watchers' own process(es) {fmt_pct(wp.cpu.get('clients', math.nan))}. API resident"
        f" memory: {fmt_mib(rss['before']['end'])} at the end of the phase before,"
        f" {fmt_mib(rss[WATCHERS]['max'])} at most with the watchers,"
        f" {fmt_mib(rss[WATCHERS]['end'])} at their end.",
        "",
    ]
    if pargs is not None:
        ps = res["pollers_latency"]
        rows = [
            "| endpoint | requests | req/s | 304 | p50 | p95 | p99 | max | errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for key, s in ps.items():
            share = 100 * s["not_modified"] / s["requests"] if s["requests"] else math.nan
            rows.append(
                f"| {'**all**' if key == 'all' else pollers.ENDPOINT_PATHS[key]}"
                f" | {s['requests']:.0f} | {s['rps']:.0f} | {fmt_pct(share)} |"
                f" {fmt_ms(s['p50'])} | {fmt_ms(s['p95'])} | {fmt_ms(s['p99'])} |"
                f" {fmt_ms(s['max'])} | {s['errors']:.0f} |"
            )
        pp = by[POLLERS]
        pc = res["pollers_steps"]
        lines += [
            "### The conditional pollers",
            "",
            *rows,
            "",
            "While the run trains every step appends events, so a tag is stale after one step:"
            " the share of 304s says how often a poller came back within the same step. The"
            f" API used {fmt_pct(pp.cpu.get('api', math.nan))} of a core, its PostgreSQL"
            f" backends {fmt_pct(pp.cpu.get('pg_api', math.nan))}; the step took"
            f" {pc['slowdown'] * 100:+.1f}% against the phases around it (noise"
            f" {pc['drift'] * 100:+.1f}%).",
            "",
        ]
        cost = res["not_modified_cost"]
        rows = [
            "| URL, the run stopped | answer | requests | p50 | p99 | API CPU / request |"
            " PostgreSQL CPU / request | body |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for key, c in cost.items():
            what, code = key.rsplit("_", 1)
            path = COST_PATHS[what]
            rows.append(
                f"| `{path}` | {code}{'' if c['expected'] == c['requests'] else ' (**not all**)'}"
                f" | {c['requests']:.0f} | {fmt_ms(c['p50_ms'], 2)} | {fmt_ms(c['p99_ms'], 2)} |"
                f" {c['api_cpu_ms']:.3f} ms | {c['pg_cpu_ms']:.3f} ms | {c['bytes']:.0f} B |"
            )
        lines += [
            "The cost of a 304: after the run stopped, each URL one request at a time"
            " (keep-alive, httpx in the harness), with the `ETag` of its last answer as"
            " `If-None-Match` (304), then without (200, a body read from the database); for"
            " reference `GET /runs/{id}` (the key checked, one query) and `GET /healthz` (no"
            " key, no query: the floor of any request through uvicorn and FastAPI here). The"
            " API process's CPU time over the requests / N (`/proc` counts it in 10 ms ticks:"
            f" ±{10 / args.cost_requests:.3f} ms per request):",
            "",
            *rows,
            "",
        ]
    lines += [
        "### Training step time, CPU",
        "",
        "The run's `step_seconds` metric (on_step_begin → the step's log in the worker; a step"
        " counts in a phase when it began and ended inside it):",
        "",
        render_steps(phases),
        "",
        "CPU, % of one core over each phase (`clients`: the watchers' or the pollers' own"
        " processes, as they measure themselves; `everything else`: PostgreSQL's shared"
        " processes, the LISTEN process, Redis, and whatever else ran on the machine):",
        "",
        render_cpu(phases, len(os.sched_getaffinity(0)), "clients"),
        "",
        "### What this shows and what it does not",
        "",
        "- One small machine runs everything: the API, PostgreSQL, Redis, the watchers and"
        " the training worker; pinned, the worker keeps a CPU to itself and everything else"
        " shares the other, so the latencies are those of a single-core API server with its"
        " clients on the same core.",
        "- The latency is an upper bound of what the service adds: it includes the watchers'"
        " own event loop, which reads a thousand sockets after each fan-out, and the hub's"
        " gathering of notifications (`sse_gather_seconds`).",
        "- One run, one API process: the hub reads each batch of new events once whatever the"
        " number of watchers; many runs watched at once, or several API processes, are not"
        " measured here.",
        "- Noise: each comparison's drift (the phases around it against each other) says how"
        " much the step time moves without any load.",
        "",
        MARK_END,
    ]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="SSE watchers and conditional pollers on a training run: delivery, API"
        " CPU and memory, the training's step time with and without them.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--watchers", type=int, default=1000, help="concurrent SSE streams")
    p.add_argument("--duration", type=float, default=60.0, help="seconds with the watchers")
    p.add_argument("--ramp", type=float, default=10.0, help="seconds the connections spread over")
    p.add_argument("--drain", type=float, default=3.0, help="streams stay open after the window")
    p.add_argument(
        "--client-procs", type=int, default=1, help="client processes the watchers are spread over"
    )
    p.add_argument(
        "--request-timeout", type=float, default=30.0, help="connect and response head, s"
    )
    p.add_argument(
        "--pollers", type=int, default=200, help="conditional pollers afterwards (0: none)"
    )
    p.add_argument(
        "--poll-duration", type=float, help="seconds with the pollers (default: --duration)"
    )
    p.add_argument("--poll-interval", type=float, default=1.0, help="seconds between cycles")
    p.add_argument("--events-limit", type=int, default=50, help="the pollers' events page size")
    p.add_argument("--metric-names", default="reward_mean,loss", help="the pollers' metric series")
    p.add_argument(
        "--metrics-window",
        type=int,
        default=50,
        help="the pollers ask for the last N steps of each series (0: the whole series)",
    )
    p.add_argument(
        "--cost-requests",
        type=int,
        default=1000,
        help="conditional requests per URL, one at a time, for the CPU per 304",
    )
    add_run_under_load_args(p, load="watchers", baseline=40.0)
    add_trainyard_args(
        p,
        databases=f"database {DB_NAME} is",
        redis_db=13,
        broker_prefix="bench-watchers:",
        settle_timeout=30.0,
        start_timeout=180.0,
    )
    add_output_arg(p, "watchers")
    p.add_argument("--seed", type=int, default=0, help="connection and poll offsets")
    args = p.parse_args(argv)
    if args.watchers < 1 or args.duration <= 0 or args.baseline <= 0 or args.client_procs < 1:
        p.error("--watchers, --duration, --baseline and --client-procs must be positive")
    if args.pollers < 0 or args.cost_requests < 1:
        p.error("--pollers must be 0 or more, --cost-requests positive")
    args.metric_names = [n.strip() for n in args.metric_names.split(",") if n.strip()]
    resolve_pin(p, args)
    return args


def poller_args(args: argparse.Namespace) -> argparse.Namespace | None:
    """bench/pollers.py's options for the conditional pollers (its defaults otherwise)."""
    if not args.pollers:
        return None
    return pollers.parse_args(
        [
            "--pollers",
            str(args.pollers),
            "--duration",
            str(args.poll_duration or args.duration),
            "--interval",
            str(args.poll_interval),
            "--events-limit",
            str(args.events_limit),
            "--metric-names",
            ",".join(args.metric_names),
            "--metrics-window",
            str(args.metrics_window),
            "--seed",
            str(args.seed),
            "--start-timeout",
            str(args.start_timeout),
        ]
    )


def raise_nofile() -> int:
    """A thousand streams need more descriptors than a default soft limit of 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pargs = poller_args(args)
    OUT.mkdir(parents=True, exist_ok=True)
    args.nofile = raise_nofile()
    if args.nofile < args.watchers + 200:
        raise SystemExit(f"RLIMIT_NOFILE {args.nofile} is too low for {args.watchers} watchers")
    started = utc_now()
    home = Path(tempfile.mkdtemp(prefix="trainyard-watchers-"))
    servers: list[Server] = []
    services = RunUnderLoad(args, servers, home, name="watchers", db_name=DB_NAME)
    rss: RssSampler | None = None
    versions: dict[str, str] = {"Trainyard": trainyard_version()}
    phases: list[Phase] = []
    span: dict[str, Any] = {}
    cost: dict[str, dict[str, float]] = {}
    run_id = ""
    config = "pinned" if args.pin else "unpinned"
    settings: dict[str, str] = {}

    def measured(run_id: str) -> list[Phase]:
        nonlocal span
        phases = [idle_phase(config, "before", args.baseline, services, run_id)]
        ph, span = watcher_phase(config, args, services, run_id)
        phases += [ph, idle_phase(config, "between", args.baseline, services, run_id)]
        if pargs is not None:
            phases.append(
                pollers.poller_phase(
                    config, pargs, services, run_id, name=POLLERS, conditional=True
                )
            )
            phases.append(idle_phase(config, "after", args.baseline, services, run_id))
        return phases

    try:
        with stop_on_exit(servers):
            versions["PostgreSQL"] = pg_version(args.pg_url)
            versions.update(
                package_versions("torch", "transformers", "trl", "uvicorn", "fastapi", "asyncpg")
            )
            versions["Python"] = platform.python_version()
            wait_for_other_load(args.wait_others, "before starting")
            wait_for_quiet(args.settle_timeout)
            model = model_for(args, home)
            services.start(project="bench-watchers", api_workers=1, timeout=args.start_timeout)
            rss = RssSampler(services.roles)
            rss.start()
            run_id, phases = services.measure(config, model, measured)
            status = services.cancel_and_wait(run_id)
            log(f"{config}: run {run_id} {status}")
            assign_steps(phases, services.step_seconds(run_id), services.step_events(run_id))
            if pargs is not None:
                log(f"the CPU per 304: {args.cost_requests} conditional GETs per URL")
                cost = not_modified_cost(services, run_id, args)
            settings |= services.settings()
    finally:
        if rss is not None:
            rss.stop()
        services.close()

    assert rss is not None
    by = {p.name: p for p in phases}
    d = deliveries(by[WATCHERS], span)
    res: dict[str, Any] = {
        "run_id": run_id,
        "deliveries": d,
        "watchers_steps": compare_steps(by["before"], by[WATCHERS], by["between"]),
        "rss": {p.name: rss.window(p.start, p.end) for p in phases},
    }
    targets = {
        "none_lost_or_repeated": d["lost_total"] == 0
        and d["repeated_total"] == 0
        and d["unordered_total"] == 0
        and d["span"]["expected"] > 0,
        "delivery_p99": d["latency_ms"]["p99"] <= TARGET_DELIVERY_P99_MS,
        "api_cpu": by[WATCHERS].cpu.get("api", math.inf) <= TARGET_API_CPU_PCT,
        "step_within_10pct": res["watchers_steps"]["slowdown"] <= TARGET_SLOWDOWN,
    }
    if pargs is not None:
        stats = pollers.latency_stats(by[POLLERS].clients)
        res["pollers_latency"] = stats
        res["pollers_steps"] = compare_steps(by["between"], by[POLLERS], by["after"])
        res["not_modified_cost"] = cost
        targets["poll_p99"] = (
            all(s["p99"] < TARGET_POLL_P99_MS for s in stats.values())
            and stats["all"]["errors"] == 0
        )
        targets["cpu_per_304"] = all(
            cost[k]["api_cpu_ms"] <= TARGET_304_CPU_MS
            and cost[k]["expected"] == cost[k]["requests"]
            for k in ("events_304", "metrics_304")
        )
    res["targets"] = targets
    others = [f"{p.name}: {', '.join(sorted(p.overlap))}" for p in phases if p.overlap]
    section = render_section(
        args, pargs, phases, res, versions, started, services.cpus, others, settings
    )
    write_section(args.output, section, MARK_START, MARK_END)
    summary = {
        "started": started,
        "args": args_json(args),
        "versions": versions,
        "cpus": cpus_json(services.cpus),
        "other_load": others,
        "phases": phases_json(phases),
        **res,
        "output": str(args.output),
    }
    (OUT / "watchers.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(json.dumps(summary, indent=2, default=str))
    log(
        f"wrote {args.output} (section {MARK_START} … {MARK_END}); targets: "
        + ", ".join(f"{k} {'pass' if v else 'FAIL'}" for k, v in targets.items())
    )
    return 0


if __name__ == "__main__":
    kit.run(main)
