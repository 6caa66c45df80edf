#!/usr/bin/env python3
"""The request path of this checkout against an older commit: creates and gets, in rounds
whose order alternates (this, then old; old, then this; …).

Each measurement is `api_vs_mlflow.py --only trainyard`'s (the same server, database, wrk
load and CPU accounting); the older commit is served from a `git worktree` with this
checkout's `.venv` (`python -P`, `PYTHONPATH` on the worktree), so only the code differs.
On a shared machine the first server of a pair tends to lose; swapping the order every
round cancels that and any drift of the machine over the minutes a round takes. The report
gives req/s per round, the ratio of the means, and CPU per request (the API's processes and
PostgreSQL's), which is steadier than throughput. See bench/README.md.

    .venv/bin/python bench/request_path.py                     # against 224089f, 4 rounds
    .venv/bin/python bench/request_path.py --rounds 2 --duration 5 --output /tmp/rp.md
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path

import api_vs_mlflow as api
import kit
from kit import OUT, REPO, BenchError, log
from kit.load import wrk_version
from kit.processes import Server, listening_pid, stop_on_exit
from kit.report import add_output_arg, markers, report_head, utc_now, write_section, written_by
from kit.stores import pg_version, redis_ping

MARK_START, MARK_END = markers("request-path")
OPERATIONS = ("create", "get")


@contextlib.contextmanager
def served_from(rev: str) -> Iterator[Path]:
    """A `trainyard` command running ``rev``'s code with this checkout's interpreter."""
    with tempfile.TemporaryDirectory(prefix="trainyard-rev-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(tree), rev],
            check=True,
        )
        try:
            command = Path(tmp) / "trainyard"
            command.write_text(
                "#!/bin/sh\n"
                f'PYTHONPATH="{tree}" exec "{sys.executable}" -P -c '
                '"import sys; from app.cli import main; sys.exit(main())" "$@"\n'
            )
            command.chmod(0o755)
            yield command
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False
            )


def per_request_us(cpu_pct: float | None, rps: float) -> float | None:
    return None if cpu_pct is None or rps <= 0 else cpu_pct / 100 / rps * 1e6


def render(
    args: argparse.Namespace,
    rounds: list[dict[str, dict[str, api.Measurement]]],
    versions: dict[str, str],
    started: str,
) -> str:
    head = report_head("request_path.py", started=started, versions=versions)
    lines = [
        MARK_START,
        f"## The request path: this checkout against {args.against}",
        "",
        written_by(
            "request_path.py",
            f" {len(rounds)} rounds of `api_vs_mlflow.py --only trainyard`'s measurement"
            f" ({args.workers} API processes, {args.duration:g} s each), the order swapped"
            " every round.",
        ),
        "",
        *head,
        "",
        "| round | order | create this | create old | get this | get old |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for i, pair in enumerate(rounds, 1):
        order = "this, old" if i % 2 else "old, this"
        cells = [f"{pair[side][op].rps:,.0f}" for op in OPERATIONS for side in ("this", "old")]
        lines.append(f"| {i} | {order} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| mean | this | old | ratio | API CPU per request, this / old"
        " | PostgreSQL CPU per request, this / old |",
        "|---|---:|---:|---:|---|---|",
    ]

    def mean(op: str, side: str, value: Callable[[api.Measurement], float | None]) -> float:
        return statistics.fmean(value(pair[side][op]) or 0.0 for pair in rounds)

    for op in OPERATIONS:
        sides = ("this", "old")
        rps = {side: mean(op, side, lambda m: m.rps) for side in sides}
        cpu = {
            side: mean(op, side, lambda m: per_request_us(m.server_cpu_pct, m.rps))
            for side in sides
        }
        pg = {
            side: mean(op, side, lambda m: per_request_us(m.postgres_cpu_pct, m.rps))
            for side in sides
        }
        lines.append(
            f"| {op} req/s | {rps['this']:,.0f} | {rps['old']:,.0f} |"
            f" {rps['this'] / rps['old']:.2f}× | {cpu['this']:,.0f} / {cpu['old']:,.0f} µs"
            f" | {pg['this']:,.0f} / {pg['old']:,.0f} µs |"
        )
    lines += ["", MARK_END, ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(
        description="Creates and gets of this checkout against an older commit, ABBA rounds.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--against", default="224089f", help="the older commit (any git revision)")
    p.add_argument("--rounds", type=int, default=4, help="pairs of measurements (even: ABBA)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    p.add_argument("--workers", type=int, default=2, help="API processes, both servers")
    add_output_arg(p, "request-path")
    args, rest = p.parse_known_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    # Everything else (wrk, PostgreSQL, Redis, warm-up) as api_vs_mlflow.py takes it.
    measure = api.parse_args(
        [
            *("--only", "trainyard", "--duration", str(args.duration)),
            *("--workers", str(args.workers), *rest),
        ]
    )
    if measure.trainyard_url:
        raise BenchError("--trainyard-url: this benchmark starts both servers itself")
    return args, measure


def main(argv: list[str] | None = None) -> int:
    args, measure = parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    started = utc_now()
    redis_ping(measure.redis_url)
    pg = urllib.parse.urlsplit(measure.pg_url)
    if pg.hostname in ("127.0.0.1", "localhost", "::1"):
        measure.postgres_pid = listening_pid(pg.port or 5432)
    this = measure.trainyard_bin
    if not this.exists():
        raise BenchError(f"{this} not found: install the project first (make install)")
    rounds: list[dict[str, dict[str, api.Measurement]]] = []
    versions: dict[str, str] = {}
    with served_from(args.against) as old:
        for i in range(args.rounds):
            pair: dict[str, dict[str, api.Measurement]] = {}
            for side in ("this", "old") if i % 2 == 0 else ("old", "this"):
                log(f"round {i + 1}: {side}")
                measure.trainyard_bin = this if side == "this" else old
                servers: list[Server] = []
                with stop_on_exit(servers):
                    results, version = api.bench_trainyard(measure, servers)
                    for server in servers:
                        server.stop()
                versions[side] = version
                pair[side] = {r.operation: r for r in results}
            rounds.append(pair)
    versions = {
        "this": versions["this"],
        f"old ({args.against})": "git "
        + subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", args.against],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip(),
        "PostgreSQL": pg_version(measure.pg_url),
        "wrk": wrk_version(),
    }
    section = render(args, rounds, versions, started)
    write_section(args.output, section, MARK_START, MARK_END)
    (OUT / "request_path.json").write_text(
        json.dumps(
            [
                {side: {op: dataclasses.asdict(m) for op, m in pair[side].items()} for side in pair}
                for pair in rounds
            ],
            indent=2,
        )
        + "\n"
    )
    print(section)
    return 0


if __name__ == "__main__":
    kit.run(main)
