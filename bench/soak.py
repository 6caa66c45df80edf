#!/usr/bin/env python3
"""Memory over time (issue 15, "Soak and memory"): a worker's resident memory over one long
run of the real pipeline (default 2,000 steps of configs/runs/letters.yaml on the tiny
model), and the API's over many requests (default 1,000,000 GETs of runs, their events and
their metrics, through wrk). Target: at most 10% growth from the end of the warm-up to the
end, for each.

The worker's memory is its whole process tree's RSS, sampled every ``--sample`` seconds and
read against the run's step at that moment; the warm-up (imports, the model, the first
steps' allocator growth) ends at ``--warmup-steps``. The API's is one uvicorn process (one
worker), sampled between wrk rounds of ``--round`` seconds after ``--warmup-requests``.

    .venv/bin/python bench/soak.py                                   # ~15 min
    .venv/bin/python bench/soak.py --steps 300 --requests 100000 --output /tmp/s.md

Needs PostgreSQL (the database bench_soak is dropped and created), Redis (db 12, keys
under a prefix of its own) and wrk. Results replace the soak section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import kit
from kit import OUT, BenchError, log
from kit.load import run_wrk, wrk_version
from kit.machine import machine_description, versions_of, wait_for_quiet
from kit.processes import Server, rss_bytes, stop_on_exit
from kit.report import add_output_arg, command_line, markers, utc_now, write_section
from kit.trainyard import (
    LETTERS,
    Trainyard,
    add_model_arg,
    add_trainyard_args,
    model_for,
    preset_run,
)

DB_NAME = "bench_soak"
START, END = markers("soak")
TARGET_GROWTH = 0.10


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def soak_worker(ty: Trainyard, worker: Server, model: Path, args: argparse.Namespace) -> dict:
    run = ty.create_run(
        preset_run(LETTERS, model, steps=args.steps, save_steps=args.save_steps, name="soak")
    )
    samples: list[tuple[float, int, int]] = []  # (seconds, step, rss)
    t0 = time.monotonic()

    def sample(got: dict[str, Any]) -> None:
        samples.append((time.monotonic() - t0, int(got["step"]), rss_bytes(worker.proc.pid)))
        if len(samples) % 30 == 0:
            log(f"worker: step {got['step']}/{args.steps}, {mib(samples[-1][2])}")

    ty.wait_for_run(run["id"], every=args.sample, each=sample)
    after_warmup = [s for s in samples if s[1] >= args.warmup_steps]
    if len(after_warmup) < 2:
        raise BenchError("too few samples after the warm-up; lower --warmup-steps")
    start = statistics.median(r for _, _, r in after_warmup[:5])
    end = statistics.median(r for _, _, r in after_warmup[-5:])
    return {
        "run_id": run["id"],
        "steps": args.steps,
        "seconds": samples[-1][0],
        "rss_start": start,
        "rss_end": end,
        "rss_max": max(r for _, _, r in after_warmup),
        "rss_first": samples[0][2],
        "growth": end / start - 1,
        "curve": [(step, rss) for _, step, rss in after_warmup[:: max(1, len(after_warmup) // 12)]],
    }


def soak_api(ty: Trainyard, api: Server, run_id: str, args: argparse.Namespace) -> dict:
    ids = OUT / "soak-ids.txt"
    ids.write_text(run_id + "\n")
    header = [f"Authorization: Bearer {ty.key}"]
    pid = api.proc.pid
    rounds: list[tuple[int, int]] = []  # (requests so far, rss)
    done = done_at_warm = 0
    warm = False
    paths = [
        "/runs/{id}",
        "/runs/{id}/events?limit=50",
        "/runs/{id}/metrics?step_min=" + str(max(0, args.steps - 10)),
    ]
    while done < args.requests + args.warmup_requests:
        path = paths[len(rounds) % len(paths)]
        w = run_wrk(
            label=f"soak-api-{len(rounds)}",
            url=ty.base_url,
            script="get_ids.lua",
            script_args=[str(ids), path, *header],
            threads=1,
            connections=8,
            duration=args.round,
            timeout=10,
            secret=ty.key,
        )
        if w.errors:
            raise BenchError(f"wrk saw {w.errors} errors on {path}: {w.statuses}")
        done += w.requests
        if not warm and done >= args.warmup_requests:
            warm = True
            done_at_warm = done
        rounds.append((done, rss_bytes(pid)))
        log(f"api: {done:,} requests, {mib(rounds[-1][1])}")
    first = next(i for i, (n, _) in enumerate(rounds) if n >= done_at_warm)
    start = rounds[first][1]
    end = statistics.median(r for _, r in rounds[-3:])
    return {
        "requests": done - done_at_warm,
        "rss_start": start,
        "rss_end": end,
        "rss_max": max(r for _, r in rounds[first:]),
        "growth": end / start - 1,
        "rounds": len(rounds),
    }


def render(args: argparse.Namespace, started: str, worker: dict, api: dict, versions: dict) -> str:
    def row(process: str, load: str, got: dict) -> str:
        verdict = "**met**" if got["growth"] <= TARGET_GROWTH else "**not met**"
        cells = [process, load, *(mib(got[k]) for k in ("rss_start", "rss_end", "rss_max"))]
        return "| " + " | ".join([*cells, f"{got['growth']:+.1%}", verdict]) + " |"

    worker_load = (
        f"one run of {worker['steps']:,} steps ({worker['seconds'] / 60:.1f} min), "
        f"warm-up {args.warmup_steps} steps"
    )
    api_load = (
        f"{api['requests']:,} GETs (run, events page, metrics) after "
        f"{args.warmup_requests:,} warm-up, wrk 8 connections"
    )
    curve = ", ".join(f"{step}: {mib(rss)}" for step, rss in worker["curve"])
    table = "\n".join(
        [
            "| process | load | after warm-up | at the end | max | growth | target |",
            "|---|---|---|---|---|---|---|",
            row("worker (`--pool solo`, whole tree)", worker_load, worker),
            row("API (uvicorn, 1 worker)", api_load, api),
        ]
    )
    return f"""{START}
