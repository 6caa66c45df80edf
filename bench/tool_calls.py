#!/usr/bin/env python3
"""What Trainyard adds to each tool call of an agent run, beyond the tool's own time and
the model's generation (issue 10: target ≤ 5 ms median).

Three parts, each measured with the worker's own code, and summed:

(a) the guarded call: a no-op tool (:func:`noop`, this module) called through the method
    ``workers.environments.load_environment`` generates for a ``tools`` environment
    (a thread with a deadline, the output cap, the call's record), minus the same function
    called bare;
(b) the episode's bookkeeping: ``workers.pipeline.episodes.build`` of an episode with
    ``--tool-calls`` calls, divided by its tool messages (all of the build is charged to the
    calls, a bound from above);
(c) storing it: a step's rollouts written through
    ``app.runs.lifecycle.step_moves.rollouts_collected``
    (scored, as the worker writes them with reward functions) whose episodes carry
    ``--tool-calls`` calls each, against the same rollouts with none, on a run this process
    holds the lease on; the difference divided by the step's tool calls.

And, for reference only (the server's own time is the tool's time):

(d) an MCP stdio call through ``workers.environments.mcp.McpToolbox`` against the SDK's bare
    ``ClientSession.call_tool``, on the same server (``tests/support/mcp_server.py``'s add).

    .venv/bin/python bench/tool_calls.py                              # ~2 min
    .venv/bin/python bench/tool_calls.py --calls 500 --steps 10 --mcp-calls 50 \\
        --output /tmp/tc.md                                           # a check that it runs

The results replace the section between the tool-calls markers in docs/benchmarks.md.
Needs PostgreSQL (database bench_tool_calls is dropped and created) and Redis (db 11, only
keys under the prefix). See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import kit
from kit import OUT, REPO, BenchError, log
from kit.machine import loadavg, trainyard_version, wait_for_quiet
from kit.report import (
    add_output_arg,
    floor_quantile,
    markers,
    report_head,
    timed_ms,
    utc_now,
    write_section,
    written_by,
)
from kit.stores import pg_version
from kit.trainyard import Trainyard, add_trainyard_args

MARK_START, MARK_END = markers("tool-calls")
DB_NAME = "bench_tool_calls"
OWNER = "bench-tool-calls"
TARGET_MS = 5.0  # issue 10: the service's cost per tool call, median
MCP_SERVER = [sys.executable, "-m", "tests.support.mcp_server"]
SYSTEM = "Use the tools to compute, then answer with the number only."


def noop(a: int, b: int) -> int:
    """Return the first number: a tool that does nothing, so its call is all overhead.

    Args:
        a: Returned as it is.
        b: Ignored.
    """
    return a


# ---------------------------------------------------------------------------- measuring


def percentiles(values: list[float]) -> dict[str, float]:
    """Median and p90, in the values' unit."""
    ordered = sorted(values)
    return {
        "median": statistics.median(ordered),
        "p90": floor_quantile(ordered, 0.9),
        "n": len(ordered),
    }


@contextlib.contextmanager
def collected_first() -> Iterator[None]:
    """One collection before a measurement, then the collector as the worker has it (on):
    the cycles a guarded call leaves behind are part of what it costs, and they land in
    the p90s."""
    gc.collect()
    yield


