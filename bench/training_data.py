#!/usr/bin/env python3
"""Training data at scale (issue 4): ten million trajectories in PostgreSQL, read through the
training-data library the way the API reads them, and written through the workers' own path.

The script builds its own database (``trainyard_bench_td``), migrates it, loads it with COPY
(the training-data indexes of migration 0005 are dropped for the load and rebuilt after it,
with the same definitions), then measures on one persistent connection:

a. a filtered page of 100 (project + reward >= 0.5 + 80 of the 90 days, newest first): page 1
   and page 10,000 by keyset;
b. the count under the same filters;
c. a page of 1,000 without and with messages;
d. JSON Lines export throughput;
e. pages 1 and 10,000 with the 0005 indexes dropped (inside a transaction rolled back after);
f. ingest through the workers' per-step statements (``app.runs.lifecycle.step_moves``: the
   scored rollouts with their status move, then the step's metrics) vs a raw COPY,
   alternately.

The results replace the section between the training-data markers in docs/benchmarks.md
(``--output`` for another file); a JSON summary goes to stdout, progress to stderr.

    .venv/bin/python bench/training_data.py                      # 10M rows, ~17 GB, ~20 min
    .venv/bin/python bench/training_data.py --rows 300000 --ingest-rows 20000 \\
        --output /tmp/td-bench.md                                # a quick look
    .venv/bin/python bench/training_data.py --reuse              # measure again, no load

See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import functools
import itertools
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

import asyncpg
import kit
import psutil
from kit import BenchError, log
from kit.machine import machine_description, package_versions, trainyard_version, wait_for_quiet
from kit.report import (
    add_output_arg,
    command_line,
    markers,
    report_head,
    utc_now,
    write_section,
    written_by,
)
from kit.report import fmt_ms as _fmt_ms
from kit.stores import drop_database, migrate, pg_url_for, recreate_database
from kit.trainyard import add_trainyard_bin_arg

from app.core.copy_format import NULL, copy_field
from app.core.pg import connect_kwargs
from app.runs.lifecycle.status import TERMINAL
from app.training_data import queries
from app.training_data.filters import Filters
from app.training_data.jsonl import COPY_COLUMNS
from app.training_data.library import (
    count_training_trajectories_async,
    get_training_trajectories_async,
    open_connection,
)

fmt_ms = functools.partial(_fmt_ms, digits=2)  # the queries take well under a millisecond
MARK_START, MARK_END = markers("training-data")
DEFAULT_ADMIN_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
DEFAULT_DB = "trainyard_bench_td"
META_TABLE = "bench_training_data"

FULL_ROWS = 10_000_000
BYTES_PER_ROW = 1750  # heap + TOAST + the six indexes: 1.70 KB measured at 300k rows
PROJECTS = 20
RUNS = 2000
DAYS = 90
SPAN_S = DAYS * 86400.0
FILTER_FROM_DAYS_AGO, FILTER_TO_DAYS_AGO = 85, 5  # the main filter: 80 of the 90 days
MIN_REWARD = 0.5
PAGE = 100
FULL_DEEP_PAGE = 10_000
NULL_REWARD_SHARE = 0.03
POOL_SIZE = 2000
POOL_MIN_BYTES, POOL_MAX_BYTES = 200, 2000
BLOCK_NOISE_S = 120.0  # created_at of a step: its place on the timeline +- a few minutes
ROW_SPACING_US = 50_000  # between the rollouts of one step
INGEST_PROJECT = "bench-ingest"
INGEST_STEPS_PER_RUN = 100
GROUP_SIZE = 8  # rollouts per group in the ingest steps

# Migration 0005's indexes, dropped for the load and rebuilt from their own definitions.
TD_INDEXES = (
    "ix_trajectories_project_created",
    "ix_trajectories_created",
    "ix_trajectories_learning_key_created",
    "ix_trajectories_run_created",
)
INGEST_COPY_COLUMNS = tuple(c for c in COPY_COLUMNS if c != "created_at")  # now(), as upserts
_INSERT_RUN = """
INSERT INTO runs (id, project_id, status, model_name, task_description, num_examples,
                  rollouts_per_group, learning_rate, num_epochs, learning_key, step, epoch,
                  version, attempt, cancel_requested, pause_requested, created_at, updated_at,
                  started_at, completed_at)
VALUES ($1, $2, $3, 'bench-model', 'training-data benchmark run', 1000, $4, 1e-5, 1, $5, $6,
        0, 1, 1, false, false, $7, $8, $7, $9)
"""
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_WORDS = tuple(
    " ".join(
        (
            "the of and to in is that for it as with was on be by this are from at or an which",
            "answer step first then result value number equation solve check compute therefore",
            "reward policy model token group rollout sample gradient loss function variable sum",
            "total each because since we let consider given find prove list table string parse",
            "return error case test input output example integer prime factor divide multiply",
        )
    ).split(" ")
)
_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a careful math tutor. Show your reasoning, then give the final answer.",
    "Answer in JSON with the keys reasoning and answer.",
    "You write short, correct Python functions.",
)


# ----------------------------------------------------------------------------- data set


@dataclasses.dataclass
class PlanRun:
    id: uuid.UUID
    project: int
    learning_key: str | None
    status: str
    groups: int
    rollouts: int
    start_s: float  # seconds into the 90 days
    end_s: float
    steps: int = 0
    rows: int = 0
    prefix: str = ""  # "run_id\tproject_id\tlearning_key\t" for the COPY lines


@dataclasses.dataclass
class PlanProject:
    id: uuid.UUID
    name: str
    weight: float
    runs: list[PlanRun]
    rows: int = 0

    def pick(self, t: float, rng: random.Random) -> PlanRun:
        """One of the project's runs live at ``t`` (runs tile the 90 days, two or three
        overlapping at any time)."""
        width = SPAN_S / len(self.runs)
        j0 = min(int(t / width), len(self.runs) - 1)
        live = [r for r in self.runs[max(0, j0 - 1) : j0 + 2] if r.start_s <= t <= r.end_s]
        return rng.choice(live) if live else self.runs[j0]


def make_plan(seed: int) -> list[PlanProject]:
    """20 projects with Zipf-like sizes (weight 1/rank: the biggest holds ~28% of the rows),
    2,000 runs spread in proportion (at least 10 each), each with its own learning key (or
    none), status and group shape."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) for rank in range(PROJECTS)]
    total = sum(weights)
    counts = [max(10, round(RUNS * w / total)) for w in weights]
    counts[0] += RUNS - sum(counts)
    keys = [f"task-{i:02d}" for i in range(40)]
    projects = []
    for p, (weight, n_runs) in enumerate(zip(weights, counts, strict=True)):
        project_id = uuid.UUID(int=rng.getrandbits(128), version=4)
        width = SPAN_S / n_runs
        runs = []
        for j in range(n_runs):
            start, end = max(0.0, (j - 0.5) * width), min(SPAN_S, (j + 1.5) * width)
            if j == n_runs - 1:  # still going at the end of the data
                status = rng.choices(["training", "scoring", "paused"], [6, 2, 2])[0]
            else:
                status = rng.choices(["completed", "failed", "cancelled"], [85, 10, 5])[0]
            key = None if rng.random() < 0.2 else rng.choice(keys)
            run = PlanRun(
                id=uuid.UUID(int=rng.getrandbits(128), version=4),
                project=p,
                learning_key=key,
                status=status,
                groups=rng.choice([1, 2, 4]),
                rollouts=rng.choice([4, 8]),
                start_s=start,
                end_s=end,
            )
            run.prefix = f"{run.id}\t{project_id}\t{copy_field(key) if key else NULL}\t"
            runs.append(run)
        projects.append(PlanProject(project_id, f"bench-p{p:02d}", weight / total, runs))
    return projects