## Soak: memory over a long run and many requests

Written by `bench/soak.py`; rerun it rather than editing this section. Issue 15, "Soak and
memory": at most {TARGET_GROWTH:.0%} growth after the warm-up.

- Command: `{command_line("soak.py")}`
- Date: {started}; machine: {machine_description()}
- Versions: {", ".join(f"{k} {v}" for k, v in versions.items())}

{table}

The worker's resident memory against its step (after the warm-up): {curve}. Before the
first step it held {mib(worker["rss_first"])}.
{END}
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=2000, help="GRPO steps of the soak run")
    p.add_argument("--save-steps", type=int, default=500, help="checkpoint every N steps")
    p.add_argument("--warmup-steps", type=int, default=200, help="steps before measuring")
    p.add_argument("--sample", type=float, default=2.0, help="seconds between RSS samples")
    p.add_argument("--requests", type=int, default=1_000_000, help="API requests measured")
    p.add_argument("--warmup-requests", type=int, default=20_000, help="API requests first")
    p.add_argument("--round", type=float, default=20.0, help="seconds per wrk round")
    add_model_arg(p)
    add_trainyard_args(
        p,
        databases=DB_NAME,
        redis_db=12,
        broker_prefix="bench-soak:",
        settle_timeout=60.0,
        start_timeout=180.0,
    )
    add_output_arg(p, "soak")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    started = utc_now()
    home = Path(tempfile.mkdtemp(prefix="trainyard-soak-"))
    servers: list[Server] = []
    versions = versions_of("torch", "transformers", "trl", "uvicorn")
    versions["wrk"] = wrk_version()
    ty = Trainyard(
        args,
        name="soak",
        db_name=DB_NAME,
        servers=servers,
        home=home,
        # Rate limits and the active-run cap are for tenants, not for a load generator.
        env={"TRAINYARD_RATE_LIMIT_PER_SECOND": "0", "OMP_NUM_THREADS": "1"},
    )
    try:
        with stop_on_exit(servers):
            wait_for_quiet(args.settle_timeout)
            model = model_for(args, home)
            ty.start(api_workers=1, timeout=args.start_timeout)
            assert ty.worker is not None and ty.api is not None
            worker = soak_worker(ty, ty.worker, model, args)
            ty.worker.stop()  # the API alone from here: nothing else on its CPU
            api = soak_api(ty, ty.api, worker["run_id"], args)
    finally:
        ty.remove()
    section = render(args, started, worker, api, versions)
    write_section(args.output, section, START, END)
    (OUT / "soak.json").write_text(json.dumps({"worker": worker, "api": api}, indent=2))
    print(section)
    return 0 if max(worker["growth"], api["growth"]) <= TARGET_GROWTH else 1


if __name__ == "__main__":
    kit.run(main)
