#!/usr/bin/env python3
"""The overhead of the service: a GRPO run driven through Trainyard vs the same TRL GRPO
training written as a plain script (bench/grpo_script.py), on the same tiny model, inputs,
settings and steps.

Service: a run created with POST /runs and worked by one `trainyard worker --pool solo`;
its time is claim → completed, both read from the run's events (the database clock), so
process start-up and dispatch are left out. Script: GRPOTrainer construction (model load)
+ train() + save_model(), timed inside the script, imports left out. Repetitions are
interleaved (script, service, script, service …) and compared by their medians. The
results replace the section between the service-vs-script markers in docs/benchmarks.md
and are printed. See bench/README.md.

    .venv/bin/python bench/service_vs_script.py                  # 3 pairs of 100 steps
    .venv/bin/python bench/service_vs_script.py --repeats 5 --profile
    .venv/bin/python bench/service_vs_script.py --steps 20 --repeats 1 --output bench/out/b.md
    .venv/bin/python bench/service_vs_script.py --agent   # agent-calculator.yaml vs agent_script.py
    .venv/bin/python bench/service_vs_script.py --agent --profile \
        --environment tests.support.agent_tools:SmallCalculator   # tools that fail

Needs PostgreSQL (trust or password auth; database bench_service is dropped and created)
and Redis (db 12, keys under a prefix of their own). Standard library, httpx, psutil, the
project in .venv and, for --profile, py-spy.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import itertools
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import kit
import psutil
from kit import BENCH, OUT, REPO, BenchError, log
from kit.machine import (
    loadavg,
    machine_busy,
    torch_thread_env,
    trainyard_version,
    wait_for_quiet,
)
from kit.processes import (
    PYSPY_RATE,
    Server,
    cpu_seconds,
    pyspy,
    run_to_end,
    start_server,
    stop_on_exit,
)
from kit.report import add_output_arg, markers, report_head, utc_now, write_section, written_by
from kit.stores import clear_redis_prefix, pg_json, pg_query, pg_url_for, pg_version, redis_ping
from kit.trainyard import (
    AGENT_CALCULATOR,
    LETTERS,
    Trainyard,
    add_model_arg,
    add_trainyard_args,
    model_for,
    preset_run,
)

SECTION = "service-vs-script"  # the docs/benchmarks.md section, and bench/out/ JSON, of a case
SCRIPT = BENCH / "grpo_script.py"
STEP_WRITES = BENCH / "step_writes.py"
DB_NAME = "bench_service"
TARGET = 1.05  # issue 9: the service costs at most 5% over the plain script
# --agent: a multi-turn run of configs/runs/agent-calculator.yaml against bench/agent_script.py
AGENT_SECTION = "service-vs-script-agent"
# --agent --environment CLASS: the same run in a python environment of its own (both sides
# train in that one class), a section of its own
ENVIRONMENT_SECTION = "service-vs-script-agent-environment"
AGENT_SCRIPT = BENCH / "agent_script.py"
AGENT_TARGET = 1.10  # issue 10: a multi-turn run through the service within 1.10x
TABLES = ("trajectories", "metric_points", "run_events", "runs", "checkpoints", "task_inputs")


# ------------------------------------------------------------------------------ settings


def run_body(
    args: argparse.Namespace, model: Path, steps: int, *, warm_up: bool = False
) -> dict[str, Any]:
    """The measured run (``warm_up``: the unmeasured first one; an agent's with one SFT
    epoch, enough for the worker to import SFT's code too)."""
    if args.agent:
        return preset_run(
            AGENT_CALCULATOR,
            model,
            steps=steps,
            save_steps=args.save_steps,
            name="bench",
            overrides=(
                *(("sft.epochs=1",) if warm_up else ()),
                *((f"environment.factory={args.environment}",) if args.environment else ()),
            ),
        )
    return preset_run(LETTERS, model, steps=steps, save_steps=args.save_steps, name="bench")


def resolved(body: dict[str, Any]) -> dict[str, Any]:
    """The run as the API stores it (every default filled in)."""
    from app.runs.spec.body import RunCreate

    return RunCreate.model_validate(body).model_dump(mode="json")


def planned_prompts(run: dict[str, Any]) -> list[str]:
    """The input of each group, in the order Trainyard's step plan trains on them."""
    return [i["input_text"] for i in planned_inputs(run)]


def planned_inputs(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Each group's input and context, in the order Trainyard's step plan trains on them."""
    from workers.pipeline.plan import PlannedInput, build_plan

    train = [i for i in run["inputs"] if i.get("split", "train") == "train"]
    plan = build_plan(
        [PlannedInput(str(n), n, i["input_text"], i.get("context")) for n, i in enumerate(train)],
        groups_per_step=run["grpo"]["groups_per_step"],
        num_epochs=run["num_epochs"],
        max_steps=run["max_steps"],
        seed=run["grpo"]["seed"],
    )
    return [
        {"input_text": item.input_text, "context": item.context}
        for batch in plan
        for item in batch.items
    ]


def agent_script_command(
    run: dict[str, Any],
    model: Path,
    run_file: Path,
    inputs_file: Path,
    output_dir: Path,
    environment: str | None = None,
) -> list[str]:
    """agent_script.py on the resolved run (in ``environment``, a class of the run's own,
    or the calculator); refuses settings the script does not mirror."""
    g, env, sft = run["grpo"], run["environment"] or {}, run["sft"] or {}
    unmirrored = {
        "environment (the script has the calculator or --environment)": (
            env.get("type"),
            env.get("factory"),
        )
        != ("python", environment or "calculator"),
        "environment.tool_errors (the script shows what TRL shows)": env.get("tool_errors")
        != "trl",
        "reward": [f["name"] for f in run["reward"].get("functions", [])] != ["environment"],
        "sft.examples (the script has no training-data query)": not sft.get("examples"),
        "grpo.lora": g.get("lora") is not None,
        "grpo.engine": g["engine"] != "transformers",
        "grpo.validation_fraction": g["validation_fraction"] > 0,
    }
    bad = [k for k, v in unmirrored.items() if v]
    if bad:
        raise BenchError(f"agent_script.py does not mirror these run settings: {', '.join(bad)}")
    run_file.write_text(json.dumps(run))
    return [
        sys.executable,
        str(AGENT_SCRIPT),
        "--model",
        str(model),
        "--run",
        str(run_file),
        "--inputs-file",
        str(inputs_file),
        "--output-dir",
        str(output_dir),
        *(["--environment", environment] if environment else []),
    ]


def script_command(
    run: dict[str, Any], model: Path, prompts_file: Path, output_dir: Path
) -> list[str]:
    """grpo_script.py with the run's settings; refuses settings the script does not mirror."""
    g = run["grpo"]
    unmirrored = {
        "system_prompt": run["system_prompt"] is not None,
        "grpo.lora": g.get("lora") is not None,
        "grpo.top_k": g.get("top_k") is not None,
        "grpo.min_p": g.get("min_p") is not None,
        "grpo.repetition_penalty": g["repetition_penalty"] != 1.0,
        "grpo.gradient_accumulation_steps": g["gradient_accumulation_steps"] != 1,
        "grpo.gradient_checkpointing": bool(g["gradient_checkpointing"]),
        "grpo.engine": g["engine"] != "transformers",
        "reward": [f["name"] for f in run["reward"].get("functions", [])] != ["char_fraction"],
    }
    bad = [k for k, v in unmirrored.items() if v]
    if bad:
        raise BenchError(f"grpo_script.py does not mirror these run settings: {', '.join(bad)}")
    char = run["reward"]["functions"][0].get("args", {}).get("char", "a")
    return [
        sys.executable,
        str(SCRIPT),
        "--model",
        str(model),
        "--steps",
        str(run["max_steps"]),
        "--prompts-file",
        str(prompts_file),
        "--output-dir",
        str(output_dir),
        "--rollouts-per-group",
        str(run["rollouts_per_group"]),
        "--groups-per-step",
        str(g["groups_per_step"]),
        "--learning-rate",
        repr(run["learning_rate"]),
        "--beta",
        repr(g["beta"]),
        "--temperature",
        repr(g["temperature"]),
        "--max-completion-length",
        str(g["max_completion_length"]),
        "--warmup",
        repr(g["warmup_ratio"]),
        "--weight-decay",
        repr(g["weight_decay"]),
        "--max-grad-norm",
        repr(g["max_grad_norm"]),
        "--loss-type",
        g["loss_type"],
        "--scale-rewards",
        g["scale_rewards"],
        "--top-p",
        repr(g["top_p"]),
        "--seed",
        str(g["seed"]),
        "--save-steps",
        str(g["save_steps"]),
        "--char",
        char,
    ]


# --------------------------------------------------------------------------- measuring


@dataclasses.dataclass
class Sample:
    """One measured run of either side. Phases share their boundaries on both sides:
    setup = start → step 1 begins; steps = step 1 begins → the last step's log;
    finish = that → the end (last checkpoint, final model, and for the service its
    records and the `completed` transition)."""

    side: str
    rep: int
    seconds: float
    setup_seconds: float
    steps_seconds: float
    finish_seconds: float
    step_median: float
    interval_median: float
    final_reward: float | None
    final_reward_last10: float | None
    cpu_seconds: dict[str, float]
    loadavg_before: tuple[float, float, float]
    loadavg_after: tuple[float, float, float]
    machine_busy_pct: float
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


class Database:
    """What the harness reads of the bench database: counters, a run's events and rows."""

    def __init__(self, admin_url: str) -> None:
        self.url = pg_url_for(admin_url, DB_NAME)

    def json(self, sql: str) -> Any:
        return pg_json(self.url, sql)

    def backend_pids(self) -> list[int]:
        return [
            int(p)
            for p in pg_query(
                self.url,
                f"SELECT pid FROM pg_stat_activity WHERE datname = '{DB_NAME}'"
                " AND pid <> pg_backend_pid()",
            )
            if p
        ]

    def stats(self) -> dict[str, Any]:
        return self.json(
            "SELECT json_build_object("
            "'db', (SELECT json_build_object('xact_commit', xact_commit, 'tup_inserted',"
            " tup_inserted, 'tup_updated', tup_updated, 'tup_deleted', tup_deleted)"
            f" FROM pg_stat_database WHERE datname = '{DB_NAME}'),"
            "'tables', (SELECT json_object_agg(relname, json_build_object('ins', n_tup_ins,"
            " 'upd', n_tup_upd, 'hot', n_tup_hot_upd, 'del', n_tup_del))"
            " FROM pg_stat_user_tables))::text"
        )

    def events(self, run_id: str) -> list[dict[str, Any]]:
        return (
            self.json(
                "SELECT coalesce(json_agg(json_build_object('id', id, 'type', type, 'message',"
                " message, 'to', data->>'to', 'step', data->'step',"
                " 't', extract(epoch FROM created_at)) ORDER BY id), '[]')::text"
                f" FROM run_events WHERE run_id = '{run_id}'"
            )
            or []
        )

    def run_created(self, run_id: str) -> float:
        return float(
            pg_query(
                self.url, f"SELECT extract(epoch FROM created_at) FROM runs WHERE id = '{run_id}'"
            )[0]
            or "nan"
        )

    def volume(self, run_id: str) -> dict[str, dict[str, int]]:
        """Rows and their bytes (pg_column_size of the row) that the run left per table."""
        out = {}
        for table, key in (
            ("trajectories", "run_id"),
            ("metric_points", "run_id"),
            ("run_events", "run_id"),
            ("checkpoints", "run_id"),
            ("task_inputs", "run_id"),
            ("runs", "id"),
        ):
            out[table] = self.json(
                "SELECT json_build_object('rows', count(*), 'bytes',"
                f" coalesce(sum(pg_column_size(t.*)), 0))::text FROM {table} t"
                f" WHERE t.{key} = '{run_id}'"
            )
        return out

    def trained_order(self, run_id: str) -> list[str]:
        return (
            self.json(
                "SELECT coalesce(json_agg(i.input_text ORDER BY t.step, t.group_index),"
                " '[]')::text FROM trajectories t JOIN task_inputs i ON i.id = t.task_input_id"
                f" WHERE t.run_id = '{run_id}' AND t.rollout_index = 0"
            )
            or []
        )

    def tool_counts(self, run_id: str) -> dict[str, int]:
        """The run's episodes' tool calls and failed calls (their ``metadata`` counts)."""
        return self.json(
            "SELECT json_build_object("
            "'tool_calls', coalesce(sum((metadata->>'tool_calls')::int), 0),"
            "'tool_errors', coalesce(sum((metadata->>'tool_errors')::int), 0))::text"
            f" FROM trajectories WHERE run_id = '{run_id}'"
        ) or {"tool_calls": 0, "tool_errors": 0}

    def checkpoints(self, run_id: str) -> list[str]:
        rows = (
            self.json(
                "SELECT coalesce(json_agg(json_build_object('step', step, 'final', is_final)"
                f" ORDER BY is_final, step), '[]')::text FROM checkpoints WHERE run_id = '{run_id}'"
            )
            or []
        )
        return [f"final ({r['step']})" if r["final"] else str(r["step"]) for r in rows]


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    db = {k: after["db"][k] - before["db"][k] for k in after["db"]}
    tables = {}
    for name, now in (after.get("tables") or {}).items():
        was = (before.get("tables") or {}).get(name, {})
        tables[name] = {k: now[k] - was.get(k, 0) for k in now}
    return {"db": db, "tables": tables}


class Services(Trainyard):
    """The API and one worker on a fresh database, plus what it takes to measure a run."""

    def __init__(self, args: argparse.Namespace, servers: list[Server], home: Path) -> None:
        super().__init__(
            args,
            name="svs",
            db_name=DB_NAME,
            servers=servers,
            home=home,
            env=torch_thread_env(args.torch_threads),
        )
        self.args = args
        self.db = Database(args.pg_url)

    def create_and_wait(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST the run and poll it until it completed; the run as it ended."""
        run = self.create_run(body)
        return self.wait_for_run(
            run["id"], every=self.args.poll_interval, timeout=self.args.run_timeout
        )


def writes_behind() -> bool:
    """Whether the worker's step writes go behind training (``WriteBehind``, which moved
    from training.py to steps.py) rather than the training thread waiting for each."""
    return any(
        p.exists() and "WriteBehind" in p.read_text() for p in (SNAPSHOT, STEPS_PY, TRAINING_PY)
    )


def pipeline_version(path: Path) -> str:
    """training.py's hash and how it writes (the training thread waits, or write-behind)."""
    import hashlib

    text = path.read_text()
    mode = "write-behind" if writes_behind() else "synchronous writes"
    return f"training.py {hashlib.sha256(text.encode()).hexdigest()[:10]} ({mode})"


def phase_times(
    events: list[dict[str, Any]], step1_seconds: float | None = None
) -> dict[str, float]:
    """Claim, step 1 begins, last step logged, completed: DB-clock times from the events.

    Step 1 begins at its `step` event minus its `step_seconds` (the worker measures that
    from on_step_begin to the step's log, as the script does); without the metric, at the
    first `collecting` event (whose place in the code has moved over time)."""
    claimed = next(
        float(e["t"])
        for e in events
        if e["type"] == "lease" and str(e["message"]).startswith("claimed by")
    )
    completed = next(
        float(e["t"]) for e in events if e["type"] == "status" and e["to"] == "completed"
    )
    first_step = next(
        float(e["t"]) for e in events if e["type"] == "status" and e["to"] == "collecting"
    )
    step_events = [float(e["t"]) for e in events if e["type"] == "step"]
    if step_events and step1_seconds is not None:
        first_step = step_events[0] - step1_seconds
    return {
        "claimed": claimed,
        "first_step": first_step,
        "last_step": step_events[-1] if step_events else completed,
        "completed": completed,
        "step_intervals": [b - a for a, b in itertools.pairwise(step_events)],
    }


def measure_service(
    services: Services, body: dict[str, Any], prompts: list[str], rep: int, *, settle: bool = True
) -> Sample:
    args = services.args
    assert services.worker is not None and services.api is not None
    if settle:
        wait_for_quiet(args.settle_timeout)
    stats_before = services.db.stats()
    pg_pids = services.db.backend_pids()
    procs = {"worker": [services.worker.proc.pid], "api": [services.api.proc.pid]}
    cpu_before = {k: cpu_seconds(*v) for k, v in procs.items()}
    pg_before = {pid: cpu_seconds(pid) for pid in pg_pids}
    load_before, machine_before = loadavg(), psutil.cpu_times()
    run = services.create_and_wait(body)
    load_after, machine_after = loadavg(), psutil.cpu_times()
    cpu = {k: cpu_seconds(*v) - cpu_before[k] for k, v in procs.items()}
    # Backends of the bench database; pooled connections live across the run.
    pg_after_pids = services.db.backend_pids()
    cpu["postgres"] = sum(cpu_seconds(p) - pg_before.get(p, 0.0) for p in pg_after_pids)
    run_id = run["id"]
    events = services.db.events(run_id)
    series = services.metrics(run_id, "step_seconds", "reward_mean")
    step_seconds = [v for _, v in series.get("step_seconds", [])]
    step1 = next((v for n, v in series.get("step_seconds", []) if n == 1), None)
    ph = phase_times(events, step1)
    rewards = [v for _, v in series.get("reward_mean", [])]
    order = services.db.trained_order(run_id)
    volume = services.db.volume(run_id)
    checkpoints = services.db.checkpoints(run_id)
    # Backends flush their statistics when idle, at most every 10 s (PostgreSQL 15).
    time.sleep(args.stats_wait)
    stats = stats_delta(stats_before, services.db.stats())
    if order != prompts:
        log(f"WARNING: run {run_id} trained on its inputs in another order than the script")
    sample = Sample(
        side="service",
        rep=rep,
        seconds=ph["completed"] - ph["claimed"],
        setup_seconds=ph["first_step"] - ph["claimed"],
        steps_seconds=ph["last_step"] - ph["first_step"],
        finish_seconds=ph["completed"] - ph["last_step"],
        step_median=statistics.median(step_seconds) if step_seconds else float("nan"),
        interval_median=(
            statistics.median(ph["step_intervals"]) if ph["step_intervals"] else float("nan")
        ),
        final_reward=rewards[-1] if rewards else None,
        final_reward_last10=statistics.fmean(rewards[-10:]) if rewards else None,
        cpu_seconds=cpu,
        loadavg_before=load_before,
        loadavg_after=load_after,
        machine_busy_pct=machine_busy(machine_before, machine_after),
        extra={
            "run_id": run_id,
            "steps": run["step"],
            "dispatch_seconds": ph["claimed"] - services.db.run_created(run_id),
            "same_order_as_script": order == prompts,
            "checkpoints": checkpoints,
            "volume": volume,
            "pg_stats": stats,
            "events": len(events),
            **services.db.tool_counts(run_id),
        },
    )
    log_sample(sample)
    return sample


def measure_script(
    args: argparse.Namespace,
    servers: list[Server],
    cmd: list[str],
    rep: int,
    *,
    settle: bool = True,
    wrap: list[str] | None = None,
    label: str | None = None,
) -> Sample:
    if settle:
        wait_for_quiet(args.settle_timeout)
    label = label or f"svs-script-{rep}"
    load_before, machine_before = loadavg(), psutil.cpu_times()
    full = [*(wrap or []), *cmd]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **torch_thread_env(args.torch_threads)}
    script = run_to_end(label, full, env=env, servers=servers, timeout=args.run_timeout)
    load_after, machine_after = loadavg(), psutil.cpu_times()
    lines = script.log_path.read_text(errors="replace").splitlines()
    result = None
    for line in reversed(lines):
        if line.startswith("{") and '"total_seconds"' in line:
            result = json.loads(line)
            break
    if script.proc.returncode != 0 or result is None:
        raise BenchError(
            f"{label} exited with {script.proc.returncode} and no result; last lines of"
            f" {script.log_path}:\n{script.tail()}"
        )
    rewards = result["step_rewards"]
    sample = Sample(
        side="script",
        rep=rep,
        seconds=result["total_seconds"],
        setup_seconds=result["first_step_seconds"],
        steps_seconds=result["last_step_seconds"] - result["first_step_seconds"],
        finish_seconds=result["total_seconds"] - result["last_step_seconds"],
        step_median=result["step_seconds_median"],
        interval_median=result["step_interval_median"],
        final_reward=rewards[-1] if rewards else None,
        final_reward_last10=statistics.fmean(rewards[-10:]) if rewards else None,
        cpu_seconds={"script": result["cpu_seconds"]},
        loadavg_before=load_before,
        loadavg_after=load_after,
        machine_busy_pct=machine_busy(machine_before, machine_after),
        extra={
            "steps": result["steps"],
            "load_seconds": result["load_seconds"],
            "train_seconds": result["train_seconds"],
            "save_seconds": result["save_seconds"],
            "checkpoints": result["checkpoints"],
            "final_model": bool(result["final_model"]),
            "versions": result["versions"],
            "torch_threads": result["torch_threads"],
        },
    )
    log_sample(sample)
    return sample


def log_sample(s: Sample) -> None:
    reward = "n/a" if s.final_reward is None else f"{s.final_reward:.3f}"
    log(
        f"  -> {s.side} rep {s.rep}: {s.seconds:.1f} s (setup {s.setup_seconds:.2f}, steps"
        f" {s.steps_seconds:.1f}, finish {s.finish_seconds:.2f}), step median"
        f" {s.step_median * 1e3:.0f} ms, final reward {reward}, load {s.loadavg_before[0]:.2f}"
        f"→{s.loadavg_after[0]:.2f}, machine {s.machine_busy_pct:.0f}% busy"
    )


# ------------------------------------------------------------------------------ py-spy


TRAINING_LOOP = "_inner_training_loop"
DB_CALL = re.compile(r"\b_(\w+)\(")
TRAINING_PY = REPO / "workers" / "pipeline" / "training.py"
STEPS_PY = REPO / "workers" / "pipeline" / "steps.py"
SNAPSHOT = OUT / "svs-training-loaded.py"  # training.py as the worker imported it
# Where the training thread hands a write to the worker's event loop and waits for it:
# ``StepBridge.db`` (synchronous writes), ``Runtime.run``, or a write-behind queue's
# ``flush``/``check``/``submit`` when it has to wait.
WAIT_FRAMES = (
    ("db", "pipeline/training.py"),
    ("run", "workers/runtime.py"),
    ("flush", "pipeline/writes.py"),
    ("check", "pipeline/writes.py"),
    ("submit", "pipeline/writes.py"),
)


def frame_parts(frame: str) -> tuple[str, str, int]:
    m = re.match(r"(.*) \((.*):(\d+)\)$", frame)
    return (m.group(1), m.group(2), int(m.group(3))) if m else (frame, "", 0)


def classify(frames: list[str], source: list[str]) -> str:
    """What the training thread is doing in one sample (outermost frame first)."""

    def waits(frame: str) -> str | None:
        name, path, _ = frame_parts(frame)
        short = name.rsplit(".", 1)[-1]
        return short if any(short == n and path.endswith(f) for n, f in WAIT_FRAMES) else None

    for i in range(len(frames) - 1, 0, -1):  # the innermost wait on a database write wins
        short = waits(frames[i])
        if short:
            while i > 1 and waits(frames[i - 1]):  # StepBridge.db → Runtime.run: take db
                i -= 1
                short = waits(frames[i]) or short
            path = frame_parts(frames[i])[1]
            caller, caller_path, line = frame_parts(frames[i - 1])
            what = caller.rsplit(".", 1)[-1]
            text = source[line - 1] if 0 < line <= len(source) else ""
            if caller_path.endswith("pipeline/training.py") and "db(" in text:
                m = DB_CALL.search(text.split("db(", 1)[1])
                what = m.group(1) if m else what
            if path.endswith("pipeline/writes.py"):
                what = f"write-behind {short}() in {what}"
            return f"database: {what}"
    names = [frame_parts(f)[0] for f in frames]
    joined = ";".join(frames)
    if any(n.endswith("free_memory") for n in names):
        return "end of train(): free_memory (gc)"
    if any(n.endswith("_save_checkpoint") or n.endswith("save_model") for n in names):
        return "checkpoint / model save"
    if any(n.split(".")[-1] == "generate" for n in names):
        return "generation"
    # An agent run's: TRL's tool loop outside generation (the calls, their guard), and the
    # chat template rendering prompts and tool results.
    if any(n.endswith("_tool_call_loop") for n in names) and not any(
        n.endswith(("apply_chat_template", "_get_tool_suffix_ids")) for n in names
    ):
        return "tool calls"
    if any(n.endswith(("apply_chat_template", "_get_tool_suffix_ids")) for n in names):
        return "chat template"
    if any(n.endswith("_calculate_rewards") for n in names):
        return "reward function (other)"
    if "backward" in joined:
        return "backward"
    if any("torch/optim" in f for f in frames):
        return "optimizer"
    if any(n.endswith("compute_loss") for n in names):
        return "loss forward"
    if any("RunCallback" in n or "StepBridge" in n for n in names):
        return "Trainyard callbacks (other)"
    return "other"


def in_warm_up(frames: list[str]) -> bool:
    """Whether a sample is an agent run's SFT warm-up (the same Trainer loop as GRPO's, so
    told apart by its caller): the worker's workers/pipeline/sft.py, or the line of
    agent_script.py that trains the SFTTrainer."""
    for frame in frames:
        _, path, line = frame_parts(frame)
        if path.endswith("pipeline/sft.py"):
            return True
        if path.endswith("agent_script.py") and line in SFT_TRAIN_LINES:
            return True
    return False


SFT_TRAIN_LINES = {
    n
    for n, text in enumerate(AGENT_SCRIPT.read_text().splitlines(), 1)
    if "sft_trainer.train(" in text
}


def profile_breakdown(path: Path) -> dict[str, float]:
    """Seconds of the training thread per activity, from py-spy's raw output (--idle, so
    every sample is wall time); GRPO's training loop only, an agent run's warm-up left out."""
    loaded = SNAPSHOT if SNAPSHOT.exists() else TRAINING_PY
    source = loaded.read_text().splitlines() if loaded.exists() else []
    counts: collections.Counter[str] = collections.Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if TRAINING_LOOP not in stack or not count.isdigit():
            continue
        frames = stack.split(";")[1:]
        if in_warm_up(frames):
            continue
        counts[classify(frames, source)] += int(count)
    return {k: v / PYSPY_RATE for k, v in counts.most_common()}


WRITE_WHAT = {
    "_begin_step": "status → `collecting` (a transaction of its own in older code)",
    "_store_rollouts": "the step's rollouts + status → `scoring`",
    "_store_rewards": "their rewards + status → `training`",
    "_finish_step": "the step's metrics, the run's progress and summary, a `step` event",
}
OWN_FRAME = re.compile(r"\((?:app|workers)/[^)]*\)$")


def short_name(frame: str) -> str:
    return frame_parts(frame)[0].rsplit(".", 1)[-1]


def top(counts: collections.Counter[str], n: int) -> dict[str, float]:
    """The n largest as seconds, the rest summed into one entry."""
    out = {k: v / PYSPY_RATE for k, v in counts.most_common(n)}
    rest = counts.most_common()[n:]
    if rest:
        out[f"{len(rest)} more"] = sum(v for _, v in rest) / PYSPY_RATE
    return out


def db_thread_breakdown(path: Path) -> dict[str, dict[str, float]]:
    """Seconds the worker's event-loop thread (``trainyard-db``, which runs every database
    call) was busy in Python, not waiting in the selector: by the library of its innermost
    frame, and by Trainyard call site (the pipeline's write → the innermost Trainyard
    function, e.g. ``_begin_step → renew``)."""
    by_lib: collections.Counter[str] = collections.Counter()
    by_site: collections.Counter[str] = collections.Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if "trainyard-db" not in frames[0] or not count.isdigit():
            continue
        if any(f.startswith(("select (selectors.py", "EpollSelector.select")) for f in frames):
            continue  # idle: waiting on PostgreSQL, or for work
        n = int(count)
        leaf = frame_parts(frames[-1])[1]
        if "sqlalchemy/orm" in leaf:
            by_lib["SQLAlchemy ORM"] += n
        elif "sqlalchemy/sql" in leaf:
            by_lib["SQLAlchemy statement building, cache keys, compiling"] += n
        elif "sqlalchemy" in leaf:
            by_lib["SQLAlchemy engine, pool, dialect"] += n
        elif "asyncpg" in leaf:
            by_lib["asyncpg"] += n
        elif "asyncio" in leaf:
            by_lib["asyncio, sockets"] += n
        else:
            by_lib["other Python"] += n
        own = [f for f in frames if OWN_FRAME.search(f)]
        sites = [f for f in own if re.search(r"\._(store_|begin_|finish_|record_)", f)]
        if sites:
            site, inner = short_name(sites[0]), short_name(own[-1])
            by_site[site if inner == site else f"{site} → {inner}"] += n
        elif own:
            by_site[f"other: {short_name(own[0])} → {short_name(own[-1])}"] += n
        else:  # SQLAlchemy runs the statement in a greenlet: no Trainyard frame above it
            names = ";".join(frame_parts(f)[0] for f in frames)
            if "_BulkORMInsert" in names:
                by_site["SQLAlchemy greenlet: INSERTs (rollouts, metrics, events)"] += n
            elif "_BulkORMUpdate" in names:
                by_site["SQLAlchemy greenlet: UPDATEs of the run (renewals, transitions)"] += n
            elif "greenlet" in names or "Session." in names or "AsyncAdapt" in names:
                by_site["SQLAlchemy greenlet: other statements, commits"] += n
            else:
                by_site["event-loop callbacks (socket reads, futures)"] += n
    return {
        "library": {k: v / PYSPY_RATE for k, v in by_lib.most_common()},
        "site": top(by_site, 12),
    }


def commit_probe(admin_url: str, n: int = 200) -> dict[str, float]:
    """Median latency (s) on the bench database of a round trip, and of a one-row UPDATE
    committed with synchronous_commit on and off (asyncpg, one connection)."""
    import asyncio

    import asyncpg

    async def go() -> dict[str, float]:
        conn = await asyncpg.connect(pg_url_for(admin_url, DB_NAME, "postgresql"))
        out: dict[str, float] = {}
        try:
            await conn.execute("CREATE TABLE IF NOT EXISTS svs_probe (id int PRIMARY KEY, v int)")
            await conn.execute("INSERT INTO svs_probe VALUES (1, 0) ON CONFLICT DO NOTHING")

            async def tx(sync: str) -> None:
                async with conn.transaction():
                    await conn.execute(f"SET LOCAL synchronous_commit TO {sync}")
                    await conn.execute("UPDATE svs_probe SET v = v + 1 WHERE id = 1")

            for label, fn in (
                ("round trip (SELECT 1)", lambda: conn.fetchval("SELECT 1")),
                ("UPDATE + COMMIT, synchronous_commit on", lambda: tx("on")),
                ("UPDATE + COMMIT, synchronous_commit off", lambda: tx("off")),
            ):
                times = []
                for _ in range(n):
                    t = time.perf_counter()
                    await fn()
                    times.append(time.perf_counter() - t)
                out[label] = statistics.median(times)
            await conn.execute("DROP TABLE svs_probe")
        finally:
            await conn.close()
        return out

    return asyncio.run(go())


def step_writes(
    args: argparse.Namespace, servers: list[Server], services: Services, run_id: str
) -> dict[str, Any]:
    """bench/step_writes.py on a completed run: each per-step write replayed alone."""
    cmd = [sys.executable, str(STEP_WRITES), "--run-id", run_id, "--steps", "50"]
    log("replaying one step's writes")
    proc = run_to_end(
        "svs-step-writes", cmd, env=services.env, servers=servers, timeout=args.run_timeout
    )
    lines = proc.log_path.read_text(errors="replace").splitlines()
    if proc.proc.returncode != 0 or not lines or not lines[-1].startswith("{"):
        raise BenchError(f"step_writes.py failed; last lines of {proc.log_path}:\n{proc.tail()}")
    return dict(json.loads(lines[-1]))


def profile_pair(
    args: argparse.Namespace,
    servers: list[Server],
    services: Services,
    body: dict[str, Any],
    prompts: list[str],
    cmd: list[str],
) -> dict[str, Any]:
    spy_bin = pyspy()
    assert services.worker is not None
    flags = ["--rate", str(PYSPY_RATE), "--format", "raw", "--threads", "--idle", "--nonblocking"]
    script_raw = OUT / "svs-profile-script.txt"
    worker_raw = OUT / "svs-profile-worker.txt"
    script = measure_script(
        args,
        servers,
        cmd,
        0,
        wrap=[spy_bin, "record", *flags, "-o", str(script_raw), "--"],
        label="svs-script-profile",
    )
    wait_for_quiet(args.settle_timeout)
    spy = start_server(
        "svs-pyspy",
        [spy_bin, "record", *flags, "-o", str(worker_raw), "--pid", str(services.worker.proc.pid)],
        env=dict(os.environ),
    )
    servers.append(spy)
    try:
        time.sleep(2.0)  # py-spy attaches
        service = measure_service(services, body, prompts, 0, settle=False)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(spy.pgid, signal.SIGINT)  # py-spy writes its file on SIGINT
        with contextlib.suppress(subprocess.TimeoutExpired):
            spy.proc.wait(timeout=60)
        spy.stop()
        servers.remove(spy)
    if not worker_raw.exists() or not script_raw.exists():
        raise BenchError(f"py-spy wrote no profile; see {spy.log_path}")
    writes = step_writes(args, servers, services, service.extra["run_id"])
    # Is it the database, or a second busy Python thread? The plain script, back to back,
    # without and with a thread burning what the worker's event-loop thread burned.
    db = db_thread_breakdown(worker_raw)
    busy_ms = round(sum(db["library"].values()) / max(service.extra["steps"], 1) * 1e3)
    gil = {"busy_ms_per_100ms": busy_ms}
    # Not for an agent run: its event-loop thread's time includes the SFT warm-up's writes,
    # which are not the GRPO steps'.
    if busy_ms > 0 and not args.agent:
        plain, loaded = [], []
        for i in (1, 2):  # interleaved, medians of two
            plain.append(measure_script(args, servers, cmd, 0, label=f"svs-script-plain-{i}"))
            loaded.append(
                measure_script(
                    args,
                    servers,
                    [*cmd, "--busy-thread-ms", str(busy_ms)],
                    0,
                    label=f"svs-script-busy-{i}",
                )
            )
        gil.update(
            plain_seconds=statistics.median(s.seconds for s in plain),
            busy_seconds=statistics.median(s.seconds for s in loaded),
        )
    return {
        "gil": gil,
        "db_thread": db,
        "write_behind": writes_behind(),
        "step_writes": writes,
        "script": profile_breakdown(script_raw),
        "service": profile_breakdown(worker_raw),
        "commit_probe": commit_probe(args.pg_url),
        "script_steps": script.extra["steps"],
        "service_steps": service.extra["steps"],
        "script_seconds": script.seconds,
        "service_seconds": service.seconds,
    }


# ------------------------------------------------------------------------------ report


def med(samples: list[Sample], get: Any) -> float:
    values = [v for v in (get(s) for s in samples) if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else float("nan")


def fmt_s(v: float) -> str:
    if math.isnan(v):
        return "n/a"
    return f"{v:.1f} s" if v >= 10 else f"{v:.2f} s"


def fmt_ms(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v * 1e3:.0f} ms"


def fmt_r(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:.3f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and not math.isnan(a) and not math.isnan(b) else "n/a"


def render_table(script: list[Sample], service: list[Sample]) -> str:
    def row(label: str, get: Any, fmt: Any, with_ratio: bool = True) -> str:
        a, b = med(script, get), med(service, get)
        return f"| {label} | {fmt(a)} | {fmt(b)} | {ratio(b, a) if with_ratio else ''} |"

    def spread(samples: list[Sample]) -> str:
        values = sorted(s.seconds for s in samples)
        return f"{fmt_s(statistics.median(values))} ({values[0]:.1f}–{values[-1]:.1f})"

    def cpu(s: Sample) -> float:
        return sum(s.cpu_seconds.values())

    a, b = med(script, lambda s: s.seconds), med(service, lambda s: s.seconds)
    return "\n".join(
        [
            "| median of the repetitions | plain TRL script | Trainyard service"
            " | service / script |",
            "|---|---:|---:|---:|",
            f"| **total** (min–max) | {spread(script)} | {spread(service)} | **{ratio(b, a)}** |",
            row("setup: start → step 1 begins (model load)", lambda s: s.setup_seconds, fmt_s),
            row("steps: step 1 begins → last step logged", lambda s: s.steps_seconds, fmt_s),
            row(
                "finish: → end (checkpoint, final model, records)",
                lambda s: s.finish_seconds,
                fmt_s,
            ),
            row("step, median (`step_seconds`)", lambda s: s.step_median, fmt_ms),
            row(
                "step to step, median (`step` events; script: `on_log`)",
                lambda s: s.interval_median,
                fmt_ms,
            ),
            row("reward at the last step", lambda s: s.final_reward, fmt_r, with_ratio=False),
            row(
                "reward, mean of the last 10 steps",
                lambda s: s.final_reward_last10,
                fmt_r,
                with_ratio=False,
            ),
            row("CPU seconds (script; worker + API + Postgres backends)", cpu, fmt_s),
        ]
    )


def render_reps(samples: list[Sample]) -> str:
    rows = [
        "| # | side | total | steps | step median | final reward"
        " | loadavg before → after | machine busy |",
        "|---:|---|---:|---:|---:|---:|---|---:|",
    ]
    for s in samples:
        reward = "n/a" if s.final_reward is None else f"{s.final_reward:.3f}"
        rows.append(
            f"| {s.rep} | {s.side} | {fmt_s(s.seconds)} | {fmt_s(s.steps_seconds)} |"
            f" {fmt_ms(s.step_median)} | {reward} |"
            f" {' '.join(map(str, s.loadavg_before))} → {' '.join(map(str, s.loadavg_after))} |"
            f" {s.machine_busy_pct:.0f}% |"
        )
    return "\n".join(rows)


def render_volume(service: list[Sample]) -> list[str]:
    s = service[len(service) // 2]
    steps = max(int(s.extra["steps"]), 1)
    volume = s.extra["volume"]
    tables = s.extra["pg_stats"]["tables"]
    db = s.extra["pg_stats"]["db"]
    rows = [
        "| table | rows kept | bytes kept | inserted / step | updated / step |",
        "|---|---:|---:|---:|---:|",
    ]
    total_ins = total_upd = 0
    for t in TABLES:
        kept = volume.get(t, {"rows": 0, "bytes": 0})
        st = tables.get(t, {"ins": 0, "upd": 0})
        total_ins += st["ins"]
        total_upd += st["upd"]
        rows.append(
            f"| `{t}` | {kept['rows']} | {kept['bytes'] / 1024:.0f} KiB |"
            f" {st['ins'] / steps:.1f} | {st['upd'] / steps:.1f} |"
        )
    rows.append(f"| all | | | {total_ins / steps:.1f} | {total_upd / steps:.1f} |")
    return [
        f"Database writes of one {steps}-step run (rep {s.rep}, run `{s.extra['run_id']}`):"
        " rows it left behind and PostgreSQL's per-table counters over the run"
        f" (`pg_stat_user_tables`); {db['xact_commit'] / steps:.1f} committed transactions"
        " per step in the database (the worker's writes and heartbeats, the reconciler's"
        " sweeps and the harness's once-a-second `GET /runs/{id}`).",
        "",
        *rows,
    ]


def render_profile(profile: dict[str, Any]) -> list[str]:
    script, service = profile["script"], profile["service"]
    names = sorted(
        set(script) | set(service), key=lambda k: -(service.get(k, 0) + script.get(k, 0))
    )
    ns, nv = max(profile["script_steps"], 1), max(profile["service_steps"], 1)
    rows = [
        "| training thread | script ms / step | service ms / step | difference |",
        "|---|---:|---:|---:|",
    ]
    for k in names:
        a, b = script.get(k, 0.0) / ns * 1e3, service.get(k, 0.0) / nv * 1e3
        rows.append(f"| {k} | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
    a, b = sum(script.values()) / ns * 1e3, sum(service.values()) / nv * 1e3
    rows.append(f"| all of `train()` | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
    db = profile.get("db_thread", {})
    lib, site = db.get("library", {}), db.get("site", {})
    db_rows = [
        "| busy in | ms / step | | Trainyard call (write → innermost function) | ms / step |",
        "|---|---:|---|---|---:|",
    ]
    for i in range(max(len(lib), len(site))):
        a = list(lib.items())[i] if i < len(lib) else ("", None)
        b = list(site.items())[i] if i < len(site) else ("", None)
        fa = "" if a[1] is None else f"{a[1] / nv * 1e3:.1f}"
        fb = "" if b[1] is None else f"{b[1] / nv * 1e3:.1f}"
        name_b = f"`{b[0]}`" if b[0] else ""
        db_rows.append(f"| {a[0]} | {fa} | | {name_b} | {fb} |")
    busy = sum(lib.values()) / nv * 1e3
    writes = profile.get("step_writes") or {}
    medians = writes.get("median_ms", {})
    calls = [k for k in medians if k.startswith("_")]
    write_rows = [
        "| write (transaction) | what it does | median |",
        "|---|---|---:|",
        *(f"| `{k}` | {WRITE_WHAT.get(k, '')} | {medians[k]:.1f} ms |" for k in calls),
        f"| all of a step's writes | | **{sum(medians[k] for k in calls):.1f} ms** |",
        "| an empty fenced transaction | `RunContext.session()` with nothing in it: lease"
        " renewal + commit |"
        f" {medians.get('empty fenced transaction', 0.0):.1f} ms |",
    ]
    probe = profile.get("commit_probe", {})
    probe_text = "; ".join(f"{k}: {v * 1e3:.2f} ms" for k, v in probe.items())
    return [
        f"py-spy ({PYSPY_RATE} Hz, wall time, `--profile`: one more pair, not in the medians;"
        f" script {profile['script_seconds']:.1f} s, service {profile['service_seconds']:.1f} s)."
        " Samples of the thread running TRL's training loop, by what it was doing; database"
        " rows are that thread waiting on the worker's event-loop thread (for a write to"
        " commit, or on a write-behind queue):",
        "",
        *rows,
        "",
        "Meanwhile the worker's event-loop thread, which runs every database call (the"
        " training thread hands it each write, and waits for it unless writes are behind),"
        " was busy in"
        f" Python for {busy:.1f} ms per step (the rest of the time it waited in the selector):",
        "",
        *db_rows,
        "",
        f"PostgreSQL on this machine, median of 200 (asyncpg, bench database): {probe_text}.",
        "",
        "Each write of a step replayed alone with the worker's own code"
        f" (`bench/step_writes.py`: {writes.get('steps', 0)} steps on a scratch copy of a"
        f" finished run, the rows of its step {writes.get('source_step', '?')}:"
        f" {writes.get('rollouts', 0)} rollouts, {writes.get('metric_values', 0)} metric"
        " values; each timed from the calling thread until it committed):",
        "",
        *write_rows,
    ]


def where_the_time_goes(
    script: list[Sample], service: list[Sample], profile: dict[str, Any] | None
) -> list[str]:
    a, b = med(script, lambda s: s.seconds), med(service, lambda s: s.seconds)
    diff = b - a
    parts = []
    for label, get in (
        ("setup", lambda s: s.setup_seconds),
        ("the steps", lambda s: s.steps_seconds),
        ("finish", lambda s: s.finish_seconds),
    ):
        parts.append(f"{label} {med(service, get) - med(script, get):+.1f} s")
    steps = med(service, lambda s: s.extra["steps"])
    interval = med(service, lambda s: s.interval_median) - med(script, lambda s: s.interval_median)
    text = (
        f"The service took {diff:+.1f} s ({ratio(b, a)}) over the script's median: "
        + ", ".join(parts)
        + f". Step to step the service is {interval * 1e3:+.0f} ms per step slower in the"
        f" median, about {interval * steps:+.1f} s over {steps:.0f} steps."
    )
    dispatch = med(service, lambda s: s.extra["dispatch_seconds"])
    text += (
        f" Not counted: POST → claimed (dispatch through the reconciler and Celery), median"
        f" {dispatch:.2f} s."
    )
    out = [text]
    writes = (profile or {}).get("step_writes", {}).get("median_ms", {})
    probe = (profile or {}).get("commit_probe", {})
    if writes:
        total = sum(v for k, v in writes.items() if k.startswith("_"))
        commit = probe.get("UPDATE + COMMIT, synchronous_commit on", float("nan"))
        trip = probe.get("round trip (SELECT 1)", float("nan"))
        out += [
            "",
            f"A step's {len([k for k in writes if k.startswith('_')])} write transactions,"
            " replayed alone with the worker's code, take"
            f" {total:.1f} ms; an empty fenced transaction (lease renewal + commit) alone"
            f" {writes.get('empty fenced transaction', float('nan')):.1f} ms. PostgreSQL itself"
            f" answers a round trip in {trip * 1e3:.2f} ms and commits a one-row UPDATE in"
            f" {commit * 1e3:.2f} ms (fsync included), so nearly all of it is Python in the"
            " worker: SQLAlchemy building, caching and compiling statements, the ORM, asyncio.",
        ]
    gil = (profile or {}).get("gil", {})
    if "busy_seconds" in gil:
        slowed = gil["busy_seconds"] > 1.05 * gil["plain_seconds"]
        out += [
            "",
            "The plain script with a second Python thread burning"
            f" {gil['busy_ms_per_100ms']} ms of CPU every 100 ms (about what the worker's"
            " event-loop thread burns per step, see below; `grpo_script.py --busy-thread-ms`,"
            f" median of two each, back to back) took {gil['busy_seconds']:.1f} s instead of"
            f" {gil['plain_seconds']:.1f} s"
            + (
                ": no database needed to lose that time. Training this small is mostly Python"
                " dispatching tiny torch operations; each releases the GIL and has to win it"
                " back from the busy thread. What costs is the CPU the write path burns in the"
                " worker's process, whether the training thread waits for the writes or they"
                " run behind it."
                if slowed
                else ": no measurable slowdown, so sharing the GIL does not explain the gap here."
            ),
        ]
    if profile:
        db = {k: v for k, v in profile["service"].items() if k.startswith("database:")}
        if db:
            per_step = {k: v / max(profile["service_steps"], 1) * 1e3 for k, v in db.items()}
            out += [
                "",
                "In the profiled pair the training thread waited on database writes, per step: "
                + ", ".join(f"`{k.split(': ')[1]}` {v:.1f} ms" for k, v in per_step.items())
                + f" (total {sum(per_step.values()):.1f} ms).",
            ]
        ns, nv = max(profile["script_steps"], 1), max(profile["service_steps"], 1)
        busy = sum(profile.get("db_thread", {}).get("library", {}).values()) / nv
        own_script = sum(v for k, v in profile["script"].items() if not k.startswith("database:"))
        own_service = sum(v for k, v in profile["service"].items() if not k.startswith("database:"))
        gen = (
            profile["service"].get("generation", 0.0) / nv
            - profile["script"].get("generation", 0.0) / ns
        )
        out += [
            "",
            f"Outside those waits the training thread spent {own_service / nv * 1e3:.1f} ms per"
            f" step in the service and {own_script / ns * 1e3:.1f} ms in the script (generation"
            f" {gen * 1e3:+.1f} ms of the difference): the same TRL work, slower in the worker"
            " process. The extra is spread over the model's torch operations, not in any"
            " Trainyard function."
            + (
                f" With write-behind, the event-loop thread's {busy * 1e3:.1f} ms per step of"
                " Python (below) runs while the training thread computes, and only one of them"
                " can hold the GIL at a time."
                if profile.get("write_behind")
                else " This profile does not say why (the machine's load, and the worker's"
                " other threads and PostgreSQL sharing its two cores, are candidates)."
            ),
        ]
    return out


def render_section(
    args: argparse.Namespace,
    script: list[Sample],
    service: list[Sample],
    cold: Sample | None,
    profile: dict[str, Any] | None,
    versions: dict[str, str],
    started: str,
    run: dict[str, Any],
    load_start: tuple[float, float, float],
) -> str:
    a, b = med(script, lambda s: s.seconds), med(service, lambda s: s.seconds)
    r = b / a if a else float("nan")
    target = AGENT_TARGET if args.agent else TARGET
    verdict = "within" if r <= target else "**above**"
    g = run["grpo"]
    sv = service[len(service) // 2]
    sc = script[len(script) // 2]
    orders = all(s.extra["same_order_as_script"] for s in service)
    same_order = "yes (checked against the stored trajectories)" if orders else "**no**"
    work = (
        f"- Work: {run['max_steps']} GRPO steps of `configs/runs/letters.yaml` on the tiny"
        f" Llama (`trainyard tiny-model`): {g['groups_per_step']} groups of"
        f" {run['rollouts_per_group']} rollouts per step, {g['max_completion_length']}"
        f" completion tokens, lr {run['learning_rate']:g}, beta {g['beta']:g}, temperature"
        f" {g['temperature']:g}, loss {g['loss_type']}, seed {g['seed']}, reward"
        f" `char_fraction` (share of 'a'), checkpoints every {g['save_steps']} steps plus the"
        " final model on both sides, no evaluation. Same prompts in the same order:"
        f" {same_order}."
    )
    script_side = (
        "Script: `bench/grpo_script.py`, a fresh process per repetition;"
        " time = GRPOTrainer construction (model load) + `train()` + `save_model()`, imports"
        " excluded."
    )
    if args.agent:
        sft = run["sft"]
        where, reward = (
            "the calculator environment (add, subtract, multiply, divide)",
            "reward 1 for the right final answer",
        )
        if args.environment:
            cls = run["environment"]["factory"]
            where = (
                f"the python environment `{cls}`, the same class on both sides (the run's"
                " `environment.factory`, the script's `environment_factory`)"
            )
            reward = "reward its `get_reward()` (the run's `environment` function; TRL's own)"
            errors = sum(s.extra.get("tool_errors", 0) for s in service[:1])
            calls = sum(s.extra.get("tool_calls", 0) for s in service[:1])
            if calls:
                where += (
                    f"; of the {calls} tool calls of the first repetition's service run,"
                    f" {errors} failed ({100 * errors / calls:.0f}%)"
                )
        work = (
            f"- Work: `configs/runs/agent-calculator.yaml` on the agent tiny Llama (`trainyard"
            f" tiny-model --tools`, Qwen2.5's chat template): an SFT warm-up of {sft['epochs']}"
            f" epochs on its {len(sft['examples'])} demonstrations (batch {sft['batch_size']},"
            f" lr {sft['learning_rate']:g}, loss on assistant tokens, a checkpoint every epoch"
            f" on both sides as the worker keeps them), then {run['max_steps']} GRPO steps from"
            f" its model in {where} (at"
            f" most {run['environment']['max_turns']} tool rounds per episode, TRL's"
            f" `max_tool_calling_iterations`): {g['groups_per_step']} groups of"
            f" {run['rollouts_per_group']} rollouts per step, {g['max_completion_length']}"
            f" completion tokens, lr {run['learning_rate']:g}, beta {g['beta']:g}, temperature"
            f" {g['temperature']:g}, loss {g['loss_type']}, seed {g['seed']}, {reward},"
            f" checkpoints every {g['save_steps']} steps plus the final"
            f" model on both sides, no evaluation. Same inputs in the same order: {same_order}."
        )
        script_side = (
            "Script: `bench/agent_script.py` (plain TRL: `SFTTrainer`, then `GRPOTrainer` with"
            " an `environment_factory` class of the four tools and a reward function), a fresh"
            " process per repetition; time = SFT (tokenizing, construction, `train()`, saving"
            " its model) + GRPOTrainer construction (loads that model) + `train()` +"
            " `save_model()`, imports excluded. The service's time includes the same warm-up"
            " (status `warming_up`)."
        )
    parts = [
        markers(section_name(args))[0],
        (
            f"## Agent runs in `{args.environment}`: through Trainyard vs the same TRL script"
            if args.environment
            else "## Agent runs: a multi-turn run through Trainyard vs the same TRL script"
        )
        if args.agent
        else "## Service overhead: a run through Trainyard vs the same TRL script",
        "",
        written_by("service_vs_script.py"),
        "",
        *report_head("service_vs_script.py", started=started, versions=versions),
        work,
        f"- Service: `trainyard api` + one `trainyard worker --pool solo`, fresh database"
        f' `{DB_NAME}`; time = `lease` event "claimed by …" → `status` event to `completed`'
        " (`run_events.created_at`, the database clock). The worker ran a"
        f" {args.warmup_steps}-step run first, so it had imported TRL (excluded like the"
        f" script's imports). {script_side}",
        f"- Repetitions: {len(script)} of each, interleaved (script, service, …); medians."
        f" Checkpoints: script {', '.join(sc.extra['checkpoints'])} + final model; service"
        f" {', '.join(sv.extra['checkpoints'])}.",
        "- Threads: "
        + (
            f"`OMP_NUM_THREADS={args.torch_threads}` for the worker and the script. With torch's"
            " default (one thread per core) on a shared 2-core machine, OpenMP threads spin"
            " whenever another process holds a core, and the same script took from 2 s to 22 s"
            " for 30 steps."
            if args.torch_threads
            else "torch's default (one per core) on both sides."
        ),
        f"- Machine load: loadavg {' '.join(map(str, load_start))} at the start; the table of"
        " repetitions below has it for each run.",
        "",
        render_table(script, service),
        "",
        f"Ratio of medians, service / script: **{r:.2f}x**, {verdict} the {target:.2f}x target,"
        f" with every one of the {sv.extra['volume']['trajectories']['rows']} trajectories"
        " (and its reward), every metric, event and checkpoint persisted.",
        "",
    ]
    if cold is not None:
        parts += [
            f"First run on a fresh worker ({cold.extra['steps']} steps, not in the medians):"
            f" claim → completed {cold.seconds:.1f} s, of which setup {cold.setup_seconds:.1f} s"
            " — the worker imports torch, transformers and TRL on its first run.",
            "",
        ]
    parts += [
        "Each repetition (loadavg: 1, 5, 15 min; machine busy = all CPUs, whole run):",
        "",
        render_reps(sorted([*script, *service], key=lambda s: (s.rep, s.side != "script"))),
        "",
        *render_volume(service),
        "",
    ]
    if r > target or profile:
        parts += ["### Where the time goes", "", *where_the_time_goes(script, service, profile), ""]
    if profile:
        parts += [*render_profile(profile), ""]
    parts.append(markers(section_name(args))[1])
    return "\n".join(parts) + "\n"


# -------------------------------------------------------------------------------- main


def section_name(args: argparse.Namespace) -> str:
    """The name of the section these options write, and of their JSON in bench/out/."""
    if args.agent:
        return ENVIRONMENT_SECTION if args.environment else AGENT_SECTION
    return SECTION


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Trainyard's overhead over a plain TRL GRPO script, same training.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=100, help="GRPO steps per run")
    p.add_argument("--repeats", type=int, default=3, help="repetitions of each side")
    p.add_argument("--save-steps", type=int, default=50, help="checkpoint every N steps")
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=2,
        help="steps of the unmeasured first service run (the worker imports TRL then)",
    )
    add_model_arg(p)
    p.add_argument(
        "--agent",
        action="store_true",
        help="the multi-turn case: configs/runs/agent-calculator.yaml (SFT warm-up, then GRPO"
        " with the calculator's tools) on the agent tiny model, against bench/agent_script.py;"
        " its own section in the output",
    )
    p.add_argument(
        "--environment",
        metavar="PACKAGE.MODULE:CLASS",
        help="with --agent: train in this python environment class on both sides (the run's"
        " environment.factory; the script's environment_factory, rewarded by its get_reward)"
        " instead of the calculator, e.g. tests.support.agent_tools:SmallCalculator, whose"
        " tools fail; its own section in the output",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="one more pair under py-spy; adds a per-activity breakdown to the section",
    )
    add_trainyard_args(
        p,
        databases=f"database {DB_NAME} is",
        redis_db=12,
        broker_prefix="bench-svs:",
        settle_timeout=30.0,
        start_timeout=120.0,
    )
    add_output_arg(p, "service-vs-script")
    p.add_argument("--poll-interval", type=float, default=1.0, help="GET /runs/{id} period, s")
    p.add_argument("--run-timeout", type=float, default=1200.0, help="longest run, either side")
    p.add_argument(
        "--stats-wait",
        type=float,
        default=11.0,
        help="wait after a service run before reading PostgreSQL's counters (flushed ≤10 s)",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS for the worker and the script (0: torch's default). With 2"
        " threads on a shared 2-core machine, OpenMP spin-waits whenever another process holds"
        " a core and step times vary tenfold",
    )
    p.add_argument("--keep", action="store_true", help="keep the temporary TRAINYARD_HOME")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.steps < 1:
        p.error("--repeats and --steps must be at least 1")
    if args.environment and not args.agent:
        p.error("--environment is for the agent case (--agent)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    started = utc_now()
    home = Path(tempfile.mkdtemp(prefix="trainyard-svs-"))
    servers: list[Server] = []
    script_samples: list[Sample] = []
    service_samples: list[Sample] = []
    cold: Sample | None = None
    profile: dict[str, Any] | None = None
    versions: dict[str, str] = {"Trainyard": trainyard_version()}
    load_start = loadavg()
    try:
        with stop_on_exit(servers):
            versions["PostgreSQL"] = pg_version(args.pg_url)
            redis_ping(args.redis_url)
            model = model_for(args, home, tools=args.agent)
            body = run_body(args, model, args.steps)
            run = resolved(body)
            prompts = planned_prompts(run)
            prompts_file = home / "prompts.json"
            prompts_file.write_text(json.dumps(prompts))
            inputs_file = home / "inputs.json"
            if args.agent:
                inputs_file.write_text(json.dumps(planned_inputs(run)))

            def command(name: str) -> list[str]:
                if args.agent:
                    return agent_script_command(
                        run,
                        model,
                        home / "run.json",
                        inputs_file,
                        home / f"script-{name}",
                        args.environment,
                    )
                return script_command(run, model, prompts_file, home / f"script-{name}")

            services = Services(args, servers, home)
            services.start(timeout=args.start_timeout)
            log(f"warm-up: a {args.warmup_steps}-step service run (the worker imports TRL)")
            warm_body = run_body(args, model, args.warmup_steps, warm_up=True)
            cold = measure_service(services, warm_body, planned_prompts(resolved(warm_body)), 0)
            # The worker imported the pipeline during that run: keep the code it runs (others
            # may be editing the tree) for the profile's line numbers and the report.
            shutil.copyfile(TRAINING_PY, SNAPSHOT)
            versions["worker pipeline"] = pipeline_version(SNAPSHOT)

            for rep in range(1, args.repeats + 1):
                cmd = command(str(rep))
                script_samples.append(measure_script(args, servers, cmd, rep))
                service_samples.append(
                    measure_service(
                        services, {**body, "trained_model_name": f"bench-{rep}"}, prompts, rep
                    )
                )
            if args.profile:
                cmd = command("profile")
                profile = profile_pair(args, servers, services, body, prompts, cmd)
            versions.update(
                {
                    k: v
                    for k, v in script_samples[0].extra["versions"].items()
                    if k in ("torch", "transformers", "trl")
                }
            )
            versions["Python"] = platform.python_version()
    finally:
        with contextlib.suppress(BenchError):
            clear_redis_prefix(args.redis_url, args.broker_prefix)
        if args.keep:
            log(f"kept {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)

    section = render_section(
        args, script_samples, service_samples, cold, profile, versions, started, run, load_start
    )
    start_mark, end_mark = markers(section_name(args))
    target = AGENT_TARGET if args.agent else TARGET
    write_section(args.output, section, start_mark, end_mark)
    (OUT / f"{section_name(args).replace('-', '_')}.json").write_text(
        json.dumps(
            {
                "started": started,
                "versions": versions,
                "loadavg_start": load_start,
                "loadavg_end": loadavg(),
                "args": {k: str(v) for k, v in vars(args).items()},
                "script": [dataclasses.asdict(s) for s in script_samples],
                "service": [dataclasses.asdict(s) for s in service_samples],
                "cold": dataclasses.asdict(cold) if cold else None,
                "profile": profile,
            },
            indent=2,
        )
        + "\n"
    )
    print()
    print(render_table(script_samples, service_samples))
    a = med(script_samples, lambda s: s.seconds)
    b = med(service_samples, lambda s: s.seconds)
    print(f"\nservice / script (medians): {b / a:.2f}x (target ≤ {target:.2f}x)")
    print(f"loadavg at start {load_start}, at end {loadavg()}")
    print(
        f"\nwrote {args.output} (section {start_mark} … {end_mark});"
        f" logs and JSON in {OUT.relative_to(REPO)}/"
    )
    return 0


if __name__ == "__main__":
    kit.run(main)
