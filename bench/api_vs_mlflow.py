#!/usr/bin/env python3
"""API throughput: Trainyard vs MLflow's tracking server, create and get, measured with wrk.

Both servers run on this machine one after the other (never at the same time), each with
the same number of workers, against the same local PostgreSQL, under the same wrk load.
The results replace the section between the api-throughput markers in docs/benchmarks.md
and are printed as a table. See bench/README.md.

    .venv/bin/python bench/api_vs_mlflow.py                  # both, 15 s per measurement
    .venv/bin/python bench/api_vs_mlflow.py --duration 5     # a quick look
    .venv/bin/python bench/api_vs_mlflow.py --only mlflow
    .venv/bin/python bench/api_vs_mlflow.py --trainyard-url http://127.0.0.1:8000 \\
        --trainyard-key ty_... --output bench/out/benchmarks.md

Needs: wrk on PATH, PostgreSQL and, for a Trainyard server that the script starts itself,
Redis.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import kit
import psutil
from kit import BENCH, OUT, REPO, BenchError, log
from kit.load import run_wrk, wrk_version
from kit.machine import machine_busy, trainyard_version, wait_for_quiet
from kit.processes import (
    Server,
    cpu_seconds,
    free_port,
    listening_pid,
    start_server,
    stop_on_exit,
    wait_ready,
)
from kit.report import (
    add_output_arg,
    fmt_ms,
    markers,
    report_head,
    utc_now,
    write_section,
    written_by,
)
from kit.stores import pg_url_for, pg_version, recreate_database, redis_ping
from kit.trainyard import Trainyard, add_trainyard_args

MLFLOW_VENV = BENCH / ".venv-mlflow"
# 3.18.0 is listed on PyPI but its mlflow-skinny==3.18.0 was not installable when this was
# written, so the newest MLflow 3 that installs is 3.17.x. Override with --mlflow-spec.
MLFLOW_SPEC = "mlflow==3.17.*"
MARK_START, MARK_END = markers("api-throughput")

TRAINYARD_CREATE_BODY = {
    "model_name": "tiny",
    "task_description": "benchmark run",
    "inputs": [{"input_text": "hello"}],
}


EXPECTED_STATUS = {
    ("Trainyard", "create"): 202,
    ("Trainyard", "get"): 200,
    ("MLflow", "create"): 200,
    ("MLflow", "get"): 200,
}


@dataclasses.dataclass
class Measurement:
    server: str
    operation: str
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int
    statuses: dict[str, int]
    wrk_cpu_pct: float
    server_cpu_pct: float | None
    postgres_cpu_pct: float | None
    machine_busy_pct: float
    duration_s: float


def measure(
    args: argparse.Namespace,
    *,
    label: str,
    url: str,
    script: str,
    script_args: list[str],
    duration: float,
    server: Server | None,
    secret: str | None,
    server_name: str,
    operation: str,
) -> Measurement:
    """One wrk run, with the CPU that wrk, the server's tree and PostgreSQL used meanwhile."""
    pg_pid = args.postgres_pid
    cpu_before = server.cpu_seconds() if server else 0.0
    pg_before = cpu_seconds(pg_pid) if pg_pid else 0.0
    machine_before = psutil.cpu_times()
    w = run_wrk(
        label=label,
        url=url,
        script=script,
        script_args=script_args,
        threads=args.threads,
        connections=args.connections,
        duration=duration,
        timeout=args.wrk_timeout,
        secret=secret,
    )
    cpu_after = server.cpu_seconds() if server else 0.0
    pg_after = cpu_seconds(pg_pid) if pg_pid else 0.0
    wall = w.wall_seconds
    result = Measurement(
        server=server_name,
        operation=operation,
        rps=w.rps,
        p50_ms=w.p50_ms,
        p99_ms=w.p99_ms,
        requests=w.requests,
        errors=w.errors,
        statuses=w.statuses,
        wrk_cpu_pct=100.0 * w.cpu_seconds / wall,
        server_cpu_pct=100.0 * (cpu_after - cpu_before) / wall if server else None,
        postgres_cpu_pct=100.0 * (pg_after - pg_before) / wall if pg_pid else None,
        machine_busy_pct=machine_busy(machine_before, psutil.cpu_times()),
        duration_s=wall,
    )
    log(
        f"  -> {result.rps:.1f} req/s, p50 {result.p50_ms:.1f} ms, p99 {result.p99_ms:.1f} ms,"
        f" {result.errors} errors, statuses {result.statuses}, wrk CPU {result.wrk_cpu_pct:.0f}%"
        + (f", server CPU {result.server_cpu_pct:.0f}%" if server else "")
        + (f", Postgres CPU {result.postgres_cpu_pct:.0f}%" if pg_pid else "")
    )
    return result


