"""`trainyard demo` (what `make demo` runs) and `trainyard demo --agent` (`make
demo-agent`) from an empty folder, shortened."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import ROOT, free_port, scratch, servers_under


@pytest.fixture
def folder() -> Iterator[Path]:
    """Not pytest's tmp_path: see :func:`tests.cli.support.scratch`."""
    with scratch() as path:
        yield path


def _demo(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The demo as a user runs it: embedded services (no URLs set) under ``folder``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"TRAINYARD_DATABASE_URL", "TRAINYARD_REDIS_URL", "TRAINYARD_BROKER_PREFIX"}
    }
    env.update(PYTHONPATH=str(ROOT), TRAINYARD_HOME=str(folder / "home"))
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "demo", "--port", str(free_port()), *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _final_model(stderr: str) -> Path:
    final = next(line for line in stderr.splitlines() if "final model:" in line)
    return Path(final.split("final model:")[1].strip())


@pytest.mark.slow
def test_demo_runs_a_real_training_run_end_to_end(folder: Path) -> None:
    done = _demo(
        folder,
        "--preset",
        str(ROOT / "configs" / "runs" / "letters.yaml"),
        "max_steps=20",
        "grpo.save_steps=10",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # The log's whole path on the line that names it, ready to copy (rich wraps no path).
    log = (folder / "home" / "logs" / "demo-up.log").resolve()
    assert any(line.endswith(f"log: {log}") for line in done.stderr.splitlines())
    assert "completed 20 steps" in done.stderr
    assert "reward curve" in done.stderr
    assert "final model" in done.stderr
    assert Path(_final_model(done.stderr), "model.safetensors").is_file()
    assert not servers_under(folder / "home")


@pytest.mark.slow
def test_demo_agent_shows_the_warm_up_and_the_tool_calls_of_each_step(folder: Path) -> None:
    done = _demo(
        folder,
        "--agent",
        "--preset",
        str(ROOT / "configs" / "runs" / "agent-calculator.yaml"),
        "max_steps=10",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (folder / "home" / "models" / "tiny-llama-tools" / "config.json").is_file()
    # The warm-up, then one episode of every step (10 steps: every one is shown).
    warm_up = re.search(r"SFT warm-up: (\d+) steps, loss ([\d.]+) → ([\d.]+)", done.stderr)
    assert warm_up, done.stderr[-3000:]
    assert float(warm_up[3]) < float(warm_up[2]) / 2
    steps = [line for line in done.stderr.splitlines() if re.match(r"step \d+ ", line)]
    assert [int(line.split()[1]) for line in steps] == list(range(1, 11)), steps
    assert all(re.search(r'→ ".*"  reward [\d.]+  \(step mean [\d.]+\)$', s) for s in steps)
    # After the warm-up the model calls the calculator, and the calls read as calls.
    assert any(re.search(r"→ (add|subtract|multiply|divide)\(a=\S+, b=\S+\) = ", s) for s in steps)
    assert "completed 10 steps" in done.stderr
    assert "reward curve" in done.stderr
    assert Path(_final_model(done.stderr), "model.safetensors").is_file()
    assert not servers_under(folder / "home")