def guarded_call(calls: int, episode_calls: int) -> dict[str, Any]:
    """(a): the generated tool method against the bare function, interleaved in rounds.
    Each instance plays episodes of ``episode_calls`` calls (``reset`` between, untimed),
    so its call records grow as an episode's do."""
    from app.runs.spec.environments import ToolsEnvironment
    from workers.environments import load_environment

    spec = ToolsEnvironment.model_validate(
        {"type": "tools", "tools": ["bench.tool_calls:noop"]}
    ).model_dump(mode="json")
    environment = load_environment(spec)
    instance = environment.factory()
    instance.reset(prompt=[{"role": "user", "content": "What is 1 plus 1?"}])
    bare: list[float] = []
    guarded: list[float] = []
    rounds = max(1, calls // episode_calls)
    with collected_first():
        for _ in range(rounds):
            bare += timed_ms(lambda: noop(a=1, b=2), episode_calls)
            guarded += timed_ms(lambda: instance.noop(a=1, b=2), episode_calls)  # type: ignore[attr-defined]
            instance.reset(prompt=[{"role": "user", "content": "What is 1 plus 1?"}])
    environment.close()
    b, g = percentiles(bare), percentiles(guarded)
    return {
        "bare_ms": b,
        "guarded_ms": g,
        "overhead_ms": {"median": g["median"] - b["median"], "p90": g["p90"] - b["p90"]},
    }


def episode_messages(k: int) -> tuple[list[dict[str, Any]], list[Any]]:
    """A calculator episode as TRL hands it over: ``k`` rounds of a tool call and its
    result, then the answer; and the environment's records of those calls."""
    from workers.environments.safety import CallRecord

    completion: list[dict[str, Any]] = []
    records = []
    for i in range(k):
        completion += [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "add", "arguments": {"a": i, "b": 3}}}
                ],
            },
            {"role": "tool", "name": "add", "content": str(i + 3)},
        ]
        records.append(CallRecord("add", 0.05))
    completion.append({"role": "assistant", "content": str(k + 2)})
    return completion, records


def bookkeeping(calls: int, k: int) -> dict[str, Any]:
    """(b): ``episodes.build`` of a ``k``-call episode, per tool message."""
    from workers.pipeline import episodes

    completion, records = episode_messages(k)
    mask = [1] * 40 + [0] * (6 * k) + [1] * 4
    with collected_first():
        times = timed_ms(lambda: episodes.build(completion, records, mask), max(1, calls // k))
    built = episodes.build(completion, records, mask)
    if built.counts["tool_calls"] != k:
        raise BenchError(f"episodes.build counted {built.counts} for {k} calls")
    whole = percentiles(times)
    return {
        "episode_ms": whole,
        "per_call_ms": {"median": whole["median"] / k, "p90": whole["p90"] / k},
    }


def rollouts(groups: int, size: int, k: int, input_ids: list[uuid.UUID]) -> list[dict[str, Any]]:
    """A step's rollouts as ``StepBridge`` hands them to the write: scored, each an episode
    of ``k`` tool calls (0: a single-turn answer), messages and metadata as stored."""
    from workers.pipeline import episodes

    out = []
    for gi in range(groups):
        prompt = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"What is {gi + 1} plus 3?"},
        ]
        completion, records = episode_messages(k)
        if k == 0:
            completion = [{"role": "assistant", "content": str(gi + 4)}]
        mask = [1] * 40 + [0] * (6 * k) + [1] * 4
        built = episodes.build(completion, records, mask)
        for ri in range(size):
            out.append(
                {
                    "group_index": gi,
                    "rollout_index": ri,
                    "task_input_id": input_ids[gi % len(input_ids)],
                    "messages": [*prompt, *built.messages],
                    "metadata": {
                        "engine": "transformers",
                        "completion_tokens": 44 + 6 * k,
                        **built.metadata,
                    },
                    "reward": 1.0 if ri % 2 else 0.0,
                    "breakdown": {"environment": 1.0 if ri % 2 else 0.0},
                }
            )
    return out