def precreate(
    base_url: str,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
    count: int,
    expect: int,
    get_id: Callable[[Any], str],
) -> list[str]:
    """Create `count` resources to GET later (also warms the server up)."""
    with (
        httpx.Client(base_url=base_url, headers=headers, timeout=60.0) as client,
        concurrent.futures.ThreadPoolExecutor(8) as pool,
    ):

        def one(_: int) -> str:
            r = client.post(path, json=body)
            if r.status_code != expect:
                raise BenchError(
                    f"POST {base_url}{path} answered {r.status_code}, expected {expect}:"
                    f" {r.text[:500]}"
                )
            return get_id(r.json())

        return list(pool.map(one, range(count)))


def check_get(base_url: str, path: str, headers: dict[str, str]) -> None:
    r = httpx.get(base_url + path, headers=headers, timeout=30.0)
    if r.status_code != 200:
        raise BenchError(f"GET {base_url}{path} answered {r.status_code}: {r.text[:500]}")


def measure_pair(
    args: argparse.Namespace,
    *,
    name: str,
    base_url: str,
    server: Server | None,
    create_path: str,
    create_body: dict[str, Any],
    create_status: int,
    get_template: str,
    get_id: Callable[[Any], str],
    headers: dict[str, str],
    secret: str | None,
) -> list[Measurement]:
    slug = name.lower()
    header_args = [f"{k}: {v}" for k, v in headers.items()]
    body_file = OUT / f"{slug}_create_body.json"
    body_file.write_text(json.dumps(create_body))
    ids_file = OUT / f"{slug}_ids.txt"

    log(f"{name}: creating {args.get_ids} runs for the get measurement")
    ids = precreate(
        base_url, create_path, create_body, headers, args.get_ids, create_status, get_id
    )
    ids_file.write_text("\n".join(ids) + "\n")
    check_get(base_url, get_template.replace("{id}", ids[0]), headers)

    results = []
    for operation, label_url, script, script_args in (
        ("create", base_url + create_path, "post_json.lua", [str(body_file), *header_args]),
        ("get", base_url, "get_ids.lua", [str(ids_file), get_template, *header_args]),
    ):
        wait_for_quiet(args.settle_timeout)
        if args.warmup > 0:
            measure(
                args,
                label=f"{slug}-{operation}-warmup",
                url=label_url,
                script=script,
                script_args=script_args,
                duration=args.warmup,
                server=server,
                secret=secret,
                server_name=name,
                operation=operation,
            )
        results.append(
            measure(
                args,
                label=f"{slug}-{operation}",
                url=label_url,
                script=script,
                script_args=script_args,
                duration=args.duration,
                server=server,
                secret=secret,
                server_name=name,
                operation=operation,
            )
        )
    return results


# --------------------------------------------------------------------------- the servers


def ensure_mlflow_venv(spec: str) -> Path:
    """bench/.venv-mlflow with `spec` and psycopg2-binary; reused while the spec matches."""
    python = MLFLOW_VENV / "bin" / "python"
    marker = MLFLOW_VENV / ".bench-spec"
    wanted = f"{spec} psycopg2-binary"
    if (
        python.exists()
        and (MLFLOW_VENV / "bin" / "mlflow").exists()
        and (marker.exists() and marker.read_text().strip() == wanted)
    ):
        return MLFLOW_VENV
    if not python.exists():
        log(f"creating {MLFLOW_VENV.relative_to(REPO)}")
        subprocess.run([sys.executable, "-m", "venv", str(MLFLOW_VENV)], check=True)
    log(f"installing {wanted} into {MLFLOW_VENV.relative_to(REPO)} (a minute or two)")
    res = subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            spec,
            "psycopg2-binary",
        ],
    )
    if res.returncode != 0:
        raise BenchError(f"pip could not install {wanted} (see above); try another --mlflow-spec")
    marker.write_text(wanted + "\n")
    return MLFLOW_VENV