def message_pool(seed: int) -> list[list[dict[str, str]]]:
    """~2,000 conversations (system, user, assistant) whose JSON spreads evenly over 0.2-2 KB."""
    rng = random.Random(seed + 1)
    pool = []
    for i in range(POOL_SIZE):
        target = POOL_MIN_BYTES + (POOL_MAX_BYTES - POOL_MIN_BYTES) * i // (POOL_SIZE - 1)
        system = rng.choice(_SYSTEM_PROMPTS)
        skeleton = [
            {"role": "system", "content": system},
            {"role": "user", "content": ""},
            {"role": "assistant", "content": ""},
        ]
        budget = max(20, target - len(_JSON.encode(skeleton)))
        user_len = max(10, budget * 3 // 10)
        skeleton[1]["content"] = _text(rng, user_len)
        skeleton[2]["content"] = _text(rng, budget - user_len, lines=True)
        pool.append(skeleton)
    return pool


def _text(rng: random.Random, length: int, *, lines: bool = False) -> str:
    words: list[str] = []
    size = 0
    while size < length:
        word = rng.choice(_WORDS)
        if lines and words and rng.random() < 0.05:
            word = "\n" + word
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:length]


class Progress:
    def __init__(self, what: str, total: int) -> None:
        self.what, self.total = what, total
        self.rows = self.bytes = 0
        self.started = self.last = time.perf_counter()

    def add(self, rows: int, nbytes: int) -> None:
        self.rows += rows
        self.bytes += nbytes
        now = time.perf_counter()
        if now - self.last >= 5 or self.rows >= self.total:
            self.last = now
            elapsed = now - self.started
            log(
                f"{self.what}: {self.rows:,}/{self.total:,} rows"
                f" ({self.rows / elapsed:,.0f} rows/s, {self.bytes / elapsed / 1e6:.1f} MB/s)"
            )


def copy_chunks(
    projects: list[PlanProject],
    rows: int,
    start_epoch: float,
    seed: int,
    chunk_bytes: int = 4 << 20,
) -> Iterator[tuple[bytes, int]]:
    """COPY text lines for ``rows`` trajectories in created_at order (with noise), a few MB at
    a time. Each block is one step of one run: groups x rollouts rows, indexes unique."""
    rng = random.Random(seed + 2)
    pool = [copy_field(_JSON.encode(m)) for m in message_pool(seed)]
    breakdowns = [
        copy_field(_JSON.encode({"correct": round(i / 99, 2), "format": 1.0})) for i in range(100)
    ]
    metadatas = [
        copy_field(_JSON.encode({"engine": "vllm", "completion_tokens": 16 * (i + 1)}))
        for i in range(32)
    ]
    # A project is drawn per step, so its weight is divided by its runs' mean step size: the
    # shares of rows then follow the Zipf weights.
    per_step = [
        p.weight / statistics.fmean(r.groups * r.rollouts for r in p.runs) for p in projects
    ]
    cum = list(itertools.accumulate(per_step))
    choices, rnd, bits, randrange, gauss = (
        rng.choices,
        rng.random,
        rng.getrandbits,
        rng.randrange,
        rng.gauss,
    )
    n_pool, n_breakdowns, n_metadatas = len(pool), len(breakdowns), len(metadatas)
    emitted = 0
    buf: list[str] = []
    size = pending = 0
    cached_sec, cached_text = -1, ""
    while emitted < rows:
        t = min(max(emitted / rows * SPAN_S + gauss(0.0, BLOCK_NOISE_S), 0.0), SPAN_S - 60)
        project = choices(projects, cum_weights=cum)[0]
        run = project.pick(t, rng)
        step = run.steps
        run.steps += 1
        n = min(run.groups * run.rollouts, rows - emitted)
        base_us = int((start_epoch + t) * 1e6)
        prefix, per_group = run.prefix, run.rollouts
        for k in range(n):
            sec, frac = divmod(base_us + k * ROW_SPACING_US, 1_000_000)
            if sec != cached_sec:
                cached_sec = sec
                cached_text = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(sec))
            reward = NULL if rnd() < NULL_REWARD_SHARE else f"{rnd():.6f}"
            line = (
                f"{bits(128):032x}\t{prefix}{step}\t{k // per_group}\t{k % per_group}\t"
                f"{pool[randrange(n_pool)]}\t{reward}\t{breakdowns[randrange(n_breakdowns)]}\t"
                f"{metadatas[randrange(n_metadatas)]}\t{cached_text}.{frac:06d}+00\n"
            )
            buf.append(line)
            size += len(line)
        run.rows += n
        project.rows += n
        emitted += n
        pending += n
        if size >= chunk_bytes or emitted >= rows:
            yield "".join(buf).encode(), pending
            buf, size, pending = [], 0, 0


# ----------------------------------------------------------------------------- database


async def admin_connect(admin_url: str) -> asyncpg.Connection:
    try:
        return await asyncpg.connect(**connect_kwargs(admin_url))
    except (OSError, asyncpg.PostgresError) as exc:
        raise BenchError(f"cannot connect to PostgreSQL at {admin_url}: {exc}") from exc


async def stored_dataset(admin: asyncpg.Connection, db_url: str, name: str) -> dict[str, Any]:
    """What an earlier run loaded into the bench database ({} when nothing complete is there)."""
    if not await admin.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
        return {}
    conn = await asyncpg.connect(**connect_kwargs(db_url))
    try:
        value = await conn.fetchval(f"SELECT value FROM {META_TABLE} WHERE key = 'dataset'")
        indexes = await index_definitions(conn)
    except asyncpg.UndefinedTableError:
        return {}
    finally:
        await conn.close()
    data: dict[str, Any] = json.loads(value) if value else {}
    if data and set(indexes) != set(TD_INDEXES):
        log(f"the stored data set lacks indexes ({sorted(set(TD_INDEXES) - set(indexes))})")
        return {}
    return data


async def index_definitions(conn: asyncpg.Connection) -> dict[str, str]:
    rows = await conn.fetch(
        "SELECT indexname, indexdef FROM pg_indexes"
        " WHERE schemaname = 'public' AND tablename = 'trajectories'"
        " AND indexname = ANY($1::text[])",
        list(TD_INDEXES),
    )
    return {r["indexname"]: r["indexdef"] for r in rows}


def free_disk(data_directory: str | None) -> tuple[str, int]:
    path = data_directory if data_directory and os.path.isdir(data_directory) else "/"
    return path, shutil.disk_usage(path).free


def estimated_bytes(rows: int) -> int:
    return rows * BYTES_PER_ROW