def storing(services: Trainyard, steps: int, k: int, groups: int, size: int) -> dict[str, Any]:
    """(c): the step write with ``k``-call episodes against the same rollouts without tool
    calls, alternating, on a run this process holds the lease on (``tests/support/runs``'
    ``create_run``, forced into ``collecting``). Each timed write moves the run to
    ``training``; an untimed ``step_finished`` moves it back for the next one."""
    os.environ["TRAINYARD_DATABASE_URL"] = services.env["TRAINYARD_DATABASE_URL"]
    from sqlalchemy import text

    from app.core.settings import Settings
    from app.runs.lifecycle import step_moves
    from app.runs.lifecycle.state import Fence
    from app.runs.lifecycle.status import RunStatus
    from tests.support.runs import create_run
    from workers.runtime import Runtime

    runtime = Runtime(Settings())
    ttl = runtime.settings.lease_ttl_seconds
    fence = Fence(owner=OWNER, attempt=1)

    async def setup() -> tuple[uuid.UUID, list[uuid.UUID]]:
        async with runtime.session() as session:
            project = (
                await session.execute(text("SELECT id FROM projects ORDER BY created_at LIMIT 1"))
            ).scalar_one()
        run = await create_run(
            runtime.sessionmaker,
            project_id=project,
            status=RunStatus.COLLECTING,
            lease_owner=OWNER,
            lease_expires_at=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1),
            attempt=1,
        )
        async with runtime.session() as session:
            ids = (
                await session.execute(
                    text("SELECT id FROM task_inputs WHERE run_id = :id"), {"id": run.id}
                )
            ).scalars()
            return run.id, list(ids)

    run_id, input_ids = runtime.run(setup())
    with_calls = rollouts(groups, size, k, input_ids)
    without = rollouts(groups, size, 0, input_ids)

    async def write(step: int, rows: list[dict[str, Any]]) -> float:
        async with runtime.pg() as conn:
            t = time.perf_counter()
            await step_moves.rollouts_collected(
                conn, run_id, fence, step, rows, ttl_seconds=ttl, scored=True
            )
            elapsed = (time.perf_counter() - t) * 1e3
            await step_moves.step_finished(
                conn,
                run_id,
                fence,
                step,
                0,
                metrics={"reward_mean": 0.5},
                summary={"step": step},
                last=False,
                event=f"step {step}",
                ttl_seconds=ttl,
            )
        return elapsed

    times: dict[str, list[float]] = {"with": [], "without": []}
    step = 0
    try:
        for i in range(steps + 1):  # the first pair warms the pool and the statement cache
            order = [("with", with_calls), ("without", without)]
            for name, rows in order if i % 2 else order[::-1]:
                step += 1
                elapsed = runtime.run(write(step, rows))
                if i:
                    times[name].append(elapsed)
    finally:
        runtime.run(runtime.engine.dispose())
        runtime.loop.call_soon_threadsafe(runtime.loop.stop)
    sizes = {
        name: len(json.dumps([r["messages"] for r in rows]))
        for name, rows in (("with", with_calls), ("without", without))
    }
    w, wo = percentiles(times["with"]), percentiles(times["without"])
    n_calls = groups * size * k
    return {
        "rollouts": groups * size,
        "tool_calls_per_step": n_calls,
        "messages_json_bytes": sizes,
        "with_ms": w,
        "without_ms": wo,
        "per_call_ms": {
            "median": (w["median"] - wo["median"]) / n_calls,
            "p90": (w["p90"] - wo["p90"]) / n_calls,
        },
    }