def venv_package_version(python: Path, package: str) -> str:
    res = subprocess.run(
        [str(python), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
        capture_output=True,
        text=True,
    )
    return res.stdout.strip() if res.returncode == 0 else "unknown"


def bench_mlflow(
    args: argparse.Namespace, servers: list[Server], venv: Path
) -> tuple[list[Measurement], str]:
    version = venv_package_version(venv / "bin" / "python", "mlflow")
    recreate_database(args.pg_url, "bench_mlflow")
    # Name the driver: SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3, not psycopg2.
    store = pg_url_for(args.pg_url, "bench_mlflow", "postgresql+psycopg2")
    port = free_port()
    workdir = OUT / "mlflow"  # MLflow's default ./mlartifacts lands here, not in the repo
    workdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    server = start_server(
        "mlflow",
        [
            str(venv / "bin" / "mlflow"),
            "server",
            "--backend-store-uri",
            store,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            str(args.workers),
        ],
        env=env,
        cwd=workdir,
        base_url=f"http://127.0.0.1:{port}",
    )
    servers.append(server)
    wait_ready(server, "/health", timeout=args.start_timeout)
    r = httpx.post(
        server.base_url + "/api/2.0/mlflow/experiments/create", json={"name": "bench"}, timeout=30.0
    )
    if r.status_code != 200:
        raise BenchError(f"MLflow experiments/create answered {r.status_code}: {r.text[:500]}")
    experiment_id = r.json()["experiment_id"]
    results = measure_pair(
        args,
        name="MLflow",
        base_url=server.base_url,
        server=server,
        create_path="/api/2.0/mlflow/runs/create",
        create_body={"experiment_id": experiment_id},
        create_status=EXPECTED_STATUS["MLflow", "create"],
        get_template="/api/2.0/mlflow/runs/get?run_id={id}",
        get_id=lambda j: j["run"]["info"]["run_id"],
        headers={},
        secret=None,
    )
    return results, version


def bench_trainyard(
    args: argparse.Namespace, servers: list[Server]
) -> tuple[list[Measurement], str]:
    version = trainyard_version()
    server: Server | None = None
    if args.trainyard_url:
        base_url = args.trainyard_url.rstrip("/")
        key = args.trainyard_key
        log(f"using the Trainyard server already running at {base_url}")
        version += f"; external server at {base_url}"
    else:
        trainyard = Trainyard(
            args,
            name="trainyard",
            db_name="bench_trainyard",
            servers=servers,
            # Measure the API, not its limits: the create measurement alone makes thousands
            # of pending runs with one key. --trainyard-env turns them back on.
            env={
                "TRAINYARD_RATE_LIMIT_PER_SECOND": "0",
                "TRAINYARD_MAX_ACTIVE_RUNS_PER_PROJECT": "0",
                **dict(item.partition("=")[::2] for item in args.trainyard_env),
            },
        )
        trainyard.prepare()
        server = trainyard.start_api(workers=args.workers, timeout=args.start_timeout)
        base_url, key = trainyard.base_url, trainyard.key
    results = measure_pair(
        args,
        name="Trainyard",
        base_url=base_url,
        server=server,
        create_path="/runs",
        create_body=TRAINYARD_CREATE_BODY,
        create_status=EXPECTED_STATUS["Trainyard", "create"],
        get_template="/runs/{id}",
        get_id=lambda j: j["id"],
        headers={"Authorization": f"Bearer {key}"},
        secret=key,
    )
    return results, version


# ------------------------------------------------------------------------------ report


def render_table(results: list[Measurement]) -> str:
    rows = [
        "| server | operation | req/s | p50 | p99 | errors | wrk CPU | server CPU | Postgres CPU |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    op_names = {
        ("Trainyard", "create"): "create (`POST /runs`)",
        ("Trainyard", "get"): "get (`GET /runs/{id}`)",
        ("MLflow", "create"): "create (`POST runs/create`)",
        ("MLflow", "get"): "get (`GET runs/get`)",
    }
    for r in results:
        errors = f"{r.errors}" if r.errors == 0 else f"**{r.errors}** of {r.requests}"
        server_cpu = "n/a" if r.server_cpu_pct is None else f"{r.server_cpu_pct:.0f}%"
        pg_cpu = "n/a" if r.postgres_cpu_pct is None else f"{r.postgres_cpu_pct:.0f}%"
        rows.append(
            f"| {r.server} | {op_names.get((r.server, r.operation), r.operation)} |"
            f" {r.rps:.1f} | {fmt_ms(r.p50_ms)} | {fmt_ms(r.p99_ms)} | {errors} |"
            f" {r.wrk_cpu_pct:.0f}% | {server_cpu} | {pg_cpu} |"
        )
    return "\n".join(rows)


def render_ratios(results: list[Measurement]) -> list[str]:
    by = {(r.server, r.operation): r for r in results}
    lines = []
    for op in ("create", "get"):
        ty, ml = by.get(("Trainyard", op)), by.get(("MLflow", op))
        if not (ty and ml) or not ml.rps or not ml.p50_ms or not ml.p99_ms:
            continue
        lines.append(
            f"- {op}: {ty.rps / ml.rps:.2f}x the requests per second,"
            f" p50 {ty.p50_ms / ml.p50_ms:.2f}x, p99 {ty.p99_ms / ml.p99_ms:.2f}x"
        )
    return lines


def render_section(
    args: argparse.Namespace, results: list[Measurement], versions: dict[str, str], started: str
) -> str:
    ratios = render_ratios(results)
    unexpected = [
        f"{r.server} {r.operation}: {r.statuses}"
        for r in results
        if r.statuses and set(r.statuses) != {str(EXPECTED_STATUS[r.server, r.operation])}
    ]
    busy = [f"{r.server} {r.operation} {r.machine_busy_pct:.0f}%" for r in results]
    parts = [
        MARK_START,
        "## API throughput: Trainyard vs MLflow",
        "",
        written_by("api_vs_mlflow.py"),
        "",
        *report_head(
            "api_vs_mlflow.py", started=started, versions=versions, secret=args.trainyard_key
        ),
        f"- Load: wrk, {args.threads} threads, {args.connections} connections,"
        f" {args.duration:g} s per measurement after a {args.warmup:g} s warm-up; get cycles"
        f" through {args.get_ids} runs created beforehand. Servers run one at a time with"
        f" {args.workers} workers each, on the same machine as wrk and PostgreSQL.",
        "",
        render_table(results),
        "",
        "CPU columns are % of one core over the measurement (wrk: the load generator's own"
        " cost, taken from its rusage; server: the server's whole process tree; Postgres: the"
        " postmaster listening on the database port and all its backends). Errors are"
        " non-2xx responses plus socket errors and time-outs.",
    ]
    if ratios:
        parts += [
            "",
            "Trainyard / MLflow (above 1 is more requests; below 1 is lower latency):",
            "",
            *ratios,
        ]
    parts += ["", "Machine CPU busy during each measurement: " + ", ".join(busy) + "."]
    if unexpected:
        parts += ["", "Unexpected status codes: " + "; ".join(unexpected) + "."]
    parts.append(MARK_END)
    return "\n".join(parts) + "\n"


# -------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="API throughput of Trainyard vs MLflow's tracking server, measured with wrk.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--duration", type=float, default=15.0, help="seconds per measurement")
    p.add_argument(
        "--warmup",
        type=float,
        default=3.0,
        help="seconds of unrecorded load before each measurement (0: none)",
    )
    p.add_argument("--connections", type=int, default=32, help="wrk -c")
    p.add_argument("--threads", type=int, default=2, help="wrk -t")
    p.add_argument(
        "--wrk-timeout",
        type=float,
        default=10.0,
        help="wrk --timeout: a slower response counts as an error",
    )
    p.add_argument("--workers", type=int, default=2, help="server worker processes, both servers")
    p.add_argument(
        "--get-ids",
        type=int,
        default=200,
        help="runs created before the get measurement, which cycles through them",
    )
    p.add_argument("--only", choices=["trainyard", "mlflow"], help="measure one server only")
    p.add_argument(
        "--trainyard-url", help="use this running Trainyard server instead of starting one"
    )
    p.add_argument("--trainyard-key", help="API key for --trainyard-url")
    p.add_argument(
        "--trainyard-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for the Trainyard server the harness starts (its rate limit "
        "and active-run cap are off unless set here)",
    )
    p.add_argument("--mlflow-spec", default=MLFLOW_SPEC, help="pip requirement for MLflow")
    add_trainyard_args(
        p,
        databases="bench_trainyard and bench_mlflow are",
        redis_db=15,
        broker_prefix="bench-api:",
        settle_timeout=60.0,
        start_timeout=120.0,
    )
    add_output_arg(p, "api-throughput")
    args = p.parse_args(argv)
    if args.trainyard_url and not args.trainyard_key:
        p.error("--trainyard-url needs --trainyard-key")
    if args.trainyard_key and not args.trainyard_url:
        p.error("--trainyard-key only goes with --trainyard-url (otherwise a key is created)")
    if args.trainyard_url and args.only == "mlflow":
        p.error("--trainyard-url with --only mlflow makes no sense")
    args.postgres_pid = None  # found in main() when PostgreSQL runs on this machine
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("wrk") is None:
        print(
            "wrk (the HTTP load generator) is not installed. Install it with:\n"
            "    sudo apt-get update && sudo apt-get install -y wrk    # Debian/Ubuntu\n"
            "    brew install wrk                                       # macOS",
            file=sys.stderr,
        )
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    started = utc_now()
    versions: dict[str, str] = {}
    results: list[Measurement] = []
    servers: list[Server] = []
    with stop_on_exit(servers):
        versions["PostgreSQL"] = pg_version(args.pg_url)
        pg = urllib.parse.urlsplit(args.pg_url)
        if pg.hostname in ("127.0.0.1", "localhost", "::1"):
            args.postgres_pid = listening_pid(pg.port or 5432)
        # Everything that can fail before the first measurement fails here.
        if args.only != "mlflow" and not args.trainyard_url:
            if not args.trainyard_bin.exists():
                raise BenchError(
                    f"{args.trainyard_bin} not found: install the project first"
                    " (make install) or pass --trainyard-url and --trainyard-key"
                )
            redis_ping(args.redis_url)
        mlflow_venv = None if args.only == "trainyard" else ensure_mlflow_venv(args.mlflow_spec)

        if args.only != "mlflow":
            ty_results, versions["Trainyard"] = bench_trainyard(args, servers)
            results += ty_results
            for server in servers:
                log(f"stopping {server.name} before the next server starts")
                server.stop()
            servers.clear()
        if mlflow_venv is not None:
            ml_results, versions["MLflow"] = bench_mlflow(args, servers, mlflow_venv)
            results += ml_results

    versions["wrk"] = wrk_version()
    versions["Python"] = platform.python_version()
    versions = {
        k: versions[k]
        for k in ("Trainyard", "MLflow", "PostgreSQL", "wrk", "Python")
        if k in versions
    }
    section = render_section(args, results, versions, started)
    write_section(args.output, section, MARK_START, MARK_END)
    (OUT / "api_vs_mlflow.json").write_text(
        json.dumps(
            {
                "started": started,
                "versions": versions,
                "args": {k: str(v) for k, v in vars(args).items() if k != "trainyard_key"},
                "results": [dataclasses.asdict(r) for r in results],
            },
            indent=2,
        )
        + "\n"
    )
    print()
    print(render_table(results))
    for line in render_ratios(results):
        print(line)
    print(
        f"\nwrote {args.output} (section {MARK_START} … {MARK_END});"
        f" raw wrk output and server logs in {OUT.relative_to(REPO)}/"
    )
    return 0


if __name__ == "__main__":
    kit.run(main)