async def table_sizes(conn: asyncpg.Connection) -> dict[str, Any]:
    row = await conn.fetchrow(
        """
        SELECT pg_total_relation_size(c.oid) AS total, pg_relation_size(c.oid) AS heap,
               coalesce(pg_total_relation_size(nullif(c.reltoastrelid, 0)), 0) AS toast,
               pg_indexes_size(c.oid) AS indexes, c.reltuples::bigint AS estimated_rows
          FROM pg_class AS c WHERE c.oid = 'trajectories'::regclass
        """
    )
    per_index = await conn.fetch(
        "SELECT i.relname AS name, pg_relation_size(i.oid) AS bytes FROM pg_index AS x"
        " JOIN pg_class AS i ON i.oid = x.indexrelid"
        " WHERE x.indrelid = 'trajectories'::regclass ORDER BY 2 DESC"
    )
    return {**dict(row), "per_index": {r["name"]: r["bytes"] for r in per_index}}


async def insert_runs(
    conn: asyncpg.Connection, runs: Sequence[PlanRun], project_ids: Sequence[uuid.UUID], t0: float
) -> None:
    def at(seconds: float) -> dt.datetime:
        return dt.datetime.fromtimestamp(t0 + seconds, dt.UTC)

    await conn.executemany(
        _INSERT_RUN,
        [
            (
                r.id,
                project_ids[r.project],
                r.status,
                r.rollouts,
                r.learning_key,
                r.steps,
                at(r.start_s),
                at(r.end_s),
                at(r.end_s) if r.status in TERMINAL else None,
            )
            for r in runs
        ],
    )


async def load(args: argparse.Namespace, db_url: str, rows: int, superuser: bool) -> dict[str, Any]:
    """Projects, runs and ``rows`` trajectories, then the 0005 indexes, then VACUUM ANALYZE."""
    end_at = dt.datetime.now(dt.UTC).replace(microsecond=0)
    start_epoch = end_at.timestamp() - SPAN_S
    projects = make_plan(args.seed)
    runs = [r for p in projects for r in p.runs]
    conn = await asyncpg.connect(**connect_kwargs(db_url))
    try:
        await conn.execute(f"CREATE TABLE {META_TABLE} (key text PRIMARY KEY, value text)")
        await conn.executemany(
            "INSERT INTO projects (id, name, created_at) VALUES ($1, $2, $3)",
            [(p.id, p.name, dt.datetime.fromtimestamp(start_epoch, dt.UTC)) for p in projects],
        )
        await insert_runs(conn, runs, [p.id for p in projects], start_epoch)
        definitions = await index_definitions(conn)
        missing = set(TD_INDEXES) - set(definitions)
        if missing:
            raise BenchError(f"migration 0005's indexes are missing: {sorted(missing)}")
        for name in TD_INDEXES:
            await conn.execute(f"DROP INDEX {name}")
        log(
            f"loading {rows:,} trajectories with COPY (primary key and unique index in place;"
            f" {', '.join(TD_INDEXES)} dropped for the load)"
        )
        progress = Progress("COPY", rows)

        async def source() -> AsyncIterator[bytes]:
            for chunk, n in copy_chunks(projects, rows, start_epoch, args.seed):
                yield chunk
                progress.add(n, len(chunk))

        started = time.perf_counter()
        async with conn.transaction():
            if superuser:  # foreign-key triggers off: the rows are consistent by construction
                await conn.execute("SET LOCAL session_replication_role = replica")
            await conn.execute("TRUNCATE trajectories")  # so that COPY may FREEZE
            await conn.copy_to_table(
                "trajectories", source=source(), columns=COPY_COLUMNS, format="text", freeze=True
            )
        copy_s = time.perf_counter() - started
        log(f"COPY done: {rows:,} rows in {copy_s:.1f} s ({rows / copy_s:,.0f} rows/s)")
        await conn.executemany(
            "UPDATE runs SET step = $2 WHERE id = $1", [(r.id, r.steps) for r in runs]
        )
        await conn.execute("SET maintenance_work_mem = '1GB'")
        index_s: dict[str, float] = {}
        for name in TD_INDEXES:
            started = time.perf_counter()
            await conn.execute(definitions[name])
            index_s[name] = time.perf_counter() - started
            log(f"built {name} in {index_s[name]:.1f} s")
        if await index_definitions(conn) != definitions:
            raise BenchError("the rebuilt indexes differ from migration 0005's")
        await conn.execute("RESET maintenance_work_mem")
        started = time.perf_counter()
        await conn.execute("VACUUM (ANALYZE) trajectories")
        await conn.execute("ANALYZE runs")
        await conn.execute("ANALYZE projects")
        vacuum_s = time.perf_counter() - started
        log(f"VACUUM ANALYZE in {vacuum_s:.1f} s")
        biggest = max(projects, key=lambda p: p.rows)
        data = {
            "rows": rows,
            "seed": args.seed,
            "end_at": end_at.isoformat(),
            "loaded_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "projects": len(projects),
            "runs": len(runs),
            "biggest_project": {"id": str(biggest.id), "name": biggest.name, "rows": biggest.rows},
            "project_rows": {p.name: p.rows for p in projects},
            "copy_seconds": round(copy_s, 2),
            "copy_rows_per_s": round(rows / copy_s),
            "copy_mb": round(progress.bytes / 1e6, 1),
            "foreign_keys_checked_during_load": not superuser,
            "index_seconds": {k: round(v, 2) for k, v in index_s.items()},
            "vacuum_analyze_seconds": round(vacuum_s, 2),
        }
        await conn.execute(
            f"INSERT INTO {META_TABLE} VALUES ('dataset', $1)", json.dumps(data, default=str)
        )
        return data
    finally:
        await conn.close()


# ------------------------------------------------------------------------------ measures


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def latency(samples: Sequence[float]) -> dict[str, Any]:
    return {
        "p50_ms": round(pct(samples, 0.5), 3),
        "p95_ms": round(pct(samples, 0.95), 3),
        "min_ms": round(min(samples), 3),
        "n": len(samples),
    }


async def timed(call: Callable[[], Awaitable[Any]], reps: int, warmup: int = 5) -> list[float]:
    for _ in range(warmup):
        await call()
    out = []
    for _ in range(reps):
        started = time.perf_counter()
        await call()
        out.append((time.perf_counter() - started) * 1000)
    return out


def plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return [plan, *(n for child in plan.get("Plans", []) for n in plan_nodes(child))]


def plan_summary(plan: dict[str, Any]) -> str:
    """``Limit > Index Scan Backward (ix_…)``: node types in tree order, index names."""
    parts = []
    for node in plan_nodes(plan):
        kind = node["Node Type"]
        if node.get("Scan Direction") == "Backward":
            kind += " Backward"
        if node.get("Index Name"):
            kind += f" ({node['Index Name']})"
        elif node.get("Relation Name"):
            kind += f" ({node['Relation Name']})"
        parts.append(kind)
    return " > ".join(parts)


