#!/usr/bin/env python3
"""The same agent task as a gateway run and as a python environment run, side by side
(issue 28: they must learn alike): reward curves and wall time.

The calculator agent twice, on the agent tiny model, one after the other on one worker:
``configs/runs/agent-calculator.yaml`` (the built-in ``calculator`` python environment: TRL's
own tool loop in the worker) and ``configs/runs/agent-gateway.yaml`` (the same SFT warm-up,
tools and inputs; each episode played by ``examples/gateway/calculator.py``, a harness in a
process of its own on the plain ``openai`` SDK, through the gateway). Same seed, same steps.

    .venv/bin/python bench/gateway_learning.py                  # ~25 min on 2 CPUs
    .venv/bin/python bench/gateway_learning.py --steps 10 --output /tmp/gl.md

Needs PostgreSQL (database bench_gateway_learning is dropped and created) and Redis (db 12,
only keys under the prefix). The results replace the gateway-learning section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import kit
from kit import REPO, log
from kit.machine import trainyard_version, wait_for_quiet
from kit.processes import stop_on_exit
from kit.report import add_output_arg, markers, report_head, utc_now, write_section, written_by
from kit.trainyard import (
    AGENT_CALCULATOR,
    Trainyard,
    add_model_arg,
    add_trainyard_args,
    model_for,
    preset_run,
)

SECTION = "gateway-learning"
AGENT_GATEWAY = REPO / "configs" / "runs" / "agent-gateway.yaml"
HARNESS = REPO / "examples" / "gateway" / "calculator.py"


def windows(values: list[float], size: int) -> list[float]:
    return [statistics.fmean(values[i : i + size]) for i in range(0, len(values), size)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="GRPO steps of each run")
    p.add_argument("--seed", type=int, default=42)
    add_model_arg(p)
    add_trainyard_args(
        p,
        databases="bench_gateway_learning",
        redis_db=12,
        broker_prefix="bench-gateway-learning:",
        settle_timeout=120.0,
        start_timeout=120.0,
    )
    add_output_arg(p, SECTION)
    args = p.parse_args()
    started = utc_now()
    servers: list[kit.processes.Server] = []
    curves: dict[str, list[float]] = {}
    walls: dict[str, float] = {}
    with stop_on_exit(servers), tempfile.TemporaryDirectory(prefix="bench-gwl-") as tmp:
        home = Path(tmp)
        model = model_for(args, home, tools=True)
        ty = Trainyard(
            args, name="gwl", db_name="bench_gateway_learning", servers=servers, home=home
        )
        ty.start(timeout=args.start_timeout)
        for label, preset in (("python environment", AGENT_CALCULATOR), ("gateway", AGENT_GATEWAY)):
            wait_for_quiet(args.settle_timeout)
            body = preset_run(
                preset,
                model,
                steps=args.steps,
                save_steps=args.steps + 1,
                name=label.split()[0],
                overrides=(f"grpo.seed={args.seed}",),
            )
            t0 = time.monotonic()
            run = ty.create_run(body)
            harness = None
            if label == "gateway":
                argv = [sys.executable, str(HARNESS), "--url", ty.base_url, "--key", ty.key]
                harness = subprocess.Popen(
                    [*argv, "--run", run["id"]],
                    stdout=(home / "harness.log").open("ab"),
                    stderr=subprocess.STDOUT,
                )
            try:
                ty.wait_for_run(run["id"], every=2.0, timeout=3600)
            finally:
                if harness is not None:
                    harness.terminate()
                    harness.wait(10)
            walls[label] = time.monotonic() - t0
            names = ("reward_mean", "loss", "grad_norm", "completions/mean_length", "reward_std")
            series = ty.metrics(run["id"], *names)
            curves[label] = [v for _, v in sorted(series["reward_mean"])]
            for name in names[1:]:
                values = [v for _, v in sorted(series.get(name, []))]
                if values:
                    log(f"{label}: {name} first 5 {values[:5]} last 5 {values[-5:]}")
            log(f"{label}: {walls[label]:.0f} s, reward {curves[label][:3]} … {curves[label][-3:]}")
        ty.remove()
    size = max(1, args.steps // 10)
    labels = list(curves)
    rows = list(zip(*(windows(curves[label], size) for label in labels), strict=False))
    start_mark, end_mark = markers(SECTION)
    lines = [
        start_mark,
        "## Gateway: the same agent task as a gateway run and as a python environment run",
        "",
        written_by(
            "gateway_learning.py",
            " The calculator agent on the agent tiny model: the built-in python environment "
            "(TRL's tool loop in the worker) against the gateway, each episode played by "
            "`examples/gateway/calculator.py` in a process of its own; the same SFT warm-up, "
            "inputs, tools, seed and steps, one run after the other on one worker.",
        ),
        "",
        *report_head(
            "gateway_learning.py", started=started, versions={"trainyard": trainyard_version()}
        ),
        "",
        f"Mean reward per {size} steps:",
        "",
        "| steps | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
        *(
            f"| {i * size + 1}–{(i + 1) * size} | " + " | ".join(f"{v:.3f}" for v in row) + " |"
            for i, row in enumerate(rows)
        ),
        "",
        "| | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
        "| first 10 steps | "
        + " | ".join(f"{statistics.fmean(curves[label][:10]):.3f}" for label in labels)
        + " |",
        "| last 10 steps | "
        + " | ".join(f"{statistics.fmean(curves[label][-10:]):.3f}" for label in labels)
        + " |",
        "| wall time (warm-up and steps) | "
        + " | ".join(f"{walls[label]:.0f} s" for label in labels)
        + " |",
        end_mark,
    ]
    write_section(args.output, "\n".join(lines) + "\n", start_mark, end_mark)
    log(f"wrote the {SECTION} section of {args.output}")
    return 0


if __name__ == "__main__":
    kit.run(main)