def mcp_calls(calls: int, batch: int = 50) -> dict[str, Any]:
    """(d): ``McpToolbox.call`` against the SDK's ``ClientSession.call_tool``, each on a
    server process of its own (``tests/support/mcp_server.py``), in alternating batches.
    The bare session lives on this thread's loop; the toolbox's synchronous calls block
    that loop meanwhile, which the bare session does not mind between its batches."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    from workers.environments.mcp import McpToolbox

    env = {"PYTHONPATH": str(REPO)}
    arguments = {"a": 1, "b": 2}

    async def both() -> tuple[list[float], list[float]]:
        params = StdioServerParameters(command=MCP_SERVER[0], args=MCP_SERVER[1:], env=env)
        through: list[float] = []
        sdk: list[float] = []
        with (
            tempfile.TemporaryFile("w+") as errlog,
            McpToolbox(command=MCP_SERVER, env=env, allow=["add"]) as toolbox,
        ):
            async with (
                stdio_client(params, errlog=errlog) as (read, write),
                ClientSession(read, write) as session,
            ):
                await session.initialize()
                for _ in range(20):  # both warm
                    await session.call_tool("add", arguments)
                    toolbox.call("add", arguments, timeout=10)
                with collected_first():
                    for _ in range(max(1, calls // batch)):
                        for _ in range(batch):
                            t = time.perf_counter()
                            await session.call_tool("add", arguments)
                            sdk.append((time.perf_counter() - t) * 1e3)
                        through += timed_ms(
                            lambda: toolbox.call("add", arguments, timeout=10), batch
                        )
        return through, sdk

    through, sdk = asyncio.run(both())
    a, b = percentiles(through), percentiles(sdk)
    return {
        "toolbox_ms": a,
        "sdk_ms": b,
        "overhead_ms": {"median": a["median"] - b["median"], "p90": a["p90"] - b["p90"]},
    }


# ------------------------------------------------------------------------------- report


def f3(v: float) -> str:
    """Milliseconds, below one as microseconds."""
    return f"{v * 1e3:.1f} µs" if abs(v) < 1.0 else f"{v:.2f} ms"


def render_section(args: argparse.Namespace, result: dict[str, Any], versions: str) -> str:
    a, b, c, d = (result[k] for k in ("guarded", "bookkeeping", "storing", "mcp"))
    total = {
        q: a["overhead_ms"][q] + b["per_call_ms"][q] + c["per_call_ms"][q]
        for q in ("median", "p90")
    }
    verdict = "within" if total["median"] <= TARGET_MS else "**above**"
    k = args.tool_calls
    rows = [
        "| part (per tool call) | measured | median | p90 |",
        "|---|---|---:|---:|",
        f"| (a) guarded call | generated tool method − bare function, {a['guarded_ms']['n']}"
        f" calls each (bare: median {f3(a['bare_ms']['median'])}; guarded:"
        f" {f3(a['guarded_ms']['median'])}) | {f3(a['overhead_ms']['median'])} |"
        f" {f3(a['overhead_ms']['p90'])} |",
        f"| (b) episode bookkeeping | `episodes.build` of a {k}-call episode"
        f" ({b['episode_ms']['n']} builds, median {f3(b['episode_ms']['median'])}) ÷ {k} |"
        f" {f3(b['per_call_ms']['median'])} | {f3(b['per_call_ms']['p90'])} |",
        f"| (c) storing | step write of {c['rollouts']} scored rollouts with {k} calls each −"
        f" the same with none ({c['with_ms']['n']} steps each: {f3(c['with_ms']['median'])}"
        f" vs {f3(c['without_ms']['median'])}) ÷ {c['tool_calls_per_step']} calls |"
        f" {f3(c['per_call_ms']['median'])} | {f3(c['per_call_ms']['p90'])} |",
        f"| **(a) + (b) + (c)** | against the {TARGET_MS:g} ms target |"
        f" **{f3(total['median'])}** | {f3(total['p90'])} |",
        f"| (d) reference: MCP stdio | `McpToolbox.call` − SDK `ClientSession.call_tool`,"
        f" {d['toolbox_ms']['n']} calls each, alternating batches of 50 (SDK alone: median"
        f" {f3(d['sdk_ms']['median'])},"
        f" p90 {f3(d['sdk_ms']['p90'])}; toolbox: {f3(d['toolbox_ms']['median'])},"
        f" p90 {f3(d['toolbox_ms']['p90'])}) | {f3(d['overhead_ms']['median'])} |"
        f" {f3(d['overhead_ms']['p90'])} |",
    ]
    sizes = c["messages_json_bytes"]
    return (
        "\n".join(
            [
                MARK_START,
                "## Agent runs: Trainyard's cost per tool call",
                "",
                written_by("tool_calls.py"),
                "",
                *report_head("tool_calls.py", started=result["started"], versions=versions),
                f"- Machine load: loadavg {' '.join(map(str, result['loadavg_start']))} at the"
                f" start, {' '.join(map(str, result['loadavg_end']))} at the end.",
                "- What is counted: what Trainyard's worker adds to a tool call, beyond the tool's"
                " own time and the model's generation (TRL's tool loop, parsing and the chat"
                " template are TRL's, on both sides of the service/script comparison). Each part"
                " runs the worker's own code in one process; p90 of a difference is the"
                " difference of the p90s.",
                f"- (c) writes on a fresh database `{DB_NAME}` through the worker's asyncpg pool"
                " (`workers.runtime.Runtime.pg`), one committed statement per step, fenced on a"
                f" lease this process holds; {c['rollouts']} rollouts a step as the calculator"
                f" preset has them (4 groups of 8); messages JSON {sizes['with']:,} bytes with"
                f" calls vs {sizes['without']:,} without; alternating, the first pair left out.",
                "",
                *rows,
                "",
                f"Trainyard's cost per tool call, median: **{f3(total['median'])}**, {verdict}"
                f" the {TARGET_MS:g} ms target.",
                "",
                MARK_END,
            ]
        )
        + "\n"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="What Trainyard adds per tool call of an agent run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--calls", type=int, default=20_000, help="calls timed for (a) and (b)")
    p.add_argument("--tool-calls", type=int, default=2, help="tool calls per episode")
    p.add_argument("--steps", type=int, default=200, help="step writes of each kind for (c)")
    p.add_argument("--groups", type=int, default=4, help="groups per step for (c)")
    p.add_argument("--group-size", type=int, default=8, help="rollouts per group for (c)")
    p.add_argument("--mcp-calls", type=int, default=2000, help="calls of each kind for (d)")
    add_trainyard_args(
        p,
        databases=f"database {DB_NAME} is",
        redis_db=11,
        broker_prefix="bench-tools:",
        settle_timeout=60.0,
        start_timeout=60.0,
    )
    add_output_arg(p, "tool-calls")
    args = p.parse_args(argv)
    if min(args.calls, args.tool_calls, args.steps, args.mcp_calls) < 1:
        p.error("--calls, --tool-calls, --steps and --mcp-calls must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    started = utc_now()
    load_start = loadavg()
    services: Trainyard | None = None
    try:
        services = Trainyard(args, name="tools", db_name=DB_NAME, servers=[])
        services.prepare(project="bench-tools")
        postgres = pg_version(args.pg_url)
        result: dict[str, Any] = {"started": started, "loadavg_start": load_start}
        for name, measure in (
            ("guarded", lambda: guarded_call(args.calls, args.tool_calls)),
            ("bookkeeping", lambda: bookkeeping(args.calls, args.tool_calls)),
            (
                "storing",
                lambda: storing(
                    services, args.steps, args.tool_calls, args.groups, args.group_size
                ),
            ),
            ("mcp", lambda: mcp_calls(args.mcp_calls)),
        ):
            wait_for_quiet(args.settle_timeout)
            log(f"measuring {name}")
            result[name] = measure()
            log(f"  -> {json.dumps(result[name])}")
        result["loadavg_end"] = loadavg()
    finally:
        if services is not None:
            with contextlib.suppress(BenchError):
                services.clear_broker()
    from importlib.metadata import version

    versions = (
        f"Trainyard {trainyard_version()}, PostgreSQL {postgres}, mcp {version('mcp')},"
        f" Python {sys.version.split()[0]}"
    )
    write_section(args.output, render_section(args, result, versions), MARK_START, MARK_END)
    (OUT / "tool_calls.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"\nwrote {args.output} (section {MARK_START} … {MARK_END})")
    return 0


if __name__ == "__main__":
    kit.run(main)
