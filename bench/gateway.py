#!/usr/bin/env python3
"""The gateway's own cost per model call, and what a call and an episode store (issue 28:
target ≤ 2 ms median, ≤ 5 ms p99 beyond generation with 200 concurrent episodes on one API
process; ≥ 1,000 recorded calls/s).

One API process (``trainyard api``, one uvicorn worker) serves a gateway run whose calls are
answered by a *fixed engine*: a process of this benchmark that pops the run's inbox
(``app.gateway.wire``) and answers every call at once with the same token ids, the way the
worker answers (prompt and completion ids, log-probabilities, a parsed message). No model
runs, so what a call costs is the gateway's own path: the episode token checked against its
claim (one read), the call handed over, numbered and answered through Redis, the call
recorded (one insert, token ids packed), the OpenAI answer. ``--episodes`` harness tasks (one
keep-alive connection each, a lean HTTP client by default, ``--client httpx`` for the
client a Python harness has) each hold a claimed episode and call its
``/chat/completions`` in a loop for ``--duration`` s.

Then (``--tiny-steps``, 0 for none) the same API serves a gateway run on the tiny model that
a real worker answers: each call's time splits into its wait for the engine, its generation
and the gateway's own path (``episode_calls.queued_ms``, ``generation_ms``, the rest).

Reported: calls per second; the latency each call had as its harness saw it (client) and as
the API recorded it (``episode_calls.latency_ms``, from the request's arrival to the answer
being ready, minus the engine's ``generation_ms``: zero here); the bytes a call's row and an
episode's row take (``pg_column_size``), per column.

    .venv/bin/python bench/gateway.py                                   # ~2 min
    .venv/bin/python bench/gateway.py --episodes 20 --duration 5 --output /tmp/gw.md

Needs PostgreSQL (database bench_gateway is dropped and created) and Redis (db 12, only keys
under the prefix). The results replace the gateway section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import signal
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import kit
import uvloop
from kit import BenchError, log
from kit.load import RawHTTP
from kit.machine import trainyard_version, versions_of, wait_for_quiet
from kit.processes import stop_on_exit
from kit.report import (
    add_output_arg,
    markers,
    quantile,
    report_head,
    utc_now,
    write_section,
    written_by,
)
from kit.stores import bench_query, pg_json, pg_url_for
from kit.trainyard import Trainyard, add_model_arg, add_trainyard_args, model_for

from app.gateway import wire

SECTION = "gateway"
PROMPT_TOKENS = 400
COMPLETION_TOKENS = 40


def fixed_engine(redis_url: str, inbox: str, stop: Any) -> None:
    """Answer every call on ``inbox`` at once with the same ids, as the worker answers."""
    import redis

    from app.core.embedded import redis_py_url

    client = redis.Redis.from_url(redis_py_url(redis_url))
    draw = random.Random(0)  # ids and logprobs that compress like real ones: hardly
    reply = {
        "ok": True,
        "prompt_ids": [draw.randrange(151_000) for _ in range(PROMPT_TOKENS)],
        "completion_ids": [draw.randrange(151_000) for _ in range(COMPLETION_TOKENS)],
        "logprobs": [-draw.expovariate(2.0) for _ in range(COMPLETION_TOKENS)],
        "finish_reason": "stop",
        "message": {"content": "a" * COMPLETION_TOKENS, "tool_calls": []},
        "continued": False,
        "policy_version": 0,
        "generation_ms": 0.0,
    }
    seqs: dict[tuple[str, int], int] = {}  # the worker numbers each claim's calls
    while not stop.is_set():
        popped = client.blpop([inbox], timeout=0.2)
        if popped is None:
            continue
        asks = [popped[1], *(client.lpop(inbox, 255) or [])]
        pipe = client.pipeline(transaction=False)
        for raw in asks:
            ask = wire.loads(raw)
            if ask.get("kind") == "call":
                claim = (ask["episode_id"], ask["issue"])
                seqs[claim] = seq = seqs.get(claim, 0) + 1
                answer = {"call_id": ask["call_id"], "seq": seq, **reply}
                pipe.rpush(ask["reply_to"], wire.dumps(answer))
                pipe.expire(ask["reply_to"], wire.REPLY_TTL_SECONDS)
        pipe.execute()


def insert_episodes(db_url: str, run_id: str, n: int, timeout: float) -> None:
    bench_query(
        db_url,
        f"""INSERT INTO episodes (id, run_id, phase, step, slot, group_index, rollout_index,
                prompt, context, status, attempt, issued, max_issues, max_calls,
                timeout_seconds, metrics)
            SELECT gen_random_uuid(), '{run_id}', 'train', 1, s, s / 8, s % 8,
                   '[{{"role": "user", "content": "Say something."}}]', '{{}}', 'pending', 1,
                   0, 3, 1000000, {timeout}, '{{}}'
              FROM generate_series(0, {n - 1}) AS s""",
    )


async def claim_all(ty: Trainyard, run_id: str, n: int) -> list[dict[str, Any]]:
    claimed: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=ty.base_url, headers=ty.headers, timeout=60) as http:
        while len(claimed) < n:
            r = await http.post(
                f"/runs/{run_id}/episodes/claim",
                json={"max": min(64, n - len(claimed)), "wait_seconds": 0},
            )
            r.raise_for_status()
            got = r.json()["episodes"]
            if not got:
                raise BenchError(f"only {len(claimed)} of {n} episodes could be claimed")
            claimed += got
    return claimed


async def drive(
    ty: Trainyard,
    episodes: list[dict[str, Any]],
    duration: float,
    think: float = 0.0,
    client: str = "raw",
) -> tuple[list[float], float, float, float]:
    """Each episode calls in a loop for ``duration`` s, waiting about ``think`` s after each
    answer (uniformly 0.5-1.5 times it, and a first wait as long, so the episodes do not
    call in step): what a harness does while its tools run and a real engine generates.
    ``client``: ``raw`` (one lean keep-alive connection per episode, ``kit.load.RawHTTP``)
    or ``httpx`` (an ``httpx.AsyncClient`` per episode, as a Python harness has): the
    harnesses share this machine's cores with the API, so the lean one leaves the API more
    of them. Client latencies (ms), the window as wall-clock times, and the harnesses' CPU
    seconds."""
    latencies: list[float] = []
    draw = random.Random(1)
    body = {
        "model": "policy",
        "messages": [
            {"role": "system", "content": "Answer with letters."},
            {"role": "user", "content": "Say something."},
        ],
    }
    payload = json.dumps(body).encode()
    start = time.monotonic() + 1.0
    end = start + duration
    wall_start = time.time() + 1.0

    async def one(episode: dict[str, Any]) -> None:
        path = f"/gateway/episodes/{episode['id']}/v1/chat/completions"
        if client == "raw":
            raw = RawHTTP(ty.base_url, episode["token"], 30)

            async def call() -> tuple[int, bytes]:
                return await raw.post(path, payload)
        else:
            http = httpx.AsyncClient(
                base_url=ty.base_url,
                timeout=30,
                headers={"Authorization": f"Bearer {episode['token']}"},
            )

            async def call() -> tuple[int, bytes]:
                r = await http.post(path, json=body)
                return r.status_code, r.content

        try:  # the connection opened before the window
            models = f"/gateway/episodes/{episode['id']}/v1/models"
            await (raw.get(models) if client == "raw" else http.get(models))
            await asyncio.sleep(max(0.0, start - time.monotonic()) + think * draw.random())
            while time.monotonic() < end:
                t0 = time.monotonic()
                status, answer = await call()
                if status != 200:
                    raise BenchError(f"a call answered {status}: {answer[:300]!r}")
                latencies.append((time.monotonic() - t0) * 1000)
                if think:
                    await asyncio.sleep(think * draw.uniform(0.5, 1.5))
        finally:
            if client == "raw":
                raw.close()
            else:
                await http.aclose()

    cpu = time.process_time()
    await asyncio.gather(*(one(e) for e in episodes))
    return latencies, wall_start, wall_start + duration, time.process_time() - cpu


def recorded_between(db_url: str, first: float, last: float) -> tuple[list[float], float]:
    """The API's own cost of each call recorded in [first, last) (wall-clock seconds), and
    the calls per second over the span they were recorded in."""
    got = pg_json(
        db_url,
        f"""SELECT json_build_object(
                   'latency', array_agg(latency_ms - generation_ms ORDER BY created_at),
                   'first', extract(epoch FROM min(created_at)),
                   'last', extract(epoch FROM max(created_at)))
                 FROM episode_calls
                WHERE created_at >= to_timestamp({first}) AND created_at < to_timestamp({last})""",
    )
    overhead = [float(x) for x in got["latency"] or []]
    window = float(got["last"] or 0) - float(got["first"] or 0)
    return overhead, (len(overhead) / window if window > 0 else 0.0)


def served_between(api_log: Path, first: float, last: float) -> list[float]:
    """The API's whole time (ms) for each call it answered in [first, last) (wall-clock
    seconds), from its access log: the request's arrival to its answer sent, the call's
    insert included (the own cost stops before it)."""
    route = "/gateway/episodes/{episode_id}/v1/chat/completions"
    times = []
    with api_log.open(errors="replace") as lines:
        for line in lines:
            if route not in line or not line.startswith("{"):
                continue
            entry = json.loads(line)
            if entry.get("route") != route or entry.get("status") != 200:
                continue
            if first <= datetime.fromisoformat(entry["time"]).timestamp() < last:
                times.append(float(entry["duration_ms"]))
    return times


def tiny_model_phase(
    args: argparse.Namespace, ty: Trainyard, db_url: str, home: Path
) -> dict[str, list[float]]:
    """A gateway run on the tiny model, answered by a real worker: ``--episodes`` episodes a
    step (groups of 8), all played at once by harnesses of the SDK (``Run.play``), each one
    call and a reward, for ``--tiny-steps`` steps. Each recorded call's time in the API,
    its wait for the engine (``queued_ms``) and the generation that answered it; the
    gateway's own cost is the rest."""
    import trainyard

    model = model_for(args, home)
    ty.start_worker(timeout=args.start_timeout)
    groups = max(1, args.episodes // 8)
    body = {
        "model_name": str(model),
        "task_description": "Answer with as many letters a as you can.",
        "trained_model_name": f"bench-gateway-{os.getpid()}",
        "rollouts_per_group": 8,
        "learning_rate": 5e-3,
        "max_steps": args.tiny_steps,
        "num_epochs": args.tiny_steps,
        "inputs": [{"input_text": f"Say something, number {i}."} for i in range(groups)],
        "environment": {"type": "gateway", "episode_timeout_seconds": 300},
        "grpo": {
            "groups_per_step": groups,
            "max_completion_length": 16,
            "beta": 0.0,
            "save_steps": args.tiny_steps + 1,
            "validation_fraction": 0.0,
            "load_best_model_at_end": False,
        },
    }

    async def one_call(episode: trainyard.Episode) -> float:
        client = episode.openai_client()
        answer = await client.chat.completions.create(model="policy", messages=episode.messages)
        text = answer.choices[0].message.content or ""
        return text.count("a") / len(text) if text else 0.0

    async def play() -> str:
        async with trainyard.Client(ty.base_url, ty.key) as client:
            run = await client.create_run(body)
            await run.play(one_call, concurrency=args.episodes)
            await run.refresh()
            if run.status != "completed":
                raise BenchError(f"the tiny-model run ended {run.status}: {run.data.get('error')}")
            return str(run.id)

    log(f"the tiny model: {groups * 8} episodes a step, {args.tiny_steps} steps")
    run_id = uvloop.run(play())
    got = pg_json(
        db_url,
        f"""SELECT json_build_object(
                   'own', array_agg(c.latency_ms - c.generation_ms - c.queued_ms),
                   'queued', array_agg(c.queued_ms),
                   'generation', array_agg(c.generation_ms),
                   'total', array_agg(c.latency_ms))
                 FROM episode_calls c WHERE c.run_id = '{run_id}'""",
    )
    return {name: [float(x) for x in got[name] or []] for name in got}


def tiny_lines(args: argparse.Namespace, tiny: dict[str, list[float]] | None) -> list[str]:
    """The report's part on the tiny model (none without ``--tiny-steps``)."""
    if not tiny:
        return []

    def cell(name: str) -> str:
        got = tiny[name]
        return f"{quantile(got, 0.5):.2f} / {quantile(got, 0.99):.2f} ms"

    return [
        f"Then the real tiny model: a gateway run of {args.tiny_steps} steps, "
        f"{len(tiny['own']) // max(1, args.tiny_steps):,} episodes a step all played at once "
        "(the SDK's `Run.play`, one call each), a real worker answering on the CPU. Each "
        "recorded call's time in the API splits into its wait for the engine (`queued_ms`: "
        "in the inbox while the worker was busy, its batch's prompts rendered, the "
        "generations before its own), the generation that answered it, and the gateway's "
        "own path, the rest (the insert not included: it follows):",
        "",
        "| the tiny model, per call | median / p99 | target |",
        "|---|---|---|",
        f"| gateway's own cost | {cell('own')} | ≤ 2 / ≤ 5 ms |",
        f"| waiting for the engine | {cell('queued')} | |",
        f"| the generation that answered it | {cell('generation')} | |",
        f"| the call in the API | {cell('total')} | |",
        "",
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=200, help="concurrent episodes (harnesses)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of calls, per phase")
    p.add_argument(
        "--paced-rate",
        type=float,
        default=400.0,
        help="the second phase's aimed-at calls per second over all episodes (each waits "
        "episodes / rate s between calls, as a harness does while its tools run)",
    )
    p.add_argument(
        "--client",
        choices=("raw", "httpx"),
        default="raw",
        help="the harnesses' HTTP client: raw (lean, leaves the API its cores) or httpx",
    )
    p.add_argument(
        "--tiny-steps",
        type=int,
        default=2,
        help="steps of the run on the tiny model, a real worker answering (0: none)",
    )
    add_model_arg(p)
    add_trainyard_args(
        p,
        databases="bench_gateway",
        redis_db=12,
        broker_prefix="bench-gateway:",
        settle_timeout=60.0,
        start_timeout=120.0,
    )
    add_output_arg(p, SECTION)
    args = p.parse_args()
    started = utc_now()
    servers: list[Any] = []
    stop = multiprocessing.Event()
    with stop_on_exit(servers), tempfile.TemporaryDirectory(prefix="bench-gateway-") as home:
        ty = Trainyard(
            args, name="gateway", db_name="bench_gateway", servers=servers, home=Path(home)
        )
        ty.prepare()
        ty.start_api(timeout=args.start_timeout)
        run = ty.create_run(
            {
                "model_name": "no-worker-runs-this",
                "task_description": "The gateway's own cost.",
                "inputs": [{"input_text": "Say something."}],
                "environment": {"type": "gateway", "episode_timeout_seconds": 3600},
            }
        )
        db_url = pg_url_for(args.pg_url, "bench_gateway")
        insert_episodes(db_url, run["id"], args.episodes, 3600)
        engine = multiprocessing.Process(
            target=fixed_engine,
            args=(args.redis_url, wire.inbox(args.broker_prefix, run["id"]), stop),
            daemon=True,
        )
        engine.start()
        try:
            episodes = uvloop.run(claim_all(ty, run["id"], args.episodes))
            wait_for_quiet(args.settle_timeout)
            log(f"{args.episodes} episodes calling back to back for {args.duration:.0f} s")
            latencies, first, last, cpu = uvloop.run(
                drive(ty, episodes, args.duration, client=args.client)
            )
            overhead, rate = recorded_between(db_url, first, last)
            assert ty.api is not None
            served = served_between(ty.api.log_path, first, last)
            think = args.episodes / args.paced_rate
            log(f"then waiting ~{think * 1000:.0f} ms between calls for {args.duration:.0f} s")
            paced_latencies, first, last, paced_cpu = uvloop.run(
                drive(ty, episodes, args.duration, think, client=args.client)
            )
            paced, paced_rate = recorded_between(db_url, first, last)
            paced_served = served_between(ty.api.log_path, first, last)
        finally:
            stop.set()
            engine.join(5)
        sizes = pg_json(  # the fixed engine's run: its calls are the sizes the report says
            db_url,
            f"""SELECT json_build_object(
                       'row', avg(pg_column_size(c.*)),
                       'ids', avg(pg_column_size(c.prompt_ids) + pg_column_size(c.completion_ids)),
                       'logprobs', avg(pg_column_size(c.logprobs)),
                       'request', avg(pg_column_size(c.request)),
                       'response', avg(pg_column_size(c.response)),
                       'episode', (SELECT avg(pg_column_size(e.*)) FROM episodes e
                                    WHERE e.run_id = '{run["id"]}'))
                     FROM episode_calls c WHERE c.run_id = '{run["id"]}'""",
        )
        ty.cancel(run["id"])  # no model: the worker started next is not to take it
        tiny = tiny_model_phase(args, ty, db_url, Path(home)) if args.tiny_steps else None
        ty.remove()
    p50, p99 = quantile(overhead, 0.5), quantile(overhead, 0.99)
    c50, c99 = quantile(latencies, 0.5), quantile(latencies, 0.99)
    q50, q99 = quantile(paced, 0.5), quantile(paced, 0.99)
    d50, d99 = quantile(paced_latencies, 0.5), quantile(paced_latencies, 0.99)
    log(f"back to back: {len(overhead)} calls, {rate:.0f}/s; p50 {p50:.2f} ms, p99 {p99:.2f}")
    s50, s99 = quantile(served, 0.5), quantile(served, 0.99)
    t50, t99 = quantile(paced_served, 0.5), quantile(paced_served, 0.99)
    log(f"paced: {len(paced)} calls, {paced_rate:.0f}/s; p50 {q50:.2f} ms, p99 {q99:.2f}")
    log(f"paced, the API's whole time per call: p50 {t50:.2f} ms, p99 {t99:.2f}")
    start_mark, end_mark = markers(SECTION)
    lines = [
        start_mark,
        "## Gateway: its own cost per call, and what a call stores",
        "",
        written_by(
            "gateway.py",
            " One API process; a fixed engine answers every call at once, so the numbers "
            "are the gateway's path alone (token check, hand-over through Redis, the "
            "recorded row, the OpenAI answer).",
        ),
        "",
        *report_head(
            "gateway.py",
            started=started,
            versions={
                "trainyard": trainyard_version(),
                **versions_of("uvicorn", "asyncpg", "redis"),
            },
        ),
        "",
        f"{args.episodes} concurrent episodes; each call {PROMPT_TOKENS} prompt and "
        f"{COMPLETION_TOKENS} completion tokens. Two phases of {args.duration:.0f} s: every "
        "episode calling back to back (the process saturated: what it can record), then "
        f"every episode waiting about {args.episodes / args.paced_rate * 1000:.0f} ms "
        "between calls, as a harness does while its tools run and a real engine generates "
        f"(aimed at {args.paced_rate:,.0f} calls/s). The own cost is the API's: from a "
        "call's arrival to its answer being ready, minus the engine's generation time (zero "
        "here); back to back it is mostly the wait for the process, which serves one call "
        "at a time per core.",
        "",
        "| measure | back to back | paced | target |",
        "|---|---|---|---|",
        f"| recorded calls per second (one API process) | {rate:,.0f} | {paced_rate:,.0f} "
        "| ≥ 1,000 |",
        f"| gateway's own cost, median | {p50:.2f} ms | {q50:.2f} ms | ≤ 2 ms |",
        f"| gateway's own cost, p99 | {p99:.2f} ms | {q99:.2f} ms | ≤ 5 ms |",
        f"| the API's whole time per call (access log: arrival → answer sent, the insert "
        f"included), median / p99 | {s50:.2f} / {s99:.2f} ms | {t50:.2f} / {t99:.2f} ms | |",
        f"| as the harness saw it (client: send → answer read), median / p99 "
        f"| {c50:.2f} / {c99:.2f} ms | {d50:.2f} / {d99:.2f} ms | |",
        f"| calls recorded | {len(overhead):,} | {len(paced):,} | |",
        f"| the harnesses' CPU per call ({args.client} client, on the same cores) "
        f"| {cpu / max(1, len(latencies)) * 1000:.2f} ms "
        f"| {paced_cpu / max(1, len(paced_latencies)) * 1000:.2f} ms | |",
        "",
        *tiny_lines(args, tiny),
        "Bytes stored (PostgreSQL `pg_column_size`, averages):",
        "",
        "| what | bytes |",
        "|---|---|",
        f"| a call's row | {float(sizes['row']):,.0f} |",
        f"| its token ids ({PROMPT_TOKENS + COMPLETION_TOKENS} tokens, int32) "
        f"| {float(sizes['ids']):,.0f} |",
        f"| its log-probabilities ({COMPLETION_TOKENS}, float32) "
        f"| {float(sizes['logprobs']):,.0f} |",
        f"| its request (messages, JSONB) | {float(sizes['request']):,.0f} |",
        f"| its answer (JSONB) | {float(sizes['response']):,.0f} |",
        f"| an episode's row | {float(sizes['episode']):,.0f} |",
        end_mark,
    ]
    write_section(args.output, "\n".join(lines) + "\n", start_mark, end_mark)
    log(f"wrote the {SECTION} section of {args.output}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    kit.run(main)
