"""`trainyard demo` (what `make demo` runs) from an empty folder, shortened to 20 steps."""

from __future__ import annotations

import os
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


@pytest.mark.slow
def test_demo_runs_a_real_training_run_end_to_end(folder: Path) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"TRAINYARD_DATABASE_URL", "TRAINYARD_REDIS_URL", "TRAINYARD_BROKER_PREFIX"}
    }
    env.update(PYTHONPATH=str(ROOT), TRAINYARD_HOME=str(folder / "home"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "demo",
            "--port",
            str(free_port()),
            "--preset",
            str(ROOT / "configs" / "runs" / "letters.yaml"),
            "max_steps=20",
            "grpo.save_steps=10",
        ],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "completed 20 steps" in done.stderr
    assert "reward curve" in done.stderr
    assert "final model" in done.stderr
    final = next(line for line in done.stderr.splitlines() if "final model:" in line)
    assert Path(final.split("final model:")[1].strip(), "model.safetensors").is_file()
    assert not servers_under(folder / "home")