async def explain(conn: asyncpg.Connection, sql: str, params: Sequence[Any]) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of the statement with its parameters (a custom plan)."""
    (doc,) = await conn.fetchval(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}", *params)
    text = await conn.fetch(f"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {sql}", *params)
    plan = doc["Plan"]
    return {
        "summary": plan_summary(plan),
        "seq_scan_of_trajectories": any(
            n["Node Type"] == "Seq Scan" and n.get("Relation Name") == "trajectories"
            for n in plan_nodes(plan)
        ),
        "execution_ms": doc.get("Execution Time"),
        "planning_ms": doc.get("Planning Time"),
        "shared_hit": plan.get("Shared Hit Blocks"),
        "shared_read": plan.get("Shared Read Blocks"),
        "text": "\n".join(r[0] for r in text),
    }


def sql_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, uuid.UUID):
        return f"'{value}'::uuid"
    if isinstance(value, dt.datetime):
        return f"'{value.isoformat()}'::timestamptz"
    text = str(value).replace("'", "''")
    return f"'{text}'"


async def explain_generic(
    conn: asyncpg.Connection, sql: str, params: Sequence[Any]
) -> dict[str, Any]:
    """The generic plan PostgreSQL may switch a prepared statement to after five runs (asyncpg
    prepares every statement): PREPARE, force the generic plan, EXPLAIN EXECUTE."""
    name = "td_bench_generic"
    await conn.execute(f"PREPARE {name} AS {sql}")
    try:
        await conn.execute("SET plan_cache_mode = force_generic_plan")
        args = ", ".join(sql_literal(v) for v in params)
        (doc,) = await conn.fetchval(
            f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE {name}({args})"
        )
        text = await conn.fetch(f"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) EXECUTE {name}({args})")
        return {
            "summary": plan_summary(doc["Plan"]),
            "execution_ms": doc.get("Execution Time"),
            "text": "\n".join(r[0] for r in text),
        }
    finally:
        await conn.execute("RESET plan_cache_mode")
        await conn.execute(f"DEALLOCATE {name}")


async def plan_cache_use(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    """How the timed statements (asyncpg's prepared statements) were planned."""
    rows = await conn.fetch(
        "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
        " WHERE statement LIKE '%FROM trajectories AS t%' AND statement NOT LIKE 'EXPLAIN%'"
        " AND statement NOT LIKE '%pg_prepared_statements%' ORDER BY generic_plans DESC"
    )
    return [
        {
            "statement": statement_kind(r["statement"]),
            "generic_plans": r["generic_plans"],
            "custom_plans": r["custom_plans"],
        }
        for r in rows
    ]


def statement_kind(sql: str) -> str:
    if sql.lstrip().startswith("SELECT count("):
        return "count"
    if "json_build_object" in sql:
        kind = "export batch"
    else:
        kind = "page" + (" with messages" if "t.messages" in sql else " without messages")
    return kind + (" after a keyset position" if "(t.created_at, t.id) <" in sql else "")


@dataclasses.dataclass
class MainQuery:
    """The main filtered page, as the API runs it, at page 1 and deep."""

    filters: Filters
    position: queries.Position  # the keyset position before the deep page
    page1: Callable[[], Awaitable[Any]]
    deep: Callable[[], Awaitable[Any]]
    page1_sql: tuple[str, list[Any]]


async def measure_reads(
    args: argparse.Namespace, conn: asyncpg.Connection, data: dict[str, Any]
) -> tuple[dict[str, Any], MainQuery]:
    end_at = dt.datetime.fromisoformat(data["end_at"])
    biggest = data["biggest_project"]
    start = end_at - dt.timedelta(days=FILTER_FROM_DAYS_AGO)
    end = end_at - dt.timedelta(days=FILTER_TO_DAYS_AGO)
    # As the API builds them: the caller's project by id (GET /trajectories).
    f = Filters.build(
        project_ids=[uuid.UUID(biggest["id"])],
        min_reward=MIN_REWARD,
        start_date=start,
        end_date=end,
    )
    library_filters: dict[str, Any] = {
        "projects": [biggest["name"]],
        "min_reward": MIN_REWARD,
        "start_date": start,
        "end_date": end,
    }
    out: dict[str, Any] = {
        "filter": {
            "project": biggest["name"],
            "project_rows": biggest["rows"],
            "min_reward": MIN_REWARD,
            "start_date": start.isoformat(),
            "end_date": end.isoformat(),
        }
    }
    matching = await count_training_trajectories_async(conn, **library_filters)
    out["filter"]["matching_rows"] = matching
    deep_page = max(2, round(FULL_DEEP_PAGE * data["rows"] / FULL_ROWS))
    if matching < deep_page * PAGE:
        deep_page = max(2, matching // PAGE)
        log(f"only {matching:,} rows match the main filter; the deep page is {deep_page:,}")
    out["deep_page"] = deep_page
    log(f"main filter matches {matching:,} rows; deep page {deep_page:,} of {PAGE}")

    # The keyset position before the deep page, found once with OFFSET (untimed).
    sql, params = queries.trajectory_select(
        f,
        f.project_ids,
        include_messages=False,
        include_metadata=False,
        order="newest",
        after=None,
        limit=None,
    )
    offset = (deep_page - 1) * PAGE
    row = await conn.fetchrow(f"{sql} OFFSET {offset - 1} LIMIT 1", *params)
    position: queries.Position = (row["created_at"], row["id"])
    expected = [r["id"] for r in await conn.fetch(f"{sql} OFFSET {offset} LIMIT {PAGE}", *params)]

    # The API asks for one row more than the page, to know whether another page follows.
    async def page1() -> list[Any]:
        return await queries.fetch_trajectories(conn, f, limit=PAGE + 1)

    async def deep() -> list[Any]:
        return await queries.fetch_trajectories(conn, f, after=position, limit=PAGE + 1)

    async def library_page1() -> list[Any]:
        return await get_training_trajectories_async(conn, limit=PAGE, **library_filters)

    got = await deep()
    if [t.id for t in got[:PAGE]] != expected:
        raise BenchError("the keyset page differs from the OFFSET page: a paging bug")
    if len(await page1()) != PAGE + 1:
        raise BenchError("page 1 is short")

    log(f"timing page 1 and page {deep_page:,} ({args.reps} each, alternating)")
    samples: dict[str, list[float]] = {"page1": [], "deep": [], "library_page1": []}
    calls = {"page1": page1, "deep": deep, "library_page1": library_page1}
    for call in calls.values():
        await timed(call, 0, warmup=5)
    for _ in range(args.reps):
        for name, call in calls.items():
            samples[name] += await timed(call, 1, warmup=0)
    out["page1"] = latency(samples["page1"])
    out["deep"] = latency(samples["deep"])
    out["library_page1"] = latency(samples["library_page1"])
    out["deep_over_page1"] = round(out["deep"]["p50_ms"] / out["page1"]["p50_ms"], 2)
    log(
        f"page 1 p50 {out['page1']['p50_ms']:.2f} ms, page {deep_page:,} p50"
        f" {out['deep']['p50_ms']:.2f} ms"
    )

    log(f"timing count ({args.count_reps})")
    count_samples = await timed(
        lambda: count_training_trajectories_async(conn, **library_filters), args.count_reps, 2
    )
    out["count"] = latency(count_samples)

    log(f"timing a page of 1,000 with and without messages ({args.messages_reps} each)")
    variants = {  # (include_messages, include_metadata)
        "page1000_with_messages": (True, True),
        "page1000_without_messages": (False, True),
        "page1000_bare": (False, False),  # neither messages nor metadata
    }
    big: dict[str, list[float]] = {name: [] for name in variants}

    def big_page(messages: bool, metadata: bool) -> Callable[[], Awaitable[Any]]:
        async def call() -> list[Any]:
            return await queries.fetch_trajectories(
                conn, f, include_messages=messages, include_metadata=metadata, limit=1000
            )

        return call

    calls1000 = {name: big_page(*flags) for name, flags in variants.items()}
    for page_call in calls1000.values():
        await timed(page_call, 0, 3)
    for _ in range(args.messages_reps):
        for name, page_call in calls1000.items():
            big[name] += await timed(page_call, 1, 0)
    for name, page_samples in big.items():
        out[name] = latency(page_samples)
    with_m = out["page1000_with_messages"]["p50_ms"]
    out["without_messages_faster_pct"] = round(
        100 * (1 - out["page1000_without_messages"]["p50_ms"] / with_m), 1
    )
    out["bare_faster_pct"] = round(100 * (1 - out["page1000_bare"]["p50_ms"] / with_m), 1)

    export_rows = min(args.export_rows, matching)
    log(f"exporting {export_rows:,} rows as JSON Lines ({args.export_rounds} rounds)")
    rounds = []
    for _ in range(args.export_rounds):
        lines = nbytes = 0
        started = time.perf_counter()
        async for chunk in queries.jsonl_chunks(conn, f, limit=export_rows):
            lines += chunk.count("\n")
            nbytes += len(chunk.encode())
        elapsed = time.perf_counter() - started
        if lines != export_rows:
            raise BenchError(f"the export wrote {lines:,} lines, not {export_rows:,}")
        rounds.append(
            {"seconds": elapsed, "rows_per_s": lines / elapsed, "mb_per_s": nbytes / elapsed / 1e6}
        )
        log(f"  {lines / elapsed:,.0f} rows/s, {nbytes / elapsed / 1e6:.1f} MB/s")
    out["export"] = {
        "rows": export_rows,
        "mb": round(nbytes / 1e6, 1),
        "rows_per_s": round(statistics.median(r["rows_per_s"] for r in rounds)),
        "mb_per_s": round(statistics.median(r["mb_per_s"] for r in rounds), 1),
        "rounds_rows_per_s": [round(r["rows_per_s"]) for r in rounds],
    }

    # Plans: the page queries as the library sends them, with their parameters.
    plans: dict[str, Any] = {}
    page_sql = queries.trajectory_select(
        f,
        f.project_ids,
        include_messages=True,
        include_metadata=True,
        order="newest",
        after=None,
        limit=PAGE + 1,
    )
    deep_sql = queries.trajectory_select(
        f,
        f.project_ids,
        include_messages=True,
        include_metadata=True,
        order="newest",
        after=position,
        limit=PAGE + 1,
    )
    w = queries.trajectory_where(f, f.project_ids)
    count_sql = (f"SELECT count(*) FROM trajectories AS t WHERE {w.sql()}", w.params)
    plans["page1"] = await explain(conn, *page_sql)
    plans["deep"] = await explain(conn, *deep_sql)
    plans["count"] = await explain(conn, *count_sql)
    generic: dict[str, Any] = {}
    for name, (q, p) in (("page1", page_sql), ("deep", deep_sql), ("count", count_sql)):
        try:
            generic[name] = await explain_generic(conn, q, p)
        except asyncpg.PostgresError as exc:
            generic[name] = {"error": str(exc)}
    plans["generic"] = generic
    plans["plan_cache"] = await plan_cache_use(conn)
    out["plans"] = plans
    for name in ("page1", "deep", "count"):
        log(f"plan {name}: {plans[name]['summary']} ({plans[name]['execution_ms']:.2f} ms)")
        log(f"  generic plan: {generic[name].get('summary', generic[name].get('error'))}")
    return out, MainQuery(f, position, page1, deep, page_sql)


async def measure_without_indexes(
    args: argparse.Namespace, conn: asyncpg.Connection, reads: dict[str, Any], main: MainQuery
) -> dict[str, Any]:
    """Pages 1 and N with the 0005 indexes dropped inside a transaction that is rolled back
    afterwards: the indexes come back exactly as they were, with no rebuild, even if this
    is interrupted."""
    out: dict[str, Any] = {"timeout_s": args.noindex_timeout, "reps": args.noindex_reps}
    before = await index_definitions(conn)
    tx = conn.transaction()
    await tx.start()
    try:
        await conn.execute(f"SET LOCAL statement_timeout = '{int(args.noindex_timeout * 1000)}'")
        for name in TD_INDEXES:
            await conn.execute(f"DROP INDEX {name}")
        sql, params = main.page1_sql
        plan = await conn.fetch(f"EXPLAIN (COSTS OFF) {sql}", *params)
        out["plan_page1"] = "\n".join(r[0] for r in plan)
        for name, call in (("page1", main.page1), ("deep", main.deep)):
            samples: list[float] = []
            timed_out = False
            for rep in range(args.noindex_reps):
                log(f"without indexes: {name} ({rep + 1}/{args.noindex_reps})")
                try:
                    async with conn.transaction():  # a savepoint: a timeout undoes only this
                        samples += await timed(call, 1, 0)
                except asyncpg.QueryCanceledError:
                    timed_out = True
                    log(f"  > {args.noindex_timeout:g} s (statement_timeout)")
                    break
                log(f"  {samples[-1] / 1000:.1f} s")
            out[name] = {
                **(latency(samples) if samples else {"n": 0}),
                "timed_out": timed_out,
            }
    finally:
        await tx.rollback()
    if await index_definitions(conn) != before:
        raise BenchError("the training-data indexes did not come back after the rollback")
    for name in ("page1", "deep"):
        res = out[name]
        indexed = reads[name]["p50_ms"]
        if res.get("timed_out"):
            floor_ms = args.noindex_timeout * 1000
            res["ratio"] = round(floor_ms / indexed)
            res["ratio_is_lower_bound"] = True
        else:
            res["ratio"] = round(res["p50_ms"] / indexed)
            res["ratio_is_lower_bound"] = False
    return out


# -------------------------------------------------------------------------------- ingest


def ingest_steps(seed: int, rows: int, step_size: int) -> list[list[dict[str, Any]]]:
    """The rollouts of ``rows // step_size`` steps, as the training loop hands them over."""
    rng = random.Random(seed + 3)
    pool = message_pool(seed)
    steps = []
    for _ in range(max(1, rows // step_size)):
        rollouts = []
        for i in range(step_size):
            reward = None if rng.random() < NULL_REWARD_SHARE else round(rng.random(), 6)
            rollouts.append(
                {
                    "group_index": i // GROUP_SIZE,
                    "rollout_index": i % GROUP_SIZE,
                    "task_input_id": None,
                    "messages": pool[rng.randrange(len(pool))],
                    "metadata": {"engine": "vllm", "completion_tokens": rng.randrange(16, 512)},
                    "reward": reward,
                    "breakdown": {"correct": reward} if reward is not None else {},
                }
            )
        steps.append(rollouts)
    return steps


INGEST_OWNER = "bench-ingest-worker"


async def new_ingest_runs(
    conn: asyncpg.Connection, project_id: uuid.UUID, n: int, step_size: int
) -> list[uuid.UUID]:
    """Runs in ``collecting``, leased to :data:`INGEST_OWNER` (attempt 1) as a worker's are."""
    ids = [uuid.uuid4() for _ in range(n)]
    now = dt.datetime.now(dt.UTC)
    await conn.executemany(
        _INSERT_RUN,
        [(i, project_id, "collecting", step_size, "ingest", 0, now, now, None) for i in ids],
    )
    await conn.execute(
        "UPDATE runs SET lease_owner = $2, lease_expires_at = now() + interval '1 hour'"
        " WHERE id = ANY($1::uuid[])",
        ids,
        INGEST_OWNER,
    )
    return ids


async def ingest_steps_written(
    pool: asyncpg.Pool, runs: list[uuid.UUID], steps: list[list[dict[str, Any]]]
) -> float:
    """The worker's writes, step by step as the training loop makes them
    (``app.runs.lifecycle.step_moves``): the scored rollouts with the move out of collecting,
    then the step's metrics and progress with the move back to collecting. Each is one statement,
    committed on its own."""
    from app.runs.lifecycle import step_moves
    from app.runs.lifecycle.state import Fence

    fence = Fence(owner=INGEST_OWNER, attempt=1)
    started = time.perf_counter()
    async with pool.acquire() as conn:
        for i, rollouts in enumerate(steps):
            run_id, step = runs[i // INGEST_STEPS_PER_RUN], i % INGEST_STEPS_PER_RUN
            await step_moves.rollouts_collected(
                conn, run_id, fence, step, rollouts, ttl_seconds=3600, scored=True
            )
            rewards = [r["reward"] for r in rollouts if r["reward"] is not None]
            await step_moves.step_finished(
                conn,
                run_id,
                fence,
                step,
                0,
                metrics={"reward_mean": statistics.fmean(rewards) if rewards else 0.0},
                summary={"step": step},
                last=False,
                event=f"step {step} done",
                ttl_seconds=3600,
            )
    return time.perf_counter() - started


async def ingest_copy(
    conn: asyncpg.Connection,
    project_id: uuid.UUID,
    runs: list[uuid.UUID],
    steps: list[list[dict[str, Any]]],
) -> float:
    """The same rows in one COPY (encoded here as the JSONL import encodes them)."""

    async def source() -> AsyncIterator[bytes]:
        buf: list[str] = []
        size = 0
        for i, rollouts in enumerate(steps):
            run_id, step = runs[i // INGEST_STEPS_PER_RUN], i % INGEST_STEPS_PER_RUN
            head = f"{run_id}\t{project_id}\tingest\t{step}\t"
            for r in rollouts:
                reward = r["reward"]
                line = "\t".join(
                    (
                        str(uuid.uuid4()),
                        head + str(r["group_index"]),
                        str(r["rollout_index"]),
                        copy_field(_JSON.encode(r["messages"])),
                        repr(reward) if reward is not None else NULL,
                        copy_field(_JSON.encode(r["breakdown"])),
                        copy_field(_JSON.encode(r["metadata"])),
                    )
                )
                buf.append(line + "\n")
                size += len(line) + 1
            if size > 4 << 20:
                yield "".join(buf).encode()
                buf, size = [], 0
        yield "".join(buf).encode()

    started = time.perf_counter()
    await conn.copy_to_table(
        "trajectories", source=source(), columns=INGEST_COPY_COLUMNS, format="text"
    )
    return time.perf_counter() - started


async def measure_ingest(args: argparse.Namespace, db_url: str) -> dict[str, Any]:
    from app.core.pg import create_pool

    steps = ingest_steps(args.seed, args.ingest_rows, args.ingest_step)
    rows = len(steps) * args.ingest_step
    n_runs = math.ceil(len(steps) / INGEST_STEPS_PER_RUN)
    conn = await asyncpg.connect(**connect_kwargs(db_url))
    pool = await create_pool(db_url, size=1, name="bench-ingest")
    try:
        await conn.execute("DELETE FROM projects WHERE name = $1", INGEST_PROJECT)
        project_id = uuid.uuid4()
        await conn.execute(
            "INSERT INTO projects (id, name) VALUES ($1, $2)", project_id, INGEST_PROJECT
        )
        upserts: list[float] = []
        copies: list[float] = []
        for round_no in range(args.ingest_rounds):
            order = ("upsert", "copy") if round_no % 2 == 0 else ("copy", "upsert")
            for kind in order:
                runs = await new_ingest_runs(conn, project_id, n_runs, args.ingest_step)
                if kind == "upsert":
                    seconds = await ingest_steps_written(pool, runs, steps)
                    upserts.append(rows / seconds)
                else:
                    seconds = await ingest_copy(conn, project_id, runs, steps)
                    copies.append(rows / seconds)
                log(
                    f"ingest round {round_no + 1}/{args.ingest_rounds} {kind}:"
                    f" {rows:,} rows in {seconds:.1f} s ({rows / seconds:,.0f} rows/s)"
                )
        written = await conn.fetchval(
            "SELECT count(*) FROM trajectories WHERE project_id = $1", project_id
        )
        if written != rows * 2 * args.ingest_rounds:
            raise BenchError(
                f"ingest wrote {written:,} rows, not {rows * 2 * args.ingest_rounds:,}"
            )
        log("removing the ingested rows (DELETE + VACUUM)")
        started = time.perf_counter()
        await conn.execute("DELETE FROM projects WHERE id = $1", project_id)
        await conn.execute("VACUUM (ANALYZE) trajectories")
        cleanup_s = time.perf_counter() - started
    finally:
        await pool.close()
        await conn.close()
    upsert_med, copy_med = statistics.median(upserts), statistics.median(copies)
    return {
        "rows_per_round": rows,
        "step_size": args.ingest_step,
        "rounds": args.ingest_rounds,
        "upsert_rows_per_s": round(upsert_med),
        "copy_rows_per_s": round(copy_med),
        "upsert_rounds": [round(v) for v in upserts],
        "copy_rounds": [round(v) for v in copies],
        "upsert_over_copy": round(upsert_med / copy_med, 3),
        "cleanup_seconds": round(cleanup_s, 1),
    }


# -------------------------------------------------------------------------------- report


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def verdicts(results: dict[str, Any]) -> dict[str, bool]:
    r = results["reads"]
    out = {
        "page1_p50_under_10ms": r["page1"]["p50_ms"] < 10,
        "deep_p50_under_10ms": r["deep"]["p50_ms"] < 10,
        "deep_within_2x_page1": r["deep_over_page1"] <= 2,
        "without_messages_50pct_faster": r["without_messages_faster_pct"] >= 50,
        "export_50k_rows_per_s": r["export"]["rows_per_s"] >= 50_000,
    }
    noindex = results.get("without_indexes")
    if noindex:
        out["indexes_50x_faster"] = all(noindex[k]["ratio"] >= 50 for k in ("page1", "deep"))
    ingest = results.get("ingest")
    if ingest:
        out["ingest_half_of_copy"] = ingest["upsert_over_copy"] >= 0.5
    return out


def mark(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**pass**" if ok else "**FAIL**")


def render_section(results: dict[str, Any]) -> str:
    data, reads, sizes = results["dataset"], results["reads"], results["sizes"]
    ok = results["verdicts"]
    deep_page = reads["deep_page"]
    flt = reads["filter"]
    p1, dp = reads["page1"], reads["deep"]
    rows = [
        "| measurement | result | target | |",
        "|---|---|---|---|",
        f"| page 1 of 100 (`queries.fetch_trajectories`, limit 101 as the API asks,"
        f" messages and metadata) | p50 {fmt_ms(p1['p50_ms'])}, p95 {fmt_ms(p1['p95_ms'])}"
        f" | p50 < 10 ms | {mark(ok['page1_p50_under_10ms'])} |",
        f"| page {deep_page:,} of 100 (keyset `after=`) | p50 {fmt_ms(dp['p50_ms'])},"
        f" p95 {fmt_ms(dp['p95_ms'])} | p50 < 10 ms | {mark(ok['deep_p50_under_10ms'])} |",
        f"| page {deep_page:,} / page 1 (p50) | {reads['deep_over_page1']:.2f}x | ≤ 2x |"
        f" {mark(ok['deep_within_2x_page1'])} |",
        f"| page 1 via `get_training_trajectories_async` (project by name: one more query)"
        f" | p50 {fmt_ms(reads['library_page1']['p50_ms'])},"
        f" p95 {fmt_ms(reads['library_page1']['p95_ms'])} | | |",
        f"| `count_training_trajectories_async`, same filters ({flt['matching_rows']:,})"
        f" | p50 {fmt_ms(reads['count']['p50_ms'])}, p95 {fmt_ms(reads['count']['p95_ms'])}"
        " | | |",
        f"| 1,000 rows without / with messages (p50)"
        f" | {fmt_ms(reads['page1000_without_messages']['p50_ms'])} /"
        f" {fmt_ms(reads['page1000_with_messages']['p50_ms'])}:"
        f" {reads['without_messages_faster_pct']:.0f}% faster | 50–70% faster (reference)"
        f" | {mark(ok['without_messages_50pct_faster'])} |",
        f"| 1,000 rows without messages and metadata (`include_metadata=False` too)"
        f" | {fmt_ms(reads['page1000_bare']['p50_ms'])}: {reads['bare_faster_pct']:.0f}%"
        " faster than with both | | |",
        f"| JSON Lines export (`queries.jsonl_chunks`, {reads['export']['rows']:,} rows,"
        f" {reads['export']['mb']:,.0f} MB) | {reads['export']['rows_per_s']:,} rows/s,"
        f" {reads['export']['mb_per_s']:.1f} MB/s | ≥ 50,000 rows/s"
        f" | {mark(ok['export_50k_rows_per_s'])} |",
    ]
    noindex = results.get("without_indexes")
    if noindex:
        for key, label in (("page1", "page 1"), ("deep", f"page {deep_page:,}")):
            res = noindex[key]
            took = (
                f"> {noindex['timeout_s']:g} s (timeout)"
                if res["timed_out"] and not res.get("p50_ms")
                else f"p50 {fmt_ms(res['p50_ms'])} ({res['n']} runs)"
            )
            bound = "> " if res["ratio_is_lower_bound"] else ""
            rows.append(
                f"| {label} without the 0005 indexes | {took}: indexes {bound}{res['ratio']:,}x"
                f" faster | ≥ 50x | {mark(res['ratio'] >= 50)} |"
            )
    ingest = results.get("ingest")
    if ingest:
        rows.append(
            f"| ingest: the workers' `step_moves` ({ingest['step_size']} scored rollouts, then"
            " the step's metrics: two statements per step),"
            f" vs one COPY ({ingest['rows_per_round']:,} rows each, median of"
            f" {ingest['rounds']} rounds) | {ingest['upsert_rows_per_s']:,} vs"
            f" {ingest['copy_rows_per_s']:,} rows/s: {100 * ingest['upsert_over_copy']:.0f}%"
            f" | ≥ 50% of COPY | {mark(ok.get('ingest_half_of_copy'))} |"
        )
    load = (
        f"COPY {data['copy_rows_per_s']:,} rows/s ({data['copy_seconds']:,.0f} s,"
        f" {data['copy_mb']:,.0f} MB of COPY text"
        + (", foreign keys not checked" if not data["foreign_keys_checked_during_load"] else "")
        + "); the 0005 indexes then built in "
        + ", ".join(f"`{k}` {s:.1f} s" for k, s in data["index_seconds"].items())
        + f"; VACUUM ANALYZE {data['vacuum_analyze_seconds']:.1f} s"
    )
    per_index = ", ".join(f"`{k}` {fmt_bytes(b)}" for k, b in sizes["per_index"].items())
    plans = reads["plans"]
    parts = [
        MARK_START,
        f"## Training data: {data['rows']:,} trajectories (issue 4)",
        "",
        written_by("training_data.py"),
        "",
        *report_head("training_data.py", started=results["date"], versions=results["versions"]),
        f"- Data set: {data['rows']:,} trajectories in {data['projects']} projects and"
        f" {data['runs']:,} runs over {DAYS} days (loaded {data['loaded_at']}); messages 0.2–2"
        f" KB, rewards uniform 0–1 with {NULL_REWARD_SHARE:.0%} unscored. The biggest"
        f" project holds {flt['project_rows']:,}; the main filter (that project, reward ≥"
        f" {MIN_REWARD}, {FILTER_FROM_DAYS_AGO - FILTER_TO_DAYS_AGO} of the {DAYS} days, newest"
        f" first) matches {flt['matching_rows']:,}.",
        f"- Size of `trajectories`: {fmt_bytes(sizes['total'])} (heap {fmt_bytes(sizes['heap'])},"
        f" TOAST {fmt_bytes(sizes['toast'])}, indexes {fmt_bytes(sizes['indexes'])}:"
        f" {per_index}).",
        f"- Load: {load}.",
        f"- Latencies: one persistent connection (`library.open_connection`), {results['reps']}"
        " repetitions of each page query (alternating), client-side wall time including"
        " decoding into `TrainingTrajectory`.",
        "",
        *rows,
        "",
        "Plans of the main filter (`EXPLAIN (ANALYZE, BUFFERS)`, the parameters bound):",
        "",
        f"- page 1: {plans['page1']['summary']}, {plans['page1']['execution_ms']:.2f} ms,"
        f" {plans['page1']['shared_hit']} buffers hit, {plans['page1']['shared_read']} read",
        f"- page {deep_page:,}: {plans['deep']['summary']},"
        f" {plans['deep']['execution_ms']:.2f} ms, {plans['deep']['shared_hit']} buffers hit,"
        f" {plans['deep']['shared_read']} read",
        f"- count: {plans['count']['summary']}, {plans['count']['execution_ms']:.1f} ms",
        "- generic plans (asyncpg prepares every statement; PostgreSQL may switch it to its"
        " generic plan after five runs): "
        + "; ".join(
            f"{k}: {g.get('summary', g.get('error'))}" for k, g in plans["generic"].items()
        ),
        "- how the timed statements were planned (`pg_prepared_statements`): "
        + "; ".join(
            f"{c['statement']}: {c['generic_plans']} generic, {c['custom_plans']} custom"
            for c in plans["plan_cache"]
            if c["generic_plans"] + c["custom_plans"] > 5
        ),
    ]
    for key, label in (("page1", "Page 1"), ("deep", f"Page {deep_page:,}")):
        parts += ["", f"{label}:", "", "```text", plans[key]["text"], "```"]
        generic = plans["generic"].get(key, {})
        if generic.get("summary") and generic["summary"] != plans[key]["summary"]:
            parts += [
                "",
                f"{label}, generic plan (`plan_cache_mode = force_generic_plan`):",
                "",
                "```text",
                generic["text"],
                "```",
            ]
    if noindex:
        parts += [
            "",
            "Without the 0005 indexes (dropped in a transaction, rolled back after):",
            "",
            "```text",
            noindex["plan_page1"],
            "```",
        ]
    parts += [
        "",
        f"Before the reads the machine was {results['cpu_busy_before_pct']:.0f}% busy (load"
        f" average {', '.join(map(str, results['loadavg_before']))}); the run took"
        f" {results['total_seconds'] / 60:.1f} min in all.",
        MARK_END,
    ]
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Training-data queries, export and ingest on 10M trajectories (issue 4)."
    )
    p.add_argument(
        "--database-url",
        default=DEFAULT_ADMIN_URL,
        help="an admin database of the server; the bench database is created beside it"
        f" (default {DEFAULT_ADMIN_URL})",
    )
    p.add_argument(
        "--db-name",
        default=DEFAULT_DB,
        help=f"the bench database, dropped and recreated for a load (default {DEFAULT_DB})",
    )
    p.add_argument(
        "--rows",
        type=int,
        default=None,
        help=f"trajectories to load (default {FULL_ROWS:,}; fewer when the disk is short)",
    )
    p.add_argument(
        "--reuse",
        action="store_true",
        help="measure the data set an earlier run left in the bench database, without"
        " loading (loads when there is none, or when --rows differs)",
    )
    p.add_argument(
        "--drop",
        action="store_true",
        help="drop the bench database at the end (by default it stays, for --reuse)",
    )
    p.add_argument("--seed", type=int, default=4, help="of the generated data (default 4)")
    p.add_argument(
        "--reps", type=int, default=200, help="timed runs of each page query (default 200)"
    )
    p.add_argument("--count-reps", type=int, default=20, help="timed counts (default 20)")
    p.add_argument(
        "--messages-reps",
        type=int,
        default=30,
        help="timed pages of 1,000 with and without messages, each (default 30)",
    )
    p.add_argument(
        "--export-rows",
        type=int,
        default=500_000,
        help="rows per export, at most what the filter matches (default 500,000)",
    )
    p.add_argument("--export-rounds", type=int, default=3, help="exports (default 3)")
    p.add_argument(
        "--noindex-reps",
        type=int,
        default=3,
        help="timed runs of each page without the indexes (default 3)",
    )
    p.add_argument(
        "--noindex-timeout",
        type=float,
        default=120.0,
        help="statement_timeout without the indexes, in seconds (default 120)",
    )
    p.add_argument("--skip-noindex", action="store_true", help="no measurement without indexes")
    p.add_argument(
        "--ingest-rows",
        type=int,
        default=200_000,
        help="rows written per round by each method (default 200,000)",
    )
    p.add_argument(
        "--ingest-rounds",
        type=int,
        default=3,
        help="rounds of the workers' writes and COPY, alternating which goes first (default 3)",
    )
    p.add_argument(
        "--ingest-step", type=int, default=64, help="rollouts per step and commit (default 64)"
    )
    p.add_argument("--skip-ingest", action="store_true", help="no ingest measurement")
    add_trainyard_bin_arg(p)
    add_output_arg(p, "training-data")
    args = p.parse_args(argv)
    if args.rows is not None and args.rows < 10_000:
        p.error("--rows must be at least 10,000")
    for name in ("reps", "count_reps", "messages_reps", "export_rounds", "noindex_reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.ingest_rounds < 1 or args.ingest_rows < args.ingest_step:
        p.error("--ingest-rounds must be at least 1, --ingest-rows at least --ingest-step")
    if args.ingest_step % GROUP_SIZE or args.ingest_step < GROUP_SIZE:
        p.error(f"--ingest-step must be a multiple of {GROUP_SIZE}")
    return args


async def run(args: argparse.Namespace) -> dict[str, Any]:
    db_url = pg_url_for(args.database_url, args.db_name, "postgresql+asyncpg")
    admin = await admin_connect(args.database_url)
    try:
        server_version = await admin.fetchval("SHOW server_version")
        superuser = bool(
            await admin.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        )
        try:
            data_directory = await admin.fetchval("SHOW data_directory")
        except asyncpg.PostgresError:
            data_directory = None
        data = await stored_dataset(admin, db_url, args.db_name) if args.reuse else {}
        if args.reuse and not data:
            log(f"--reuse: no complete data set in {args.db_name}; loading one")
        if data and args.rows is not None and data["rows"] != args.rows:
            log(
                f"--reuse: {args.db_name} holds {data['rows']:,} rows, not {args.rows:,}; reloading"
            )
            data = {}
        if data:
            log(f"reusing {data['rows']:,} trajectories loaded {data['loaded_at']}")
        else:
            rows = FULL_ROWS if args.rows is None else args.rows
            path, free = free_disk(data_directory)
            existing = await admin.fetchval(
                "SELECT pg_database_size(datname) FROM pg_database WHERE datname = $1",
                args.db_name,
            )
            free += existing or 0  # dropped before the load
            extra = 2 * args.ingest_rows * args.ingest_rounds
            need = 2 * estimated_bytes(rows + extra)
            log(
                f"disk: {fmt_bytes(free)} free for {path} (incl. the old bench database);"
                f" {rows:,} rows need ~{fmt_bytes(estimated_bytes(rows + extra))}, 2x margin"
                f" {fmt_bytes(need)}"
            )
            if free < need:
                fits = int(free / 2 / BYTES_PER_ROW) - extra
                fits = fits // 10_000 * 10_000
                if fits < 10_000:
                    raise BenchError(f"not enough disk for even 10,000 rows ({fmt_bytes(free)})")
                log(f"NOTE: scaling down to {fits:,} rows to fit the disk with a 2x margin")
                rows = fits
            await asyncio.to_thread(recreate_database, args.database_url, args.db_name)
            await asyncio.to_thread(migrate, db_url, [str(args.trainyard_bin)])
            data = await load(args, db_url, rows, superuser)
    finally:
        await admin.close()

    results: dict[str, Any] = {"dataset": data, "reps": args.reps}
    conn = await open_connection(db_url)
    try:
        await conn.execute("DELETE FROM projects WHERE name = $1", INGEST_PROJECT)  # leftover
        results["sizes"] = await table_sizes(conn)
        with contextlib.redirect_stdout(sys.stderr):  # its warning, not the JSON
            results["cpu_busy_before_pct"] = await asyncio.to_thread(wait_for_quiet, 60.0)
        results["loadavg_before"] = [round(x, 2) for x in os.getloadavg()]
        reads, main = await measure_reads(args, conn, data)
        if not args.skip_noindex:
            results["without_indexes"] = await measure_without_indexes(args, conn, reads, main)
        results["reads"] = reads
    finally:
        await conn.close()
    if not args.skip_ingest:
        results["ingest"] = await measure_ingest(args, db_url)
    results["versions"] = {
        "PostgreSQL": server_version,
        "Python": platform.python_version(),
        "asyncpg": asyncpg.__version__,
        **{"SQLAlchemy": package_versions("sqlalchemy").get("sqlalchemy", "unknown")},
    }
    if args.drop:
        log(f"dropping {args.db_name}")
        await asyncio.to_thread(drop_database, args.database_url, args.db_name)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = utc_now()
    t0 = time.perf_counter()
    psutil.cpu_percent(interval=None)
    results = asyncio.run(run(args))
    results["versions"] = {"Trainyard": trainyard_version(), **results["versions"]}
    results["command"] = command_line("training_data.py")
    results["date"] = started
    results["machine"] = machine_description()
    results["verdicts"] = verdicts(results)
    results["total_seconds"] = round(time.perf_counter() - t0, 1)
    write_section(args.output, render_section(results), MARK_START, MARK_END)
    log(f"wrote the training-data section of {args.output}")
    for name, ok in results["verdicts"].items():
        log(f"{'pass' if ok else 'FAIL'}: {name}")
    log(f"total {results['total_seconds']:.0f} s")
    print(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    kit.run(main)
